"""Replica classes of a reshape re-laid out straight from one replica (``local._direct``).

Each target replica is assembled in one exchange from the current replica sharing most of its
GPUs (then the one feeding fewest targets so far, then the first): every target GPU acquires only
its own shard. Current replicas that feed none are destroyed before every exchange onto their
GPUs, the others after the exchanges they feed. ``direct`` makes the classes of those nodes on
replica arrays, as ``class_moves.py`` does for Split → Extend → Merge; ``classplan.py`` schedules
both and keeps the shorter.
"""

from __future__ import annotations

import heapq

import numpy as np

from nereus.plan.layout import Layout
from nereus.plan.opclass import Link
from nereus.transition.classes import SECONDS, Builder, FallbackError, Ints, remember, table, unique_rows
from nereus.transition.dag import Flow, Primitive
from nereus.transition.primitives import Geometry


def direct(b: Builder, stage: str, geo: Geometry, cl: Layout, cur: Ints, tl: Layout, tgt: Ints) -> None:
    """``local._direct``: each target replica assembled straight from the current replica
    sharing most of its GPUs (then the one feeding fewest so far, then the first); current
    replicas that feed none destroyed before every exchange onto their GPUs, the others after
    the exchanges they feed."""
    sc, st = cl.size, tl.size
    if len(cur) == len(tgt) and sc == st:
        own = {frozenset(r) for r in cur.tolist()}
        if all(frozenset(r) in own for r in tgt.tolist()):
            raise FallbackError  # every replica re-laid out on its own GPUs: an in-place reshard
    code = np.full(len(b.init), -1, np.int64)  # GPU → its replica · sc + its rank
    code[cur] = np.arange(len(cur))[:, None] * sc + np.arange(sc)[None, :]
    at = code[tgt]
    owner = np.where(at >= 0, at // sc, -1)
    src = _sources(owner, len(cur))
    mine = owner == src[:, None]
    pos = np.where(mine, at % sc, -1)  # per target rank, the source rank on its GPU (−1 none)
    uses = np.bincount(src, minlength=len(cur))
    idle_rows = cur[uses == 0]
    held = table(geo, cl)[1]
    waits = b.idle(stage, idle_rows, tgt, held)
    gpn = b.gpn
    lo = np.minimum(cur[src].min(1), tgt.min(1)) // gpn
    hi = np.maximum(cur[src].max(1), tgt.max(1)) // gpn
    pats, of = unique_rows(np.hstack([pos, (lo == hi).astype(np.int64)[:, None], waits[:, None]]))
    old_pos, new_pos = cl.positions(), tl.positions()
    keys = []
    for row in pats.tolist():
        memo = (b.links, geo, cl, tl, "direct", *row[: st + 1])
        out = SECONDS.get(memo)
        if out is None:
            link = Link.INTRA if row[st] else Link.INTER
            recv = [
                _receives(geo, cl, old_pos[q] if q >= 0 else None, tl, new_pos[r])
                for r, q in enumerate(row[:st])
            ]
            moved = sum(recv)
            if not moved:
                raise FallbackError  # an exchange with no port: ``Groups`` colours it apart
            # a target rank on a source GPU is that GPU's flow (labels: source ranks 0…sc−1)
            ranks = enumerate(zip(row[:st], recv, strict=True))
            flows = [Flow(q if q >= 0 else sc + r, n, link) for r, (q, n) in ranks]
            flows += [Flow(j, moved // sc, link) for j in range(sc)]
            local = max(geo.payload(tl, *new_pos[r]) - n for r, n in enumerate(recv))
            est = b.links.node_seconds(Primitive.MERGE, tuple(flows), sc, local)
            out = remember(memo, est, moved, st)
        keys.append((*out, frozenset([row[st + 1]] if row[st + 1] >= 0 else [])))
    acquire = table(geo, tl)[1]
    b.acq[tgt] += acquire  # every target rank acquires its own shard
    ext = b.classes(stage, Primitive.MERGE, keys, of, src, [2 * cur[src], 2 * tgt + 1], (tgt, acquire))
    fed = np.flatnonzero(uses)
    first = np.full(len(cur), -1, np.int64)
    first[fed] = np.arange(len(fed))
    b.destroys(stage, *b.preds_of(ext, len(fed), first[src]), cur[fed], held)


def _receives(
    geo: Geometry, cl: Layout, held: tuple[int, int] | None, tl: Layout, at: tuple[int, int]
) -> int:
    """Bytes target rank ``at`` of ``tl`` receives: what its GPU lacks where it holds rank ``held``
    of ``cl``, else its whole shard (``NodeMaker.reshard_across``)."""
    if held is None:
        return geo.payload(tl, at[0], at[1])
    return geo.missing(cl, held[0], held[1], tl, at[0], at[1])


def _sources(owner: Ints, n: int) -> Ints:
    """Per target replica (rows of ``owner``: each GPU's current replica, −1 none), the current
    replica it is assembled from, in target order: most shared GPUs, then fewest targets fed so
    far, then the lowest index (``local._direct``)."""
    nt = len(owner)
    if not (owner >= 0).any():  # nothing shared: round robin
        return np.arange(nt, dtype=np.int64) % n
    rows, cols = np.nonzero(owner >= 0)
    pairs, counts = np.unique(rows * n + owner[rows, cols], return_counts=True)  # row-major
    row_of = pairs // n
    best = np.zeros(nt, np.int64)
    np.maximum.at(best, row_of, counts)
    top = counts == best[row_of]
    tied: list[list[int]] = [[] for _ in range(nt)]
    for r, i in zip(row_of[top].tolist(), (pairs[top] % n).tolist(), strict=True):
        tied[r].append(i)
    uses = [0] * n
    heap = [(0, i) for i in range(n)] if not all(tied) else []  # (uses, replica), stale skipped
    pop, push = heapq.heappop, heapq.heappush
    out = []
    for cands in tied:
        if cands:
            i = cands[0]
            for c in cands[1:]:
                if uses[c] < uses[i]:
                    i = c
        else:
            while heap[0][0] != uses[heap[0][1]]:
                pop(heap)
            i = heap[0][1]
        uses[i] += 1
        if heap:
            push(heap, (uses[i], i))
        out.append(i)
    return np.asarray(out, np.int64)
