"""What the runtime can run: the layout and batch rules ``nereus plan --fix`` and plan files
(``nereus transition``, ``--anchor``) are held to, each refusal one line without its flag or
file (the caller names it). Pure.

- A layout (``layout_refusal``): tp shards the attention heads (``ModelSpec.tp_refusal``) and
  stays inside a node (or under ``--max-tp``), pp at most the layers, a generation model-stage on
  vLLM (``SearchSpace.flat``) at pp 1.
- A split of the work (``batch_refusal``): a trainer's dp divides the global batch and its
  micro-batch a replica's share; an inference or generation micro-batch at most the workload's
  ``inference_micro_batch`` or ``max_num_seqs``, and no more replicas than sequences.
"""

from __future__ import annotations

from nereus.plan.layout import Layout
from nereus.plan.problem import SearchSpace
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import ModelStage, Stage, WorkloadSpec


def layout_refusal(
    name: str, layout: Layout, model: ModelSpec, space: SearchSpace, cluster: ClusterSpec
) -> str:
    """Why the runtime could not run ``layout`` for ``name`` ("" when it can)."""
    refusal = model.tp_refusal(layout.tp)
    if refusal:
        return refusal
    if layout.tp > (space.max_tp or cluster.gpus_per_node):
        why = (
            f"exceeds --max-tp {space.max_tp}"
            if space.max_tp
            else f"exceeds the {cluster.gpus_per_node} GPUs of a node of {cluster.name} (tensor "
            f"parallelism stays inside a node; --max-tp {layout.tp} lets it cross)"
        )
        return f"tp {layout.tp} {why}"
    if layout.pp > model.num_hidden_layers:
        return f"pp {layout.pp} exceeds {model.name}'s {model.num_hidden_layers} layers"
    if layout.pp > 1 and name in space.flat:
        return (
            f"pp {layout.pp}: vLLM does not pipeline generation (--pipelined-gen plans the "
            "torch-native engine's)"
        )
    return ""


def batch_refusal(
    workload: WorkloadSpec, model_stage: ModelStage, dp: int, micro: int, mb: str = "mb"
) -> str:
    """Why ``dp`` replicas (micro-batch ``micro``, 0: the workload's; named ``mb`` in the line)
    cannot split the model-stage's sequences as the runtime does ("" when they can): a trainer's
    replicas take equal shares of every optimizer step, and its micro-batch divides a share."""
    if model_stage.stage is not Stage.TRAIN:
        n = workload.sequences(model_stage)
        if dp > n:
            return f"dp {dp} exceeds the {n} sequences it processes per step"
        gen = model_stage.stage is Stage.GEN
        key, cap = ("max_num_seqs", workload.max_num_seqs) if gen else (
            "inference_micro_batch", workload.inference_micro_batch)  # fmt: skip
        if micro > cap:  # the engine runs at most the workload's (a larger one would be priced, not run)
            return f"{mb} {micro} exceeds {workload.name}'s {key} {cap} (allowed: 1 to {cap})"
        return ""
    batch = workload.global_batch
    if batch % dp:
        allowed = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        return f"dp {dp} must divide the global batch {batch} (allowed dp: {allowed})"
    share = batch // dp
    if micro and share % micro:
        allowed = ", ".join(str(b) for b in range(1, share + 1) if share % b == 0)
        return f"{mb} {micro} must divide a replica's share of the global batch, {share} (allowed: {allowed})"
    return ""
