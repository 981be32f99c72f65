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
from nereus.plan.rules import batch_refusal, layout_refusal
from nereus.spec.cluster import ClusterSpec
from nereus.spec.files import brief
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Role, WorkloadSpec
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
    if not 1 <= dp <= MAX_GPUS:
        raise ConfigError(f"--fix {name}: dp must be in [1, {MAX_GPUS}], got {dp}")
    if micro > 1 << 24 or (m.group(5) is not None and micro < 1):
        raise ConfigError(f"--fix {name}: mb must be in [1, {1 << 24}], got {micro}")
    return name, Layout(tp, pp), dp, micro


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
    names = [name for name, *_ in held]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ConfigError(f"--fix: model-stage {twice} is named twice (one --fix per model-stage)")
    for name, layout, dp, micro in held:  # the layouts the runtime can shard (the planner's rule)
        why = layout_refusal(name, layout, models[workload.workflow().get(name).role], space, cluster)
        if why:
            raise ConfigError(f"--fix {name}: {why}")
        if layout.size * dp > gpus:
            raise ConfigError(
                f"--fix {name}: tp{layout.tp}·pp{layout.pp}·dp{dp} needs {layout.size * dp} GPUs, "
                f"more than the {gpus} of --gpus"
            )
        why = batch_refusal(workload, workload.workflow().get(name), dp, micro)
        if why:
            raise ConfigError(f"--fix {name}: {why}")
    return dataclasses.replace(
        space.holding({name: layout for name, layout, _, _ in held}),
        fixed_shapes=tuple((name, dp, micro) for name, _, dp, micro in held),
    )
