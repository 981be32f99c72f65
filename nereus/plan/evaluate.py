"""Price one given plan under a problem: what the controller asks of the plan it is running.

The search prices every candidate at once; here one shape per model-stage is priced on its own —
under new sequence lengths, new calibration or a new pool — with the same cost model, the same
co-residency rule and the same step-latency graph, so "the current plan" and "the target plan"
are compared on equal terms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from nereus.plan.bestfit import anchored
from nereus.plan.calibration import Efficiencies
from nereus.plan.candidates import Shape
from nereus.plan.cost import Cost, CostModel, LatencyTerms
from nereus.plan.costterms import GROUPED
from nereus.plan.layout import Plan
from nereus.plan.memory import coresident_bounds
from nereus.plan.opclass import OpClass
from nereus.plan.overlap import step_latency
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import ExecutionMode, Stage


@dataclass(frozen=True, slots=True)
class PlanCost:
    """Per model-stage latency and memory of one plan, and what they add up to."""

    step_latency_s: float
    latency: Mapping[str, float]
    resident: Mapping[str, float]  # bytes per GPU kept while idle
    active: Mapping[str, float]  # bytes per GPU while running
    bound: Mapping[str, float]  # active + co-resident idle state of other stages (no reserve)
    by_class: Mapping[str, Mapping[OpClass, float]]  # seconds per op class, per model-stage
    checkpoint: Mapping[str, float]  # bytes per GPU a restart reads back (weights, optimizer state)

    def over_capacity(self, problem: PlanningProblem) -> list[str]:
        """Model-stages whose bound exceeds capacity after headroom and the runtime reserve."""
        limit = problem.capacity_bytes - problem.reserved_bytes
        return [name for name, b in self.bound.items() if b > limit]


def shapes_of(plan: Plan) -> dict[str, Shape]:
    return {c.model_stage: Shape(c.layout, c.dp, c.micro_batch, c.recompute) for c in plan.candidates}


def price(problem: PlanningProblem, shapes: Mapping[str, Shape]) -> PlanCost:
    """Latency and memory of the plan ``shapes`` (one per model-stage) under ``problem``."""
    cost = CostModel(problem)
    wf = problem.workflow
    latency, resident, active, by_class, checkpoint = {}, {}, {}, {}, {}
    for m in wf.model_stages:
        s = shapes[m.name]
        terms, mem = cost.evaluate(m, s.layout, np.array([s.dp]), np.array([s.micro_batch]), s.recompute)
        latency[m.name] = float(terms.total[0])
        resident[m.name] = float(mem.persistent[0])
        checkpoint[m.name] = float(mem.checkpoint[0])
        active[m.name] = float(mem.active[0])
        by_class[m.name] = {op: float(t[0]) for op, t in terms.by_class.items() if float(t[0]) > 0}
    mode = problem.workload.mode
    bound = coresident_bounds(
        {m.name: m.stage for m in wf.model_stages}, resident, active, mode is ExecutionMode.ASYNC
    )
    return PlanCost(step_latency(wf, mode, latency), latency, resident, active, bound, by_class, checkpoint)


def placed_latency(problem: PlanningProblem, plan: Plan, estimate: float) -> float:
    """The step latency of ``plan`` (found for ``problem``) where its GPUs put it. The search
    prices each model-stage as best fit would place it alone on the pool (``bestfit``); placement
    shares the pool among stage-mates, and on a fragmented pool one can take the room another was
    priced in, leaving a TP group or a replica across nodes its price did not cross. Where that
    happened (``bestfit.anchored`` with ``plan`` as the anchor names those model-stages), the plan
    priced where it runs; else ``estimate``, the search's own latency."""
    placed = replace(problem, anchor=plan)
    if not anchored(placed):
        return estimate
    return price(placed, shapes_of(plan)).step_latency_s


def fits_pool(problem: PlanningProblem, shapes: Mapping[str, Shape]) -> bool:
    """Per-stage GPU budgets: concurrent model-stages share the pool (async: generation apart)."""
    gpus: dict[Stage, int] = {}
    for m in problem.workflow.model_stages:
        gpus[m.stage] = gpus.get(m.stage, 0) + shapes[m.name].num_gpus
    beside = gpus.get(Stage.GEN, 0) if problem.workload.mode is ExecutionMode.ASYNC else 0
    return all(n + (beside if s is not Stage.GEN else 0) <= problem.gpus for s, n in gpus.items())


@dataclass(frozen=True, slots=True)
class ClassShape:
    """What one op class of one model-stage would take at η = 1, and the shape it ran at: the
    seconds-weighted geometric mean of its sizes and (collectives) ranks per node (0: none)."""

    ideal_s: float
    size: float
    group: float


# Generation's compute classes carry no size: decode is a roofline (max of the HBM reads and the
# matmuls), and which side a step lands on differs between the model and the hardware, so a
# generation stage's measured GEMM seconds may hold decode matmuls the model priced as memory
# reads (its GEMM ideal then being prefill alone). Such a sample would bend the GEMM curve at the
# prefill's size; it still calibrates the class-wide η, as before.
ROOFLINE_CLASSES = (OpClass.GEMM, OpClass.ATTENTION)  # (decode: paired with them, sized)


def unsized(stage: Stage) -> tuple[OpClass, ...]:
    """The op classes whose measurements of a ``stage`` model-stage carry no shape."""
    return ROOFLINE_CLASSES if stage is Stage.GEN else ()


def class_shapes(
    terms: LatencyTerms, skip: tuple[str, ...] = (), no_size: tuple[OpClass, ...] = ()
) -> dict[OpClass, ClassShape]:
    """Each op class's seconds and shape in tracked ``terms`` (``CostModel(track=True)``) of one
    row, leaving out the terms named in ``skip``; classes in ``no_size`` get size 0 (unknown)."""
    parts = [c for name, c in terms.parts.items() if name not in skip]
    merged = sum(parts, Cost({}))
    feats = merged.feats or {}
    grouped = {*(k.value for k in GROUPED), OpClass.MEMORY.value, OpClass.DECODE.value}  # (pp stages)
    out: dict[OpClass, ClassShape] = {}
    for op, t in merged.by_class.items():
        seconds = float(np.sum(t))
        if seconds <= 0:
            continue
        if op not in feats or op in no_size:
            out[op] = ClassShape(seconds, 0.0, 0.0)
            continue
        ln_size, ln_group = (float(np.sum(v)) / seconds for v in feats[op])
        group = math.exp(ln_group) if op.value.partition(".")[0] in grouped else 0.0
        out[op] = ClassShape(seconds, math.exp(ln_size), group)
    return out


def ideal_shapes(
    problem: PlanningProblem, shapes: Mapping[str, Shape]
) -> dict[str, dict[OpClass, ClassShape]]:
    """Per model-stage, each op class's ideal seconds (η = 1) and the shape of its work: what a
    measurement of that class is paired with (``nereus.sim.observe.pair``)."""
    unit = replace(problem, efficiencies=Efficiencies.unit())
    cost = CostModel(unit, track=True)
    out: dict[str, dict[OpClass, ClassShape]] = {}
    for m in unit.workflow.model_stages:
        s = shapes[m.name]
        terms, _ = cost.evaluate(m, s.layout, np.array([s.dp]), np.array([s.micro_batch]), s.recompute)
        out[m.name] = class_shapes(terms, no_size=unsized(m.stage))
    return out
