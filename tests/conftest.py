"""pytest configuration: hypothesis profiles."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")
