"""What a replan of the same job can reuse from earlier searches (issue 21).

The controller replans one job again and again: for one trigger it searches the target and a few
held-layout alternatives under the same prices; across triggers the pool size, the lengths or the
calibration change. ``PlanCache`` keeps, per job (workload, models, cluster, headroom):

* rows:      each model-stage's enumerated shapes and their layout facts, by pool size and search
             space (what the lengths and the calibration do not change);
* tables:    the priced candidate table of each model-stage, by *price key* — everything a price
             reads besides the job: the lengths, every efficiency and memory correction, the
             search space's options and the pool's occupancy (free GPUs per node,
             ``bestfit.occupancy``: on a fragmented pool best fit splits groups across nodes) —
             and, within a price key, by the model-stage, its held layout and where it runs when
             the running plan keeps it in place (its own ``bestfit.anchored`` entry, usually none:
             a pool change that moves another model-stage's anchor leaves this table priced);
* frontiers: each table's feasible non-dominated candidates (also per held layout);
* programs:  the shapes the exact program chose from those frontiers, per pool size and anchors;
* estimates: the full breakdown of a chosen shape (per anchor entry);
* results:   whole searches, keyed by every field of the problem (pool ids and anchor included);
* placements: the GPUs of chosen shapes, by shapes, pool ids, anchor and failure domains (what a
             drift of the lengths or the calibration that keeps the shapes does not change).

Pool size: on whole nodes of a power of two GPUs (occupancy ``()``) a row's price does not
depend on the pool, and the rows of a smaller pool are exactly the rows of a larger one with at
most that many GPUs, in the same order. A table priced for G GPUs therefore serves any pool of G
or fewer by a filter on GPUs; so does its frontier, because a dominator never needs more GPUs
than the candidate it dominates.
On a fragmented pool the occupancy (part of the price key) fixes the pool size, so no such reuse.

Invalidation is by key: a calibration update changes an efficiency, hence the price key, hence
every entry it reaches; entries of the oldest price keys are dropped beyond ``keep`` of them. A
problem of another job (another workload, model set, cluster or headroom) clears the cache.
Results are exact: a cached search returns what a cold search returns (``tests/test_plan_cache.py``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import numpy as np

from nereus.plan.bestfit import anchored, occupancy
from nereus.plan.calibration import Efficiencies
from nereus.plan.candidates import (
    CandidateTable,
    Estimate,
    Rows,
    Shape,
    enumerate_rows,
    price_rows,
    recomputes_of,
    twin_key,
)
from nereus.plan.cost import CostModel
from nereus.plan.frontier import frontier
from nereus.plan.layout import Layout, Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import ModelStage, Workflow

T = TypeVar("T")
JOB_FIELDS = ("workload", "models", "cluster", "headroom")
PriceKey = tuple[Hashable, ...]
Hold = Layout | None  # a model-stage's held layout, or None: free


def efficiency_key(eff: Efficiencies) -> tuple[Hashable, ...]:
    """Every value a price reads from calibration, as a hashable key."""
    return (
        tuple(sorted(eff.eta.items())),
        tuple(sorted(eff.memory_correction.items())),
        tuple(sorted(eff.curves.items())),
    )


@dataclass(slots=True)
class _Priced:
    """Everything cached under one price key; G-indexed entries hold the pool size they cover."""

    # by (model-stage, held layout, its anchor entry)
    tables: dict[tuple[str, Hold, Hashable], tuple[int, CandidateTable]] = field(default_factory=dict)
    twins: dict[Hashable, tuple[int, CandidateTable]] = field(default_factory=dict)  # by twin key
    fronts: dict[tuple[str, Hold, Hashable], tuple[int, CandidateTable]] = field(default_factory=dict)
    programs: dict[Hashable, Any] = field(default_factory=dict)
    estimates: dict[tuple[str, Shape, Hashable], Estimate] = field(default_factory=dict)


@dataclass(slots=True)
class CacheStats:
    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, hit: bool) -> None:
        d = self.hits if hit else self.misses
        d[what] = d.get(what, 0) + 1


def _within(entry: tuple[int, CandidateTable] | None, gpus: int) -> CandidateTable | None:
    """The cached table cut to ``gpus`` GPUs, or None when it was priced for fewer."""
    if entry is None or entry[0] < gpus:
        return None
    g, table = entry
    if g == gpus or len(table) == 0 or int(table.gpus.max()) <= gpus:
        return table
    return table.take(np.flatnonzero(table.gpus <= gpus))


def _rows_within(entry: tuple[int, Rows] | None, gpus: int) -> Rows | None:
    if entry is None or entry[0] < gpus:
        return None
    g, rows = entry
    if g == gpus or len(rows.gpus) == 0 or int(rows.gpus.max()) <= gpus:
        return rows
    return rows.take(np.flatnonzero(rows.gpus <= gpus))


class PlanCache:
    """Per-job memo of the planner's intermediate results; pass it to ``search``."""

    def __init__(self, keep: int = 4, results: int = 64) -> None:
        if keep < 1 or results < 0:
            raise ValueError("keep must be positive and results non-negative")
        self.keep = keep
        self.max_results = results
        self.stats = CacheStats()
        self.pricing_s = 0.0  # seconds spent enumerating and pricing, over the cache's life
        self._job: tuple[Any, ...] | None = None
        self._eff: tuple[Efficiencies, tuple[Hashable, ...]] | None = None
        self._workflow: Workflow | None = None
        self._rows: dict[tuple[Hashable, ...], tuple[int, Rows]] = {}
        self._priced: OrderedDict[PriceKey, _Priced] = OrderedDict()
        self._results: OrderedDict[Hashable, Any] = OrderedDict()
        self._placements: OrderedDict[Hashable, Plan] = OrderedDict()
        self._last_where: tuple[tuple[int, ...], int, Hashable] | None = None

    def clear(self) -> None:
        self._job, self._eff, self._workflow = None, None, None
        self._rows.clear()
        self._priced.clear()
        self._results.clear()
        self._placements.clear()
        self._last_where = None

    # ------------------------------------------------------------------ keys
    def bind(self, problem: PlanningProblem) -> Workflow:
        """Check that ``problem`` is this cache's job (clearing it otherwise); its workflow."""
        job = tuple(getattr(problem, f) for f in JOB_FIELDS)
        if self._job is None or not _same(self._job, job):
            self.clear()
            self._job = job
        if self._workflow is None:
            self._workflow = problem.workflow
        return self._workflow

    def _efficiency_key(self, eff: Efficiencies) -> tuple[Hashable, ...]:
        if self._eff is None or self._eff[0] is not eff:
            self._eff = (eff, efficiency_key(eff))
        return self._eff[1]

    def price_key(self, problem: PlanningProblem) -> PriceKey:
        s = problem.space
        where = self._where(problem)
        return (problem.seq, self._efficiency_key(problem.efficiencies), s.recompute, s.shrink_micro_batch,
                problem.max_tp, s.flat, s.overlap_dp_sync, s.paged_kv, where)  # fmt: skip

    def _where(self, problem: PlanningProblem) -> Hashable:
        """What the links of every price read of the pool: its occupancy; kept for the last pool,
        which replans reuse. (Where the running plan's model-stages run is read per model-stage:
        ``anchor_of``.)"""
        gpn = problem.cluster.gpus_per_node
        last = self._last_where
        if last is not None and last[1] == gpn and last[0] == problem.pool:
            return last[2]
        where = occupancy(problem.pool, gpn)
        self._last_where = (problem.pool, gpn, where)
        return where

    @staticmethod
    def anchor_of(problem: PlanningProblem, name: str) -> Hashable:
        """Model-stage ``name``'s entry of ``bestfit.anchored`` (None: priced by best fit): the
        one thing of the running plan its price reads (``CostModel.spans``)."""
        return next((a for a in anchored(problem) if a[0] == name), None)

    def result_key(self, problem: PlanningProblem) -> Hashable | None:
        """Every non-job field of ``problem``; None when one cannot be hashed (no result memo)."""
        key = tuple(
            self._efficiency_key(v) if isinstance(v, Efficiencies) else v
            for f in fields(problem)
            if f.name not in JOB_FIELDS
            for v in (getattr(problem, f.name),)
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    # ------------------------------------------------------------------ entries
    def priced(self, key: PriceKey) -> _Priced:
        entry = self._priced.get(key)
        if entry is None:
            entry = self._priced[key] = _Priced()
            while len(self._priced) > self.keep:
                self._priced.popitem(last=False)
        else:
            self._priced.move_to_end(key)
        return entry

    def result(self, key: Hashable | None) -> Any:
        if key is None:
            return None
        found = self._results.get(key)
        self.stats.count("result", found is not None)
        return found

    def store_result(self, key: Hashable | None, value: Any) -> None:
        if key is None or self.max_results == 0:
            return
        self._results[key] = value
        while len(self._results) > self.max_results:
            self._results.popitem(last=False)

    def rows(self, problem: PlanningProblem, ms: ModelStage, hold: Hold) -> Rows:
        s = problem.space
        key = (ms.name, hold, s.shrink_micro_batch, problem.max_tp, ms.name in s.flat)
        found = _rows_within(self._rows.get(key), problem.gpus)
        self.stats.count("rows", found is not None)
        if found is None:
            started = time.perf_counter()
            found = enumerate_rows(problem, ms)
            self.pricing_s += time.perf_counter() - started
            self._rows[key] = (problem.gpus, found)
        return found

    def table(
        self,
        problem: PlanningProblem,
        priced: _Priced,
        cost: Callable[[], CostModel],
        ms: ModelStage,
        hold: Hold,
    ) -> CandidateTable:
        """The priced table of ``ms`` (at ``hold``) for this pool size."""
        gpus = problem.gpus
        at = self.anchor_of(problem, ms.name)
        found = _within(priced.tables.get((ms.name, hold, at)), gpus)
        if found is None and hold is not None:  # the held layout's rows of the free table
            free = _within(priced.tables.get((ms.name, None, at)), gpus)
            if free is not None and hold in free.layouts:
                found = free.take(np.flatnonzero(free.layout_index == free.layouts.index(hold)))
        self.stats.count("table", found is not None)
        if found is None:
            rows = self.rows(problem, ms, hold)
            started = time.perf_counter()
            recomputes = recomputes_of(problem, ms)
            twin_at = (twin_key(problem, ms), gpus)
            twin = priced.twins.get(twin_at)
            same = twin is not None and _same_rows(twin[1], rows, len(recomputes))
            self.stats.count("twin", same)
            found = price_rows(cost(), ms, rows, recomputes, twin[1] if same and twin is not None else None)
            self.pricing_s += time.perf_counter() - started
            priced.tables[(ms.name, hold, at)] = (gpus, found)
            priced.twins.setdefault(twin_at, (gpus, found))
        return found

    def frontier(
        self,
        problem: PlanningProblem,
        priced: _Priced,
        cost: Callable[[], CostModel],
        ms: ModelStage,
        hold: Hold,
        limit: float,
    ) -> CandidateTable:
        key = (ms.name, hold, self.anchor_of(problem, ms.name))
        found = _within(priced.fronts.get(key), problem.gpus)
        self.stats.count("frontier", found is not None)
        if found is None:
            found = frontier(self.table(problem, priced, cost, ms, hold), limit)
            priced.fronts[key] = (problem.gpus, found)
        return found

    def placement(
        self, problem: PlanningProblem, wf: Workflow, shapes: Mapping[str, Shape], make: Callable[[], Plan]
    ) -> Plan:
        """The placement of ``shapes`` on this pool (``make`` when not kept): placement reads the
        shapes, the pool, the anchor and the failure domains, not the prices, so a replan after a
        length or calibration drift that keeps the shapes keeps their GPUs."""
        key = (
            problem.workload.mode,
            tuple(shapes[m.name] for m in wf.model_stages),
            problem.pool,
            problem.anchor,
            problem.domains,
        )
        try:
            found = self._placements.get(key)
        except TypeError:  # something unhashable: no memo
            return make()
        self.stats.count("placement", found is not None)
        if found is None:
            found = self._placements[key] = make()
            while len(self._placements) > max(self.max_results, 1):
                self._placements.popitem(last=False)
        else:
            self._placements.move_to_end(key)
        return found

    @staticmethod
    def memo(store: dict[Any, Any], key: Hashable, make: Callable[[], T]) -> T:
        if key in store:
            value: T = store[key]
            return value
        value = store[key] = make()
        return value


def _same_rows(table: CandidateTable, rows: Rows, blocks: int) -> bool:
    """Whether ``table`` was priced whole from rows equal to ``rows`` (a twin's: same key)."""
    n = len(rows.dp)
    return (
        table.source is None
        and len(table) == n * blocks
        and table.layouts == rows.layouts
        and np.array_equal(table.dp[:n], rows.dp)
        and np.array_equal(table.micro_batch[:n], rows.micro_batch)
        and np.array_equal(table.layout_index[:n], rows.layout_index)
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            if dict(x) != dict(y):
                return False
        elif x != y:
            return False
    return True
