"""Run a transition DAG on torch.distributed: the edge where planned moves become bytes.

What moves is decided in ``wire.py`` (pure); this module only communicates. Every rank walks the
same DAG in the same waves (nodes grouped by depth, so a wave depends only on earlier ones) and
takes part in the nodes that touch its GPU: it posts the sends and receives its ``RankPart``
names — a wave's messages, across all its nodes, go out together (``batch_isend_irecv``), so the
rank pairs of an Extend, the members of a Split group and every ready primitive run concurrently
— copies what it already holds while those messages travel, installs the units it assembled and
frees what the node consumed.
A Destroy drops its unit; a restore from storage reads the rank through ``storage``. Ranks walk
the waves in one order and a wave only waits on its own participants, so the walk cannot
deadlock; memory follows the DAG's ledger, which holds for every execution that respects its edges.

Zero-copy by default (``zero_copy=False`` keeps the older packed messages, bit for bit the same
result): a provider sends the slices that are contiguous in its flat buffers as they are, and the
receiver receives straight into the slices of its new buffers that are contiguous there; the rest
passes through ``Staging``, one byte buffer per peer that later waves and transitions reuse.

gloo on CPU, NCCL/RCCL on GPU, the same code. The transition's process group is created at the
start and destroyed at the end, with a short timeout: a peer that dies surfaces as an error
naming the node and the rank instead of a hang.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.plan.layout import Layout
from nereus.state.buffers import BufferKind, Slot
from nereus.state.emu import LogicalState
from nereus.state.holder import RankState, StateHolder
from nereus.state.sources import STORAGE
from nereus.state.staging import Staging, pool
from nereus.transition.dag import Node, Primitive, TransitionDag
from nereus.transition.exchange import Chunk, Piece
from nereus.transition.move import StageMove
from nereus.transition.wire import (
    CHUNK,
    HEADER,
    PACKED,
    STATE,
    Carry,
    Receive,
    Transfer,
    WirePlan,
    kinds_of,
    staging_need,
    tag,
    takes_part,
    waves,
)

Storage = Callable[[str, Layout, int, int], RankState]  # a frozen model's rank from shared storage
Finish = Callable[[], None]


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
        zero_copy: bool = True,
        staging: Staging | None = None,
    ) -> None:
        if not dag.feasible:
            raise TransitionError(f"the transition is infeasible: {dag.reason}")
        self.dag, self.holder = dag, holder
        self.wire = WirePlan(dag, moves, zero_copy)
        self.zero_copy = zero_copy
        # where pieces that are not contiguous on this side pass: reused across transitions
        self.staging = staging if staging is not None else pool(holder.device)
        self.moves = self.wire.moves
        self.rank = holder.rank
        self.gpu_of_rank = dict(gpu_of_rank)
        self.rank_of_gpu = {g: r for r, g in self.gpu_of_rank.items()}
        self.gpu = self.gpu_of_rank[self.rank]
        self.states = dict(states or {})
        self.storage = storage
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.sent = self.received = 0
        self.messages: list[tuple[int, int, int, int]] = []  # (node, from rank, to rank, bytes) sent
        self.node_seconds: dict[int, float] = {}  # wall time of each node this rank took part in
        self.wave_seconds: list[float] = []  # wall time of each wave this rank took part in
        self._copies: list[Finish] = []  # a wave's local copies, run while its messages travel

    # -------------------------------------------------------------- bookkeeping
    def _adopt(self) -> None:
        """Name this rank's units as the DAG does (``<model-stage>/u<i>``); units of model-stages
        the transition does not move (a weight sync moves only its receivers) stay as they are."""
        named: dict[str, RankState] = {}
        for name, rs in self.holder.by_stage().items():
            m = self.moves.get(name)
            if m is None:
                named[name] = rs
                continue
            for u in m.current:
                if self.gpu in u.gpus:
                    t, p = u.position(self.gpu)
                    if (rs.layout, rs.t, rs.p) != (m.current_layout, t, p):
                        raise TransitionError(
                            f"rank {self.rank}: holds {name} {rs.layout} (t={rs.t}, p={rs.p}), "
                            f"the plan says {m.current_layout} (t={t}, p={p})"
                        )
                    named[u.id] = rs  # a unit broken by a lost GPU is dropped: its peers are gone
        self.holder.units = named  # only once every unit checked out: bad input changes nothing

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
            for wave in waves(self.dag, order):
                mine = [self.dag.nodes[i] for i in wave if takes_part(self.dag.nodes[i], self.gpu)]
                if mine:
                    self._wave(mine, group, on_node)
                    done += len(mine)
        finally:
            dist.destroy_process_group(group)
        self.holder.by_stage()  # checks: one unit per model-stage again (ids stay the DAG's)
        return Report(done, self.sent, self.received, tuple(sorted(self.holder.units)))

    def _wave(
        self, mine: list[Node], group: dist.ProcessGroup, on_node: Callable[[Node, str], None] | None
    ) -> None:
        started = time.perf_counter()
        try:
            ops: list[dist.P2POp] = []
            finishes = []
            self._copies.clear()
            if self.zero_copy:
                self.staging.prepare(self._staging_need(mine))
            for node in mine:
                if on_node:
                    on_node(node, "start")
                finishes.append(self._node(node, group, ops))
            # every ready node's messages at once: they run concurrently, and with the copies of
            # what this rank already holds (disjoint regions of the new buffers)
            works = dist.batch_isend_irecv(ops) if ops else []
            for copy in self._copies:
                copy()
            for work in works:
                work.wait()
            for finish in finishes:
                finish()
        except Exception as exc:  # a dead peer, a timeout, a bad buffer
            what = "; ".join(f"{n.primitive.value} node {n.id} ({n.describe()})" for n in mine)
            peers = sorted({self.rank_of_gpu[g] for n in mine for g in (*n.gpus, *n.sends)} - {self.rank})
            raise TransitionError(f"rank {self.rank}: {what} with ranks {peers} failed: {exc}") from exc
        elapsed = time.perf_counter() - started
        self.wave_seconds.append(elapsed)
        for node in mine:
            self.node_seconds[node.id] = elapsed
            if on_node:
                on_node(node, "done")

    def _node(self, node: Node, group: dist.ProcessGroup, ops: list[dist.P2POp]) -> Finish:
        """Post this rank's messages of ``node`` into ``ops``; what to do once they arrived."""
        if node.primitive is Primitive.DESTROY:

            def drop() -> None:
                self.holder.units.pop(node.inputs[0], None)

            return drop
        if node.source == STORAGE:
            self._from_storage(node)
            return lambda: None
        part = self.wire.part(node, self.gpu)
        for x in part.sends:
            self._send(x, group, ops)
        landed = self._receive(node, part.receive, group, ops) if part.receive else None

        def finish() -> None:
            if landed is not None:
                assert part.receive is not None
                self.holder.units[part.receive.unit] = landed()
            for uid in node.frees:  # what the node consumed (never one of its outputs)
                self.holder.units.pop(uid, None)

        return finish

    # -------------------------------------------------------------- sending
    def _staging_need(self, mine: list[Node]) -> dict[int, int]:
        """Staging bytes this rank's zero-copy messages of a wave need, per peer rank (what
        ``wire.staging_bytes`` counts for the ledger)."""
        need = staging_need(self.wire, mine, self.gpu)
        return {self.rank_of_gpu[g]: n for g, n in need.items()}

    def _send(self, x: Transfer, group: dist.ProcessGroup, ops: list[dist.P2POp]) -> None:
        src, dst = self.holder.units[x.src_unit], self.rank_of_gpu[x.dst]
        kinds = kinds_of(self.moves[self.dag.nodes[x.node].model_stage].policy)
        if x.carry is Carry.WHOLE:  # each buffer kind as one message, as it is, and the state
            ops.append(
                dist.P2POp(dist.isend, state_tensor(src.state, src.device), dst, group, tag(x.node, STATE))
            )
            tensors = [src.buffers[k] for k in kinds]
            for j, buf in enumerate(tensors):
                ops.append(dist.P2POp(dist.isend, buf, dst, group, tag(x.node, j)))
        elif self.zero_copy:  # the state, then each chunk in place or through staging
            tensors = [state_tensor(src.state, src.device)]
            ops.append(dist.P2POp(dist.isend, tensors[0], dst, group, tag(x.node, STATE)))
            i = CHUNK
            for k in kinds:
                buf = src.buffers[k]
                for c in x.chunks:
                    if c.src is not None:
                        msg = buf[c.src : c.src + c.numel]
                    else:
                        msg = self.staging.take(dst, c.numel, buf.dtype)
                        gather(c, buf, msg)
                    ops.append(dist.P2POp(dist.isend, msg, dst, group, tag(x.node, i)))
                    tensors.append(msg)
                    i += 1
        else:
            tensors = [pack(x.pieces, src.buffers, kinds, src.state)]
            ops.append(dist.P2POp(dist.isend, tensors[0], dst, group, tag(x.node, PACKED)))
        for buf in tensors:
            self.sent += buf.numel() * buf.element_size()
            self.messages.append((x.node, self.rank, dst, buf.numel() * buf.element_size()))

    # -------------------------------------------------------------- receiving
    def _receive(
        self, node: Node, r: Receive, group: dist.ProcessGroup, ops: list[dist.P2POp]
    ) -> Callable[[], RankState]:
        """Post the receives of this rank's new unit; returns what builds it once they arrived."""
        move = self.moves[node.model_stage]
        kinds, device = kinds_of(move.policy), self._device()
        whole = r.whole
        if whole is not None:  # a rank-aligned copy: the flat buffers as they are
            new = RankState.uninitialised(
                node.model_stage, move.model, r.layout, r.t, r.p, move.policy, device
            )
            header = torch.zeros(4, dtype=torch.int64, device=device)
            src = self.rank_of_gpu[whole.src]
            ops.append(dist.P2POp(dist.irecv, header, src, group, tag(node.id, STATE)))
            for j, k in enumerate(kinds):
                ops.append(dist.P2POp(dist.irecv, new.buffers[k], src, group, tag(node.id, j)))
                self.received += new.buffers[k].numel() * new.buffers[k].element_size()

            def copied() -> RankState:
                new.state = LogicalState(*header.tolist())
                return new

            return copied
        if self.zero_copy:  # every slot is written below: only the padding needs zeros
            new = RankState.uninitialised(
                node.model_stage, move.model, r.layout, r.t, r.p, move.policy, device
            )
            new.zero_padding()
        else:
            new = RankState.empty(node.model_stage, move.model, r.layout, r.t, r.p, move.policy, None, device)
        states: list[LogicalState] = []
        inbox: list[tuple[torch.Tensor, Transfer]] = []
        headers: list[torch.Tensor] = []
        staged: list[tuple[Chunk, torch.Tensor, torch.Tensor]] = []  # (chunk, region, buffer)
        for x in r.transfers:
            if x.carry is Carry.LOCAL:  # resident: a local copy once the messages are posted
                held = self.holder.units[x.src_unit]
                self._copies.append(functools.partial(copy_local, x.pieces, held.buffers, new.buffers, kinds))
                states.append(held.state)
                continue
            peer = self.rank_of_gpu[x.src]
            if self.zero_copy:  # the state, then each chunk in place or into staging
                headers.append(torch.empty(4, dtype=torch.int64, device=device))
                ops.append(dist.P2POp(dist.irecv, headers[-1], peer, group, tag(node.id, STATE)))
                self.received += HEADER
                i = CHUNK
                for k in kinds:
                    buf = new.buffers[k]
                    for c in x.chunks:
                        if c.dst is not None:
                            msg = buf[c.dst : c.dst + c.numel]
                        else:
                            msg = self.staging.take(peer, c.numel, buf.dtype)
                            staged.append((c, msg, buf))
                        ops.append(dist.P2POp(dist.irecv, msg, peer, group, tag(node.id, i)))
                        self.received += msg.numel() * msg.element_size()
                        i += 1
                continue
            size = HEADER + sum(pc.numel * new.buffers[k].element_size() for pc in x.pieces for k in kinds)
            packed = torch.empty(size, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, packed, peer, group, tag(node.id, PACKED)))
            inbox.append((packed, x))
            self.received += size

        def assembled() -> RankState:
            for c, msg, buf in staged:
                scatter(c, msg, buf)
            got = states + [unpack(buf, x.pieces, new.buffers, kinds) for buf, x in inbox]
            got += [LogicalState(*h.tolist()) for h in headers]
            if node.model_stage in self.states:
                got.append(self.states[node.model_stage])
            if len(set(got)) > 1:
                raise TransitionError(
                    f"{node.describe()}: providers disagree on the logical state {set(got)}"
                )
            new.state = got[0] if got else new.state
            return new

        return assembled

    def _from_storage(self, node: Node) -> None:
        uid = node.outputs[0]
        unit = self.wire.units[uid]
        if self.gpu not in unit.gpus:
            return
        if self.storage is None:
            raise TransitionError(f"{node.describe()}: no storage reader to restore {node.model_stage} from")
        t, p = unit.position(self.gpu)
        self.holder.units[uid] = self.storage(node.model_stage, unit.layout, t, p)

    def _device(self) -> torch.device:
        return self.holder.device


# ------------------------------------------------------------------ bytes in and out of messages
def _piece_view(buf: torch.Tensor, pc: Piece, slot: Slot) -> torch.Tensor:
    v = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return v.narrow(pc.dim, pc.lo - slot.region[pc.dim][0], pc.hi - pc.lo)


def state_tensor(state: LogicalState, device: torch.device | None = None) -> torch.Tensor:
    values = [state.updates, state.version, state.minibatch, state.seed]
    return torch.tensor(values, dtype=torch.int64, device=device)


def pack(
    pieces: Sequence[Piece], buffers: Mapping[BufferKind, torch.Tensor], kinds: Sequence[BufferKind],
    state: LogicalState,
) -> torch.Tensor:  # fmt: skip
    """The logical state, then every piece of every kind (widest dtype first, so each kind
    starts aligned) as bytes: one message, each piece copied once into it."""
    device = next(iter(buffers.values())).device
    total = HEADER + sum(pc.numel * buffers[k].element_size() for k in kinds for pc in pieces)
    msg = torch.empty(total, dtype=torch.uint8, device=device)
    msg[:HEADER].copy_(state_tensor(state).view(torch.uint8))
    at = HEADER
    for k in kinds:
        buf = buffers[k]
        for pc in pieces:
            n = pc.numel * buf.element_size()
            src = _piece_view(buf, pc, pc.src)
            msg[at : at + n].view(buf.dtype).view(src.shape).copy_(src)
            at += n
    return msg


def gather(c: Chunk, buf: torch.Tensor, msg: torch.Tensor) -> None:
    """Copy a staged chunk's pieces of ``buf`` one after another into ``msg`` (the sender's side)."""
    at = 0
    for pc in c.pieces:
        src = _piece_view(buf, pc, pc.src)
        msg[at : at + pc.numel].view(src.shape).copy_(src)
        at += pc.numel


def scatter(c: Chunk, msg: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a staged chunk out of ``msg`` into its pieces of ``buf`` (the receiver's side)."""
    at = 0
    for pc in c.pieces:
        dst = _piece_view(buf, pc, pc.dst)
        dst.copy_(msg[at : at + pc.numel].view(dst.shape))
        at += pc.numel


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
