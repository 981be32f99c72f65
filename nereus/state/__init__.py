"""What an EMU holds: shard geometry, flat state buffers, logical state and its sources (pure)."""
