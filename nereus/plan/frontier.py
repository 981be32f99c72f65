"""Latency–GPU frontier of one model-stage (paper §2.6 steps 2–3).

Infeasible candidates (their own footprint over capacity) are dropped, then dominated ones: A
dominates B when A needs no more GPUs, is no slower, and keeps no more memory resident and active.
Memory is part of dominance because co-resident state couples the stages (``search.py``); within
one resident-memory class this is the plain latency × GPUs frontier with an active-memory tie.
"""

from __future__ import annotations

import bisect

import numpy as np

from nereus.plan.candidates import CandidateTable


def _pareto_3d(gpus: np.ndarray, latency: np.ndarray, active: np.ndarray) -> np.ndarray:
    """Indices not dominated in (gpus, latency, active), all minimised; ties keep the first."""
    order = np.lexsort((active, latency, gpus))
    lat_steps: list[float] = []  # staircase: latency ascending, active strictly descending
    act_steps: list[float] = []
    keep: list[int] = []
    for i in order.tolist():
        lat, act = float(latency[i]), float(active[i])
        pos = bisect.bisect_right(lat_steps, lat)
        if pos and act_steps[pos - 1] <= act:
            continue  # an earlier point has ≤ GPUs, ≤ latency and ≤ active memory
        keep.append(i)
        end = pos
        while end < len(lat_steps) and act_steps[end] >= act:
            end += 1
        lat_steps[pos:end] = [lat]
        act_steps[pos:end] = [act]
    return np.array(sorted(keep), dtype=np.int64)


def frontier(table: CandidateTable, limit_bytes: float) -> CandidateTable:
    """Feasible, non-dominated candidates of ``table``, sorted by latency.

    ``limit_bytes`` is what one model-stage may use per GPU on its own (capacity after headroom
    minus the runtime reserve). Dominance is checked among candidates with equal resident memory
    and across levels (a candidate that keeps less resident and dominates otherwise wins).
    """
    feasible = np.flatnonzero(table.active <= limit_bytes)
    if feasible.size == 0:
        return table.take(feasible)
    t = table.take(feasible)
    keep: list[np.ndarray] = []
    best_below: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    for level in np.unique(t.persistent):
        idx = np.flatnonzero(t.persistent == level)
        local = idx[_pareto_3d(t.gpus[idx], t.latency[idx], t.active[idx])]
        if best_below is not None:  # drop points dominated by a lower resident-memory level
            g, lat, act = best_below
            dominated = (
                (g[None, :] <= t.gpus[local][:, None])
                & (lat[None, :] <= t.latency[local][:, None])
                & (act[None, :] <= t.active[local][:, None])
            ).any(axis=1)
            local = local[~dominated]
        keep.append(local)
        merged = np.concatenate(keep)
        best = merged[_pareto_3d(t.gpus[merged], t.latency[merged], t.active[merged])]
        best_below = (t.gpus[best], t.latency[best], t.active[best])
    chosen = np.concatenate(keep)
    chosen = chosen[np.argsort(t.latency[chosen], kind="stable")]
    return t.take(chosen)
