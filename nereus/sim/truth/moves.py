"""What moving a transition's state truly takes: its DAG walked in waves, at the truth's link speeds.

The planner prices a transition as a list schedule of its DAG, each node at the bytes it moves
over a constant per-link bandwidth, with transfers on one GPU port serialised. The runtime runs it
otherwise (``nereus.transition.execute``): every rank walks the DAG in waves (nodes grouped by
depth), a wave's messages with all its peers go out together, and whatever does not go straight
between the buffers passes through staging, at most ``staging_budget`` bytes per peer per batch.
The truth follows the runtime, with its own functional forms:

* a message takes the truth's point-to-point time (``collectives.seconds("sendrecv")``): a per-call
  latency plus the bytes at the bus bandwidth that message size reaches — a saturating curve
  fitted to nccl-tests sweeps, so messages cut to 16 MiB staging batches move well below the link
  rate, where the planner's constant bandwidth sees no difference;
* a flow is cut into messages of at most one staging batch (the worst case: every byte staged);
* a GPU receives its flows one after another (they share its link), a sender's share of a node's
  bytes likewise; a node lasts as long as its busiest GPU;
* a node starts when its predecessors have finished and every GPU it touches has finished what
  it did before in the walk (no global barrier between waves, no overlap of one GPU's parts);
* a restore from shared storage reads at the node's storage rate shared by its GPUs.

Pure: the simulator hands in each node as plain numbers (``Transfer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nereus.sim.truth import collectives as coll
from nereus.sim.truth.params import TruthParams

INTRA, INTER, STORAGE = "intra", "inter", "storage"
LINKS = (INTRA, INTER, STORAGE)


@dataclass(frozen=True, slots=True)
class Flow:
    """``bytes`` arriving at GPU ``dst`` over ``link`` (one of ``LINKS``)."""

    dst: int
    bytes: int
    link: str

    def __post_init__(self) -> None:
        if self.link not in LINKS:
            raise ValueError(f"flow link must be one of {', '.join(LINKS)}, got {self.link!r}")
        if self.bytes < 0:
            raise ValueError(f"flow bytes must be ≥ 0, got {self.bytes}")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One node of a transition DAG as the truth sees it: the nodes it waits for (``preds``,
    indices of nodes listed before it), every GPU it touches, what arrives where and which GPUs
    send."""

    preds: tuple[int, ...]
    gpus: tuple[int, ...]
    flows: tuple[Flow, ...] = ()
    senders: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Links:
    """The machine's rates, bytes/s per GPU per direction; storage per node."""

    intra: float
    inter: float
    storage_per_node: float
    gpus_per_node: int

    def __post_init__(self) -> None:
        if not (self.intra > 0 and self.inter > 0 and self.storage_per_node > 0 and self.gpus_per_node >= 1):
            raise ValueError("link rates must be positive and gpus_per_node at least 1")


def message_seconds(nbytes: float, link: str, links: Links, p: TruthParams) -> float:
    """One message of ``nbytes`` over ``link``."""
    if nbytes <= 0:
        return 0.0
    if link == STORAGE:  # every GPU of the node may be reading: each gets its share
        return nbytes / (links.storage_per_node / links.gpus_per_node)
    group = coll.Group(2, 1) if link == INTRA else coll.Group(1, 2)
    return coll.seconds("sendrecv", group, nbytes, links.intra, links.inter, p)


def flow_seconds(flow: Flow, budget: int, links: Links, p: TruthParams) -> float:
    """A flow cut into messages of at most ``budget`` bytes (storage reads are not staged)."""
    if flow.link == STORAGE:
        return message_seconds(flow.bytes, STORAGE, links, p)
    full, rest = divmod(flow.bytes, budget)
    return full * message_seconds(budget, flow.link, links, p) + message_seconds(rest, flow.link, links, p)


def node_seconds(node: Transfer, budget: int, links: Links, p: TruthParams) -> float:
    """The busiest GPU of ``node``: a receiver's flows one after another, or a sender's share."""
    into: dict[int, float] = {}
    wire = 0.0
    for f in node.flows:
        t = flow_seconds(f, budget, links, p)
        into[f.dst] = into.get(f.dst, 0.0) + t
        wire += 0.0 if f.link == STORAGE else t
    sender = wire / len(node.senders) if node.senders else 0.0
    return max(max(into.values(), default=0.0), sender)


def waves(nodes: Sequence[Transfer]) -> list[int]:
    """Each node's depth: 0 without predecessors, else one more than its deepest predecessor.
    ``nodes`` are listed in a topological order (every predecessor earlier)."""
    depth: list[int] = []
    for i, node in enumerate(nodes):
        if any(not 0 <= q < i for q in node.preds):
            raise ValueError(f"transfer {i} waits for a node not listed before it: {node.preds}")
        depth.append(1 + max((depth[q] for q in node.preds), default=-1))
    return depth


def moving_seconds(nodes: Sequence[Transfer], budget: int, links: Links, p: TruthParams) -> float:
    """Seconds from the first node's start to the last one's end, walked in waves."""
    if budget <= 0:
        raise ValueError(f"staging budget must be a positive byte count, got {budget}")
    clock: dict[int, float] = {}  # when each GPU is done with what it walked so far
    end = [0.0] * len(nodes)
    depth = waves(nodes)
    for i in sorted(range(len(nodes)), key=lambda k: (depth[k], k)):
        node = nodes[i]
        start = max((clock.get(g, 0.0) for g in node.gpus), default=0.0)
        start = max(start, max((end[q] for q in node.preds), default=0.0))
        end[i] = start + node_seconds(node, budget, links, p)
        for g in node.gpus:
            clock[g] = end[i]
    return max(end, default=0.0)
