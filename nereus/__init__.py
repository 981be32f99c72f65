"""Nereus: adaptive parallelism for LLM RL post-training."""

__version__ = "0.1.0"
