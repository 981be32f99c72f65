"""``nereus plan --fix MODEL_STAGE=tpT,ppP,dpD[,mbB]``: a user's layouts held in the search.

Each held layout is checked by the runtime's rules before the search sees it, each refusal one
line naming the flag: tp must shard the attention heads (``ModelSpec.tp_refusal``) and stay inside
a node (or under ``--max-tp``), pp at most the layers, a generation model-stage on vLLM (the
default, ``SearchSpace.flat``) at pp 1, a trainer's dp dividing the global batch and its
micro-batch a replica's share, an inference or generation micro-batch at most the workload's
``inference_micro_batch`` or ``max_num_seqs`` (one above a replica's sequences runs them all at
once, and is shown so), and no more replicas than sequences. The search then holds those
shapes and searches the rest (``SearchSpace.holding``, ``fixed_shapes``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from nereus.errors import ConfigError
from nereus.plan.layout import Layout, is_power_of_two
from nereus.plan.problem import SearchSpace
from nereus.spec.cluster import ClusterSpec
from nereus.spec.files import brief
from nereus.spec.model import ModelSpec
from nereus.spec.workload import ModelStage, Role, Stage, WorkloadSpec
from nereus.transition.command import MAX_GPUS, MAX_TP  # a plan file's bounds

_FIX = re.compile(r"([^=\s]{1,64})=tp([0-9]{1,9}),pp([0-9]{1,9}),dp([0-9]{1,9})(?:,mb([0-9]{1,9}))?")


def parse_fix(text: str, workload: WorkloadSpec) -> tuple[str, Layout, int, int]:
    """``MODEL_STAGE=tpT,ppP,dpD[,mbB]`` → (model-stage, layout, dp, micro-batch or 0)."""
    m = _FIX.fullmatch(text.strip())
    if m is None:
        raise ConfigError(
            f"--fix: expected MODEL_STAGE=tpT,ppP,dpD[,mbB] (e.g. actor.train=tp4,pp1,dp2), got {brief(text)}"
        )
    name = m.group(1)
    allowed = [ms.name for ms in workload.workflow().model_stages]
    if name not in allowed:
        raise ConfigError(
            f"--fix: {workload.name} has no model-stage {brief(name)} (allowed: {', '.join(allowed)})"
        )
    tp, pp, dp = (int(m.group(i)) for i in (2, 3, 4))
    micro = int(m.group(5) or 0)
    for what, value in (("tp", tp), ("pp", pp)):
        if value < 1 or not is_power_of_two(value) or value > MAX_TP:
            raise ConfigError(f"--fix {name}: {what} must be a power of two in [1, {MAX_TP}], got {value}")
    if not 1 <= dp <= MAX_GPUS or micro > 1 << 24 or (m.group(5) is not None and micro < 1):
        raise ConfigError(
            f"--fix {name}: dp must be in [1, {MAX_GPUS}] and mb in [1, {1 << 24}], got dp {dp}, mb {micro}"
        )
    return name, Layout(tp, pp), dp, micro


def _refusal(name: str, layout: Layout, model: ModelSpec, space: SearchSpace, cluster: ClusterSpec) -> str:
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


def _batch_refusal(workload: WorkloadSpec, model_stage: ModelStage, dp: int, micro: int) -> str:
    """Why ``dp`` replicas (micro-batch ``micro``, 0: the workload's) cannot split the model-stage's
    sequences as the runtime does ("" when they can): a trainer's replicas take equal shares of
    every optimizer step, and its micro-batch divides a share."""
    if model_stage.stage is not Stage.TRAIN:
        n = workload.sequences(model_stage)
        if dp > n:
            return f"dp {dp} exceeds the {n} sequences it processes per step"
        gen = model_stage.stage is Stage.GEN
        key, cap = ("max_num_seqs", workload.max_num_seqs) if gen else (
            "inference_micro_batch", workload.inference_micro_batch)  # fmt: skip
        if micro > cap:  # the engine runs at most the workload's (a larger one would be priced, not run)
            return f"mb {micro} exceeds {workload.name}'s {key} {cap} (allowed: 1 to {cap})"
        return ""
    batch = workload.global_batch
    if batch % dp:
        allowed = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        return f"dp {dp} must divide the global batch {batch} (allowed dp: {allowed})"
    share = batch // dp
    if micro and share % micro:
        allowed = ", ".join(str(b) for b in range(1, share + 1) if share % b == 0)
        return f"mb {micro} must divide a replica's share of the global batch, {share} (allowed: {allowed})"
    return ""


def held_space(
    space: SearchSpace,
    fixes: Sequence[str],
    workload: WorkloadSpec,
    models: Mapping[Role, ModelSpec],
    cluster: ClusterSpec,
    gpus: int,
) -> SearchSpace:
    """``space`` holding the ``--fix`` layouts (texts as given) on a pool of ``gpus``, each
    checked; one ``ConfigError`` naming the flag on the first that cannot be held."""
    held = [parse_fix(text, workload) for text in fixes]
    if len({name for name, *_ in held}) != len(held):
        raise ConfigError("--fix: a model-stage is named twice")
    for name, layout, dp, micro in held:  # the layouts the runtime can shard (the planner's rule)
        why = _refusal(name, layout, models[workload.workflow().get(name).role], space, cluster)
        if why:
            raise ConfigError(f"--fix {name}: {why}")
        if layout.size * dp > gpus:
            raise ConfigError(
                f"--fix {name}: tp{layout.tp}·pp{layout.pp}·dp{dp} needs {layout.size * dp} GPUs, "
                f"more than the {gpus} of --gpus"
            )
        why = _batch_refusal(workload, workload.workflow().get(name), dp, micro)
        if why:
            raise ConfigError(f"--fix {name}: {why}")
    return dataclasses.replace(
        space.holding({name: layout for name, layout, _, _ in held}),
        fixed_shapes=tuple((name, dp, micro) for name, _, dp, micro in held),
    )
