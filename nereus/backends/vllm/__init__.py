"""vLLM as the generation engine of ``actor.gen`` (``engine: vllm``).

``engine.py`` is the Backend: a ``vllm.LLM`` built in this process from the plan's layout (TP
inside the replica through vLLM's external launcher over the replica's ranks of our world, one
engine per DP replica), loaded from the rank's state and reloaded in place at every weight sync.
``world.py`` gives vLLM the replica as its world; ``setup.py`` holds the engine's settings (what
vLLM can serve, its environment, KV room, the model folder it reads its config from), importable
without vLLM. Importing this package does not import vLLM; building an engine does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nereus.backends.vllm.engine import VllmEngine

__all__ = ["VllmEngine"]


def __getattr__(name: str) -> Any:
    if name == "VllmEngine":
        from nereus.backends.vllm.engine import VllmEngine

        return VllmEngine
    raise AttributeError(name)
