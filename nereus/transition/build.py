"""The global transition DAG: union of local DAGs plus resource edges (paper §2.13).

Nodes are committed one at a time in a priority topological order: releases first (Destroy),
then stage order gen → inf → train, then workflow order. Each commit is checked against a
per-GPU memory ledger that any execution respecting the edges must satisfy:

    held_g ≤ initial_g + Σ acquire_g(nodes committed so far) − Σ release_g(ancestors of n)

— every earlier acquisition may already have happened, but only the releases of n's ancestors
are certain to have. When an acquisition does not fit, the builder adds resource edges from
releases on that GPU that do not depend on it: first from nodes already committed, then from an
*executable* Destroy (its predecessors all committed), which it commits on the spot. Neither can
close a cycle, because a committed node or an executable Destroy never descends from the node
being committed. A node that still does not fit waits for later commits; if every remaining
node waits, the target fails feasibility. Because the bound holds for every execution order,
the executor needs no memory check of its own and cannot deadlock, and ``peak`` is the per-GPU
memory the controller's feasibility check reads. Which orders are built, and which DAG a
transition runs, is ``choose.py``'s choice.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

from nereus.spec.cluster import GIB
from nereus.state.emu import Emu
from nereus.transition.dag import Edge, EdgeKind, Node, Primitive, TransitionDag
from nereus.transition.links import LinkModel
from nereus.transition.local import local_dag
from nereus.transition.move import StageMove
from nereus.transition.primitives import geometry


def initial_bytes(moves: Sequence[StageMove]) -> dict[int, int]:
    """State bytes every GPU holds before the transition (intact units of every model-stage)."""
    held: dict[int, int] = defaultdict(int)
    for m in moves:
        lay, held_of = m.current_layout, geometry(m.model, m.policy).held
        per_rank = [held_of(lay, t, p) for t, p in lay.positions()]
        for u in m.current:
            for g, b in zip(u.gpus, per_rank, strict=True):
                held[g] += b
    return dict(held)


class CommitOrder(StrEnum):
    """Tie-breaking among ready nodes when committing (both put releases first)."""

    SPLITS_FIRST = "splits-first"  # Destroy, Split, Merge, Extend; stage order within each
    STAGE_FIRST = "stage-first"  # Destroy, then stage order gen → inf → train (the paper's rule)


def build_dag(
    moves: Sequence[StageMove],
    stage_rank: Mapping[str, int],
    links: LinkModel,
    capacity: int | Mapping[int, int],
    order: CommitOrder = CommitOrder.SPLITS_FIRST,
) -> TransitionDag:
    """The global DAG of ``moves`` (model-stages in workflow order) under per-GPU ``capacity``."""
    return _Locals(moves, links, capacity).commit(stage_rank, order)


class _Locals:
    """The union of the local DAGs, the initial memory and the capacities: commit it any way."""

    def __init__(
        self,
        moves: Sequence[StageMove],
        links: LinkModel,
        capacity: int | Mapping[int, int],
        direct: bool = False,
    ) -> None:
        counter = itertools.count()
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []
        self.units: dict[str, Emu] = {}
        for m in moves:
            local = local_dag(m, links, lambda: next(counter), direct)
            self.nodes += local.nodes
            self.edges += local.edges
            self.units.update(local.units)
        self.nodes.sort(key=lambda n: n.id)
        self.edges += _restores_read_first(self.nodes, moves)
        self.init = initial_bytes(moves)
        gpus = set(self.init) | {g for n in self.nodes for g, _ in n.acquire}
        self.cap = {g: int(capacity if isinstance(capacity, int) else capacity.get(g, 0)) for g in gpus}
        self.order_of = {m.name: i for i, m in enumerate(moves)}

    def commit(self, stage_rank: Mapping[str, int], order: CommitOrder) -> TransitionDag:
        classes = _CLASS if order is CommitOrder.SPLITS_FIRST else _RELEASE_FIRST
        return _commit(
            self.nodes, self.edges, self.units, self.init, self.cap, stage_rank, self.order_of, classes
        )


def _restores_read_first(nodes: list[Node], moves: Sequence[StageMove]) -> list[Edge]:
    """A restore reads its weight-sync source before any node of the source frees state there."""
    out = []
    for r in nodes:
        if not r.source or r.source not in {m.name for m in moves}:
            continue  # storage, or a source that is not part of this transition
        gpus = set(r.sends)
        for x in nodes:
            if x.model_stage == r.source and any(g in gpus for g, b in x.release if b > 0):
                out.append(Edge(r.id, x.id, EdgeKind.LOCAL))
    return out


class _Ledger:
    """The greedy commit loop: priority order, memory bound, resource edges."""

    def __init__(
        self,
        nodes: list[Node],
        edges: list[Edge],
        init: Mapping[int, int],
        cap: Mapping[int, int],
        key: Callable[[int], tuple[int, ...]],
    ) -> None:
        self.nodes, self.init, self.cap, self.key = nodes, init, cap, key
        n = len(nodes)
        self.preds: list[set[int]] = [set() for _ in range(n)]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        for e in edges:
            if e.src not in self.preds[e.dst]:
                self.preds[e.dst].add(e.src)
                self.succs[e.src].append(e.dst)
        self.waiting = [len(p) for p in self.preds]
        self.releasers: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for node in nodes:
            for g, b in node.release:
                if b > 0:
                    self.releasers[g].append((node.id, b))
        # each GPU's releases as one bitset: a level whose ancestors release nothing there is one AND
        self.rmask = {g: sum({1 << x for x, _ in rel}) for g, rel in self.releasers.items()}
        # a node acquires each of its GPUs once (so the levels ``over`` finds are its peaks)
        self.distinct = [len({g for g, _ in nd.acquire}) == len(nd.acquire) for nd in nodes]
        self.fitted: list[int] = []  # the levels of the last ``over`` that found room everywhere
        self.heap = [(key(i), i) for i in range(n) if self.waiting[i] == 0]
        heapq.heapify(self.heap)
        self.committed = [False] * n
        self.anc = [0] * n  # ancestor bitsets
        self.ef = [0.0] * n  # earliest finish through the edges (est_s), for choosing releases
        self.blocked_node = -1
        self.blocked_gpu = -1
        self.acquired: dict[int, int] = defaultdict(int)
        self.peak = {g: init.get(g, 0) for g in cap}
        self.order: list[int] = []
        self.new_edges: list[Edge] = []

    def ancestry(self, i: int) -> None:
        for p in self.preds[i]:
            self.anc[i] |= self.anc[p] | (1 << p)

    def level(self, i: int, g: int, extra: int) -> int:
        hit = self.anc[i] & self.rmask.get(g, 0)
        released = sum(b for x, b in self.releasers[g] if hit >> x & 1) if hit else 0
        return self.init.get(g, 0) + self.acquired[g] + extra - released

    def over(self, i: int) -> tuple[int, int]:
        """(GPU, bytes missing) of the first acquisition of i that does not fit, or (−1, 0) and
        the levels it would reach in ``fitted``."""
        levels = []
        for g, b in self.nodes[i].acquire:
            level = self.level(i, g, b)
            if level > self.cap[g]:
                return g, level - self.cap[g]
            levels.append(level)
        self.fitted = levels
        return -1, 0

    def finish(self, i: int, fresh: bool = False, levels: list[int] | None = None) -> None:
        """Commit ``i``; ``fresh``: its ancestry is already complete (``run`` computed it and
        ``add_edge`` kept it up to date), so it is not ORed together again; ``levels``: what
        ``over`` just found for its acquisitions, nothing committed since (they are its peaks)."""
        if not fresh:
            self.ancestry(i)
        self.ef[i] = max((self.ef[p] for p in self.preds[i]), default=0.0) + self.nodes[i].est_s
        self.committed[i] = True
        self.order.append(i)
        acquire = self.nodes[i].acquire
        for g, b in acquire:
            self.acquired[g] += b
        if levels is None or not self.distinct[i]:
            levels = [self.level(i, g, 0) for g, _ in acquire]
        for (g, _), level in zip(acquire, levels, strict=True):
            self.peak[g] = max(self.peak[g], level)
        for s in self.succs[i]:
            self.waiting[s] -= 1
            if self.waiting[s] == 0:
                heapq.heappush(self.heap, (self.key(s), s))

    def add_edge(self, src: int, dst: int) -> None:
        self.preds[dst].add(src)
        self.succs[src].append(dst)
        self.anc[dst] |= self.anc[src] | (1 << src)
        self.new_edges.append(Edge(src, dst, EdgeKind.RESOURCE))

    def relieve(self, i: int, g: int) -> bool:
        """Add one resource edge into ``i`` from a release on GPU ``g``; False when none exists.

        Among releases already committed, the one expected to finish first; else an executable
        Destroy (committed on the spot).
        """
        a = self.anc[i]
        nodes, committed = self.nodes, self.committed
        done = [x for x, _ in self.releasers[g] if committed[x] and not a >> x & 1]
        if done:
            self.add_edge(min(done, key=lambda x: (self.ef[x], x)), i)
            return True
        ready = [
            x
            for x, _ in self.releasers[g]
            if not committed[x]
            and self.waiting[x] == 0
            and nodes[x].primitive is Primitive.DESTROY
            and x != i
        ]
        if ready:
            x = min(ready, key=lambda x: (max((self.ef[p] for p in self.preds[x]), default=0.0), x))
            self.finish(x)
            self.add_edge(x, i)
            return True
        return False

    def prune(self, i: int, first: int) -> None:
        """Drop the resource edges into ``i`` (added since ``first``) that a later one made
        unneeded: ``relieve`` adds releases earliest expected finish first, and one large release
        added last can cover the small ones before it, which would only hold ``i`` back. Each is
        tried in the order it was added (the last stays); one goes when ``i`` still fits without
        it, so the memory bound is checked exactly as for any commit."""
        added = self.new_edges[first:]
        kept = [added[-1]]
        for e in added[:-1]:
            self.preds[i].discard(e.src)
            before = self.anc[i]
            self.anc[i] = 0
            self.ancestry(i)
            if self.over(i)[1] > 0:
                self.preds[i].add(e.src)
                self.anc[i] = before
                kept.append(e)
            else:
                self.succs[e.src].remove(i)
        self.new_edges[first:] = [e for e in added if e in kept]
        self.over(i)  # ``fitted``: the levels with the edges kept

    def run(self) -> str:
        """Commit every node; the reason when some acquisition can never fit ("" when all do)."""
        blocked: list[int] = []
        while self.heap or blocked:
            if not self.heap:
                i = blocked[0]
                g, missing = self.over(i)
                self.blocked_node, self.blocked_gpu = i, g
                return (
                    f"{self.nodes[i].describe()} needs {_size(missing)} more on GPU {g} "
                    f"(capacity {_size(self.cap[g])}) and no release that does not wait for it frees it"
                )
            _, i = heapq.heappop(self.heap)
            if self.committed[i]:
                continue
            self.ancestry(i)
            first = len(self.new_edges)
            g, missing = self.over(i)
            while missing > 0 and self.relieve(i, g):
                g, missing = self.over(i)
            if missing > 0:
                blocked.append(i)
                continue
            if len(self.new_edges) - first > 1:
                self.prune(i, first)
            self.finish(i, fresh=True, levels=self.fitted)
            for b in blocked:
                heapq.heappush(self.heap, (self.key(b), b))
            blocked.clear()
        return ""


MAX_PROMOTIONS = 8  # blocked nodes moved to the front of the commit order before giving up


def _commit(
    nodes: list[Node],
    edges: list[Edge],
    units: dict[str, Emu],
    init: Mapping[int, int],
    cap: Mapping[int, int],
    stage_rank: Mapping[str, int],
    order_of: Mapping[str, int],
    classes: Mapping[Primitive, int],
) -> TransitionDag:
    """Commit greedily; when a node stays blocked, retry with it first and its rivals after it.

    The fixed order (Destroys, then Splits, Merges and Extends; stage order within each) is the
    paper's release-before-acquire rule. It can commit one model-stage's acquisition onto a GPU
    before another's needs room there, although the other order fits (a Split's new shard, or a
    Merge whose chain starts later). A retry promotes the blocked node and everything it depends
    on, and gives every other acquisition on its GPU a resource edge from it (they wait for it;
    none of them is among its ancestors, so no cycle). At most ``MAX_PROMOTIONS`` retries.
    """
    promoted: dict[int, int] = {}
    deferred: list[Edge] = []  # blocked node → the acquisitions on its GPU that took the room first
    preds: list[list[int]] = [[] for _ in nodes]
    for e in edges:
        preds[e.dst].append(e.src)
    static = [
        (classes[n.primitive], stage_rank.get(n.model_stage, 0), order_of.get(n.model_stage, 0), i)
        for i, n in enumerate(nodes)
    ]
    for _ in range(MAX_PROMOTIONS + 1):
        keys = [(-promoted.get(i, 0), *k) for i, k in enumerate(static)]  # each node's, once per attempt
        ledger = _Ledger(nodes, [*edges, *deferred], init, cap, keys.__getitem__)
        why = ledger.run()
        if not why:
            break
        i, g = ledger.blocked_node, ledger.blocked_gpu
        cone = _cone(i, preds)
        done = {(e.src, e.dst) for e in deferred}
        rivals = [
            x.id
            for x in nodes
            if x.id not in cone and (i, x.id) not in done and any(gg == g and b > 0 for gg, b in x.acquire)
        ]
        fresh = cone - set(promoted)
        if not fresh and not rivals:
            break
        rank = len(promoted) + 1  # the latest promotion goes first
        promoted.update({x: rank for x in fresh})
        deferred += [Edge(i, x, EdgeKind.RESOURCE) for x in rivals]
        for x in rivals:
            preds[x].append(i)
    return TransitionDag(
        tuple(nodes), tuple(edges) + tuple(deferred) + tuple(ledger.new_edges), units, tuple(ledger.order),
        ledger.peak, dict(cap), not why, why,
    )  # fmt: skip


def _cone(i: int, preds: list[list[int]]) -> set[int]:
    """``i`` and every node it depends on through the local edges."""
    out, todo = {i}, [i]
    while todo:
        for p in preds[todo.pop()]:
            if p not in out:
                out.add(p)
                todo.append(p)
    return out


_CLASS = {Primitive.DESTROY: 0, Primitive.SPLIT: 1, Primitive.MERGE: 2, Primitive.EXTEND: 3}
_RELEASE_FIRST = {Primitive.DESTROY: 0, Primitive.SPLIT: 1, Primitive.MERGE: 1, Primitive.EXTEND: 1}


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
