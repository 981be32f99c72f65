"""Run a transition DAG on torch.distributed: the edge where planned moves become bytes.

Every rank walks the same DAG in the same waves (nodes grouped by depth, so a wave depends only on
earlier ones) and takes part in the nodes that touch its GPU. A node's data movement is the
exchange plan of its receivers (``exchange.plan_pieces``): each provider packs, per receiver, all
its pieces of every buffer kind into one message (a rank-aligned copy sends its flat buffers as
they are), and a wave's messages, across all its nodes, go out together (``batch_isend_irecv``):
the rank pairs of an Extend, the members of a Split group, and every ready primitive run
concurrently. Pieces a rank already holds are copied locally, never sent. Ranks walk the waves in
one order and a wave only waits on its own participants, so the walk cannot deadlock; memory
follows the DAG's ledger, which holds for every execution that respects its edges.

- Split: the members of the unit provide their old shards, the materialised sub-units' ranks
  receive their T_sub shard; all old shards are freed at the end.
- Extend: rank-aligned; the source keeps its shard. A restore (``node.source``) reads from the
  weight-sync trainer's units, or calls ``storage`` for a frozen model.
- Merge: the target ranks assemble from the slot units' ranks (local slices when nested).
- Destroy: drop the buffers.

gloo on CPU, NCCL/RCCL on GPU, the same code. The transition's process group is created at the
start and destroyed at the end, with a short timeout: a peer that dies surfaces as an error
naming the node and the rank instead of a hang.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.plan.layout import Layout
from nereus.state.buffers import BufferKind, Slot, StatePolicy
from nereus.state.emu import LogicalState
from nereus.state.holder import RankState, StateHolder
from nereus.transition.dag import Node, Primitive, TransitionDag, Unit
from nereus.transition.exchange import Piece, plan_pieces
from nereus.transition.local import StageMove

Storage = Callable[[str, Layout, int, int], RankState]  # a frozen model's rank from shared storage


class TransitionError(RuntimeError):
    """A node failed on this rank (a peer died, a timeout, a buffer of the wrong shape)."""


@dataclass(frozen=True, slots=True)
class Report:
    """What one rank did: nodes run, bytes sent and received, its units at the end."""

    nodes: int
    sent_bytes: int
    received_bytes: int
    units: tuple[str, ...]


class Executor:
    def __init__(
        self,
        dag: TransitionDag,
        moves: Sequence[StageMove],
        holder: StateHolder,
        gpu_of_rank: Mapping[int, int],
        states: Mapping[str, LogicalState] | None = None,
        storage: Storage | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if not dag.feasible:
            raise TransitionError(f"the transition is infeasible: {dag.reason}")
        self.dag, self.holder = dag, holder
        self.moves = {m.name: m for m in moves}
        self.rank = holder.rank
        self.gpu_of_rank = dict(gpu_of_rank)
        self.rank_of_gpu = {g: r for r, g in self.gpu_of_rank.items()}
        self.gpu = self.gpu_of_rank[self.rank]
        self.states = dict(states or {})
        self.storage = storage
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.units: dict[str, Unit] = dict(dag.units)
        for m in moves:  # units nothing touches keep the ids the local DAGs gave them
            for i, gpus in enumerate(m.current):
                self.units.setdefault(
                    f"{m.name}/u{i}", Unit(f"{m.name}/u{i}", m.name, m.current_layout, gpus)
                )
        self.sent = self.received = 0
        self.messages: list[tuple[int, int, int, int]] = []  # (node, from rank, to rank, bytes) sent
        self.node_seconds: dict[int, float] = {}  # wall time of each node this rank took part in

    # -------------------------------------------------------------- bookkeeping
    def _adopt(self) -> None:
        """Name this rank's units as the DAG does (``<model-stage>/u<i>``); units of model-stages
        the transition does not move (a weight sync moves only its receivers) stay as they are."""
        mine = self.holder.by_stage()
        named: dict[str, RankState] = {}
        for name, rs in mine.items():
            m = self.moves.get(name)
            if m is None:
                named[name] = rs
                continue
            uid = None
            for i, gpus in enumerate(m.current):
                if self.gpu in gpus:
                    uid = f"{name}/u{i}"
                    t, p = _position(m.current_layout, gpus.index(self.gpu))
                    if (rs.layout, rs.t, rs.p) != (m.current_layout, t, p):
                        raise TransitionError(
                            f"rank {self.rank}: holds {name} {rs.layout} (t={rs.t}, p={rs.p}), "
                            f"the plan says {m.current_layout} (t={t}, p={p})"
                        )
            if uid is not None:  # a unit broken by a lost GPU is dropped: its peers are gone
                named[uid] = rs
        self.holder.units = named  # only once every unit checked out: bad input changes nothing

    def _position(self, uid: str, gpu: int) -> tuple[Layout, int, int]:
        u = self.units[uid]
        t, p = _position(u.layout, u.gpus.index(gpu))
        return u.layout, t, p

    # -------------------------------------------------------------- the walk
    def run(
        self, order: Sequence[int] | None = None, on_node: Callable[[Node, str], None] | None = None
    ) -> Report:
        """Walk the DAG in waves (``order`` sets the order within a wave: the schedule's start
        order, or the commit order by default). ``on_node(node, "start" | "done")`` observes each
        node this rank takes part in.
        Raises TransitionError naming this rank, the node and its peers when a node fails; the
        holder then still holds every complete unit it had (nothing half-written is installed)."""
        self._adopt()
        # every rank has torn down its previous groups before anyone connects a new one: gloo
        # reports a peer still tearing down as "connection closed" during the new group's connect
        dist.barrier()
        group = dist.new_group(backend=dist.get_backend(), timeout=self.timeout)
        # and every rank's connections are up before anyone starts: gloo connects pairs lazily
        # per rank, so a peer that fails its first node could otherwise break a slower rank's
        # connect, which then surfaces outside the node that failed
        done = 0
        try:
            dist.barrier(group=group)
            for wave in self._waves(order):
                mine = [self.dag.nodes[i] for i in wave]
                mine = [n for n in mine if self.gpu in {*n.gpus, *n.sends, *(g for g, _ in n.release)}]
                if not mine:
                    continue
                started = time.perf_counter()
                try:
                    ops: list[dist.P2POp] = []
                    finishes = []
                    for node in mine:
                        if on_node:
                            on_node(node, "start")
                        node_ops, finish = self._node(node, group)
                        ops += node_ops
                        finishes.append(finish)
                    if ops:  # every ready node's messages at once: they run concurrently
                        for work in dist.batch_isend_irecv(ops):
                            work.wait()
                    for finish in finishes:
                        finish()
                except Exception as exc:  # a dead peer, a timeout, a bad buffer
                    what = "; ".join(f"{n.primitive.value} node {n.id} ({n.describe()})" for n in mine)
                    peers = sorted(
                        {self.rank_of_gpu[g] for n in mine for g in (*n.gpus, *n.sends)} - {self.rank}
                    )
                    raise TransitionError(
                        f"rank {self.rank}: {what} with ranks {peers} failed: {exc}"
                    ) from exc
                elapsed = time.perf_counter() - started
                for node in mine:
                    done += 1
                    self.node_seconds[node.id] = elapsed
                    if on_node:
                        on_node(node, "done")
        finally:
            dist.destroy_process_group(group)
        self.holder.by_stage()  # checks: one unit per model-stage again (ids stay the DAG's)
        return Report(done, self.sent, self.received, tuple(sorted(self.holder.units)))

    def _waves(self, order: Sequence[int] | None) -> list[list[int]]:
        """Nodes grouped by depth in the DAG: a wave's nodes depend only on earlier waves, so they
        are ready together and run concurrently (in ``order`` within a wave)."""
        preds = self.dag.preds()
        seq = list(order) if order is not None else list(self.dag.order)
        depth: dict[int, int] = {}
        for i in self.dag.order:  # a topological order
            depth[i] = 1 + max((depth[p] for p in preds[i]), default=-1)
        waves: dict[int, list[int]] = {}
        for i in seq:
            waves.setdefault(depth[i], []).append(i)
        return [waves[d] for d in sorted(waves)]

    def _node(self, node: Node, group: dist.ProcessGroup) -> tuple[list[dist.P2POp], Callable[[], None]]:
        """This rank's messages for ``node`` and what to do once they have arrived."""
        prim = node.primitive
        if prim is Primitive.DESTROY:

            def drop() -> None:
                self.holder.units.pop(node.inputs[0], None)

            return [], drop
        if prim is Primitive.EXTEND and node.source == "storage":
            self._from_storage(node)
            return [], lambda: None
        return self._exchange(node, self._roles(node), group)

    def _roles(self, node: Node) -> _Roles:
        receivers: dict[int, tuple[str, Layout, int, int]] = {}
        providers: dict[int, list[tuple[int, str]]] = {}
        for out in node.outputs:
            u = self.units[out]
            for i, g in enumerate(u.gpus):
                t, p = _position(u.layout, i)
                receivers[g] = (out, u.layout, t, p)
        if node.primitive is Primitive.EXTEND and node.source:  # a restore from the trainer
            src = self.moves[node.source]
            offer = [(g, f"{node.source}/u{k}") for k, gpus in enumerate(src.current) for g in gpus]
            for g in receivers:
                providers[g] = sorted(offer, key=lambda x: (x[0] != g, x[0]))
            return _Roles(receivers, providers, src.policy)
        offer = [(g, uid) for uid in node.inputs for g in self.units[uid].gpus]
        for g in receivers:
            if node.primitive is Primitive.EXTEND:  # rank-aligned: the same position of the source
                src_unit = self.units[node.inputs[0]]
                i = self.units[node.outputs[0]].gpus.index(g)
                providers[g] = [(src_unit.gpus[i], src_unit.id)]
            else:  # the receiver itself first, then the others in unit order
                providers[g] = sorted(offer, key=lambda x: (x[0] != g, x[0]))
        return _Roles(receivers, providers, None)

    def _exchange(
        self, node: Node, roles: _Roles, group: dist.ProcessGroup
    ) -> tuple[list[dist.P2POp], Callable[[], None]]:
        move = self.moves[node.model_stage]
        kinds = sorted((k for k, _ in move.policy.kinds), key=lambda k: -dict(move.policy.kinds)[k].itemsize)
        ops: list[dist.P2POp] = []
        inbox: list[tuple[torch.Tensor, list[Piece]]] = []
        new: RankState | None = None
        whole_copy = False  # this rank receives a rank-aligned copy: its state lands in ``header``
        header = torch.zeros(4, dtype=torch.int64)
        states: list[LogicalState] = []
        for recv_gpu in sorted(roles.receivers):
            _, lay, t, p = roles.receivers[recv_gpu]
            offer = roles.providers[recv_gpu]
            positions = tuple(self._position(u, g) for g, u in offer)
            whole = len(offer) == 1 and positions[0] == (lay, t, p) and roles.provider_policy is None
            if whole and offer[0][0] != recv_gpu:  # a rank-aligned copy: the flat buffers as they are
                if recv_gpu == self.gpu:
                    src_rank = self.rank_of_gpu[offer[0][0]]
                    new = self._receive_whole(node, move, (lay, t, p), src_rank, kinds, header, group, ops)
                    whole_copy = True
                elif offer[0][0] == self.gpu:
                    self._send_whole(
                        node, self.holder.units[offer[0][1]], self.rank_of_gpu[recv_gpu], kinds, group, ops
                    )
                continue
            pieces = plan_pieces(move.model, move.policy, (lay, t, p), positions, roles.provider_policy)
            if recv_gpu != self.gpu:  # what this rank sends to recv_gpu: one message
                mine = [pc for pc in pieces if offer[pc.provider][0] == self.gpu]
                if mine:
                    src = self.holder.units[offer[mine[0].provider][1]]
                    msg = pack(mine, src.buffers, kinds, src.state)
                    ops.append(
                        dist.P2POp(dist.isend, msg, self.rank_of_gpu[recv_gpu], group, node.id * 8 + PACKED)
                    )
                    self.sent += msg.numel()
                    self.messages.append((node.id, self.rank, self.rank_of_gpu[recv_gpu], msg.numel()))
                continue
            new = RankState.empty(node.model_stage, move.model, lay, t, p, move.policy, None, self._device())
            by_provider: dict[int, list[Piece]] = {}
            for pc in pieces:
                by_provider.setdefault(pc.provider, []).append(pc)
            for k, part in sorted(by_provider.items()):
                gpu, src_uid = offer[k]
                if gpu == self.gpu:  # resident: a local copy, nothing sent
                    src = self.holder.units[src_uid]
                    copy_local(part, src.buffers, new.buffers, kinds)
                    states.append(src.state)
                    continue
                size = HEADER + sum(pc.numel * new.buffers[kd].element_size() for pc in part for kd in kinds)
                buf = torch.empty(size, dtype=torch.uint8, device=self._device())
                ops.append(dist.P2POp(dist.irecv, buf, self.rank_of_gpu[gpu], group, node.id * 8 + PACKED))
                inbox.append((buf, part))
                self.received += size

        def finish() -> None:
            if whole_copy:
                assert new is not None
                new.state = LogicalState(*header.tolist())
                self.holder.units[roles.receivers[self.gpu][0]] = new
            elif new is not None:
                got = states + [unpack(buf, part, new.buffers, kinds) for buf, part in inbox]
                if node.model_stage in self.states:
                    got.append(self.states[node.model_stage])
                if len(set(got)) > 1:
                    raise TransitionError(
                        f"{node.describe()}: providers disagree on the logical state {set(got)}"
                    )
                new.state = got[0] if got else new.state
                self.holder.units[roles.receivers[self.gpu][0]] = new
            for uid in node.frees:  # what the node consumed (never one of its outputs)
                self.holder.units.pop(uid, None)

        return ops, finish

    def _send_whole(
        self, node: Node, src: RankState, dst: int, kinds: list[BufferKind], group: dist.ProcessGroup,
        ops: list[dist.P2POp],
    ) -> None:  # fmt: skip
        """Each buffer kind as one message (no packing), and the logical state."""
        ops.append(dist.P2POp(dist.isend, _state_tensor(src.state), dst, group, node.id * 8 + 7))
        for j, k in enumerate(kinds):
            buf = src.buffers[k]
            ops.append(dist.P2POp(dist.isend, buf, dst, group, node.id * 8 + j))
            self.sent += buf.numel() * buf.element_size()
            self.messages.append((node.id, self.rank, dst, buf.numel() * buf.element_size()))

    def _receive_whole(
        self, node: Node, move: StageMove, at: tuple[Layout, int, int], src: int, kinds: list[BufferKind],
        header: torch.Tensor, group: dist.ProcessGroup, ops: list[dist.P2POp],
    ) -> RankState:  # fmt: skip
        lay, t, p = at
        new = RankState.uninitialised(node.model_stage, move.model, lay, t, p, move.policy, self._device())
        ops.append(dist.P2POp(dist.irecv, header, src, group, node.id * 8 + 7))
        for j, k in enumerate(kinds):
            ops.append(dist.P2POp(dist.irecv, new.buffers[k], src, group, node.id * 8 + j))
            self.received += new.buffers[k].numel() * new.buffers[k].element_size()
        return new

    def _from_storage(self, node: Node) -> None:
        uid = node.outputs[0]
        if self.gpu not in self.units[uid].gpus:
            return
        if self.storage is None:
            raise TransitionError(f"{node.describe()}: no storage reader to restore {node.model_stage} from")
        lay, t, p = self._position(uid, self.gpu)
        self.holder.units[uid] = self.storage(node.model_stage, lay, t, p)

    def _device(self) -> torch.device:
        for rs in self.holder.units.values():
            return next(iter(rs.buffers.values())).device
        return torch.device("cpu")


@dataclass(frozen=True, slots=True)
class _Roles:
    """Receiver GPU → (new unit, layout, t, p); receiver GPU → providers [(GPU, unit)], preferred
    first; the providers' buffer policy when it differs from the receivers' (a restore)."""

    receivers: dict[int, tuple[str, Layout, int, int]]
    providers: dict[int, list[tuple[int, str]]]
    provider_policy: StatePolicy | None


def _position(layout: Layout, index: int) -> tuple[int, int]:
    return index % layout.tp, index // layout.tp


def _piece_view(buf: torch.Tensor, pc: Piece, slot: Slot) -> torch.Tensor:
    v = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return v.narrow(pc.dim, pc.lo - slot.region[pc.dim][0], pc.hi - pc.lo)


HEADER = 32  # the logical state (updates, version, minibatch, seed) as four int64
# message tags: node.id · 8 + j, j = buffer kind (0–3) of a whole copy, PACKED, or 7 for its state
PACKED = 6


def _state_tensor(state: LogicalState) -> torch.Tensor:
    return torch.tensor([state.updates, state.version, state.minibatch, state.seed], dtype=torch.int64)


def pack(
    pieces: Sequence[Piece], buffers: Mapping[BufferKind, torch.Tensor], kinds: Sequence[BufferKind],
    state: LogicalState,
) -> torch.Tensor:  # fmt: skip
    """The logical state, then every piece of every kind (widest dtype first, so each kind
    starts aligned) as bytes: one message, each piece copied once into it."""
    device = next(iter(buffers.values())).device
    total = HEADER + sum(pc.numel * buffers[k].element_size() for k in kinds for pc in pieces)
    msg = torch.empty(total, dtype=torch.uint8, device=device)
    msg[:HEADER].copy_(_state_tensor(state).view(torch.uint8))
    at = HEADER
    for k in kinds:
        buf = buffers[k]
        for pc in pieces:
            n = pc.numel * buf.element_size()
            src = _piece_view(buf, pc, pc.src)
            msg[at : at + n].view(buf.dtype).view(src.shape).copy_(src)
            at += n
    return msg


def copy_local(
    pieces: Sequence[Piece], src: Mapping[BufferKind, torch.Tensor], dst: Mapping[BufferKind, torch.Tensor],
    kinds: Sequence[BufferKind],
) -> None:  # fmt: skip
    """Pieces this rank already holds, straight from its old buffers into the new ones."""
    for k in kinds:
        for pc in pieces:
            _piece_view(dst[k], pc, pc.dst).copy_(_piece_view(src[k], pc, pc.src))


def unpack(
    msg: torch.Tensor, pieces: Sequence[Piece], buffers: Mapping[BufferKind, torch.Tensor],
    kinds: Sequence[BufferKind],
) -> LogicalState:  # fmt: skip
    """Write a message's pieces into ``buffers``; return the sender's logical state."""
    head = msg[:HEADER].clone().view(torch.int64).tolist()
    at = HEADER
    for k in kinds:
        buf = buffers[k]
        for pc in pieces:
            n = pc.numel * buf.element_size()
            view = _piece_view(buf, pc, pc.dst)
            view.copy_(msg[at : at + n].view(buf.dtype).view(view.shape))
            at += n
    if at != msg.numel():
        raise TransitionError(f"message of {msg.numel()} bytes, expected {at}")
    return LogicalState(*head)
