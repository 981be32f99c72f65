"""Latency–GPU frontier of one model-stage (paper §2.6 steps 2–3).

Infeasible candidates (their own footprint over capacity) are dropped, then dominated ones: A
dominates B when A needs no more GPUs, is no slower, and keeps no more memory resident and active.
Memory is part of dominance because co-resident state couples the stages (``search.py``); within
one resident-memory class this is the plain latency × GPUs frontier with an active-memory tie-break.

The points are sorted by latency, ties by (resident, active, GPUs), and identical ones merged; a
dominator of a point then always comes before it, so a point is dominated exactly when an earlier
one is ≤ in resident, active and GPUs. That is decided

* on small sets, by one pairwise comparison of every point with every other;
* on large ones, by a sweep over blocks of the order: a grid over (resident rank, GPU rank) holds
  the least active memory among the frontier points of the blocks before (prefix minima over
  both ranks), so one look-up per point finds a dominator in an earlier block; the points no
  earlier block dominates are then decided among themselves (pairwise, or by bitsets: for each
  coordinate the set {j : x_j ≤ x_i} is a prefix of the points sorted by it). A
  dominated point always has a frontier point among its dominators, so the grid needs only the
  frontier points and a point's own block needs only its survivors. A few NumPy calls per block,
  against work quadratic in the points for any all-pairs test.
"""

from __future__ import annotations

import numpy as np

from nereus.plan.candidates import CandidateTable
from nereus.plan.replica import FloatArray, IntArray

BoolArray = np.ndarray
PAIRWISE_UPTO = 160  # points; above, the block sweep (its first block this long, then doubling)
SURVIVORS_PAIRWISE_UPTO = 384  # a block's survivors compared pairwise up to this many, else by bitsets
BLOCK_UPTO = 2048  # points in a block at most: its bitsets stay under 0.5 MB


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
    if values.dtype.kind in "iu" and len(values):  # GPU counts: a table over 0..max, no sort
        low = int(values.min())
        seen = np.zeros(int(values.max()) - low + 1, dtype=bool)
        seen[values - low] = True
        rank = np.cumsum(seen) - 1
        return rank[values - low], int(rank[-1]) + 1
    ordered = np.sort(values)
    distinct = ordered[_starts(ordered)]
    return np.searchsorted(distinct, values), len(distinct)  # (cheaper than unique's inverse)


def _pairwise(pers: FloatArray, act: FloatArray, gpus: IntArray, lat: FloatArray) -> BoolArray:
    """Mask of the (distinct) points another point is ≤ in all four coordinates, for points in
    the order ``dominated_in_order`` reads (by latency, ties by resident, active, GPUs): row j,
    column i of the comparison is "j ≤ i". In that order only an earlier point can be ≤ a later
    one (a later point ≤ an earlier one in all four would equal it), and every earlier point is
    ≤ in latency, so "j ≤ i" is j < i and ≤ in the other three."""
    n = len(pers)
    le = pers[:, None] <= pers[None, :]
    le &= act[:, None] <= act[None, :]
    le &= gpus[:, None] <= gpus[None, :]
    le &= _earlier(n)
    return np.asarray(le.any(axis=0), dtype=bool)


_EARLIER: list[np.ndarray] = [np.zeros((0, 0), dtype=bool)]


def _earlier(n: int) -> np.ndarray:
    """The n × n mask of row < column (one kept, sliced: n is at most a block's survivors)."""
    mask = _EARLIER[0]
    if len(mask) < n:
        size = max(n, SURVIVORS_PAIRWISE_UPTO, PAIRWISE_UPTO)
        mask = _EARLIER[0] = np.triu(np.ones((size, size), dtype=bool), 1)
    return mask[:n, :n]


def _bitsets(pers: FloatArray, act: FloatArray, gpus: IntArray, lat: FloatArray) -> BoolArray:
    """``_pairwise`` by bitsets of n bits: for each coordinate, the set {j : x_j ≤ x_i} of every
    point i is a prefix of the points sorted by that coordinate, i.e. a row of a cumulative OR; a
    point is dominated when its four sets meet in another point."""
    n = len(pers)
    ids = np.arange(n)
    word = ids >> 6
    bit = np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64))
    common: np.ndarray | None = None
    for c in (pers, act, gpus, lat):
        order = np.argsort(c, kind="stable")
        prefix = np.zeros((n, (n + 63) >> 6), dtype=np.uint64)
        prefix[ids, word[order]] = bit[order]
        np.bitwise_or.accumulate(prefix, axis=0, out=prefix)  # row k: the first k + 1 by c
        rows = prefix[np.searchsorted(c[order], c, side="right") - 1]  # {j : c_j ≤ c_i}
        common = rows if common is None else np.bitwise_and(common, rows, out=common)
    assert common is not None
    common[ids, word] &= ~bit  # a point does not dominate itself
    return np.asarray(common.any(axis=1), dtype=bool)


def dominated_in_order(pers: FloatArray, act: FloatArray, gpus: IntArray, lat: FloatArray) -> BoolArray:
    """Mask of the dominated points among distinct points sorted by latency, then resident,
    active, GPUs (the module docstring has the method)."""
    n = len(pers)
    if n <= PAIRWISE_UPTO:
        return _pairwise(pers, act, gpus, lat)
    p, np_ = _dense_rank(pers)
    g, ng = _dense_rank(gpus)
    added = np.full((np_, ng), np.inf)  # least active memory of the frontier points so far, per cell
    least = added.copy()  # ... over every cell of no more resident and GPUs
    out = np.ones(n, dtype=bool)
    lo, step = 0, PAIRWISE_UPTO
    while lo < n:
        hi = min(n, lo + step)
        kept = lo + np.flatnonzero(least[p[lo:hi], g[lo:hi]] > act[lo:hi])
        if len(kept) > 1:  # among themselves
            among = _pairwise if len(kept) <= SURVIVORS_PAIRWISE_UPTO else _bitsets
            kept = kept[~among(pers[kept], act[kept], gpus[kept], lat[kept])]
        out[kept] = False
        if hi < n and len(kept):
            np.minimum.at(added, (p[kept], g[kept]), act[kept])
            np.minimum.accumulate(added, axis=0, out=least)
            np.minimum.accumulate(least, axis=1, out=least)
        lo, step = hi, min(2 * step, BLOCK_UPTO)
    return out


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
    # by latency, then (resident, active, GPUs), stable: one argsort when no two latencies tie
    # (the usual case; a four-key lexsort costs several times more)
    order = np.argsort(t.latency, kind="stable")
    lat = t.latency[order]
    if len(lat) > 1 and (lat[1:] == lat[:-1]).any():
        order = np.lexsort((t.gpus, t.active, t.persistent, t.latency))
        lat = t.latency[order]
    pers, act, gpus = t.persistent[order], t.active[order], t.gpus[order]
    fresh = _starts(lat, pers, act, gpus)  # first of identical points (both sorts are stable)
    if not fresh.all():
        order, pers, act, gpus, lat = order[fresh], pers[fresh], act[fresh], gpus[fresh], lat[fresh]
    if len(order) > 1:
        order = order[~dominated_in_order(pers, act, gpus, lat)]
    return t.take(order)  # the order the points already have
