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
of its target unit. Simpler moves take shortcuts: a DP-only move (the layout stays) keeps units
in place, extends the new ones and destroys the surplus; a unit re-laid-out on its own GPUs is
resharded in one exchange; a model-stage with no intact unit is *restored* straight into the
target layout from its weight-sync source or from shared storage. A move that changes layout and
GPUs is also planned *direct* (``choose._direct``): each target unit assembled straight from one
current unit (``_direct``), kept where its schedule is shorter or the DAG of the others runs out
of memory. Pure.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from nereus.plan.opclass import Link
from nereus.state.emu import Emu
from nereus.transition.links import LinkModel
from nereus.transition.move import StageMove, sub_layout
from nereus.transition.primitives import LocalDag, NodeMaker

Slot = tuple[int, tuple[int, ...]]  # (target unit index, GPUs in T_sub rank order)


def local_dag(
    move: StageMove, links: LinkModel, next_id: Callable[[], int], direct: bool = False
) -> LocalDag:
    """The local DAG of ``move`` (empty when its units stay as they are). ``direct``: a move that
    changes layout and GPUs (``applies_direct``) re-lays each target unit out straight from one
    current unit (``_direct``) instead of Split → Destroy → Extend → Merge."""
    make = NodeMaker(move, links, next_id)
    if move.unchanged:
        pass
    elif move.current_layout == move.target_layout and move.current:
        _same_layout(make)
    elif not move.current:
        for v in move.target:
            make.restore(make.touch(v))
    elif _in_place(move):
        own = {frozenset(u.gpus): u for u in move.current}
        for v in move.target:  # every unit re-lays itself out on its own GPUs: no intermediate layout
            u = make.touch(own[frozenset(v.gpus)])
            make.reshard(u, make.touch(v))
    elif direct and applies_direct(move):
        _direct(make)
    else:
        _Reshape(make).build()
    return make.out


def applies_direct(move: StageMove) -> bool:
    """Whether ``_direct`` can re-lay ``move`` out: its layout changes onto other GPUs, and it has
    intact units to draw on."""
    return (
        not move.unchanged
        and move.current_layout != move.target_layout
        and bool(move.current)
        and not _in_place(move)
    )


def _direct(make: NodeMaker) -> None:
    """Each target unit assembled straight from one current unit (``NodeMaker.reshard_across``):
    the one sharing most of its GPUs, then the one feeding fewest targets so far, then the first.
    Current units that feed no target are destroyed first, each before every exchange that
    acquires on its GPUs (release before acquire); one that feeds targets is destroyed once they
    are assembled. No intermediate T_sub layout: a GPU acquires only its target shard."""
    move = make.m
    uses = [0] * len(move.current)
    pairs: list[tuple[int, Emu]] = []
    for v in move.target:
        mine = set(v.gpus)
        src = max(
            range(len(move.current)), key=lambda i: (len(mine & set(move.current[i].gpus)), -uses[i], -i)
        )
        uses[src] += 1
        pairs.append((src, v))
    idle = [(make.destroy(make.touch(u)), set(u.gpus)) for i, u in enumerate(move.current) if not uses[i]]
    fed: dict[int, list[int]] = {}
    for src, v in pairs:
        n = make.reshard_across(make.touch(move.current[src]), make.touch(v))
        fed.setdefault(src, []).append(n)
        for d, gpus in idle:
            if gpus & set(v.gpus):
                make.edge(d, n)
    for src, exchanges in fed.items():
        d = make.destroy(move.current[src])
        for n in exchanges:
            make.edge(n, d)


def _in_place(move: StageMove) -> bool:
    own = {frozenset(u.gpus) for u in move.current}
    return len(move.current) == len(move.target) and all(frozenset(v.gpus) in own for v in move.target)


def _same_layout(make: NodeMaker) -> None:
    """DP-only moves (the layout stays): keep units in place, Extend the rest, Destroy the surplus."""
    move = make.m
    staying = {u.gpus for u in move.current} & {v.gpus for v in move.target}
    chooser = SourceChooser([u.gpus for u in move.current], make.links)
    copies: dict[int, list[int]] = {}
    onto: dict[int, list[int]] = {}
    for v in (v for v in move.target if v.gpus not in staying):
        src = chooser.take(v.gpus)
        n = make.extend(make.touch(move.current[src]), make.touch(v))
        copies.setdefault(src, []).append(n)
        for g in v.gpus:
            onto.setdefault(g, []).append(n)
    for i, u in enumerate(move.current):
        if u.gpus in staying:
            continue
        d = make.destroy(make.touch(u))
        mine = copies.get(i, [])
        for n in mine:
            make.edge(n, d)  # a replica is destroyed only after the copies it feeds
        if not mine:
            for n in sorted({n for g in u.gpus for n in onto.get(g, ())}):
                make.edge(d, n)  # release before acquire on the GPUs it leaves


class _Reshape:
    """Split → Destroy → Extend → Merge for a move that changes the layout and the GPUs."""

    def __init__(self, make: NodeMaker) -> None:
        m = make.m
        self.make, self.links = make, make.links
        cur, tgt = m.current_layout, m.target_layout
        self.sub = sub = sub_layout(cur, tgt)
        self.kt, self.kp = cur.tp // sub.tp, cur.pp // sub.pp
        self.mt, self.mp = tgt.tp // sub.tp, tgt.pp // sub.pp
        self.k = self.kt * self.kp
        self.currents = [make.touch(u) for u in m.current]
        self.targets = list(m.target)
        self.sub_pos = sub.positions()
        self._group_at: list[tuple[tuple[int, int], list[int]]] | None = None
        self.groups = [self._groups(u) for u in self.currents]
        # slot (jt, jp) of target unit v owns target positions (t'·mt + jt, p'·mp + jp): the rank
        # indices (p'·mp + jp)·tp* + t'·mt + jt of every unit (``Layout.index``), once
        mt, mp, ttp = self.mt, self.mp, tgt.tp
        at = [
            [(pq * mp + jp) * ttp + tq * mt + jt for tq, pq in self.sub_pos]
            for jp in range(mp)
            for jt in range(mt)
        ]
        self.slots: list[Slot] = [
            (vi, tuple([v.gpus[x] for x in where])) for vi, v in enumerate(self.targets) for where in at
        ]
        self.kept: dict[int, list[int]] = {}  # current unit → slots carved from it in place
        self.unmatched: list[int] = []  # slots an Extend fills
        self.split_units: set[int] = set()  # current units that are split (k > 1)
        self.kept_units: list[tuple[int, int, tuple[int, ...]]] = []  # (slot, current unit, GPUs)
        self.free_units: list[tuple[int, tuple[int, ...]]] = []  # (current unit, GPUs): sources or surplus
        self.picks: dict[int, int] = {}  # unmatched slot → source pool index
        self.pool_unit: dict[int, Emu] = {}  # pool index → the materialised sub-unit
        self.made_by: dict[int, int] = {}  # pool index → the Split that made it (−1: an unsplit unit)
        self.slot_units: dict[int, Emu] = {}  # slot → the unit that fills it
        self.unused: set[int] = set()  # split units that feed nothing after all
        self.copies: dict[int, list[int]] = {}  # pool index → Extends that read it
        self.extend_into: dict[int, int] = {}  # slot → the Extend that fills it
        self.onto: dict[int, list[int]] = {}  # GPU → Extends onto it

    def _groups(self, u: Emu) -> dict[tuple[int, int], list[int]]:
        """The Split's all-gather groups of ``u``: the k old positions that make sub-rank q."""
        if self._group_at is None:  # rank indices (``Layout.index``) of every group, once per move
            kt, kp, tp = self.kt, self.kp, u.layout.tp
            self._group_at = [
                ((tq, pq), [(pq * kp + bp) * tp + tq * kt + bt for bp in range(kp) for bt in range(kt)])
                for tq, pq in self.sub_pos
            ]
        gpus = u.gpus
        return {q: [gpus[x] for x in where] for q, where in self._group_at}

    def build(self) -> None:
        self.match_slots()
        self.choose_splits()
        self.carve_sub_units()
        self.pick_sources()
        self.split()
        self.extend()
        self.destroy()
        self.merge()

    def match_slots(self) -> None:
        """A slot is kept in place when each of its GPUs lies in the matching group of one unit."""
        owner = {g: ui for ui, u in enumerate(self.currents) for g in u.gpus}
        for si, (_, gpus) in enumerate(self.slots):
            ui = owner.get(gpus[0], -1)
            if ui >= 0 and all(g in self.groups[ui][q] for g, q in zip(gpus, self.sub_pos, strict=True)):
                self.kept.setdefault(ui, []).append(si)
            else:
                self.unmatched.append(si)

    def choose_splits(self) -> None:
        """Split the units with kept slots, then the nearest others until every slot to fill can
        copy from a source of its own."""
        if self.k == 1:
            return
        self.split_units = set(self.kept)
        gpn = self.links.gpus_per_node
        waiting = {g // gpn for si in self.unmatched for g in self.slots[si][1]}
        nearest = sorted(
            range(len(self.currents)),
            key=lambda i: -sum(g // gpn in waiting for g in self.currents[i].gpus),
        )
        carved = sum(map(len, self.kept.values()))
        for ui in nearest:
            if self.split_units and len(self.split_units) * self.k - carved >= len(self.unmatched):
                break
            self.split_units.add(ui)

    def _taking_part(self) -> list[int]:
        return sorted(self.split_units) if self.k > 1 else list(range(len(self.currents)))

    def carve_sub_units(self) -> None:
        """The T_sub units that exist after the Splits: kept in place, or free (a source, or surplus)."""
        for ui in self._taking_part():
            mine = self.kept.get(ui, [])
            self.kept_units += [(si, ui, self.slots[si][1]) for si in mine]
            if self.k == 1:
                if not mine:
                    self.free_units.append((ui, self.currents[ui].gpus))
                continue
            used = {g for si in mine for g in self.slots[si][1]}
            rest = {q: [x for x in self.groups[ui][q] if x not in used] for q in self.sub_pos}
            self.free_units += [
                (ui, tuple(rest[q][j] for q in self.sub_pos)) for j in range(self.k - len(mine))
            ]

    def pick_sources(self) -> None:
        """Sources for the slots to fill: free units first, then kept ones (least loaded, nearest)."""
        pool = [gpus for _, gpus in self.free_units] + [gpus for _, _, gpus in self.kept_units]
        chooser = SourceChooser(pool, self.links) if pool else None
        for si in self.unmatched:
            assert chooser is not None
            self.picks[si] = chooser.take(self.slots[si][1])

    def split(self) -> None:
        """Materialise each split unit's kept sub-units and the free ones that feed a copy."""
        n_free, used = len(self.free_units), set(self.picks.values())
        make = self.make
        kept_of: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
        for j, (si, owner, gpus) in enumerate(self.kept_units):
            kept_of.setdefault(owner, []).append((j, si, gpus))
        free_of: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for j, (owner, gpus) in enumerate(self.free_units):
            if j in used:
                free_of.setdefault(owner, []).append((j, gpus))
        for ui in self._taking_part():
            subunits: list[tuple[int, Emu]] = []
            for j, si, gpus in kept_of.get(ui, ()):
                unit = self.currents[ui] if self.k == 1 else make.unit(f"u{ui}.k{si}", self.sub, gpus)
                subunits.append((n_free + j, unit))
                self.slot_units[si] = unit
            for j, gpus in free_of.get(ui, ()):
                unit = self.currents[ui] if self.k == 1 else make.unit(f"u{ui}.f{j}", self.sub, gpus)
                subunits.append((j, unit))
            if self.k > 1 and not subunits:
                self.unused.add(ui)  # split for nothing after all: it is destroyed whole instead
                continue
            units = [s for _, s in subunits]
            made = make.split(self.currents[ui], self.sub, units, self.groups[ui]) if self.k > 1 else -1
            for j, unit in subunits:
                self.pool_unit[j] = unit
                self.made_by[j] = made

    def extend(self) -> None:
        """A rank-aligned copy into every slot nothing covers."""
        for si in self.unmatched:
            j = self.picks[si]
            dst = self.make.unit(f"x{si}", self.sub, self.slots[si][1])
            n = self.make.extend(self.pool_unit[j], dst)
            if self.made_by[j] >= 0:
                self.make.edge(self.made_by[j], n)
            self.slot_units[si] = dst
            self.copies.setdefault(j, []).append(n)
            self.extend_into[si] = n
            for gpu in self.slots[si][1]:
                self.onto.setdefault(gpu, []).append(n)

    def destroy(self) -> None:
        """A free unit after the copies it feeds; a unit that takes no part before the Extends
        onto its GPUs (release before acquire)."""
        make = self.make
        for j in range(len(self.free_units)):
            if j not in self.pool_unit:
                continue
            d = make.destroy(self.pool_unit[j])
            if self.made_by[j] >= 0:
                make.edge(self.made_by[j], d)
            for n in self.copies.get(j, ()):
                make.edge(n, d)
        n_cur, k = len(self.currents), self.k
        idle = [
            self.currents[ui]
            for ui in range(n_cur)
            if k > 1 and (ui not in self.split_units or ui in self.unused)
        ]
        picked = set(self.picks.values())
        idle += [self.currents[ui] for j, (ui, _) in enumerate(self.free_units) if k == 1 and j not in picked]
        for u in idle:
            d = make.destroy(u)
            for n in sorted({n for g in u.gpus for n in self.onto.get(g, ())}):
                make.edge(d, n)

    def merge(self) -> None:
        """Every target unit from its slots (a slot of a unit that needs no merge is the unit)."""
        if self.mt * self.mp == 1:
            return
        n_free = len(self.free_units)
        index_of_kept = {si: n_free + j for j, (si, _, _) in enumerate(self.kept_units)}
        slots_of: dict[int, list[int]] = {}
        for si, (vi, _) in enumerate(self.slots):
            slots_of.setdefault(vi, []).append(si)
        for vi, v in enumerate(self.targets):
            deps: set[int] = set()
            for si in slots_of[vi]:
                if si in self.extend_into:
                    deps.add(self.extend_into[si])
                else:
                    j = index_of_kept[si]
                    deps.update(self.copies.get(j, ()))  # copies read it before it is merged away
                    if self.made_by[j] >= 0:
                        deps.add(self.made_by[j])
            n = self.make.merge([self.slot_units[si] for si in slots_of[vi]], self.make.touch(v))
            for d in sorted(deps):
                self.make.edge(d, n)


class SourceChooser:
    """Pick Extend sources: least (queued copies + 1) × (link slowness), in O(log n) per pick.

    A source counts as local to a slot when both sit on one node (intra-node links); otherwise
    its copies run at inter-node speed, ``intra / inter`` bandwidth times slower.
    """

    def __init__(self, sources: list[tuple[int, ...]], links: LinkModel) -> None:
        self.slow = max(1.0, links.peak_bandwidth(Link.INTRA) / links.peak_bandwidth(Link.INTER))
        self.links = links
        self.load = [0] * len(sources)
        self.all: list[tuple[int, int]] = [(0, i) for i in range(len(sources))]
        self.by_node: dict[int, list[tuple[int, int]]] = {}
        self.gpn = gpn = links.gpus_per_node  # nodes are GPU-id ranges: one node iff min and max share it
        for i, gpus in enumerate(sources):
            first = min(gpus) // gpn
            if first == max(gpus) // gpn:
                self.by_node.setdefault(first, []).append((0, i))

    def _best(self, heap: list[tuple[int, int]]) -> tuple[int, int] | None:
        while heap and heap[0][0] != self.load[heap[0][1]]:
            _, i = heapq.heappop(heap)
            heapq.heappush(heap, (self.load[i], i))
        return heap[0] if heap else None

    def take(self, gpus: tuple[int, ...]) -> int:
        if not self.all:
            raise ValueError("no source unit to extend from")
        first = min(gpus) // self.gpn
        local = self._best(self.by_node.get(first, [])) if first == max(gpus) // self.gpn else None
        best = self._best(self.all)
        assert best is not None
        pick = best[1]
        if local is not None and (local[0] + 1) <= (best[0] + 1) * self.slow:
            pick = local[1]
        self.load[pick] += 1
        return pick
