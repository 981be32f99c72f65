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
2. ``StageSolver``: for caps (x: resident, y: active) and a GPU budget, the smallest achievable
   max-latency of one stage is found by a threshold search: for a latency T each model-stage needs
   at least need_M(T) = min{gpus : L ≤ T, resident ≤ x, active ≤ y} GPUs (a prefix minimum over the
   latency-sorted frontier); the answer is the smallest T with Σ_M need_M(T) ≤ budget.
3. Stages couple only through the caps X_s. Each stage's candidate caps are its distinct resident
   values; cap vectors are visited best-first by a lower bound (each stage solved with the other
   stages at their smallest caps), and the search stops when the bound reaches the best plan found.
   Every cap vector that could hold the optimum is either solved or bounded away: the result is
   exact (tests compare it with ``exhaustive.py``).
Async mode: generation gets its own GPUs (every split of the pool is tried), inference and training
share the rest and couple only with each other; L_step = max(L_gen, L_inf + L_train).
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from types import MappingProxyType

import numpy as np

from nereus.errors import InfeasibleError
from nereus.plan.cache import PlanCache
from nereus.plan.candidates import CandidateTable, Estimate, Shape, candidate_table, estimate
from nereus.plan.cost import CostModel
from nereus.plan.frontier import frontier
from nereus.plan.layout import Plan
from nereus.plan.overlap import step_latency
from nereus.plan.placement import place
from nereus.plan.problem import PlanningProblem
from nereus.spec.cluster import GIB
from nereus.spec.workload import ExecutionMode, ModelStage, Stage, Workflow

INF = math.inf
MISSING = object()
BOUND_BATCH = 4  # caps whose bounds one pass computes
NEVER = 1 << 40  # GPUs of an inadmissible row: more than any budget, summable in int64


@dataclass(frozen=True, slots=True)
class StageChoice:
    """The best assignment of one stage under given caps: its latency and one pick per table."""

    latency: float
    picks: tuple[int, ...]


class StageSolver:
    """Min-max assignment of concurrent model-stages under a GPU budget and memory caps.

    The tables' rows are merged into one latency order (stable: a table's own rows keep their
    order), so one call is a fixed number of NumPy operations on a (tables × rows) matrix however
    many model-stages share the stage: ``need[k, i]`` is the fewest GPUs table k needs among its
    admissible rows up to position i (a running minimum), the answer the first position where the
    column sum fits the budget."""

    def __init__(self, tables: Sequence[CandidateTable]) -> None:
        self.tables = list(tables)  # each sorted by latency (``frontier`` output)
        self._memo: dict[tuple[float, float, int], StageChoice | None] = {}
        self._fastest: dict[tuple[float, float, int], float] = {}  # latency alone (INF: none)
        self._running: dict[tuple[float, int], list[float]] = {}  # one table: −running min of active
        # active caps between two consecutive values the candidates take admit the same
        # candidates: a call is keyed by the largest value at or under its cap (fewer distinct calls)
        if len(self.tables) == 1:  # nothing to merge: the table's own order, when it is sorted
            t = self.tables[0]
            lat = t.latency
            ordered = len(lat) < 2 or bool((lat[1:] >= lat[:-1]).all())
            order = np.arange(len(lat)) if ordered else np.argsort(lat, kind="stable")
            self._lat = lat if ordered else lat[order]
            self._pers = t.persistent if ordered else t.persistent[order]
            self._act = t.active if ordered else t.active[order]
            self._gpus = t.gpus.astype(np.int64)[order]
            self._local = order
        else:
            lat = np.concatenate([t.latency for t in self.tables])
            order = np.argsort(lat, kind="stable")
            self._lat = lat[order]
            self._pers = np.concatenate([t.persistent for t in self.tables])[order]
            self._act = np.concatenate([t.active for t in self.tables])[order]
            self._gpus = np.concatenate([t.gpus for t in self.tables]).astype(np.int64)[order]
            self._local = np.concatenate([np.arange(len(t)) for t in self.tables])[order]
            which = np.concatenate([np.full(len(t), k) for k, t in enumerate(self.tables)])[order]
            # row k: table k's GPUs where the row is table k's, else "never enough"
            self._base = np.where(which[None, :] == np.arange(len(self.tables))[:, None], self._gpus, NEVER)
        self._actives: list[float] = np.unique(self._act).tolist()
        self._levels: list[float] = np.unique(self._pers).tolist()
        self._big = NEVER

    def resident_levels(self) -> list[float]:
        return self._levels

    def solve(self, x: float, y: float, budget: int) -> StageChoice | None:
        i = bisect.bisect_right(self._actives, y)
        if i == 0:
            return None
        key = (x, self._actives[i - 1], budget)
        found = self._memo.get(key, MISSING)
        if found is MISSING:
            found = self._memo[key] = self._solve(*key)
        return found  # type: ignore[return-value]

    def latency(self, x: float, y: float, budget: int) -> float:
        """``solve(x, y, budget).latency`` (INF: no solution) without the picks: the answer is the
        latency of the first position where the stage fits (its slowest pick has exactly that
        latency, or an earlier position would fit already)."""
        i = bisect.bisect_right(self._actives, y)
        if i == 0:
            return INF
        key = (x, self._actives[i - 1], budget)
        found = self._fastest.get(key)
        if found is None:
            if key in self._memo:
                choice = self._memo[key]
                found = INF if choice is None else choice.latency
            else:
                found = self._first_fit(*key)
            self._fastest[key] = found
        return found

    def _first_fit(self, x: float, y: float, budget: int) -> float:
        if len(self.tables) == 1:
            lowest = self._lowest_active(x, budget)
            i = bisect.bisect_left(lowest, -y)
            return INF if i == len(lowest) else float(self._lat[i])
        ok = (self._pers <= x) & (self._act <= y) & (self._gpus <= budget)
        need = np.minimum.accumulate(np.where(ok, self._base, NEVER), axis=1)
        fits = need.sum(axis=0) <= budget
        i = int(fits.argmax()) if len(fits) else 0
        return float(self._lat[i]) if len(fits) and fits[i] else INF

    def _lowest_active(self, x: float, budget: int) -> list[float]:
        """One table: −(running minimum of active memory over the rows within (x, budget)); the
        running minimum first reaches y at the fastest admissible candidate, so one serves every y."""
        lowest = self._running.get((x, budget))
        if lowest is None:
            within = (self._pers <= x) & (self._gpus <= budget)
            lowest = self._running[(x, budget)] = (
                -np.minimum.accumulate(np.where(within, self._act, INF))
            ).tolist()
        return lowest

    def bounds(self, xs: Sequence[float], y: float, budget: int) -> list[float]:
        """``solve(x, y, budget).latency`` (INF: no solution) for every resident cap in ``xs``,
        in one pass."""
        i = bisect.bisect_right(self._actives, y)
        if i == 0 or not len(self._lat):
            return [INF] * len(xs)
        common = (self._act <= self._actives[i - 1]) & (self._gpus <= budget)
        ok = (self._pers[None, :] <= np.asarray(xs, dtype=np.float64)[:, None]) & common[None, :]
        if len(self.tables) == 1:
            fits = ok
        else:
            cells = np.where(ok[:, None, :], self._base[None, :, :], NEVER)
            fits = np.minimum.accumulate(cells, axis=2).sum(axis=1) <= budget
        first = fits.argmax(axis=1)
        found = fits[np.arange(len(xs)), first]
        latencies: list[float] = np.where(found, self._lat[first], INF).tolist()
        return latencies

    def _solve(self, x: float, y: float, budget: int) -> StageChoice | None:
        if len(self.tables) == 1:  # one model-stage: its fastest admissible candidate
            lowest = self._lowest_active(x, budget)
            i = bisect.bisect_left(lowest, -y)
            if i == len(lowest):
                return None
            return StageChoice(float(self._lat[i]), (int(self._local[i]),))
        ok = (self._pers <= x) & (self._act <= y) & (self._gpus <= budget)
        cells = np.where(ok, self._base, self._big)
        need = np.minimum.accumulate(cells, axis=1)  # need_M(T) at every position, per table
        fits = need.sum(axis=0) <= budget  # (a table with nothing admissible yet adds NEVER)
        i = int(fits.argmax()) if len(fits) else 0
        if not len(fits) or not fits[i]:
            return None
        end = int(np.searchsorted(self._lat, self._lat[i], side="right"))
        # per table the fewest GPUs among its admissible rows no slower than the answer (the first)
        chosen = cells[:, :end].argmin(axis=1)
        picks = tuple(int(v) for v in self._local[chosen])
        return StageChoice(float(self._lat[chosen].max()), picks)


@dataclass(frozen=True, slots=True)
class CoupledChoice:
    latency: float  # Σ of stage latencies
    stages: tuple[StageChoice, ...]
    caps: tuple[float, ...]


def solve_coupled(solvers: Sequence[StageSolver], budget: int, limit: float) -> CoupledChoice | None:
    """Best assignment of stages sharing GPUs: min Σ_s L_s under co-resident memory (exact).

    First each stage's smallest useful cap (its floor) is raised to the smallest at which it has
    any solution while the others sit at their floors, until no floor moves: no feasible plan has
    a stage below its floor. Then caps are visited best-first by a lower bound: stage s at cap x
    cannot do better than solve(x, limit − Σ others' floors). The bound does not increase with x,
    so each stage's caps in descending order are already sorted by bound; a stage's bounds come
    from one batched pass. A visited combination stops being solved as soon as the stages solved
    so far plus the others' bounds reach the best plan found. Combinations are compared by
    latency alone (``StageSolver.latency``); the picks are made once, for the best.
    """
    levels = [s.resident_levels()[::-1] for s in solvers]  # descending: bound ascending
    if any(not lv for lv in levels):
        return None
    lowest = [len(lv) - 1 for lv in levels]  # index of each stage's floor in ``levels``
    moved = True
    while moved:
        moved = False
        for k, solver in enumerate(solvers):
            others = sum(levels[j][lowest[j]] for j in range(len(levels)) if j != k)
            i = lowest[k]
            while i >= 0 and solver.latency(levels[k][i], limit - others, budget) == INF:
                i -= 1
            if i < 0:
                return None
            moved |= i != lowest[k]
            lowest[k] = i
    levels = [lv[: i + 1] for lv, i in zip(levels, lowest, strict=True)]
    floor = [lv[-1] for lv in levels]
    slack = [limit - (sum(floor) - floor[k]) for k in range(len(levels))]
    n = len(levels)
    known: list[list[float]] = [[] for _ in levels]  # bounds of each stage's first caps

    def bound(k: int, i: int) -> float:
        have = known[k]
        if i >= len(have):  # the next few caps in one pass
            have += solvers[k].bounds(levels[k][len(have) : i + BOUND_BATCH], slack[k], budget)
        return have[i]

    start = (0,) * n
    first = sum(bound(k, 0) for k in range(n))
    if first == INF:
        return None
    heap = [(first, start)]
    seen = {start}
    best, best_caps = INF, None
    while heap:
        lower, combo = heapq.heappop(heap)
        if lower == INF or lower >= best:
            break
        caps = [levels[k][i] for k, i in enumerate(combo)]
        resident = sum(caps)
        total = 0.0
        for k, solver in enumerate(solvers):
            latency = solver.latency(caps[k], limit - (resident - caps[k]), budget)
            if latency == INF:
                break
            total += latency
            # the stages solved so far plus the bounds of the rest: a float sum no larger than the
            # total (addition is monotone), so at or above the best this combination cannot win
            if best < INF and k + 1 < n:
                floor_sum = total
                for j in range(k + 1, n):
                    floor_sum += known[j][combo[j]]
                if floor_sum >= best:
                    break
        else:
            if total < best:
                best, best_caps = total, caps
        for k in range(n):
            i = combo[k] + 1
            if i < len(levels[k]):
                nxt = (*combo[:k], i, *combo[k + 1 :])
                if nxt not in seen:
                    seen.add(nxt)
                    heapq.heappush(heap, (lower + (bound(k, i) - known[k][i - 1]), nxt))
    if best_caps is None:
        return None
    resident = sum(best_caps)
    stages = []
    for k, solver in enumerate(solvers):  # the picks of the best caps (their latencies summed above)
        choice = solver.solve(best_caps[k], limit - (resident - best_caps[k]), budget)
        assert choice is not None
        stages.append(choice)
    return CoupledChoice(best, tuple(stages), tuple(best_caps))


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The chosen plan, the estimate behind every candidate, and what the search cost."""

    plan: Plan
    estimates: tuple[Estimate, ...]
    step_latency_s: float
    search_ms: float  # wall time of the whole search
    solver: str
    timings: Mapping[str, float] = field(default_factory=dict)  # per phase, milliseconds


def binding_constraint(problem: PlanningProblem, tables: dict[str, CandidateTable]) -> str:
    """One line on why nothing fits: the model-stage whose smallest footprint is furthest over."""
    limit = problem.capacity_bytes - problem.reserved_bytes
    worst_name, worst = "", -INF
    for name, t in tables.items():
        if len(t) == 0:
            return f"{name} has no layout on {problem.gpus} GPUs"
        smallest = float(t.active.min())
        if smallest - limit > worst:
            worst_name, worst = name, smallest - limit
    t = tables[worst_name]
    i = int(np.argmin(t.active))
    cap = problem.cluster.gpu_memory_gib * (1 - problem.headroom)
    if worst > 0:
        return (
            f"{worst_name} needs ≥ {t.active[i] / GIB + problem.reserved_bytes / GIB:.1f} GiB per GPU "
            f"at tp·pp ≤ {int((t.gpus // t.dp).max())} ({t.shape(i)}); capacity "
            f"{cap:.1f} GiB after {problem.headroom:.0%} headroom on {problem.cluster.name}"
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
        f"no combination stays under {cap:.1f} GiB per GPU after {problem.headroom:.0%} headroom "
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
        if problem.workload.mode is ExecutionMode.SYNC:
            return _program_sync(problem, wf, fronts, limit)
        return _program_async(problem, wf, fronts, limit)

    key = (problem.gpus, space.fixed_layouts, space.fixed_shapes)
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

        return cache.memo(priced.estimates, (ms.name, shape), make)

    return finish(problem, shapes, started, "dp", None, phases, breakdown, cache)


def _solver_for(fronts: dict[str, CandidateTable], wf: Workflow, stage: Stage) -> StageSolver:
    return StageSolver([fronts[m.name] for m in wf.by_stage(stage)])


def _record(
    fronts: dict[str, CandidateTable], wf: Workflow, stage: Stage, choice: StageChoice
) -> dict[str, Shape]:
    return {m.name: fronts[m.name].shape(i) for m, i in zip(wf.by_stage(stage), choice.picks, strict=True)}


def _program_sync(
    problem: PlanningProblem, wf: Workflow, fronts: dict[str, CandidateTable], limit: float
) -> dict[str, Shape] | None:
    """Sync mode: every stage shares the pool; min Σ_s L_s."""
    coupled = solve_coupled([_solver_for(fronts, wf, s) for s in wf.stages], problem.gpus, limit)
    if coupled is None:
        return None
    shapes: dict[str, Shape] = {}
    for stage, choice in zip(wf.stages, coupled.stages, strict=True):
        shapes.update(_record(fronts, wf, stage, choice))
    return shapes


def _program_async(
    problem: PlanningProblem, wf: Workflow, fronts: dict[str, CandidateTable], limit: float
) -> dict[str, Shape] | None:
    """Async mode: generation on its own GPUs, inference and training share the rest;
    min max(L_gen, L_inf + L_train) over every split of the pool."""
    gens = wf.by_stage(Stage.GEN)
    if len(gens) != 1:
        raise InfeasibleError("async mode needs exactly one generation model-stage")
    gen = fronts[gens[0].name]
    rest_stages = [s for s in (Stage.INF, Stage.TRAIN) if wf.by_stage(s)]
    rest_solvers = [_solver_for(fronts, wf, s) for s in rest_stages]
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
