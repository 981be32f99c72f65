"""Every valid plan: the brute-force oracle for the search (shares none of its pruning).

Two enumerations of the same plan space (every candidate of every model-stage, see
``candidates.py``), both with the feasibility rules of ``search.py`` and the step latency of
``overlap.py``:

* ``iter_plans`` walks every combination one by one and prices each plan on its own. It is the
  literal definition and is tractable only for a few GPUs.
* ``exhaustive`` enumerates, per stage, every tuple of concurrent candidates that fits the GPU
  budget (as arrays), then joins the stages exactly: plans are grouped by each stage's largest
  resident footprint X_s, for which the co-residency rule becomes a per-stage bound on active
  memory, so the count and the fastest plan of every group are read off sorted arrays. No frontier,
  dominance or bound from the search is used. Tractable to a few dozen GPUs for PPO (the inference
  stage's 4 concurrent model-stages make tuples grow like P⁴); ``benchmarks/planner.py`` reports
  where it stops within its time limit.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from nereus.errors import NereusError
from nereus.plan.candidates import CandidateTable, Shape
from nereus.plan.cost import CostModel
from nereus.plan.evaluate import fits_pool, price
from nereus.plan.overlap import step_latency
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import build_tables
from nereus.spec.workload import ExecutionMode, Stage, Workflow

CHUNK = 1 << 20  # cross-product rows built at once
MAX_ROWS = 30_000_000  # stage tuples held at once (~2.4 GB); beyond this the oracle refuses


class ExhaustiveTooLargeError(NereusError):
    """The plan space is too large to enumerate in memory (the oracle's tractability limit)."""


@dataclass(frozen=True, slots=True)
class ExhaustiveResult:
    count: int  # valid plans
    best_step_latency_s: float | None
    best: dict[str, Shape] | None
    seconds: float


@dataclass(frozen=True, slots=True)
class _StageTuples:
    """Every GPU-feasible tuple of one stage's concurrent candidates, as parallel arrays."""

    gpus: np.ndarray
    latency: np.ndarray  # max over the tuple (concurrent)
    resident: np.ndarray  # max resident bytes
    active: np.ndarray  # max active bytes
    picks: np.ndarray  # (rows, model-stages) candidate indices


def _stage_tuples(tables: Sequence[CandidateTable], budget: int, max_rows: int = MAX_ROWS) -> _StageTuples:
    gpus = np.zeros(1, dtype=np.int64)
    lat = np.zeros(1)
    res = np.zeros(1)
    act = np.zeros(1)
    picks = np.zeros((1, 0), dtype=np.int64)
    for t in tables:
        parts = [(gpus[:0], lat[:0], res[:0], act[:0], np.zeros((0, picks.shape[1] + 1), dtype=np.int64))]
        for lo in range(0, len(gpus), max(1, CHUNK // max(1, len(t)))):
            hi = min(len(gpus), lo + max(1, CHUNK // max(1, len(t))))
            rows = np.repeat(np.arange(lo, hi), len(t))
            cols = np.tile(np.arange(len(t)), hi - lo)
            g = gpus[rows] + t.gpus[cols]
            ok = g <= budget
            rows, cols = rows[ok], cols[ok]
            parts.append(
                (
                    g[ok],
                    np.maximum(lat[rows], t.latency[cols]),
                    np.maximum(res[rows], t.persistent[cols]),
                    np.maximum(act[rows], t.active[cols]),
                    np.column_stack([picks[rows], cols]),
                )
            )
            if sum(len(p[0]) for p in parts) > max_rows:
                raise ExhaustiveTooLargeError(
                    f"more than {max_rows:,} tuples of concurrent candidates in one stage on {budget} GPUs"
                )
        gpus, lat, res, act, picks = (np.concatenate([p[i] for p in parts]) for i in range(5))
    return _StageTuples(gpus, lat, res, act, picks)


@dataclass(frozen=True, slots=True)
class _Group:
    """Tuples of one stage with one resident maximum, sorted by active memory."""

    active: np.ndarray
    best_latency: np.ndarray  # prefix minimum of latency in active order
    best_row: np.ndarray  # row achieving it


def _groups(t: _StageTuples) -> dict[float, _Group]:
    out = {}
    for level in np.unique(t.resident):
        rows = np.flatnonzero(t.resident == level)
        rows = rows[np.argsort(t.active[rows], kind="stable")]
        lat = t.latency[rows]
        run = np.minimum.accumulate(lat)
        arg = np.maximum.accumulate(np.where(lat == run, np.arange(len(rows)), 0))
        out[float(level)] = _Group(t.active[rows], run, rows[arg])
    return out


def _query(group: _Group, limit: float) -> tuple[int, float, int]:
    """(how many tuples fit under ``limit``, the fastest one's latency, its row)."""
    n = int(np.searchsorted(group.active, limit, side="right"))
    if n == 0:
        return 0, np.inf, -1
    return n, float(group.best_latency[n - 1]), int(group.best_row[n - 1])


def _shapes_of(
    workflow: Workflow, tables: dict[str, CandidateTable], stage: Stage, picks: np.ndarray
) -> dict[str, Shape]:
    return {
        m.name: tables[m.name].shape(int(i)) for m, i in zip(workflow.by_stage(stage), picks, strict=True)
    }


def exhaustive(problem: PlanningProblem, tables: dict[str, CandidateTable] | None = None) -> ExhaustiveResult:
    """Count every valid plan and find the fastest, without any pruning of the plan space.

    ``tables`` (every model-stage's priced candidates) are built when not given. Raises
    ``ExhaustiveTooLargeError`` past the oracle's memory limit.
    """
    started = time.perf_counter()
    tables = tables or build_tables(CostModel(problem))
    wf = problem.workflow
    limit = problem.capacity_bytes - problem.reserved_bytes
    P = problem.gpus
    if problem.workload.mode is ExecutionMode.SYNC:
        stages = wf.stages
        tuples = [_stage_tuples([tables[m.name] for m in wf.by_stage(s)], P) for s in stages]
        groups = [_groups(t) for t in tuples]
        count, best = 0, np.inf
        best_shapes: dict[str, Shape] | None = None
        for caps in itertools.product(*(sorted(g) for g in groups)):
            resident = sum(caps)
            found = [_query(groups[k][caps[k]], limit - (resident - caps[k])) for k in range(len(caps))]
            n = int(np.prod([f[0] for f in found]))
            if n == 0:
                continue
            count += n
            total = sum(f[1] for f in found)
            if total < best:
                best = total
                best_shapes = {}
                for stage, t, f in zip(stages, tuples, found, strict=True):
                    best_shapes.update(_shapes_of(wf, tables, stage, t.picks[f[2]]))
        return _result(problem, count, best_shapes, started)
    # async: generation alone on its GPUs; inference and training share the rest
    gen_name = wf.by_stage(Stage.GEN)[0].name
    gen = tables[gen_name]
    rest = [s for s in (Stage.INF, Stage.TRAIN) if wf.by_stage(s)]
    tuples = [_stage_tuples([tables[m.name] for m in wf.by_stage(s)], P) for s in rest]
    count, best = 0, np.inf
    best_shapes = None
    levels = [np.unique(t.resident) for t in tuples]
    for gi in range(len(gen)):
        g = int(gen.gpus[gi])
        if g >= P or gen.active[gi] > limit:
            continue
        for caps in itertools.product(*levels):
            resident = float(sum(caps))
            found = []
            for k, t in enumerate(tuples):
                ok = np.flatnonzero(
                    (t.resident == caps[k]) & (t.gpus <= P - g) & (t.active <= limit - (resident - caps[k]))
                )
                if ok.size == 0:
                    break
                row = int(ok[np.argmin(t.latency[ok])])
                found.append((ok.size, float(t.latency[row]), row))
            else:
                count += int(np.prod([f[0] for f in found]))
                total = max(float(gen.latency[gi]), sum(f[1] for f in found))
                if total < best:
                    best = total
                    best_shapes = {gen_name: gen.shape(gi)}
                    for stage, t, f in zip(rest, tuples, found, strict=True):
                        best_shapes.update(_shapes_of(wf, tables, stage, t.picks[f[2]]))
    return _result(problem, count, best_shapes, started)


def _result(
    problem: PlanningProblem, count: int, shapes: dict[str, Shape] | None, started: float
) -> ExhaustiveResult:
    latency = None
    if shapes is not None:
        latency = plan_step_latency(problem, shapes)
    return ExhaustiveResult(count, latency, shapes, time.perf_counter() - started)


def plan_step_latency(problem: PlanningProblem, shapes: dict[str, Shape]) -> float:
    """Step latency of a plan, priced model-stage by model-stage on the overlap graph."""
    return price(problem, shapes).step_latency_s


def plan_is_feasible(problem: PlanningProblem, shapes: dict[str, Shape]) -> bool:
    """The search's rules, checked directly on one plan: GPU budgets and co-resident memory."""
    return fits_pool(problem, shapes) and not price(problem, shapes).over_capacity(problem)


def iter_plans(problem: PlanningProblem) -> Iterator[tuple[dict[str, Shape], float]]:
    """Every valid plan with its step latency, one by one (a few GPUs only)."""
    tables = build_tables(CostModel(problem))
    wf = problem.workflow
    names = [m.name for m in wf.model_stages]
    for combo in itertools.product(*(range(len(tables[n])) for n in names)):
        shapes = {n: tables[n].shape(i) for n, i in zip(names, combo, strict=True)}
        if plan_is_feasible(problem, shapes):
            yield shapes, plan_step_latency(problem, shapes)


def all_plans(problem: PlanningProblem) -> Iterator[tuple[dict[str, Shape], float]]:
    """Every valid plan with its step latency, from the per-stage tuples (``--all``)."""
    tables = build_tables(CostModel(problem))
    wf = problem.workflow
    limit = problem.capacity_bytes - problem.reserved_bytes
    P = problem.gpus
    mode = problem.workload.mode
    gen_apart = mode is ExecutionMode.ASYNC
    shared = [s for s in wf.stages if not (gen_apart and s is Stage.GEN)]
    tuples = {s: _stage_tuples([tables[m.name] for m in wf.by_stage(s)], P) for s in shared}
    gen_rows: list[int | None] = [None]
    if gen_apart:
        gen = tables[wf.by_stage(Stage.GEN)[0].name]
        gen_rows = [i for i in range(len(gen)) if gen.gpus[i] < P and gen.active[i] <= limit]
    levels = [np.unique(tuples[s].resident) for s in shared]
    for gi in gen_rows:
        budget = P if gi is None else P - int(gen.gpus[gi])
        for caps in itertools.product(*levels):
            resident = float(sum(caps))
            rows = []
            for k, s in enumerate(shared):
                t = tuples[s]
                ok = (t.resident == caps[k]) & (t.active <= limit - (resident - caps[k]))
                rows.append(np.flatnonzero(ok & (t.gpus <= budget)).tolist())
            for combo in itertools.product(*rows):
                picks: dict[str, int] = {}
                if gi is not None:
                    picks[gen.model_stage.name] = gi
                for s, row in zip(shared, combo, strict=True):
                    members = wf.by_stage(s)
                    picks.update({m.name: int(i) for m, i in zip(members, tuples[s].picks[row], strict=True)})
                shapes = {n: tables[n].shape(i) for n, i in picks.items()}
                latency = {n: float(tables[n].latency[i]) for n, i in picks.items()}
                yield shapes, step_latency(wf, mode, latency)
