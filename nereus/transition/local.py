"""The local DAG of one model-stage: Split → Destroy → Extend → Merge (paper §2.12).

With T the current layout and T* the target, T_sub = (min tp, min pp). Each current unit that
takes part is split into k = (tp/tp_sub)(pp/pp_sub) units of layout T_sub on its own GPUs: for
every sub-rank q = (t', p') the k GPUs at old positions (t'·kt + b, p'·kp + a) form one all-gather
group and each ends with the T_sub shard at q. Which GPU of a group belongs to which sub-unit is
free, so a sub-unit is *kept* in place whenever a target slot (the k* = (tp*/tp_sub)(pp*/pp_sub)
T_sub-shaped pieces a target unit merges from, slot (jt, jp) owning target positions
(t'·kt* + jt, p'·kp* + jp)) draws each of its GPUs from the matching group. Surplus sub-units are
destroyed; slots nothing covers are filled by an Extend (rank-aligned copy) from a sub-unit,
nearest first; then each target unit merges its k* slots, a local slice wherever the layer and
head splits nest (they do for power-of-two degrees and even layer counts; otherwise the few
missing rows come from the other slots of the same unit).

Edges: a Split precedes everything that uses its sub-units; a Destroy of a sub-unit nothing
copies precedes every Extend onto its GPUs (release before acquire); an Extend precedes the
Destroy of its source (a sole replica is destroyed only after it has been copied) and the Merge
of its target unit. A model-stage with no intact unit is *restored*: an Extend straight into the
target layout from its weight-sync source or from shared storage.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state.buffers import StatePolicy, rank_buffers
from nereus.state.geometry import rank_numel, shared_numel
from nereus.state.sources import STORAGE
from nereus.transition.dag import Edge, EdgeKind, Flow, Node, Primitive, Unit
from nereus.transition.links import LinkModel


@dataclass(frozen=True, slots=True)
class StageMove:
    """One model-stage's part of a transition: its intact current units and its target units."""

    name: str
    model: ModelSpec
    policy: StatePolicy
    current_layout: Layout
    current: tuple[tuple[int, ...], ...]  # GPUs of each intact current unit
    target_layout: Layout
    target: tuple[tuple[int, ...], ...]
    restore_from: str = ""  # when no unit is intact: a model-stage (weight sync) or STORAGE
    restore_gpus: tuple[int, ...] = ()  # the GPUs of that model-stage

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError(f"{self.name}: the target has no units")
        if not self.current and not self.restore_from:
            raise ValueError(f"{self.name}: no intact unit and no source to restore from")

    @property
    def unchanged(self) -> bool:
        return self.current_layout == self.target_layout and sorted(self.current) == sorted(self.target)


def sub_layout(a: Layout, b: Layout) -> Layout:
    return Layout(min(a.tp, b.tp), min(a.pp, b.pp))


@dataclass(slots=True)
class LocalDag:
    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    units: dict[str, Unit] = field(default_factory=dict)


class _Builder:
    def __init__(self, move: StageMove, links: LinkModel, next_id: Callable[[], int]) -> None:
        self.m = move
        self.links = links
        self.next_id = next_id
        self.out = LocalDag()
        self.bpe = move.policy.bytes_per_element
        self._held: dict[tuple[Layout, int, int], int] = {}
        self._tables: dict[Layout, tuple[list[int], list[int]]] = {}
        self._missing: dict[tuple[Layout, int, int, Layout, int, int], int] = {}

    # -------------------------------------------------------------- geometry in bytes
    def held(self, layout: Layout, t: int, p: int) -> int:
        """Bytes a rank's buffers occupy (what memory holds)."""
        key = (layout, t, p)
        if key not in self._held:
            self._held[key] = rank_buffers(self.m.model, layout, t, p, self.m.policy).nbytes()
        return self._held[key]

    def table(self, layout: Layout) -> tuple[list[int], list[int]]:
        """(payload bytes, held bytes) of every rank of ``layout``, in rank order."""
        if layout not in self._tables:
            pos = _positions(layout)
            payload = [rank_numel(self.m.model, layout, t, p) * self.bpe for t, p in pos]
            self._tables[layout] = (payload, [self.held(layout, t, p) for t, p in pos])
        return self._tables[layout]

    def missing(self, have: Layout, ht: int, hp: int, need: Layout, nt: int, np_: int) -> int:
        """Bytes rank (nt, np_) of ``need`` lacks when the GPU holds rank (ht, hp) of ``have``."""
        key = (have, ht, hp, need, nt, np_)
        if key not in self._missing:
            model = self.m.model
            lack = rank_numel(model, need, nt, np_) - shared_numel(model, have, ht, hp, need, nt, np_)
            self._missing[key] = lack * self.bpe
        return self._missing[key]

    def unit(self, uid: str, layout: Layout, gpus: tuple[int, ...]) -> Unit:
        u = Unit(f"{self.m.name}/{uid}", self.m.name, layout, gpus)
        self.out.units[u.id] = u
        return u

    def add(self, node: Node) -> int:
        self.out.nodes.append(node)
        return node.id

    def edge(self, a: int, b: int) -> None:
        self.out.edges.append(Edge(a, b, EdgeKind.LOCAL))

    # -------------------------------------------------------------- primitives
    def destroy(self, u: Unit) -> int:
        release = tuple(zip(u.gpus, self.table(u.layout)[1], strict=True))
        return self.add(
            Node(
                self.next_id(),
                Primitive.DESTROY,
                self.m.name,
                u.gpus,
                0,
                0.0,
                (u.id,),
                (),
                (u.id,),
                (),
                release,
            )
        )

    def split(
        self, u: Unit, sub: Layout, subunits: list[Unit], groups: dict[tuple[int, int], list[int]]
    ) -> int:
        """All-gather the T_sub shard in every group; GPUs of no sub-unit only send, then free."""
        t_, kt, kp = u.layout, u.layout.tp // sub.tp, u.layout.pp // sub.pp
        keeps = {g for s in subunits for g in s.gpus}
        acquire, release, flows, recvs = [], [], [], []
        moved = 0
        for (tq, pq), members in groups.items():
            link = self.links.group_link(members)
            for g in members:
                i = u.gpus.index(g)
                t, p = i % t_.tp, i // t_.tp
                release.append((g, self.held(t_, t, p)))
                if g not in keeps:
                    continue  # its sub-unit is not needed: it contributes its shard and frees it
                recv = self.missing(t_, t, p, sub, tq, pq)
                acquire.append((g, self.held(sub, tq, pq)))
                flows.append(Flow(g, recv, link))
                recvs.append(g)
                moved += recv
        est = self.links.seconds(Primitive.SPLIT, flows, hops=kt * kp - 1)
        return self.add(
            Node(
                self.next_id(), Primitive.SPLIT, self.m.name, u.gpus, moved, est, (u.id,),
                tuple(s.id for s in subunits), (u.id,), tuple(acquire), tuple(release), tuple(flows),
                u.gpus, tuple(recvs),
            )
        )  # fmt: skip

    def extend(self, src: Unit, dst: Unit) -> int:
        payload, held = self.table(dst.layout)
        link = self.links.link
        # a position whose source and destination are one GPU is a local copy: nothing crosses a link
        flows = tuple(
            Flow(b, 0 if a == b else n, link(a, b))
            for a, b, n in zip(src.gpus, dst.gpus, payload, strict=True)
        )
        est = self.links.seconds(Primitive.EXTEND, flows)
        acquire = tuple(zip(dst.gpus, held, strict=True))
        moved = sum(f.bytes for f in flows)
        return self.add(
            Node(
                self.next_id(), Primitive.EXTEND, self.m.name, src.gpus + dst.gpus, moved, est,
                (src.id,), (dst.id,), (), acquire, (), flows, src.gpus, dst.gpus,
            )
        )  # fmt: skip

    def restore(self, dst: Unit) -> int:
        lay = dst.layout
        acquire, flows = [], []
        moved = 0
        src_nodes = {self.links.node_of(g) for g in self.m.restore_gpus}
        for i, b in enumerate(dst.gpus):
            t, p = i % lay.tp, i // lay.tp
            n = rank_numel(self.m.model, lay, t, p) * self.bpe
            acquire.append((b, self.held(lay, t, p)))
            if self.m.restore_from == STORAGE:
                link = None
            else:
                link = self.links.link(b, b) if self.links.node_of(b) in src_nodes else self.links.link(b, -1)
            flows.append(Flow(b, n, link))
            moved += n
        est = self.links.seconds(Primitive.EXTEND, flows)
        sends = () if self.m.restore_from == STORAGE else self.m.restore_gpus
        return self.add(
            Node(
                self.next_id(), Primitive.EXTEND, self.m.name, dst.gpus, moved, est, (), (dst.id,), (),
                tuple(acquire), (), tuple(flows), sends, dst.gpus, self.m.restore_from,
            )
        )  # fmt: skip

    def reshard(self, u: Unit, v: Unit) -> int:
        """A unit's Split and Merge on its own GPUs fused into one exchange: every GPU of ``v``
        assembles its target shard from the old shards of ``u`` (its own first), with no
        intermediate T_sub layout; a Merge node whose input has the old layout."""
        old, new = u.layout, v.layout
        acquire, release, flows = [], [], []
        moved, local = 0, 0
        link = self.links.group_link(v.gpus)
        for i, g in enumerate(v.gpus):
            t, p = i % new.tp, i // new.tp
            j = u.gpus.index(g)
            ot, op = j % old.tp, j // old.tp
            recv = self.missing(old, ot, op, new, t, p)
            acquire.append((g, self.held(new, t, p)))
            release.append((g, self.held(old, ot, op)))
            flows.append(Flow(g, recv, link))
            moved += recv
            local = max(local, rank_numel(self.m.model, new, t, p) * self.bpe - recv)
        est = self.links.seconds(Primitive.MERGE, flows, hops=len(v.gpus) - 1, local_bytes=local)
        return self.add(
            Node(
                self.next_id(), Primitive.MERGE, self.m.name, v.gpus, moved, est, (u.id,), (v.id,), (u.id,),
                tuple(acquire), tuple(release), tuple(flows), *(((v.gpus,) * 2) if moved else ((), ())),
            )
        )  # fmt: skip

    def merge(self, slots: list[Unit], target: Unit) -> int:
        sub, lay = slots[0].layout, target.layout
        kt, kp = lay.tp // sub.tp, lay.pp // sub.pp
        acquire, release, flows = [], [], []
        moved, local = 0, 0
        link = self.links.group_link(target.gpus)
        for i, g in enumerate(target.gpus):
            t, p = i % lay.tp, i // lay.tp
            st, sp = t // kt, p // kp  # the slot's rank that holds this position's rows
            recv = self.missing(sub, st, sp, lay, t, p)
            keep = rank_numel(self.m.model, lay, t, p) * self.bpe - recv
            acquire.append((g, self.held(lay, t, p) + recv))
            release.append((g, self.held(sub, st, sp) + recv))
            flows.append(Flow(g, recv, link))
            moved += recv
            local = max(local, keep)
        est = self.links.seconds(Primitive.MERGE, flows, hops=kt * kp - 1, local_bytes=local)
        return self.add(
            Node(
                self.next_id(), Primitive.MERGE, self.m.name, target.gpus, moved, est,
                tuple(s.id for s in slots), (target.id,), tuple(s.id for s in slots),
                tuple(acquire), tuple(release), tuple(flows),
                target.gpus if moved else (), target.gpus if moved else (),
            )
        )  # fmt: skip


def _positions(layout: Layout) -> list[tuple[int, int]]:
    """(t, p) of every rank, in rank order p·tp + t."""
    return [(t, p) for p in range(layout.pp) for t in range(layout.tp)]


def local_dag(move: StageMove, links: LinkModel, next_id: Callable[[], int]) -> LocalDag:
    """The local DAG of ``move`` (empty when its units stay as they are)."""
    b = _Builder(move, links, next_id)
    if move.unchanged:
        return b.out
    tgt, cur = move.target_layout, move.current_layout
    if cur == tgt and move.current:
        return _same_layout(b, move, links)
    targets = [Unit(f"{move.name}/v{i}", move.name, tgt, gpus) for i, gpus in enumerate(move.target)]
    if not move.current:
        for v in targets:
            b.out.units[v.id] = v
            b.restore(v)
        return b.out
    same_gpus = {frozenset(g): i for i, g in enumerate(move.current)}
    if len(move.current) == len(move.target) and all(frozenset(v.gpus) in same_gpus for v in targets):
        for v in targets:  # every unit re-lays itself out on its own GPUs: no intermediate layout
            u = b.unit(f"u{same_gpus[frozenset(v.gpus)]}", cur, move.current[same_gpus[frozenset(v.gpus)]])
            b.out.units[v.id] = v
            b.reshard(u, v)
        return b.out
    sub = sub_layout(cur, tgt)
    kt, kp = cur.tp // sub.tp, cur.pp // sub.pp
    mt, mp = tgt.tp // sub.tp, tgt.pp // sub.pp
    currents = [b.unit(f"u{i}", cur, gpus) for i, gpus in enumerate(move.current)]
    owner = {g: ui for ui, u in enumerate(currents) for g in u.gpus}
    sub_pos = _positions(sub)

    def groups(u: Unit) -> dict[tuple[int, int], list[int]]:
        return {
            (tq, pq): [u.gpu(tq * kt + bt, pq * kp + bp) for bp in range(kp) for bt in range(kt)]
            for tq, pq in sub_pos
        }

    # target slots: slot (jt, jp) of unit v owns target positions (t'·mt + jt, p'·mp + jp)
    slots: list[tuple[int, tuple[int, ...]]] = []  # (target unit index, GPUs in T_sub rank order)
    for vi, v in enumerate(targets):
        for jp in range(mp):
            for jt in range(mt):
                slots.append((vi, tuple(v.gpu(tq * mt + jt, pq * mp + jp) for tq, pq in sub_pos)))
    group_of = [groups(u) for u in currents]
    kept: dict[int, list[int]] = {}  # current unit → slots carved from it in place
    unmatched: list[int] = []
    for si, (_, gpus) in enumerate(slots):
        ui = owner.get(gpus[0], -1)
        if ui >= 0 and all(gpu in group_of[ui][q] for gpu, q in zip(gpus, sub_pos, strict=True)):
            kept.setdefault(ui, []).append(si)
        else:
            unmatched.append(si)
    k = kt * kp
    waiting = {links.node_of(g) for si in unmatched for g in slots[si][1]}  # nodes with slots to fill
    nearest = sorted(
        range(len(currents)), key=lambda i: -sum(links.node_of(g) in waiting for g in currents[i].gpus)
    )
    split_units: set[int] = set(kept) if k > 1 else set()
    if k > 1:  # enough sub-units that every slot to fill can copy from its own source
        for ui in nearest:
            if len(split_units) * k - sum(map(len, kept.values())) >= len(unmatched) and split_units:
                break
            split_units.add(ui)

    # the T_sub units that exist after the Splits: kept in place, or free (a source, or nothing)
    kept_units: list[tuple[int, int, tuple[int, ...]]] = []  # (slot, current unit, GPUs)
    free_units: list[tuple[int, tuple[int, ...]]] = []  # (current unit, GPUs)
    for ui in sorted(split_units) if k > 1 else range(len(currents)):
        mine = kept.get(ui, [])
        kept_units += [(si, ui, slots[si][1]) for si in mine]
        if k == 1:
            if not mine:
                free_units.append((ui, currents[ui].gpus))
            continue
        used = {g for si in mine for g in slots[si][1]}
        rest = {q: [x for x in group_of[ui][q] if x not in used] for q in sub_pos}
        free_units += [(ui, tuple(rest[q][j] for q in sub_pos)) for j in range(k - len(mine))]

    # sources for the slots to fill: free units first, then kept ones (least loaded, nearest)
    pool = [gpus for _, gpus in free_units] + [gpus for _, _, gpus in kept_units]
    chooser = _SourceChooser(pool, links) if pool else None
    picks: dict[int, int] = {}  # unmatched slot → pool index
    for si in unmatched:
        assert chooser is not None
        picks[si] = chooser.take(slots[si][1])
    used_pool = set(picks.values())

    # materialise: each split unit's kept sub-units and the free ones that feed a copy
    pool_unit: dict[int, Unit] = {}
    made_by: dict[int, int] = {}  # pool index → the Split that made it (−1: an unsplit unit)
    slot_units: dict[int, Unit] = {}
    n_free = len(free_units)
    unused: set[int] = set()
    for ui in sorted(split_units) if k > 1 else range(len(currents)):
        subunits: list[tuple[int, Unit]] = []
        for j, (si, owner_ui, gpus) in enumerate(kept_units):
            if owner_ui == ui:
                unit = currents[ui] if k == 1 else b.unit(f"u{ui}.k{si}", sub, gpus)
                subunits.append((n_free + j, unit))
                slot_units[si] = unit
        for j, (owner_ui, gpus) in enumerate(free_units):
            if owner_ui == ui and j in used_pool:
                subunits.append((j, currents[ui] if k == 1 else b.unit(f"u{ui}.f{j}", sub, gpus)))
        if k > 1 and not subunits:
            unused.add(ui)  # split for nothing after all: it is destroyed whole instead
            continue
        split_id = b.split(currents[ui], sub, [s for _, s in subunits], group_of[ui]) if k > 1 else -1
        for j, unit in subunits:
            pool_unit[j] = unit
            made_by[j] = split_id

    # Extends into the slots to fill
    copies: dict[int, list[int]] = {}
    extends: list[tuple[int, int]] = []  # (node, slot)
    onto: dict[int, list[int]] = {}
    for si in unmatched:
        j = picks[si]
        dst = b.unit(f"x{si}", sub, slots[si][1])
        n = b.extend(pool_unit[j], dst)
        if made_by[j] >= 0:
            b.edge(made_by[j], n)
        slot_units[si] = dst
        copies.setdefault(j, []).append(n)
        extends.append((n, si))
        for gpu in slots[si][1]:
            onto.setdefault(gpu, []).append(n)

    # Destroys: a free unit after the copies it feeds; a unit that takes no part before the
    # Extends onto its GPUs (release before acquire)
    for j in range(n_free):
        if j not in pool_unit:
            continue
        d = b.destroy(pool_unit[j])
        if made_by[j] >= 0:
            b.edge(made_by[j], d)
        for n in copies.get(j, ()):
            b.edge(n, d)
    idle = [currents[ui] for ui in range(len(currents)) if k > 1 and (ui not in split_units or ui in unused)]
    idle += [currents[ui] for j, (ui, _) in enumerate(free_units) if k == 1 and j not in used_pool]
    for u in idle:
        d = b.destroy(u)
        for n in sorted({n for g in u.gpus for n in onto.get(g, ())}):
            b.edge(d, n)

    # merge every target unit from its slots (a slot of a unit that needs no merge is the unit)
    index_of_kept = {si: n_free + j for j, (si, _, _) in enumerate(kept_units)}
    extend_into = dict((si, n) for n, si in extends)
    slots_of: dict[int, list[int]] = {}
    for si, (vi, _) in enumerate(slots):
        slots_of.setdefault(vi, []).append(si)
    for vi, v in enumerate(targets):
        if mt * mp == 1:
            continue  # the slot is the target unit itself
        mine = slots_of[vi]
        deps: set[int] = set()
        for si in mine:
            if si in extend_into:
                deps.add(extend_into[si])
            else:
                j = index_of_kept[si]
                deps.update(copies.get(j, ()))  # copies read it before it is merged away
                if made_by[j] >= 0:
                    deps.add(made_by[j])
        b.out.units[v.id] = v
        n = b.merge([slot_units[si] for si in mine], v)
        for d in sorted(deps):
            b.edge(d, n)
    return b.out


def _same_layout(b: _Builder, move: StageMove, links: LinkModel) -> LocalDag:
    """DP-only moves (the layout stays): keep units in place, Extend the rest, Destroy the surplus."""
    lay = move.current_layout
    staying = set(move.current) & set(move.target)
    new = [gpus for gpus in move.target if gpus not in staying]
    units: dict[int, Unit] = {}

    def current(i: int) -> Unit:  # only units a node touches get a Unit
        if i not in units:
            units[i] = b.unit(f"u{i}", lay, move.current[i])
        return units[i]

    chooser = _SourceChooser(list(move.current), links)
    copies: dict[int, list[int]] = {}
    onto: dict[int, list[int]] = {}
    for i, gpus in enumerate(new):
        src = chooser.take(gpus)
        n = b.extend(current(src), b.unit(f"x{i}", lay, gpus))
        copies.setdefault(src, []).append(n)
        for g in gpus:
            onto.setdefault(g, []).append(n)
    for i, gpus in enumerate(move.current):
        if gpus in staying:
            continue
        d = b.destroy(current(i))
        mine = copies.get(i, [])
        for n in mine:
            b.edge(n, d)  # a replica is destroyed only after the copies it feeds
        if not mine:
            for n in sorted({n for g in gpus for n in onto.get(g, ())}):
                b.edge(d, n)  # release before acquire on the GPUs it leaves
    return b.out


class _SourceChooser:
    """Pick Extend sources: least (queued copies + 1) × (link slowness), in O(log n) per pick.

    A source counts as local to a slot when both sit on one node (intra-node links); otherwise
    its copies run at inter-node speed, ``intra / inter`` bandwidth times slower.
    """

    def __init__(self, sources: list[tuple[int, ...]], links: LinkModel) -> None:
        c = links.cluster
        self.slow = max(1.0, c.intra_node_bandwidth_gbs / c.inter_node_bandwidth_gbs)
        self.links = links
        self.load = [0] * len(sources)
        self.all: list[tuple[int, int]] = [(0, i) for i in range(len(sources))]
        self.by_node: dict[int, list[tuple[int, int]]] = {}
        for i, gpus in enumerate(sources):
            nodes = {links.node_of(g) for g in gpus}
            if len(nodes) == 1:
                self.by_node.setdefault(nodes.pop(), []).append((0, i))

    def _best(self, heap: list[tuple[int, int]]) -> tuple[int, int] | None:
        while heap and heap[0][0] != self.load[heap[0][1]]:
            _, i = heapq.heappop(heap)
            heapq.heappush(heap, (self.load[i], i))
        return heap[0] if heap else None

    def take(self, gpus: tuple[int, ...]) -> int:
        if not self.all:
            raise ValueError("no source unit to extend from")
        nodes = {self.links.node_of(g) for g in gpus}
        local = self._best(self.by_node.get(next(iter(nodes)), [])) if len(nodes) == 1 else None
        best = self._best(self.all)
        assert best is not None
        pick = best[1]
        if local is not None and (local[0] + 1) <= (best[0] + 1) * self.slow:
            pick = local[1]
        self.load[pick] += 1
        return pick
