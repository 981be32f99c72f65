"""Latency–GPU frontier of one model-stage (paper §2.6 steps 2–3).

Infeasible candidates (their own footprint over capacity) are dropped, then dominated ones: A
dominates B when A needs no more GPUs, is no slower, and keeps no more memory resident and active.
Memory is part of dominance because co-resident state couples the stages (``search.py``); within
one resident-memory class this is the plain latency × GPUs frontier with an active-memory tie-break.

Within one resident level dominance is tested with 2-D prefix minima over (active, GPUs); across
levels the few survivors are compared pairwise.
"""

from __future__ import annotations

import itertools

import numpy as np

from nereus.plan.candidates import CandidateTable
from nereus.plan.replica import FloatArray, IntArray

BoolArray = np.ndarray


def _pareto_3d(active: FloatArray, gpus: IntArray, latency: FloatArray) -> BoolArray:
    """Mask of distinct points that no other point of the set dominates in (active, GPUs, latency).

    ``grid[i, k]`` holds the lowest latency among points with active ≤ the i-th smallest active
    value and GPUs ≤ the k-th smallest GPU count (2-D prefix minima); a dominator is ≤ everywhere
    and strictly better somewhere, so three lookups (strict in active, in GPUs, in latency) decide.
    """
    a_vals, a_pos = np.unique(active, return_inverse=True)
    g_vals, g_pos = np.unique(gpus, return_inverse=True)
    grid = np.full((len(a_vals) + 1, len(g_vals) + 1), np.inf)  # row/col 0: "nothing smaller"
    np.minimum.at(grid, (a_pos + 1, g_pos + 1), latency)
    grid = np.minimum.accumulate(np.minimum.accumulate(grid, axis=0), axis=1)
    dominated = (
        (grid[a_pos, g_pos + 1] <= latency)  # strictly less active
        | (grid[a_pos + 1, g_pos] <= latency)  # strictly fewer GPUs
        | (grid[a_pos + 1, g_pos + 1] < latency)  # strictly faster
    )
    return ~dominated


def _dominated_by(
    active: FloatArray, gpus: IntArray, latency: FloatArray, ref: tuple[FloatArray, IntArray, FloatArray]
) -> BoolArray:
    """Mask of query points some reference point is ≤ in active, GPUs and latency (pairwise)."""
    ra, rg, rl = ref
    if len(ra) == 0:
        return np.zeros(len(active), dtype=bool)
    out = np.zeros(len(active), dtype=bool)
    step = max(1, 2_000_000 // len(ra))
    for lo in range(0, len(active), step):
        sl = slice(lo, lo + step)
        out[sl] = (
            (ra[None, :] <= active[sl, None])
            & (rg[None, :] <= gpus[sl, None])
            & (rl[None, :] <= latency[sl, None])
        ).any(axis=1)
    return out


def frontier(table: CandidateTable, limit_bytes: float) -> CandidateTable:
    """Feasible, non-dominated candidates of ``table``, sorted by latency.

    ``limit_bytes`` is what one model-stage may use per GPU on its own (capacity after headroom
    minus the runtime reserve). Of identical candidates the first is kept. Resident levels are
    visited in increasing order: each is reduced to its own 3-D frontier, then checked against
    everything kept from lower levels (which dominates whatever was dropped there).
    """
    t = table.take(np.flatnonzero(table.active <= limit_bytes))
    if len(t) == 0:
        return t
    order = np.lexsort((t.latency, t.gpus, t.active, t.persistent))
    keys = np.column_stack([t.persistent, t.active, t.gpus, t.latency])[order]
    fresh = np.concatenate([[True], np.any(keys[1:] != keys[:-1], axis=1)])
    idx = order[fresh]  # distinct points, grouped by resident level (ascending)
    levels = t.persistent[idx]
    bounds = np.flatnonzero(np.concatenate([[True], levels[1:] != levels[:-1], [True]]))
    kept: list[IntArray] = []
    below = np.zeros(0, dtype=np.int64)  # everything kept from lower levels
    for lo, hi in itertools.pairwise(bounds):
        part = idx[lo:hi]
        if len(part) > 1:
            part = part[_pareto_3d(t.active[part], t.gpus[part], t.latency[part])]
        if len(below):
            ref = (t.active[below], t.gpus[below], t.latency[below])
            part = part[~_dominated_by(t.active[part], t.gpus[part], t.latency[part], ref)]
        kept.append(part)
        below = np.concatenate([below, part])
    chosen = np.concatenate(kept)
    chosen = chosen[np.argsort(t.latency[chosen], kind="stable")]
    return t.take(chosen)
