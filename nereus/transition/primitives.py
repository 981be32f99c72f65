"""The four primitives as DAG nodes of one model-stage: bytes from the shard geometry, seconds from
the link model, memory as per-GPU acquire/release (paper §2.11).

- **Split** all-gathers the T_sub shard within each group of a unit's ranks; ranks that keep no
  sub-unit only send, and every old shard is released.
- **Extend** is a rank-aligned copy from a source unit (a local copy where both sides share a GPU);
  a *restore* is an Extend into the target layout from the weight-sync source or shared storage.
- **Merge** assembles each target rank from the T_sub slots it covers (a local slice where the
  splits nest); a *reshard* is a Split and a Merge on one unit's own GPUs fused into one exchange.
- **Destroy** releases a unit.
Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from nereus.plan.layout import Layout
from nereus.plan.opclass import Link
from nereus.spec.model import ModelSpec
from nereus.state.buffers import StatePolicy, rank_buffers
from nereus.state.emu import Emu
from nereus.state.geometry import rank_numel, shared_numel
from nereus.state.sources import STORAGE
from nereus.transition.dag import Edge, EdgeKind, Flow, Node, Primitive
from nereus.transition.links import LinkModel
from nereus.transition.move import StageMove, emu

_INTRA, _INTER = Link.INTRA, Link.INTER


class Geometry:
    """One model's shard geometry in bytes under one state policy, memoised: held, payload and
    missing bytes per rank are pure functions of (layout, rank), so one table per (model, policy)
    lives for the process (admission prices many targets of the same models)."""

    def __init__(self, model: ModelSpec, policy: StatePolicy) -> None:
        self.model, self.policy, self.bpe = model, policy, policy.bytes_per_element
        self._held: dict[tuple[Layout, int, int], int] = {}
        self._payload: dict[tuple[Layout, int, int], int] = {}
        self._missing: dict[tuple[Layout, int, int, Layout, int, int], int] = {}
        self._merge: dict[tuple[Layout, Layout], MergeRows] = {}
        self._split: dict[tuple[Layout, Layout], tuple[tuple[int, int, int, int, int], ...]] = {}

    def held(self, layout: Layout, t: int, p: int) -> int:
        """Bytes rank (t, p)'s buffers occupy (what memory holds)."""
        key = (layout, t, p)
        out = self._held.get(key)
        if out is None:
            out = self._held[key] = rank_buffers(self.model, layout, t, p, self.policy).nbytes()
        return out

    def payload(self, layout: Layout, t: int, p: int) -> int:
        """Bytes of rank (t, p)'s shard that cross a link when it is copied whole."""
        key = (layout, t, p)
        out = self._payload.get(key)
        if out is None:
            out = self._payload[key] = rank_numel(self.model, layout, t, p) * self.bpe
        return out

    def missing(self, have: Layout, ht: int, hp: int, need: Layout, nt: int, np_: int) -> int:
        """Bytes rank (nt, np_) of ``need`` lacks when the GPU holds rank (ht, hp) of ``have``."""
        key = (have, ht, hp, need, nt, np_)
        out = self._missing.get(key)
        if out is None:
            model = self.model
            lack = rank_numel(model, need, nt, np_) - shared_numel(model, have, ht, hp, need, nt, np_)
            out = self._missing[key] = lack * self.bpe
        return out

    def merge_rows(self, sub: Layout, lay: Layout) -> MergeRows:
        """Per rank of ``lay`` (rank order) what a Merge from ``sub`` slots moves and holds."""
        key = (sub, lay)
        out = self._merge.get(key)
        if out is None:
            kt, kp = lay.tp // sub.tp, lay.pp // sub.pp
            recv, acquire, release, local = [], [], [], 0
            for t, p in lay.positions():
                st, sp = t // kt, p // kp  # the slot's rank that holds this position's rows
                r = self.missing(sub, st, sp, lay, t, p)
                recv.append(r)
                new, old = self.held(lay, t, p) + r, self.held(sub, st, sp) + r
                acquire.append(self.policy.streamed(new, old))
                release.append(acquire[-1] - (new - old))
                local = max(local, self.payload(lay, t, p) - r)
            out = self._merge[key] = MergeRows(tuple(recv), tuple(acquire), tuple(release), local)
        return out

    def split_rows(self, old: Layout, sub: Layout) -> tuple[tuple[int, int, int, int, int], ...]:
        """Per rank of ``old`` (rank order): (t, p, held, bytes it receives, bytes it acquires at
        most: ``StatePolicy.streamed``) when it keeps the ``sub`` rank (t // kt, p // kp) of a Split."""
        key = (old, sub)
        out = self._split.get(key)
        if out is None:
            kt, kp = old.tp // sub.tp, old.pp // sub.pp
            out = self._split[key] = tuple(
                (t, p, self.held(old, t, p), self.missing(old, t, p, sub, t // kt, p // kp),
                 self.policy.streamed(self.held(sub, t // kt, p // kp), self.held(old, t, p)))
                for t, p in old.positions()
            )  # fmt: skip
        return out


@dataclass(frozen=True, slots=True)
class MergeRows:
    """A Merge's bytes per target rank: received, acquired, released; the largest local copy."""

    recv: tuple[int, ...]
    acquire: tuple[int, ...]
    release: tuple[int, ...]
    local: int


@lru_cache(maxsize=64)
def geometry(model: ModelSpec, policy: StatePolicy) -> Geometry:
    """The process's memo of ``model``'s geometry under ``policy``."""
    return Geometry(model, policy)


@dataclass(slots=True)
class LocalDag:
    """One model-stage's nodes, local edges and the units they touch."""

    nodes: list[Node] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    units: dict[str, Emu] = field(default_factory=dict)


class NodeMaker:
    """Makes the nodes of one model-stage's local DAG, one method per primitive."""

    def __init__(self, move: StageMove, links: LinkModel, next_id: Callable[[], int]) -> None:
        self.m = move
        self.links = links
        self.next_id = next_id
        self.out = LocalDag()
        self.bpe = move.policy.bytes_per_element
        self.geo = geo = geometry(move.model, move.policy)
        self.held, self.payload, self.missing = geo.held, geo.payload, geo.missing
        self._tables: dict[Layout, tuple[list[int], list[int]]] = {}

    # -------------------------------------------------------------- geometry in bytes
    def table(self, layout: Layout) -> tuple[list[int], list[int]]:
        """(payload bytes, held bytes) of every rank of ``layout``, in rank order."""
        if layout not in self._tables:
            pos = layout.positions()
            self._tables[layout] = (
                [self.payload(layout, t, p) for t, p in pos],
                [self.held(layout, t, p) for t, p in pos],
            )
        return self._tables[layout]

    # -------------------------------------------------------------- bookkeeping
    def unit(self, uid: str, layout: Layout, gpus: tuple[int, ...]) -> Emu:
        """A unit of this model-stage named ``<model-stage>/<uid>``, recorded in the DAG."""
        return self.touch(emu(self.m.name, layout, gpus, f"{self.m.name}/{uid}"))

    def touch(self, u: Emu) -> Emu:
        self.out.units[u.id] = u
        return u

    def add(self, node: Node) -> int:
        self.out.nodes.append(node)
        return node.id

    def edge(self, a: int, b: int) -> None:
        self.out.edges.append(Edge(a, b, EdgeKind.LOCAL))

    # -------------------------------------------------------------- primitives
    def destroy(self, u: Emu) -> int:
        release = tuple(zip(u.gpus, self.table(u.layout)[1], strict=True))
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.DESTROY, model_stage=self.m.name, gpus=u.gpus,
                bytes=0, est_s=0.0, inputs=(u.id,), frees=(u.id,), release=release,
            )
        )  # fmt: skip

    def split(
        self, u: Emu, sub: Layout, subunits: Sequence[Emu], groups: dict[tuple[int, int], list[int]]
    ) -> int:
        """All-gather the T_sub shard in every group; GPUs of no sub-unit only send, then free."""
        kt, kp = u.layout.tp // sub.tp, u.layout.pp // sub.pp
        keeps = {g for s in subunits for g in s.gpus}
        rows = self.geo.split_rows(u.layout, sub)
        index = {g: i for i, g in enumerate(u.gpus)}
        acquire, release, flows, recvs = [], [], [], []
        moved = 0
        for (tq, pq), members in groups.items():
            link = self.links.group_link(members)
            for g in members:
                t, p, held, recv, takes = rows[index[g]]
                if g not in keeps:
                    release.append((g, held))
                    continue  # its sub-unit is not needed: it contributes its shard and frees it
                if (t // kt, p // kp) != (tq, pq):  # a group other than its own sub-rank's
                    recv = self.missing(u.layout, t, p, sub, tq, pq)
                    takes = self.geo.policy.streamed(self.held(sub, tq, pq), held)
                # kind by kind (``StatePolicy.streamed``): ends holding the sub-shard, not the old one
                acquire.append((g, takes))
                release.append((g, takes - (self.held(sub, tq, pq) - held)))
                flows.append(Flow(g, recv, link))
                recvs.append(g)
                moved += recv
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.SPLIT, model_stage=self.m.name, gpus=u.gpus,
                bytes=moved,
                est_s=self.links.node_seconds(Primitive.SPLIT, tuple(flows), kt * kp - 1, distinct=True),
                inputs=(u.id,), outputs=tuple(s.id for s in subunits), frees=(u.id,),
                acquire=tuple(acquire), release=tuple(release), flows=tuple(flows),
                sends=u.gpus, recvs=tuple(recvs),
            )
        )  # fmt: skip

    def extend(self, src: Emu, dst: Emu) -> int:
        payload, held = self.table(dst.layout)
        gpn = self.links.gpus_per_node
        # a position whose source and destination are one GPU is a local copy: nothing crosses a link
        flows = tuple(
            Flow(b, 0 if a == b else n, _INTRA if a // gpn == b // gpn else _INTER)
            for a, b, n in zip(src.gpus, dst.gpus, payload, strict=True)
        )
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.EXTEND, model_stage=self.m.name,
                gpus=src.gpus + dst.gpus, bytes=sum(f.bytes for f in flows),
                est_s=self.links.node_seconds(Primitive.EXTEND, flows, distinct=True),
                inputs=(src.id,), outputs=(dst.id,), acquire=tuple(zip(dst.gpus, held, strict=True)),
                flows=flows, sends=src.gpus, recvs=dst.gpus,
            )
        )  # fmt: skip

    def restore(self, dst: Emu) -> int:
        """An Extend into ``dst`` from the weight-sync source's GPUs or from shared storage."""
        storage = self.m.restore_from == STORAGE
        src_nodes = {self.links.node_of(g) for g in self.m.restore_gpus}
        acquire, flowing = [], []
        for b, t, p in dst.ranks():
            acquire.append((b, self.held(dst.layout, t, p)))
            near = self.links.node_of(b) in src_nodes
            link = None if storage else self.links.link(b, b) if near else self.links.link(b, -1)
            flowing.append(Flow(b, self.payload(dst.layout, t, p), link))
        flows = tuple(flowing)
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.EXTEND, model_stage=self.m.name, gpus=dst.gpus,
                bytes=sum(f.bytes for f in flows),
                est_s=self.links.node_seconds(Primitive.EXTEND, flows, distinct=True),
                outputs=(dst.id,), acquire=tuple(acquire), flows=flows,
                sends=() if storage else self.m.restore_gpus, recvs=dst.gpus, source=self.m.restore_from,
            )
        )  # fmt: skip

    def reshard(self, u: Emu, v: Emu) -> int:
        """A unit's Split and Merge on its own GPUs fused into one exchange: every GPU of ``v``
        assembles its target shard from the old shards of ``u`` (its own first), with no
        intermediate T_sub layout; a Merge node whose input has the old layout."""
        old, new = u.layout, v.layout
        acquire, release, flows = [], [], []
        moved, local = 0, 0
        link = self.links.group_link(v.gpus)
        where = {g: (t, p) for g, t, p in u.ranks()}
        policy = self.m.policy
        for g, t, p in v.ranks():
            ot, op = where[g]
            recv = self.missing(old, ot, op, new, t, p)
            grows = self.held(new, t, p) - self.held(old, ot, op)
            peak = policy.streamed(self.held(new, t, p), self.held(old, ot, op))  # kind by kind
            acquire.append((g, peak))
            release.append((g, peak - grows))
            flows.append(Flow(g, recv, link))
            moved += recv
            local = max(local, self.payload(new, t, p) - recv)
        ports = v.gpus if moved else ()
        est = self.links.node_seconds(Primitive.MERGE, tuple(flows), len(v.gpus) - 1, local, distinct=True)
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.MERGE, model_stage=self.m.name, gpus=v.gpus,
                bytes=moved, est_s=est,
                inputs=(u.id,), outputs=(v.id,), frees=(u.id,), acquire=tuple(acquire),
                release=tuple(release), flows=tuple(flows), sends=ports, recvs=ports,
            )
        )  # fmt: skip

    def reshard_across(self, u: Emu, v: Emu) -> int:
        """A unit re-laid out onto other GPUs (some may be its own) in one exchange: every GPU
        of ``v`` assembles its target shard straight from ``u``'s old shards (its own first), so
        it acquires only that shard, where Split → Extend → Merge would first copy whole T_sub
        shards (larger when the target pipelines deeper) onto it. ``u`` stays: several target
        units may draw on it, and a Destroy after them frees it. A Merge node whose input has the
        old layout; its time counts the bytes each provider sends as well as those each receiver
        takes in."""
        old, new = u.layout, v.layout
        where = {g: (t, p) for g, t, p in u.ranks()}
        link = self.links.group_link((*u.gpus, *v.gpus))
        acquire, flows = [], []
        moved, local = 0, 0
        for g, t, p in v.ranks():
            recv = self.missing(old, *where[g], new, t, p) if g in where else self.payload(new, t, p)
            acquire.append((g, self.held(new, t, p)))
            flows.append(Flow(g, recv, link))
            moved += recv
            local = max(local, self.payload(new, t, p) - recv)
        # every piece has one holder in ``u``: its ranks send about an even share of the bytes
        flows += [Flow(g, moved // len(u.gpus), link) for g in u.gpus]
        est = self.links.node_seconds(Primitive.MERGE, tuple(flows), len(u.gpus), local)
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.MERGE, model_stage=self.m.name, gpus=v.gpus,
                bytes=moved, est_s=est, inputs=(u.id,), outputs=(v.id,),
                acquire=tuple(acquire), flows=tuple(flows),
                sends=u.gpus if moved else (), recvs=v.gpus if moved else (),
            )
        )  # fmt: skip

    def merge(self, slots: Sequence[Emu], target: Emu) -> int:
        sub, lay = slots[0].layout, target.layout
        kt, kp = lay.tp // sub.tp, lay.pp // sub.pp
        rows = self.geo.merge_rows(sub, lay)
        gpus = target.gpus
        link = self.links.group_link(gpus)
        flows = tuple(Flow(g, r, link) for g, r in zip(gpus, rows.recv, strict=True))
        moved = sum(rows.recv)
        ports = gpus if moved else ()
        est = self.links.node_seconds(Primitive.MERGE, flows, kt * kp - 1, rows.local, distinct=True)
        return self.add(
            Node(
                id=self.next_id(), primitive=Primitive.MERGE, model_stage=self.m.name, gpus=gpus,
                bytes=moved, est_s=est,
                inputs=tuple(s.id for s in slots), outputs=(target.id,), frees=tuple(s.id for s in slots),
                acquire=tuple(zip(gpus, rows.acquire, strict=True)),
                release=tuple(zip(gpus, rows.release, strict=True)), flows=flows, sends=ports, recvs=ports,
            )
        )  # fmt: skip
