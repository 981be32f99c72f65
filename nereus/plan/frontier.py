"""Latency–GPU frontier of one model-stage (paper §2.6 steps 2–3).

Infeasible candidates (their own footprint over capacity) are dropped, then dominated ones: A
dominates B when A needs no more GPUs, is no slower, and keeps no more memory resident and active.
Memory is part of dominance because co-resident state couples the stages (``search.py``); within
one resident-memory class this is the plain latency × GPUs frontier with an active-memory tie-break.

Dominance is decided for all rows at once, in a fixed number of NumPy calls (no per-level pass):

* bitsets: for each of the four coordinates, the set {j : x_j ≤ x_i} of every point i is a prefix
  of the points sorted by that coordinate, i.e. a row of a cumulative OR; a point is dominated
  when the four sets of it intersect in another point (the points are distinct).
* small tables (the usual case): the points sorted by latency (ties by resident, active, GPUs),
  a point is dominated exactly when an earlier one is ≤ in the other three coordinates (a
  dominator of a distinct point comes first in that order), decided by one triangular pairwise
  comparison.
* on large tables a coarse grid first removes most dominated points: ``grid[p, g, a]`` is the
  lowest latency among points of resident rank ≤ p, GPU bucket < g and active bucket < a (prefix
  minima), so a point whose cell finds one no slower has a dominator. Every dominated point that
  remains still has a non-dominated dominator among the remaining ones, so the exact test on
  them decides.
"""

from __future__ import annotations

import numpy as np

from nereus.plan.candidates import CandidateTable
from nereus.plan.replica import FloatArray, IntArray

BoolArray = np.ndarray
PREFILTER_ABOVE = 1024  # points; below, the exact test runs on every point
ACTIVE_BUCKETS, GPU_BUCKETS = 32, 16  # of the prefilter's grid
BITSET_UPTO = 4096  # points; above, pairwise in chunks (bounded memory)
PAIR_CELLS = 2_000_000  # pairwise comparisons per chunk
SORTED_UPTO = 160  # points; up to this many, the triangular pairwise test on the latency order


def _starts(*keys: np.ndarray) -> BoolArray:
    """Mask of positions where any of the (sorted) ``keys`` differs from the position before."""
    out = np.empty(len(keys[0]), dtype=bool)
    out[0] = True
    np.not_equal(keys[0][1:], keys[0][:-1], out=out[1:])
    for k in keys[1:]:
        out[1:] |= k[1:] != k[:-1]
    return out


def _dense_rank(values: np.ndarray) -> tuple[IntArray, int]:
    """(rank of each value among the distinct values, number of distinct values)."""
    order = np.argsort(values, kind="stable")
    dense = np.cumsum(_starts(values[order])) - 1
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = dense
    return rank, int(dense[-1]) + 1


def _dominated_bitsets(cols: tuple[np.ndarray, ...]) -> BoolArray:
    """Mask of (distinct) points some other point is ≤ in every column, by bitsets of n bits."""
    n = len(cols[0])
    ids = np.arange(n)
    word = ids >> 6
    bit = np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64))
    common: np.ndarray | None = None
    for c in cols:
        order = np.argsort(c, kind="stable")
        prefix = np.zeros((n, (n + 63) >> 6), dtype=np.uint64)
        prefix[ids, word[order]] = bit[order]
        np.bitwise_or.accumulate(prefix, axis=0, out=prefix)  # row k: the first k + 1 by c
        rows = prefix[np.searchsorted(c[order], c, side="right") - 1]  # {j : c_j ≤ c_i}
        common = rows if common is None else np.bitwise_and(common, rows, out=common)
    assert common is not None
    common[ids, word] &= ~bit  # a point does not dominate itself
    return np.asarray(common.any(axis=1), dtype=bool)


def _dominated_pairwise(cols: tuple[np.ndarray, ...]) -> BoolArray:
    """``_dominated_bitsets`` in chunks of pairwise comparisons (for very large tables)."""
    n = len(cols[0])
    out = np.zeros(n, dtype=bool)
    step = max(1, PAIR_CELLS // n)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        le = np.ones((hi - lo, n), dtype=bool)
        for c in cols:
            le &= c[None, :] <= c[lo:hi, None]
        le[np.arange(hi - lo), np.arange(lo, hi)] = False
        out[lo:hi] = le.any(axis=1)
    return out


def _caught_by_grid(pers: FloatArray, act: FloatArray, gpus: IntArray, lat: FloatArray) -> BoolArray:
    """Points with a dominator of no more resident, strictly fewer GPUs and strictly less active
    memory (by buckets of ranks: a strictly lower bucket holds strictly smaller values)."""
    p, np_ = _dense_rank(pers)
    g, ng = _dense_rank(gpus)
    a, na = _dense_rank(act)
    nbg, nba = min(ng, GPU_BUCKETS), min(na, ACTIVE_BUCKETS)
    bg, ba = g * nbg // ng, a * nba // na
    grid = np.full((np_, nbg + 1, nba + 1), np.inf)  # bucket index 0: "nothing smaller"
    np.minimum.at(grid, (p, bg + 1, ba + 1), lat)
    for axis in range(3):
        np.minimum.accumulate(grid, axis=axis, out=grid)
    caught: BoolArray = grid[p, bg, ba] <= lat
    return caught


def dominated(pers: FloatArray, act: FloatArray, gpus: IntArray, lat: FloatArray) -> BoolArray:
    """Mask of the (distinct) points another point is ≤ in resident, active, GPUs and latency."""
    cols = (pers, act, gpus, lat)
    if len(pers) > PREFILTER_ABOVE:
        out = _caught_by_grid(*cols)
        rest = np.flatnonzero(~out)
        sub = (
            dominated(pers[rest], act[rest], gpus[rest], lat[rest]) if len(rest) < len(pers) else _exact(cols)
        )
        out[rest] = sub
        return out
    return _exact(cols)


def _exact(cols: tuple[np.ndarray, ...]) -> BoolArray:
    return _dominated_bitsets(cols) if len(cols[0]) <= BITSET_UPTO else _dominated_pairwise(cols)


def _dominated_in_order(pers: FloatArray, act: FloatArray, gpus: IntArray) -> BoolArray:
    """Mask of the points (distinct, sorted by latency then resident, active, GPUs) an earlier point
    is ≤ in resident, active and GPUs: row j, column i of the comparison is "j ≤ i"."""
    le = pers[:, None] <= pers[None, :]
    le &= act[:, None] <= act[None, :]
    le &= gpus[:, None] <= gpus[None, :]
    return np.asarray(np.triu(le, 1).any(axis=0), dtype=bool)


def frontier(table: CandidateTable, limit_bytes: float) -> CandidateTable:
    """Feasible, non-dominated candidates of ``table``, sorted by latency.

    ``limit_bytes`` is what one model-stage may use per GPU on its own (capacity after headroom
    minus the runtime reserve). Of identical candidates the first is kept; candidates of equal
    latency are ordered by (resident, active, GPUs).
    """
    feasible = table.active <= limit_bytes
    t = table if feasible.all() else table.take(np.flatnonzero(feasible))
    if len(t) == 0:
        return t
    if len(t) <= SORTED_UPTO:
        order = np.lexsort((t.gpus, t.active, t.persistent, t.latency))
        pers, act, gpus, lat = t.persistent[order], t.active[order], t.gpus[order], t.latency[order]
        fresh = _starts(lat, pers, act, gpus)  # first of identical points (lexsort is stable)
        if not fresh.all():
            order, pers, act, gpus = order[fresh], pers[fresh], act[fresh], gpus[fresh]
        return t.take(order[~_dominated_in_order(pers, act, gpus)])
    order = np.lexsort((t.latency, t.gpus, t.active, t.persistent))
    pers, act, gpus, lat = t.persistent[order], t.active[order], t.gpus[order], t.latency[order]
    fresh = _starts(pers, act, gpus, lat)  # first of identical points (lexsort is stable)
    idx, lat = order[fresh], lat[fresh]
    if len(idx) > 1:
        keep = ~dominated(pers[fresh], act[fresh], gpus[fresh], lat)
        idx, lat = idx[keep], lat[keep]
    # by latency, then (resident, active, GPUs): the order the points already have
    return t.take(idx[np.argsort(lat, kind="stable")])
