"""What a transition moves: every send, receive and local copy of every node, per GPU (pure).

``execute.py`` only communicates; this module decides what it communicates (picotron's split of
``tensor_parallel.py`` from ``tp_communications.py``). For each node, every GPU that gains a new
unit's rank (a *receiver*) assembles it from *providers*: the node's input units (a Split's old
unit, a Merge's slots: the receiver itself first, then the others in unit order), the rank at the
same position of the source (an Extend: rank-aligned), or every unit of the weight-sync trainer
(a restore). ``exchange.plan_pieces`` cuts what each provider contributes; a provider that is the
receiver copies locally, any other sends one message:

- **whole**: a rank-aligned copy of a rank with the same layout, position and buffers sends its
  flat buffers as they are (one message per buffer kind, widest first) and its logical state;
- **packed**: otherwise, zero-copy (the default): a 32-byte header with the logical state, then
  one message per ``exchange.Chunk`` per buffer kind — each side reads or writes the slices that
  are contiguous in its flat buffers in place, and stages only the others; or, with
  ``zero_copy=False``, one message per buffer kind: every piece of that kind (the first kind's
  after the header).

The executor moves one buffer kind at a time (a round per kind, in ``kinds_of`` order), so a
node's messages of kind j go out together with the rest of round j — staged chunks in
``batches`` that keep each GPU's staging with a peer within the transition's budget
(``STAGING_BUDGET`` unless ``between.with_staging`` chose a smaller one).
Tags are ``node.id · TAGS_PER_NODE + j``: j = buffer kind index (whole), ``PACKED`` + kind index,
``STATE``, or ``CHUNK`` + the message's index within its transfer; a node has one transfer
between a pair of GPUs, so tags are unique within a wave. ``RankPart`` is one GPU's share of a
node — what it sends, what it receives, what it copies — and is all the executor needs; ``waves``
groups nodes that may run at once. Sizes are computed from each side's own dtypes, so a test can
check that every receive has exactly one matching send of its size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

from nereus.plan.layout import Layout
from nereus.state.buffers import BufferKind, StatePolicy, rank_buffers, staged
from nereus.state.emu import Emu
from nereus.state.sources import STORAGE
from nereus.transition.dag import Node, Primitive, TransitionDag
from nereus.transition.exchange import Chunk, Piece, assembly
from nereus.transition.move import StageMove

HEADER = 32  # the logical state (updates, version, minibatch, seed) as four int64
TAGS_PER_NODE = 1 << 15  # gloo tags are int32: room for 65536 nodes
STATE = 7  # tag slot of the logical state (a whole copy's, a zero-copy transfer's header)
PACKED = 8  # tag slot of a packed message of the first kind (PACKED + j: of kind j)
CHUNK = PACKED + len(BufferKind)  # tag slot of a zero-copy transfer's first chunk message
# Staging bytes a GPU holds for one peer in one batch of a round: a round whose staged chunks
# exceed it runs in several batches, so a reshard of a large model stages a bounded amount
# (a single chunk larger than this has a batch of its own). The default; where its staging does
# not fit a GPU, ``between.with_staging`` gives the transition a smaller one.
STAGING_BUDGET = 256 << 20


class Carry(StrEnum):
    WHOLE = "whole"  # the flat buffers as they are, plus the logical state
    PACKED = "packed"  # a header with the logical state, then the pieces
    LOCAL = "local"  # the receiver holds the provider: a copy, nothing sent


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point message as one side posts it."""

    node: int
    src: int  # GPU
    dst: int  # GPU
    tag: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """What one provider contributes to one receiver in one node."""

    node: int
    src: int  # the provider's GPU
    dst: int  # the receiver's GPU
    src_unit: str
    carry: Carry
    pieces: tuple[Piece, ...]  # PACKED and LOCAL: what is copied, in order; WHOLE: everything
    chunks: tuple[Chunk, ...] = ()  # PACKED: the pieces as zero-copy messages (one per kind each)


@dataclass(frozen=True, slots=True)
class Receive:
    """What one GPU assembles in a node: rank (t, p) of ``layout`` of the new unit ``unit``."""

    unit: str
    layout: Layout
    t: int
    p: int
    transfers: tuple[Transfer, ...]

    @property
    def whole(self) -> Transfer | None:
        """The rank-aligned copy that delivers the whole rank, if that is how it arrives."""
        return self.transfers[0] if self.transfers and self.transfers[0].carry is Carry.WHOLE else None


@dataclass(frozen=True, slots=True)
class RankPart:
    """One GPU's share of a node."""

    sends: tuple[Transfer, ...]
    receive: Receive | None


def kinds_of(policy: StatePolicy) -> tuple[BufferKind, ...]:
    """Buffer kinds in message order (``StatePolicy.order``): one round of a wave each."""
    return policy.order


def unit_table(dag: TransitionDag, moves: Sequence[StageMove]) -> dict[str, Emu]:
    """Every unit the walk can meet: the DAG's, and current units no node touches."""
    units = dict(dag.units)
    for m in moves:
        for u in m.current:
            units.setdefault(u.id, u)
    return units


class WirePlan:
    """The messages of a whole transition, node by node (computed once per node, on demand)."""

    def __init__(
        self, dag: TransitionDag, moves: Sequence[StageMove], zero_copy: bool = True,
        budget: int = STAGING_BUDGET,
    ) -> None:  # fmt: skip
        if budget < 1:
            raise ValueError(f"staging budget: {budget} bytes; it must be at least 1")
        self.dag = dag
        self.zero_copy = zero_copy
        self.budget = budget  # staging bytes per peer per batch (``batches``)
        self.moves = {m.name: m for m in moves}
        self.units = unit_table(dag, moves)
        self._receives: dict[int, dict[int, Receive]] = {}

    # ------------------------------------------------------------------ per GPU
    def part(self, node: Node, gpu: int) -> RankPart:
        """What ``gpu`` sends and receives in ``node`` (local copies are in its receive)."""
        receives = self.receives(node)
        sends = tuple(
            x
            for dst in sorted(receives)
            for x in receives[dst].transfers
            if x.src == gpu and x.carry is not Carry.LOCAL
        )
        return RankPart(sends, receives.get(gpu))

    def policies(self, node: Node) -> tuple[StatePolicy, StatePolicy]:
        """(receivers' policy, providers' policy): they differ for a restore from the trainer."""
        move = self.moves[node.model_stage]
        provider = self.moves[node.source].policy if node.source and node.source != STORAGE else move.policy
        return move.policy, provider

    def sent(self, x: Transfer) -> tuple[Message, ...]:
        """The messages the provider posts for ``x``, sized by its own buffers."""
        return self._messages(x, self.policies(self._node(x))[1])

    def expected(self, x: Transfer) -> tuple[Message, ...]:
        """The messages the receiver posts for ``x``, sized by the buffers it builds."""
        return self._messages(x, self.policies(self._node(x))[0])

    # ------------------------------------------------------------------ per node
    def receives(self, node: Node) -> dict[int, Receive]:
        """Receiving GPU → its assembly (empty for a Destroy and a restore from storage)."""
        if node.id not in self._receives:
            self._receives[node.id] = self._plan(node)
        return self._receives[node.id]

    def _plan(self, node: Node) -> dict[int, Receive]:
        if node.primitive is Primitive.DESTROY or node.source == STORAGE:
            return {}
        receiver, provider = self.policies(node)
        move = self.moves[node.model_stage]
        restore = bool(node.source)
        out: dict[int, Receive] = {}
        for uid in node.outputs:
            unit = self.units[uid]
            for gpu, t, p in unit.ranks():
                offer = self._providers(node, unit, gpu)
                at = tuple((self.units[u].layout, *self.units[u].position(g)) for g, u in offer)
                if len(offer) == 1 and at[0] == (unit.layout, t, p) and not restore and offer[0][0] != gpu:
                    whole = Transfer(node.id, offer[0][0], gpu, offer[0][1], Carry.WHOLE, ())
                    out[gpu] = Receive(uid, unit.layout, t, p, (whole,))
                    continue
                parts = assembly(move.model, receiver, (unit.layout, t, p), at, provider if restore else None)
                transfers = tuple(
                    Transfer(
                        node.id,
                        offer[k][0],
                        gpu,
                        offer[k][1],
                        Carry.LOCAL if offer[k][0] == gpu else Carry.PACKED,
                        part,
                        () if offer[k][0] == gpu else cut,
                    )
                    for k, part, cut in parts
                )
                out[gpu] = Receive(uid, unit.layout, t, p, transfers)
        return out

    def _providers(self, node: Node, unit: Emu, gpu: int) -> list[tuple[int, str]]:
        """(GPU, unit id) that may provide ``gpu``'s rank of ``unit``, preferred first."""
        if node.source:  # a restore from the weight-sync trainer: any of its units
            src = self.moves[node.source]
            offer = [(g, u.id) for u in src.current for g in u.gpus]
        elif node.primitive is Primitive.EXTEND:  # rank-aligned: the same position of the source
            src_unit = self.units[node.inputs[0]]
            return [(src_unit.gpus[unit.gpus.index(gpu)], src_unit.id)]
        else:  # the receiver itself first, then the others in unit order
            offer = [(g, uid) for uid in node.inputs for g in self.units[uid].gpus]
        return sorted(offer, key=lambda x: (x[0] != gpu, x[0]))

    def _node(self, x: Transfer) -> Node:
        return self.dag.nodes[x.node]

    def _messages(self, x: Transfer, policy: StatePolicy) -> tuple[Message, ...]:
        if x.carry is Carry.LOCAL:
            return ()
        width = dict(policy.kinds)
        receiver = self.moves[self._node(x).model_stage].policy
        kinds = kinds_of(receiver)
        if x.carry is Carry.PACKED and self.zero_copy:
            sizes = [c.numel * width[k].itemsize for k in kinds for c in x.chunks]
            if len(sizes) > TAGS_PER_NODE - CHUNK:
                raise ValueError(f"node {x.node}: {len(sizes)} messages from GPU {x.src} to {x.dst}")
            return (
                Message(x.node, x.src, x.dst, tag(x.node, STATE), HEADER),
                *(Message(x.node, x.src, x.dst, tag(x.node, CHUNK + i), n) for i, n in enumerate(sizes)),
            )
        if x.carry is Carry.PACKED:
            numel = sum(pc.numel for pc in x.pieces)
            return tuple(
                Message(
                    x.node,
                    x.src,
                    x.dst,
                    tag(x.node, PACKED + j),
                    (0 if j else HEADER) + numel * width[k].itemsize,
                )
                for j, k in enumerate(kinds)
            )
        u = self.units[x.src_unit]
        t, p = u.position(x.src)
        numel = rank_buffers(self.moves[u.model_stage].model, u.layout, t, p, policy).numel
        return (
            Message(x.node, x.src, x.dst, tag(x.node, STATE), HEADER),
            *(
                Message(x.node, x.src, x.dst, tag(x.node, j), numel * width[k].itemsize)
                for j, k in enumerate(kinds)
            ),
        )


def tag(node: int, slot: int) -> int:
    return node * TAGS_PER_NODE + slot


@dataclass(frozen=True, slots=True)
class Batches:
    """One GPU's round j of a wave cut into batches that bound its staging: ``of[(node, src,
    dst, chunk)]`` is the batch a staged chunk message goes out in (every other message goes in
    batch 0), ``count`` how many batches the GPU runs, ``need[peer]`` the staging bytes it holds
    for a peer GPU (its largest batch with that peer)."""

    of: dict[tuple[int, int, int, int], int]
    count: int
    need: dict[int, int]

    def chunks(self, x: Transfer, b: int) -> Iterator[tuple[int, Chunk]]:
        """``x``'s chunk messages (index in the transfer, chunk) that go out in batch ``b``."""
        for i, c in enumerate(x.chunks):
            if self.of.get((x.node, x.src, x.dst, i), 0) == b:
                yield i, c


def batches(wire: WirePlan, nodes: Sequence[Node], gpu: int, j: int) -> Batches:
    """Cut ``gpu``'s zero-copy messages of round ``j`` in ``nodes`` (one wave, the nodes it takes
    part in) into batches: per peer, the staged chunks the two exchange (either way, in node order,
    then by sender, then in chunk order) go in batch after batch, a new batch starting when either
    side's staging with the other would pass ``wire.budget`` (a chunk larger than the budget has
    a batch of its own). Both GPUs of a pair see the same chunks in the same order, so they agree
    on every chunk's batch, and a GPU that waits on batch b only waits on peers posting batch b."""
    pairs: dict[int, list[tuple[int, Transfer, StatePolicy, StatePolicy, BufferKind]]] = {}
    for at, node in enumerate(nodes):
        if node.primitive is Primitive.DESTROY or node.source == STORAGE:
            continue
        receiver, provider = wire.policies(node)
        kinds = kinds_of(receiver)
        if j >= len(kinds):
            continue
        part = wire.part(node, gpu)
        xs = [*part.sends, *(part.receive.transfers if part.receive else ())]
        for x in xs:
            if x.carry is Carry.PACKED:
                peer = x.dst if x.src == gpu else x.src
                pairs.setdefault(peer, []).append((at, x, provider, receiver, kinds[j]))
    of: dict[tuple[int, int, int, int], int] = {}
    need: dict[int, int] = {}
    count = 1
    for peer, flow in pairs.items():
        flow.sort(key=lambda e: (e[0], e[1].src, e[1].dst))
        b = mine = theirs = 0
        for _, x, provider, receiver, kind in flow:
            send_w, recv_w = dict(provider.kinds)[kind].itemsize, dict(receiver.kinds)[kind].itemsize
            for i, c in enumerate(x.chunks):
                on_src = staged(c.numel * send_w) if c.src is None else 0
                on_dst = staged(c.numel * recv_w) if c.dst is None else 0
                here, there = (on_src, on_dst) if x.src == gpu else (on_dst, on_src)
                if not (here or there):
                    continue
                if (mine or theirs) and (mine + here > wire.budget or theirs + there > wire.budget):
                    b, mine, theirs = b + 1, 0, 0
                mine, theirs = mine + here, theirs + there
                of[(x.node, x.src, x.dst, i)] = b
                if mine:
                    need[peer] = max(need.get(peer, 0), mine)
        count = max(count, b + 1)
    return Batches(of, count, need)


def rounds(wire: WirePlan, nodes: Sequence[Node]) -> int:
    """How many rounds a wave of ``nodes`` runs: its most buffer kinds."""
    moving = [n for n in nodes if n.primitive is not Primitive.DESTROY and n.source != STORAGE]
    return max((len(kinds_of(wire.policies(n)[0])) for n in moving), default=0)


def staging_bytes(
    dag: TransitionDag, moves: Sequence[StageMove], budget: int = STAGING_BUDGET, wire: WirePlan | None = None
) -> dict[int, int]:
    """Per GPU, the bytes its staging pool holds at most while ``dag`` runs zero-copy (GPUs that
    stage nothing left out). Each peer's buffer grows to the largest batch's need (``batches``: at
    most ``budget`` bytes unless one chunk is larger, within one buffer kind of one wave) and is
    kept until the transition ends (``nereus.state.staging``), so a GPU holds
    the sum over its peers of each one's largest — on top of whatever state the DAG's ledger has
    it hold at that moment. ``wire``: the DAG's messages when the caller has them (any budget:
    what moves does not depend on it).

    What each GPU's executor computes for itself with ``batches``, once per pair of GPUs: the two
    ends of a pair cut the same chunks into the same batches, so one pass over the pair's chunks
    gives both ends' needs."""
    if budget < 1:
        raise ValueError(f"staging budget: {budget} bytes; it must be at least 1")
    wire = wire or WirePlan(dag, moves, budget=budget)
    largest: dict[int, dict[int, int]] = {}
    for wave in waves(dag):
        for (a, b), flow in _pair_flows(wire, [dag.nodes[i] for i in wave]).items():
            flow.sort(key=lambda e: (e[0], e[1].src, e[1].dst))
            for j in range(max(len(e[4]) for e in flow)):
                need_a, need_b = _pair_need(flow, a, j, budget)
                for g, peer, n in ((a, b, need_a), (b, a, need_b)):
                    if n:
                        per = largest.setdefault(g, {})
                        per[peer] = max(per.get(peer, 0), n)
    return {g: sum(per.values()) for g, per in sorted(largest.items())}


Flow = list[tuple[int, Transfer, StatePolicy, StatePolicy, tuple[BufferKind, ...]]]


def _pair_flows(wire: WirePlan, nodes: Sequence[Node]) -> dict[tuple[int, int], Flow]:
    """The packed transfers of one wave's ``nodes`` by pair of GPUs (lower GPU first), each with
    its node's position in the wave, the providers' and receivers' policies and the kinds."""
    pairs: dict[tuple[int, int], Flow] = {}
    for at, node in enumerate(nodes):
        if node.primitive is Primitive.DESTROY or node.source == STORAGE:
            continue
        receiver, provider = wire.policies(node)
        kinds = kinds_of(receiver)
        for rec in wire.receives(node).values():
            for x in rec.transfers:
                if x.carry is Carry.PACKED:
                    key = (x.src, x.dst) if x.src < x.dst else (x.dst, x.src)
                    pairs.setdefault(key, []).append((at, x, provider, receiver, kinds))
    return pairs


def _pair_need(flow: Flow, a: int, j: int, budget: int) -> tuple[int, int]:
    """The staging bytes GPU ``a`` and its peer each hold for the other in round ``j`` of a
    pair's ``flow`` (sorted as ``batches`` sorts it): the largest batch on each side, cut as
    ``batches`` cuts it."""
    mine = theirs = need_a = need_b = 0
    for _, x, provider, receiver, kinds in flow:
        if j >= len(kinds):
            continue
        send_w, recv_w = dict(provider.kinds)[kinds[j]].itemsize, dict(receiver.kinds)[kinds[j]].itemsize
        for c in x.chunks:
            on_src = staged(c.numel * send_w) if c.src is None else 0
            on_dst = staged(c.numel * recv_w) if c.dst is None else 0
            here, there = (on_src, on_dst) if x.src == a else (on_dst, on_src)
            if not (here or there):
                continue
            if (mine or theirs) and (mine + here > budget or theirs + there > budget):
                mine = theirs = 0
            mine, theirs = mine + here, theirs + there
            need_a, need_b = max(need_a, mine), max(need_b, theirs)
    return need_a, need_b


def consumed_on(dag: TransitionDag, moves: Sequence[StageMove], gpu: int) -> set[str]:
    """The model-stages whose current unit on ``gpu`` the DAG frees (a Split, a Merge, a reshard
    or a Destroy consumes it): whatever else views that unit's buffers must let go of them before
    the walk, or the memory the ledger counts free stays taken."""
    freed = {uid for n in dag.nodes for uid in n.frees}
    return {m.name for m in moves for u in m.current if gpu in u.gpus and u.id in freed}


def takes_part(node: Node, gpu: int) -> bool:
    """Whether ``gpu`` has a part in ``node``: it holds, sends, receives or frees something there."""
    return gpu in {*node.gpus, *node.sends, *(g for g, _ in node.release)}


def waves(dag: TransitionDag, order: Sequence[int] | None = None) -> list[list[int]]:
    """Nodes grouped by depth in the DAG: a wave's nodes depend only on earlier waves, so they
    are ready together and run concurrently (in ``order`` within a wave; the commit order by
    default)."""
    preds = dag.preds()
    depth: dict[int, int] = {}
    for i in dag.order:  # a topological order
        depth[i] = 1 + max((depth[p] for p in preds[i]), default=-1)
    grouped: dict[int, list[int]] = {}
    for i in order if order is not None else dag.order:
        grouped.setdefault(depth[i], []).append(i)
    return [grouped[d] for d in sorted(grouped)]
