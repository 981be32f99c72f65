"""The exact program over model-stages (paper Eq. 1; our formulation, paper-notes §5.7).

``StageSolver``: for caps (x: resident, y: active) and a GPU budget, the smallest achievable
max-latency of one stage, found by a threshold search: for a latency T each model-stage needs at
least need_M(T) = min{gpus : L ≤ T, resident ≤ x, active ≤ y} GPUs (a prefix minimum over the
latency-sorted frontier); the answer is the smallest T with Σ_M need_M(T) ≤ budget.

``solve_coupled``: stages couple only through the caps X_s; cap vectors are visited best-first by
a lower bound and the search stops when the bound reaches the best plan found (exact).

``SolverMemo``: the stage solvers of the frontiers one set of prices produced, kept across the
searches that read the same frontiers (a replan's target and its held-layout alternatives).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nereus.plan.candidates import CandidateTable

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


class SolverMemo:
    """Stage solvers by the identity of the tables they read (the newest ``keep``). An entry holds
    its tables, so their identities stay unique while it lives; a solver's answers depend on its
    tables and its arguments only, so a kept one answers as a fresh one would."""

    def __init__(self, keep: int = 16) -> None:
        if keep < 1:
            raise ValueError("keep must be positive")
        self.keep = keep
        self._solvers: OrderedDict[tuple[int, ...], StageSolver] = OrderedDict()

    def solver(self, tables: Sequence[CandidateTable]) -> StageSolver:
        key = tuple(id(t) for t in tables)
        found = self._solvers.get(key)
        if found is None:
            found = self._solvers[key] = StageSolver(tables)
            while len(self._solvers) > self.keep:
                self._solvers.popitem(last=False)
        else:
            self._solvers.move_to_end(key)
        return found

    def __len__(self) -> int:
        return len(self._solvers)
