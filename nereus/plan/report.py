"""What a plan means per model-stage: GPUs, latency terms, memory terms and per-GPU peaks (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nereus.plan.candidates import Estimate
from nereus.plan.layout import Candidate, Plan
from nereus.plan.memory import coresident_bounds
from nereus.plan.overlap import critical_path
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import SearchResult
from nereus.spec.cluster import GIB
from nereus.spec.workload import ExecutionMode, Stage


@dataclass(frozen=True, slots=True)
class StageReport:
    """One model-stage of a plan, with the numbers a user checks."""

    candidate: Candidate
    stage: Stage
    estimate: Estimate
    peak_bytes: float  # worst GPU while this model-stage runs, on this placement (+ reserve)
    bound_bytes: float  # the planner's placement-independent bound (what feasibility checked)

    @property
    def name(self) -> str:
        return self.candidate.model_stage


def stage_reports(problem: PlanningProblem, result: SearchResult) -> list[StageReport]:
    plan = result.plan
    est = {e.model_stage: e for e in result.estimates}
    stage_of = {c.model_stage: plan.stage_of(c) for c in plan.candidates}
    bounds = coresident_bounds(
        stage_of,
        {n: e.persistent_bytes for n, e in est.items()},
        {n: e.active_bytes for n, e in est.items()},
        problem.workload.mode is ExecutionMode.ASYNC,
    )
    reserve = problem.reserved_bytes
    residents: dict[int, list[str]] = {}
    for c in plan.candidates:
        for g in c.gpus:
            residents.setdefault(g, []).append(c.model_stage)
    reports = []
    for c in plan.candidates:
        s = stage_of[c.model_stage]
        e = est[c.model_stage]
        peak = 0.0
        for g in c.gpus:  # exact, on this placement
            others = sum(est[o].persistent_bytes for o in residents[g] if stage_of[o] is not s)
            peak = max(peak, e.active_bytes + others)
        reports.append(StageReport(c, s, e, peak + reserve, bounds[c.model_stage] + reserve))
    return reports


# the keys of a ``nereus plan --json`` object (``plan_json``'s, the problem the CLI adds, and
# ``--exhaustive``'s reports), and the report keys of its stage entries beside their layout:
# a plan read back (``nereus transition``, ``--anchor``) may hold these and no others
PLAN_KEYS = frozenset({
    "step_latency_s", "search_ms", "solver", "mode", "gpus", "capacity_gib", "critical_path", "stages",
    "problem", "exhaustive", "plans",
})  # fmt: skip
STAGE_REPORT_KEYS = frozenset({"stage", "latency_s", "peak_mem_gib", "bound_mem_gib"})


def plan_json(problem: PlanningProblem, result: SearchResult) -> dict[str, Any]:
    """The ``nereus plan --json`` object."""
    reports = stage_reports(problem, result)
    _, path = critical_path(
        problem.workflow, problem.workload.mode, {r.name: r.estimate.latency_s for r in reports}
    )
    return {
        "step_latency_s": result.step_latency_s,
        "search_ms": result.search_ms,
        "solver": result.solver,
        "mode": problem.workload.mode.value,
        "gpus": problem.gpus,
        "capacity_gib": problem.capacity_bytes / GIB,
        "critical_path": list(path),
        "stages": [
            {
                "name": r.name,
                "stage": r.stage.value,
                "tp": r.candidate.layout.tp,
                "pp": r.candidate.layout.pp,
                "dp": r.candidate.dp,
                "gpus": list(r.candidate.gpus),
                "micro_batch": r.candidate.micro_batch,
                "recompute": r.candidate.recompute.value,
                "latency_s": r.estimate.latency_s,
                "peak_mem_gib": r.peak_bytes / GIB,
                "bound_mem_gib": r.bound_bytes / GIB,
            }
            for r in reports
        ],
    }


def gpu_ranges(gpus: tuple[int, ...], in_rank_order: bool = False) -> str:
    """``(0,1,2,3,8,9)`` → ``0-3,8-9``; ``in_rank_order`` keeps the order given (a placed
    model-stage's ranks, whose runs of tp are its TP groups): ``(9,10,11,8)`` → ``9-11,8``."""
    if not gpus:
        return ""
    ordered = list(gpus) if in_rank_order else sorted(gpus)
    parts, start, prev = [], ordered[0], ordered[0]
    for g in ordered[1:]:
        if g != prev + 1:
            parts.append(f"{start}-{prev}" if start != prev else str(start))
            start = g
        prev = g
    parts.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(parts)


def plan_summary(plan: Plan) -> dict[str, str]:
    """``{model-stage: "tp1·pp1·dp2 @ 0-1"}``."""
    return {
        c.model_stage: f"{c.layout}·dp{c.dp} @ {gpu_ranges(c.gpus, in_rank_order=True)}"
        for c in plan.candidates
    }
