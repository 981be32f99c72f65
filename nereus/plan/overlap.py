"""Execution-overlap graph and step latency (paper §2.3).

Nodes are model-stages weighted by their latency; edges are the workflow's data dependencies
plus serialisation edges between model-stages that may share GPUs. Step latency is the longest
path. In sync mode every stage may share GPUs with the next, so the path visits each stage's
slowest model-stage: L_step = Σ_s max_{M∈s} L_M. In async mode a step is the interval between two
weight syncs: generation of the next batch overlaps inference and training of this one, on
disjoint GPUs, so L_step = max(L_gen, L_inf + L_train).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from nereus.spec.workload import STAGE_ORDER, ExecutionMode, Stage, Workflow


def overlap_edges(workflow: Workflow, mode: ExecutionMode) -> tuple[tuple[str, str], ...]:
    """Edges of the execution-overlap graph of one step."""
    edges: set[tuple[str, str]] = set()
    stages = [s for s in STAGE_ORDER if workflow.by_stage(s)]
    if mode is ExecutionMode.ASYNC:
        stages = [s for s in stages if s is not Stage.GEN]
    for earlier, later in itertools.pairwise(stages):
        for a in workflow.by_stage(earlier):
            for b in workflow.by_stage(later):
                edges.add((a.name, b.name))  # serialised: they may share GPUs
    gen_names = {m.name for m in workflow.by_stage(Stage.GEN)}
    for src, dst in workflow.edges:
        if mode is ExecutionMode.ASYNC and src in gen_names:
            continue  # generation feeds the next interval's inference
        edges.add((src, dst))
    return tuple(sorted(edges))


def critical_path(
    workflow: Workflow, mode: ExecutionMode, latency: Mapping[str, float]
) -> tuple[float, tuple[str, ...]]:
    """Length and model-stages of the longest path through the execution-overlap graph."""
    names = [m.name for m in workflow.model_stages]
    missing = [n for n in names if n not in latency]
    if missing:
        raise ValueError(f"no latency for {missing}")
    preds: dict[str, list[str]] = {n: [] for n in names}
    for a, b in overlap_edges(workflow, mode):
        preds[b].append(a)
    order = {s: i for i, s in enumerate(STAGE_ORDER)}
    best: dict[str, tuple[float, tuple[str, ...]]] = {}
    for name in sorted(names, key=lambda n: order[workflow.get(n).stage]):  # edges go forward
        start = max((best[p] for p in preds[name]), default=(0.0, ()), key=lambda t: t[0])
        best[name] = (start[0] + latency[name], (*start[1], name))
    return max(best.values(), key=lambda t: t[0])


def step_latency(workflow: Workflow, mode: ExecutionMode, latency: Mapping[str, float]) -> float:
    return critical_path(workflow, mode, latency)[0]
