"""Plan search: per-model-stage frontiers, then an exact program over model-stages (paper §2.6).

The problem (paper Eq. 1, sync mode): pick one candidate per model-stage to minimise
L_step = Σ_s max_{M∈s} L_M subject to, for every stage s,

* GPUs:    Σ_{M∈s} gpus(M) ≤ |pool|                        (concurrent model-stages are disjoint)
* memory:  active(M) + Σ_{s'≠s} X_{s'} ≤ capacity − reserve  for every M ∈ s,
           where X_s = max_{M∈s} resident(M)                  (idle state co-resident on a GPU)

The memory rule bounds what any placement can stack on a GPU, so a plan that passes it is safe
wherever its replicas land (and stays safe when a transition moves them).

Algorithm (our formulation; the paper gives none, paper-notes §5.7):
1. ``frontier``: per model-stage, feasible non-dominated candidates.
2. ``StageSolver`` (``program.py``, as is 3.): for caps (x: resident, y: active) and a GPU budget,
   the smallest achievable max-latency of one stage is found by a threshold search: for a latency
   T each model-stage needs at least need_M(T) = min{gpus : L ≤ T, resident ≤ x, active ≤ y} GPUs
   (a prefix minimum over the latency-sorted frontier); the answer is the smallest T with
   Σ_M need_M(T) ≤ budget.
3. Stages couple only through the caps X_s. Each stage's candidate caps are its distinct resident
   values; cap vectors are visited best-first by a lower bound (each stage solved with the other
   stages at their smallest caps), and the search stops when the bound reaches the best plan found.
   Every cap vector that could hold the optimum is either solved or bounded away: the result is
   exact (tests compare it with ``exhaustive.py``).
Async mode: generation gets its own GPUs (every split of the pool is tried), inference and training
share the rest and couple only with each other; L_step = max(L_gen, L_inf + L_train).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from types import MappingProxyType

import numpy as np

from nereus.errors import InfeasibleError
from nereus.plan.bestfit import anchored
from nereus.plan.cache import PlanCache
from nereus.plan.candidates import CandidateTable, Estimate, Shape, candidate_table, estimate
from nereus.plan.cost import CostModel
from nereus.plan.frontier import frontier
from nereus.plan.layout import Plan
from nereus.plan.overlap import step_latency
from nereus.plan.placement import place
from nereus.plan.problem import PlanningProblem, SearchSpace
from nereus.plan.program import CoupledChoice, SolverMemo, StageChoice, StageSolver, solve_coupled
from nereus.spec.cluster import GIB
from nereus.spec.workload import ExecutionMode, ModelStage, Stage, Workflow

INF = math.inf


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The chosen plan, the estimate behind every candidate, and what the search cost."""

    plan: Plan
    estimates: tuple[Estimate, ...]
    step_latency_s: float
    search_ms: float  # wall time of the whole search
    solver: str
    timings: Mapping[str, float] = field(default_factory=dict)  # per phase, milliseconds


def _held(space: SearchSpace, name: str) -> str:
    """Why a held (``--fix``) model-stage may have no layout: what holding it asks for."""
    layout, shape = space.fixed_layout(name), space.fixed_shape(name)
    if layout is None and shape is None:
        return ""
    held = f"{layout}" if layout is not None else "its layout"
    if shape is not None:
        held += f"·dp{shape[0]}" + (f" mb{shape[1]}" if shape[1] else "")
    return (
        f" as held ({held}): it needs tp·pp·dp GPUs of the pool, tp dividing the attention heads, "
        "pp at most the layers and, for a trainer, dp dividing the global batch and a micro-batch "
        "dividing each replica's share"
    )


def binding_constraint(problem: PlanningProblem, tables: dict[str, CandidateTable]) -> str:
    """One line on why nothing fits: the model-stage whose smallest footprint is furthest over."""
    limit = problem.capacity_bytes - problem.reserved_bytes
    worst_name, worst = "", -INF
    for name, t in tables.items():
        if len(t) == 0:
            return f"{name} has no layout on {problem.gpus} GPUs{_held(problem.space, name)}"
        smallest = float(t.active.min())
        if smallest - limit > worst:
            worst_name, worst = name, smallest - limit
    t = tables[worst_name]
    i = int(np.argmin(t.active))
    cap = problem.cluster.gpu_memory_gib * (1 - problem.headroom)
    if worst > 0:
        train = {ms.name for ms in problem.workflow.by_stage(Stage.TRAIN)}
        held = problem.space.fixed_layout(worst_name) is not None and worst_name in train
        zero = (
            "; Nereus's trainers shard nothing over DP (ZeRO-0): `nereus price --fsdp` prices an FSDP "
            "trainer (verl's) in this layout"
            if held
            else ""
        )
        return (
            f"{worst_name} needs ≥ {t.active[i] / GIB + problem.reserved_bytes / GIB:.1f} GiB per GPU "
            f"at tp·pp ≤ {int((t.gpus // t.dp).max())} ({t.shape(i)}); capacity "
            f"{cap:.1f} GiB after {problem.headroom * 100:g}% headroom on {problem.cluster.name}{zero}"
        )
    wf = problem.workflow
    min_gpus = {s: sum(int(tables[m.name].gpus.min()) for m in wf.by_stage(s)) for s in wf.stages}
    gen_apart = problem.workload.mode is ExecutionMode.ASYNC
    for s, alone in min_gpus.items():
        need = alone + (min_gpus.get(Stage.GEN, 0) if gen_apart and s is not Stage.GEN else 0)
        if need > problem.gpus:
            what = f"stage {s.value}" + (" beside generation (async)" if gen_apart else "")
            return f"{what} needs ≥ {need} GPUs for its concurrent model-stages; the pool has {problem.gpus}"
    return (
        f"model-stages fit alone but not together: with the idle state of other stages co-resident, "
        f"no combination stays under {cap:.1f} GiB per GPU after {problem.headroom * 100:g}% headroom "
        f"on {problem.gpus} GPUs of {problem.cluster.name}"
    )


def build_tables(cost: CostModel) -> dict[str, CandidateTable]:
    return {ms.name: candidate_table(cost, ms) for ms in cost.problem.workflow.model_stages}


def finish(
    problem: PlanningProblem,
    shapes: dict[str, Shape],
    started: float,
    solver: str,
    cost: CostModel | None = None,
    phases: dict[str, float] | None = None,
    estimates: Callable[[ModelStage, Shape], Estimate] | None = None,
    cache: PlanCache | None = None,
) -> SearchResult:
    """Place the chosen shapes on GPUs and price each model-stage in full (any solver's last step).
    ``estimates``: where the breakdown of a shape comes from (a cache), else ``cost``; ``cache``:
    where an earlier placement of the same shapes on the same pool is kept."""
    placing = time.perf_counter()
    wf = cache.bind(problem) if cache is not None else problem.workflow

    def placed() -> Plan:
        mode, gpn = problem.workload.mode, problem.cluster.gpus_per_node
        return place(wf, mode, shapes, problem.pool, gpn, problem.anchor, problem.domains)

    plan = placed() if cache is None else cache.placement(problem, wf, shapes, placed)
    if estimates is None:
        model = cost or CostModel(problem)
        estimates = partial(estimate, model)
    found = tuple(estimates(ms, shapes[ms.name]) for ms in wf.model_stages)
    step = step_latency(wf, problem.workload.mode, {e.model_stage: e.latency_s for e in found})
    done = time.perf_counter()
    timings = {**(phases or {}), "placement_ms": (done - placing) * 1e3}
    return SearchResult(plan, found, step, (done - started) * 1e3, solver, MappingProxyType(timings))


def search(problem: PlanningProblem, cache: PlanCache | None = None) -> SearchResult:
    """The fastest feasible plan (frontier + exact program). Raises ``InfeasibleError``.

    ``cache``: what earlier searches of the same job left (``PlanCache``); the result is the same
    with or without it. Without one the search runs cold."""
    started = time.perf_counter()
    cache = cache if cache is not None else PlanCache(keep=1, results=0)
    wf = cache.bind(problem)
    result_key = cache.result_key(problem)
    hit = cache.result(result_key)
    if isinstance(hit, str):
        raise InfeasibleError(hit)
    if isinstance(hit, SearchResult):
        elapsed = (time.perf_counter() - started) * 1e3
        zero = dict.fromkeys(PHASES, 0.0)
        return replace(hit, search_ms=elapsed, timings=MappingProxyType({**zero, "cached_ms": elapsed}))
    try:
        result = _search(problem, cache, wf, started)
    except InfeasibleError as exc:
        cache.store_result(result_key, str(exc))
        raise
    cache.store_result(result_key, result)
    return result


PHASES = ("pricing_ms", "frontier_ms", "program_ms", "placement_ms")
SOLVERS = "stage solvers"  # the key of this price key's ``SolverMemo`` among its programs


def _search(problem: PlanningProblem, cache: PlanCache, wf: Workflow, started: float) -> SearchResult:
    priced = cache.priced(cache.price_key(problem))
    models: list[CostModel] = []

    def cost() -> CostModel:
        if not models:
            models.append(CostModel(problem))
        return models[0]

    limit = problem.capacity_bytes - problem.reserved_bytes
    space = problem.space
    fixed = {name for name, _, _ in space.fixed_shapes}
    fronts: dict[str, CandidateTable] = {}
    pricing = -cache.pricing_s
    for ms in wf.model_stages:
        if ms.name in fixed:  # a held shape (``nereus plan --fix``): priced on its own
            t0 = time.perf_counter()
            table = candidate_table(cost(), ms)
            pricing += time.perf_counter() - t0
            fronts[ms.name] = frontier(table, limit)
        else:
            fronts[ms.name] = cache.frontier(problem, priced, cost, ms, space.fixed_layout(ms.name), limit)
    pricing += cache.pricing_s
    pruned = time.perf_counter()

    def tables() -> dict[str, CandidateTable]:
        return {
            ms.name: candidate_table(cost(), ms)
            if ms.name in fixed
            else cache.table(problem, priced, cost, ms, space.fixed_layout(ms.name))
            for ms in wf.model_stages
        }

    if any(len(f) == 0 for f in fronts.values()):
        raise InfeasibleError(binding_constraint(problem, tables()))

    def program() -> dict[str, Shape] | None:
        solvers = cache.memo(priced.programs, SOLVERS, SolverMemo)  # shared by this price key's searches
        if problem.workload.mode is ExecutionMode.SYNC:
            return _program_sync(problem, wf, fronts, limit, solvers)
        return _program_async(problem, wf, fronts, limit, solvers)

    key = (problem.gpus, space.fixed_layouts, space.fixed_shapes, anchored(problem))
    shapes = cache.memo(priced.programs, key, program)
    if shapes is None:
        raise InfeasibleError(binding_constraint(problem, tables()))
    programmed = time.perf_counter()
    phases = {
        "pricing_ms": pricing * 1e3,  # pricing happens inside the first frontier of each table
        "frontier_ms": (pruned - started) * 1e3 - pricing * 1e3,
        "program_ms": (programmed - pruned) * 1e3,
    }

    def breakdown(ms: ModelStage, shape: Shape) -> Estimate:
        def make() -> Estimate:  # from the terms its pricing kept, else priced again
            return fronts[ms.name].estimate(shape) or estimate(cost(), ms, shape)

        return cache.memo(priced.estimates, (ms.name, shape, cache.anchor_of(problem, ms.name)), make)

    return finish(problem, shapes, started, "dp", None, phases, breakdown, cache)


def _solver_for(
    fronts: dict[str, CandidateTable], wf: Workflow, stage: Stage, solvers: SolverMemo | None
) -> StageSolver:
    tables = [fronts[m.name] for m in wf.by_stage(stage)]
    return StageSolver(tables) if solvers is None else solvers.solver(tables)


def _record(
    fronts: dict[str, CandidateTable], wf: Workflow, stage: Stage, choice: StageChoice
) -> dict[str, Shape]:
    return {m.name: fronts[m.name].shape(i) for m, i in zip(wf.by_stage(stage), choice.picks, strict=True)}


def _program_sync(
    problem: PlanningProblem,
    wf: Workflow,
    fronts: dict[str, CandidateTable],
    limit: float,
    solvers: SolverMemo | None = None,
) -> dict[str, Shape] | None:
    """Sync mode: every stage shares the pool; min Σ_s L_s."""
    stage_solvers = [_solver_for(fronts, wf, s, solvers) for s in wf.stages]
    coupled = solve_coupled(stage_solvers, problem.gpus, limit)
    if coupled is None:
        return None
    shapes: dict[str, Shape] = {}
    for stage, choice in zip(wf.stages, coupled.stages, strict=True):
        shapes.update(_record(fronts, wf, stage, choice))
    return shapes


def _program_async(
    problem: PlanningProblem,
    wf: Workflow,
    fronts: dict[str, CandidateTable],
    limit: float,
    solvers: SolverMemo | None = None,
) -> dict[str, Shape] | None:
    """Async mode: generation on its own GPUs, inference and training share the rest;
    min max(L_gen, L_inf + L_train) over every split of the pool."""
    gens = wf.by_stage(Stage.GEN)
    if len(gens) != 1:
        raise InfeasibleError("async mode needs exactly one generation model-stage")
    gen = fronts[gens[0].name]
    rest_stages = [s for s in (Stage.INF, Stage.TRAIN) if wf.by_stage(s)]
    rest_solvers = [_solver_for(fronts, wf, s, solvers) for s in rest_stages]
    best: tuple[float, int, CoupledChoice] | None = None
    running = INF
    for i in np.argsort(gen.gpus, kind="stable").tolist():
        g = int(gen.gpus[i])
        if g >= problem.gpus or gen.latency[i] >= running:
            continue  # more GPUs for generation but no faster: only leaves less for the rest
        running = float(gen.latency[i])
        rest = solve_coupled(rest_solvers, problem.gpus - g, limit)
        if rest is not None and (best is None or max(running, rest.latency) < best[0]):
            best = (max(running, rest.latency), i, rest)
    if best is None:
        return None
    shapes = {gen.model_stage.name: gen.shape(best[1])}
    for stage, choice in zip(rest_stages, best[2].stages, strict=True):
        shapes.update(_record(fronts, wf, stage, choice))
    return shapes
