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

A wave runs in rounds, one per buffer kind (``StatePolicy.order``: master weights, the two Adam
moments, then the weights of a trainer): round j allocates kind j of every unit being built,
moves it, and then frees kind j of every unit a node consumes on this rank. A GPU that reshards a
trainer in place so holds its old rank plus one kind of the new one, not both ranks whole
(``StatePolicy.streamed``, what the ledger counts). A unit consumed part-way when a node fails is
dropped, never kept half-freed.

Zero-copy by default (``zero_copy=False`` keeps packed messages, one per kind, bit for bit the
same result): a provider sends the slices that are contiguous in its flat buffers as they are, and
the receiver receives straight into the slices of its new buffers that are contiguous there; the
rest passes through ``Staging``, one byte buffer per peer that later waves and transitions reuse.
A round whose staged messages would need more than ``staging_budget`` bytes with one peer runs in
batches (``wire.batches``), each reusing the same regions, so staging stays bounded (and counted
by the ledger) however large the model.

gloo on CPU, NCCL/RCCL on GPU, the same code. A transition's process group is created at the
start and destroyed at the end, with a short timeout: a peer that dies surfaces as an error
naming the node and the rank instead of a hang. A walk that runs every step (the weight sync) is
given a group its caller formed once per binding (``group``): no per-step connect, where a peer
dying mid-connect would hold the others for gloo's connect retries (minutes) instead of failing.
"""

from __future__ import annotations

import datetime
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nereus.devices import synchronize_device
from nereus.plan.layout import Layout
from nereus.state import recycle
from nereus.state.buffers import BufferKind, rank_buffers
from nereus.state.emu import LogicalState
from nereus.state.holder import TORCH_DTYPE, RankState, StateHolder, padding
from nereus.state.sources import STORAGE
from nereus.state.staging import Staging, pool
from nereus.transition.copying import copy_local, gather, pack, scatter, state_tensor, unpack
from nereus.transition.dag import Node, Primitive, TransitionDag
from nereus.transition.exchange import Chunk
from nereus.transition.move import StageMove
from nereus.transition.wire import (
    CHUNK,
    HEADER,
    PACKED,
    STAGING_BUDGET,
    STATE,
    Batches,
    Carry,
    Receive,
    Transfer,
    WirePlan,
    batches,
    kinds_of,
    rounds,
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


@dataclass(slots=True)
class _Part:
    """This rank's share of one node while its wave runs: the kinds it moves (a round each), what
    it sends and assembles, and the units the node consumes that this rank holds."""

    node: Node
    kinds: tuple[BufferKind, ...] = ()
    sends: tuple[Transfer, ...] = ()
    receive: Receive | None = None
    consumed: tuple[str, ...] = ()
    new: dict[BufferKind, torch.Tensor] = field(default_factory=dict)  # the new rank's, so far
    states: list[LogicalState] = field(default_factory=list)  # local providers' logical states
    headers: list[torch.Tensor] = field(default_factory=list)  # remote providers' (zero-copy, whole)
    staged: list[tuple[Chunk, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    inbox: list[tuple[torch.Tensor, Transfer, int]] = field(default_factory=list)  # packed: (msg, x, round)


def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new rank's buffer of one kind, uninitialised (every byte is then written): on the CPU
    from a block an earlier kind or unit freed (``recycle``)."""
    return recycle.take(numel, dtype, device)


def _let_go(rs: RankState | None) -> None:
    """A unit this rank no longer holds: its buffers' blocks to ``recycle`` (reused only once
    nothing else references them)."""
    if rs is not None:
        for buf in rs.buffers.values():
            recycle.offer(buf)


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
        staging_budget: int = STAGING_BUDGET,
        group: Any = None,
    ) -> None:
        if not dag.feasible:
            raise TransitionError(f"the transition is infeasible: {dag.reason}")
        self.dag, self.holder = dag, holder
        self.wire = WirePlan(dag, moves, zero_copy, staging_budget)
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
        self.group = group  # the caller's, kept after the walk (None: one of the walk's own)
        self.sent = self.received = 0
        self.messages: list[tuple[int, int, int, int]] = []  # (node, from rank, to rank, bytes) sent
        self.node_seconds: dict[int, float] = {}  # wall time of each node this rank took part in
        self.wave_seconds: list[float] = []  # wall time of each wave this rank took part in
        self._copies: list[Finish] = []  # a round's local copies, run while its messages travel
        self._partial: set[str] = set()  # units some of whose kinds a node has freed already

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
        holder then still holds every complete unit it had (nothing half-written is installed, and
        a unit a failed node had begun to free, kind by kind, is dropped)."""
        self._adopt()
        group = self.group
        if group is None:
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
            if self.group is None:
                dist.destroy_process_group(group)
        self.holder.by_stage()  # checks: one unit per model-stage again (ids stay the DAG's)
        return Report(done, self.sent, self.received, tuple(sorted(self.holder.units)))

    def _wave(
        self, mine: list[Node], group: dist.ProcessGroup, on_node: Callable[[Node, str], None] | None
    ) -> None:
        started = time.perf_counter()
        try:
            parts = []
            for node in mine:
                if on_node:
                    on_node(node, "start")
                parts.append(self._part(node))
            for j in range(rounds(self.wire, mine)):
                self._round(mine, parts, j, group)
            for part in parts:
                self._finish(part)
        except Exception as exc:  # a dead peer, a timeout, a bad buffer
            for uid in self._partial:  # begun to be freed: no longer a whole unit
                self.holder.units.pop(uid, None)
            self._partial.clear()
            what = "; ".join(f"{n.primitive.value} node {n.id} ({n.describe()})" for n in mine)
            peers = sorted({self.rank_of_gpu[g] for n in mine for g in (*n.gpus, *n.sends)} - {self.rank})
            raise TransitionError(f"rank {self.rank}: {what} with ranks {peers} failed: {exc}") from exc
        synchronize_device(self.holder.device)  # NCCL waits order the stream: time the work, not its launch
        elapsed = time.perf_counter() - started
        self.wave_seconds.append(elapsed)
        for node in mine:
            self.node_seconds[node.id] = elapsed
            if on_node:
                on_node(node, "done")

    def _part(self, node: Node) -> _Part:
        """This rank's share of ``node``; a restore from storage is read here, at once."""
        if node.primitive is Primitive.DESTROY:
            return _Part(node)
        if node.source == STORAGE:
            self._from_storage(node)
            return _Part(node)
        rp = self.wire.part(node, self.gpu)
        consumed = tuple(u for u in node.frees if u in self.holder.units)
        return _Part(node, kinds_of(self.moves[node.model_stage].policy), rp.sends, rp.receive, consumed)

    def _round(self, mine: list[Node], parts: list[_Part], j: int, group: dist.ProcessGroup) -> None:
        """Kind j of every node in the wave: its messages at once (they run concurrently, and with
        the copies of what this rank already holds, into disjoint regions of the new buffers),
        staged ones through the pool's regions, in batches that bound the staging
        (``wire.batches``: batch 0 carries every message that stages nothing); then kind j of the
        units the nodes consume here is freed (the last kind goes with them)."""
        cut = batches(self.wire, mine, self.gpu, j) if self.zero_copy else Batches({}, 1, {})
        self.staging.prepare({self.rank_of_gpu[g]: n for g, n in cut.need.items()})
        for b in range(cut.count):
            ops: list[dist.P2POp] = []
            self._copies.clear()
            for part in parts:
                if j < len(part.kinds):
                    for x in part.sends:
                        self._send(x, j, part.kinds[j], group, ops, cut, b)
                    if part.receive is not None:
                        self._receive(part, j, group, ops, cut, b)
            works = dist.batch_isend_irecv(ops) if ops else []
            for copy in self._copies:
                copy()
            for work in works:
                work.wait()
            works, ops = [], []  # the batch's messages held views of the buffers freed next
            self._copies.clear()
            for part in parts:
                for c, msg, buf in part.staged:  # out of staging before the next batch reuses it
                    scatter(c, msg, buf)
                part.staged.clear()
            self.staging.rewind()
        for part in parts:
            if j < len(part.kinds) - 1:
                self._free_kind(part, part.kinds[j])

    def _free_kind(self, part: _Part, kind: BufferKind) -> None:
        for uid in part.consumed:
            held = self.holder.units.get(uid)
            if held is not None and kind in held.buffers:
                recycle.offer(held.buffers.pop(kind))
                self._partial.add(uid)

    def _finish(self, part: _Part) -> None:
        node = part.node
        if node.primitive is Primitive.DESTROY:
            _let_go(self.holder.units.pop(node.inputs[0], None))
            return
        if part.receive is not None:
            self.holder.units[part.receive.unit] = self._assembled(part)
        for uid in node.frees:  # what the node consumed (never one of its outputs)
            _let_go(self.holder.units.pop(uid, None))
            self._partial.discard(uid)

    # -------------------------------------------------------------- sending
    def _send(
        self, x: Transfer, j: int, kind: BufferKind, group: dist.ProcessGroup, ops: list[dist.P2POp],
        cut: Batches, b: int,
    ) -> None:  # fmt: skip
        """Kind ``kind`` (round j) of what ``x`` carries in batch ``b``, into ``ops``; the logical
        state in round 0."""
        src, dst = self.holder.units[x.src_unit], self.rank_of_gpu[x.dst]
        buf = src.buffers[kind]
        if b and x.carry is not Carry.PACKED:
            return
        header = b == 0 and j == 0 and (x.carry is Carry.WHOLE or self.zero_copy)  # packed: inside
        tensors = [state_tensor(src.state, src.device)] if header else []
        if header:
            ops.append(dist.P2POp(dist.isend, tensors[0], dst, group, tag(x.node, STATE)))
        if x.carry is Carry.WHOLE:  # the flat buffer as it is
            ops.append(dist.P2POp(dist.isend, buf, dst, group, tag(x.node, j)))
            tensors.append(buf)
        elif self.zero_copy:  # each chunk in place or through staging
            first = CHUNK + j * len(x.chunks)
            for i, c in cut.chunks(x, b):
                if c.src is not None:
                    msg = buf[c.src : c.src + c.numel]
                else:
                    msg = self.staging.take(dst, c.numel, buf.dtype)
                    gather(c, buf, msg)
                ops.append(dist.P2POp(dist.isend, msg, dst, group, tag(x.node, first + i)))
                tensors.append(msg)
        elif b == 0:  # this kind's pieces packed (after the logical state, in round 0)
            tensors = [pack(x.pieces, src.buffers, (kind,), src.state if j == 0 else None)]
            ops.append(dist.P2POp(dist.isend, tensors[0], dst, group, tag(x.node, PACKED + j)))
        for t in tensors:
            self.sent += t.numel() * t.element_size()
            self.messages.append((x.node, self.rank, dst, t.numel() * t.element_size()))

    # -------------------------------------------------------------- receiving
    def _receive(
        self, part: _Part, j: int, group: dist.ProcessGroup, ops: list[dist.P2POp], cut: Batches, b: int
    ) -> None:
        """Allocate kind j of this rank's new unit and post its receives and local copies (batch
        0), or its staged chunk messages of batch ``b``."""
        node, r = part.node, part.receive
        assert r is not None
        kind, device = part.kinds[j], self._device()
        if b:
            for x in r.transfers:
                if x.carry is Carry.PACKED:
                    self._chunks(part, x, j, part.new[kind], group, ops, cut, b)
            return
        move = self.moves[node.model_stage]
        rb = rank_buffers(move.model, r.layout, r.t, r.p, move.policy)
        dtype = TORCH_DTYPE[dict(move.policy.kinds)[kind]]
        whole = r.whole
        if whole is not None:  # a rank-aligned copy: the flat buffer as it is
            buf = part.new[kind] = allocate(rb.numel, dtype, device)
            src = self.rank_of_gpu[whole.src]
            if j == 0:
                part.headers.append(torch.zeros(4, dtype=torch.int64, device=device))
                ops.append(dist.P2POp(dist.irecv, part.headers[0], src, group, tag(node.id, STATE)))
            ops.append(dist.P2POp(dist.irecv, buf, src, group, tag(node.id, j)))
            self.received += buf.numel() * buf.element_size()
            return
        if self.zero_copy:  # every slot is written below: only the padding needs zeros
            buf = part.new[kind] = allocate(rb.numel, dtype, device)
            for lo, hi in padding(rb):
                buf[lo:hi].zero_()
        else:
            buf = part.new[kind] = torch.zeros(rb.numel, dtype=dtype, device=device)
        for x in r.transfers:
            if x.carry is Carry.LOCAL:  # resident: a local copy once the messages are posted
                held = self.holder.units[x.src_unit]
                self._copies.append(functools.partial(copy_local, x.pieces, held.buffers, part.new, (kind,)))
                if j == 0:
                    part.states.append(held.state)
                continue
            peer = self.rank_of_gpu[x.src]
            if self.zero_copy:  # the state, then each chunk in place or into staging
                if j == 0:
                    part.headers.append(torch.empty(4, dtype=torch.int64, device=device))
                    ops.append(dist.P2POp(dist.irecv, part.headers[-1], peer, group, tag(node.id, STATE)))
                    self.received += HEADER
                self._chunks(part, x, j, buf, group, ops, cut, 0)
                continue
            size = (HEADER if j == 0 else 0) + sum(pc.numel for pc in x.pieces) * buf.element_size()
            packed = torch.empty(size, dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, packed, peer, group, tag(node.id, PACKED + j)))
            part.inbox.append((packed, x, j))
            self.received += size

    def _chunks(
        self, part: _Part, x: Transfer, j: int, buf: torch.Tensor, group: dist.ProcessGroup,
        ops: list[dist.P2POp], cut: Batches, b: int,
    ) -> None:  # fmt: skip
        """Receives of ``x``'s chunk messages of kind j in batch ``b``: in place, or into staging."""
        peer, first = self.rank_of_gpu[x.src], CHUNK + j * len(x.chunks)
        for i, c in cut.chunks(x, b):
            if c.dst is not None:
                msg = buf[c.dst : c.dst + c.numel]
            else:
                msg = self.staging.take(peer, c.numel, buf.dtype)
                part.staged.append((c, msg, buf))
            ops.append(dist.P2POp(dist.irecv, msg, peer, group, tag(part.node.id, first + i)))
            self.received += msg.numel() * msg.element_size()

    def _assembled(self, part: _Part) -> RankState:
        """The new unit's rank once every round arrived; its providers must agree on its state."""
        node, r = part.node, part.receive
        assert r is not None
        move = self.moves[node.model_stage]
        got = list(part.states)
        for buf, x, j in part.inbox:
            state = unpack(buf, x.pieces, part.new, (part.kinds[j],), header=j == 0)
            if state is not None:
                got.append(state)
        got += [LogicalState(*h.tolist()) for h in part.headers]
        if r.whole is None and node.model_stage in self.states:
            got.append(self.states[node.model_stage])
        if len(set(got)) > 1:
            raise TransitionError(f"{node.describe()}: providers disagree on the logical state {set(got)}")
        new = RankState(node.model_stage, move.model, r.layout, r.t, r.p, move.policy, part.new)
        if got:
            new.state = got[0]
        return new

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
