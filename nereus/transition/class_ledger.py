"""The class ledger: resource edges between replica classes where memory is too tight to hold
every acquisition of a transition at once (issue 21).

``classplan.py`` plans on replica classes where every GPU has room for its state plus every
acquisition (no acquisition ever waits). Where that fails, the per-unit builder (``build.py``)
orders acquisitions after releases with resource edges; this is the same greedy on classes, with
each class's bytes per GPU (``classes.Mem``) as numpy vectors:

* classes are committed in a priority order (a topological order of the local edges); a class's
  level on every GPU is the state before the transition plus every acquisition committed so far
  plus its own, less the releases of the classes it waits for (its *resource predecessors*);
* where the level passes the capacity on a GPU it acquires on, a resource edge comes from a
  committed class releasing there (the one expected to finish first), else from a Destroy class
  ready to run (committed on the spot); a class nothing can relieve waits for later commits, and
  where none come the ledger gives up (the per-unit builder plans the transition);
* only resource predecessors' releases count: when the plan runs, a class resource edge becomes,
  on every GPU, edges from each member releasing there to each member acquiring there
  (``expand``), so those releases precede those acquisitions GPU by GPU. A local edge or a chain
  of resource edges promises no such thing for a given GPU, so nothing is credited through them
  (more conservative than the per-unit ledger, which sees each unit's ancestors).

Every execution order that respects the expanded edges then stays within the peak the ledger
reports (the per-unit ledger's argument, with fewer credits), and the class schedule, which makes
a whole class wait for a whole class, respects them.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nereus.state.emu import Emu
from nereus.transition.classes import Derived, Ints
from nereus.transition.dag import Edge, EdgeKind, Node, Primitive, TransitionDag
from nereus.transition.group import lay_onto, match
from nereus.transition.schedule import Schedule


@dataclass(frozen=True, slots=True)
class Ledgered:
    """The resource edges (releasing class, acquiring class), the classes in commit order (a
    topological order of all edges) and the peak bytes per GPU id."""

    edges: tuple[tuple[int, int], ...]
    order: tuple[int, ...]
    peak: Ints


def class_ledger(
    d: Derived, capacity: int, key: Sequence[tuple[int, ...]], seconds: Sequence[float]
) -> Ledgered | None:
    """Commit the classes of ``d`` in ``key`` order; None where some acquisition can never fit.
    ``seconds``: each class's duration (its expected finish picks among releases)."""
    classes, size = d.classes, len(d.init)
    if int(d.init.max(initial=0)) > capacity:
        return None  # some GPU's state before the transition does not fit: no order helps
    n = len(classes)
    zero = np.zeros(size, np.int64)
    acq = [c.acquire.vector(size) if c.acquire is not None else zero for c in classes]
    rel = [c.release.vector(size) if c.release is not None else zero for c in classes]
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, c in enumerate(classes):
        for p in c.preds:
            succs[p].append(i)
    waiting = [len(c.preds) for c in classes]
    heap = [(key[i], i) for i in range(n) if not waiting[i]]
    heapq.heapify(heap)
    committed = [False] * n
    waits_for: list[list[int]] = [[] for _ in range(n)]
    finish = [0.0] * n
    acquired = np.zeros(size, np.int64)
    peak = d.init.copy()
    order: list[int] = []
    blocked: list[int] = []

    def level(i: int) -> Ints:
        out: Ints = d.init + acquired + acq[i]
        for a in waits_for[i]:
            out = out - rel[a]
        return out

    def commit(i: int, lvl: Ints) -> None:
        nonlocal acquired
        committed[i] = True
        order.append(i)
        preds = [*classes[i].preds, *waits_for[i]]
        finish[i] = max((finish[p] for p in preds), default=0.0) + seconds[i]
        mine = acq[i] > 0
        np.maximum(peak, np.where(mine, lvl, 0), out=peak)
        acquired = acquired + acq[i]
        for s in succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(heap, (key[s], s))

    def relief(i: int, g: int) -> int:
        """A class releasing on GPU ``g`` that ``i`` may wait for, or −1."""
        done = [a for a in order if rel[a][g] > 0 and a not in waits_for[i]]
        if done:
            return min(done, key=lambda a: (finish[a], a))
        ready = [
            x
            for x in range(n)
            if not committed[x]
            and not waiting[x]
            and x != i
            and classes[x].primitive is Primitive.DESTROY
            and rel[x][g] > 0
        ]
        if not ready:
            return -1
        x = min(ready, key=lambda x: (max((finish[p] for p in classes[x].preds), default=0.0), x))
        commit(x, level(x))
        return x

    while heap or blocked:
        if not heap:
            return None  # what is left waits for releases that never come
        _, i = heapq.heappop(heap)
        if committed[i]:
            continue
        before = len(order)
        lvl = level(i)
        over = np.flatnonzero((acq[i] > 0) & (lvl > capacity))
        while len(over):
            a = relief(i, int(over[0]))
            if a < 0:
                break
            waits_for[i].append(a)
            lvl = level(i)
            over = np.flatnonzero((acq[i] > 0) & (lvl > capacity))
        if len(over):
            waits_for[i].clear()
            blocked.append(i)
            if len(order) > before:  # a Destroy committed on the spot: room for the blocked, maybe
                for b in blocked:
                    heapq.heappush(heap, (key[b], b))
                blocked.clear()
            continue
        commit(i, lvl)
        for b in blocked:
            heapq.heappush(heap, (key[b], b))
        blocked.clear()
    edges = tuple(sorted({(a, i) for i in range(n) for a in waits_for[i]}))
    return Ledgered(edges, tuple(order), peak)


def _same_bytes(nodes: Sequence[Node], members: Sequence[Sequence[int]], d: Derived) -> bool:
    """Whether each class's members acquire and release on every GPU what its ``Mem`` says."""
    size = len(d.init)
    for c, mine in zip(d.classes, members, strict=True):
        for mem, kind in ((c.acquire, "acquire"), (c.release, "release")):
            got = np.zeros(size, np.int64)
            for i in mine:
                for g, b in getattr(nodes[i], kind):
                    got[g] += b
            want = mem.vector(size) if mem is not None else np.zeros(size, np.int64)
            if not np.array_equal(got, want):
                return False
    return True


def resource_edges(
    nodes: Sequence[Node], members: Sequence[Sequence[int]], edges: Sequence[tuple[int, int]]
) -> list[Edge]:
    """Per-unit resource edges for class resource edges (``members[c]``: class c's per-unit
    nodes): on every GPU, from each member of the releasing class that releases there to each
    member of the acquiring class that acquires there."""
    out: list[Edge] = []
    for a, c in edges:
        freeing: dict[int, list[int]] = {}
        for x in members[a]:
            for g, b in nodes[x].release:
                if b > 0:
                    freeing.setdefault(g, []).append(x)
        for y in members[c]:
            for g, b in nodes[y].acquire:
                if b > 0:
                    out += [Edge(x, y, EdgeKind.RESOURCE) for x in freeing.get(g, ())]
    return sorted(set(out), key=lambda e: (e.src, e.dst))


def expand_ledgered(
    nodes: list[Node],
    edges: list[Edge],
    units: Mapping[str, Emu],
    cap: Mapping[int, int],
    sigs: Sequence[tuple[object, ...]],
    sched: Schedule,
    d: Derived,
    led: Ledgered,
) -> tuple[TransitionDag, Schedule] | None:
    """``group.expand_onto`` for a class plan with resource edges (``led``): the per-unit DAG
    (local edges plus ``resource_edges``) with the class schedule laid onto it and the ledger's
    peak; members are ordered by their class's start, then its place in the ledger's order (a
    topological order of every class edge). None where the per-unit groups are not the classes
    of ``d``, bytes per GPU included (the ledger's peak holds only for those)."""
    found = match(nodes, edges, sigs)
    if found is None:
        return None
    groups, to = found
    back = {c: g for g, c in enumerate(to)}
    members = [groups.members[back[c]] for c in range(len(sigs))]
    if not _same_bytes(nodes, members, d):
        return None
    extra = resource_edges(nodes, members, led.edges)
    place = {c: i for i, c in enumerate(led.order)}
    held = {g: int(led.peak[g]) for g in cap}
    rank = [place[c] for c in to]
    return lay_onto(nodes, [*edges, *extra], dict(units), groups, to, sched, held, cap, rank)
