"""Collective time from message size, group size and where the group's GPUs sit.

NCCL/RCCL reach their link's rate only for large messages: below tens of MB the protocol (LL,
LL128), the number of channels in flight and per-chunk synchronisation leave the wires idle
(nccl-tests doc/PERFORMANCE.md; the busBW-vs-size curves in ``truth_collectives.csv``). The truth
models the achieved bus bandwidth as a saturating (Hill) curve of the message size,
    busbw(S) = eff · link · S^γ / (S^γ + half^γ),
plus a per-call latency α (each link class has its own α, eff, half and γ). Ring factors (bytes
each rank moves per byte of payload) follow
nccl-tests: all-reduce 2(n−1)/n, all-gather (n−1)/n, broadcast and send/recv 1.

A group that spans nodes runs hierarchically (NCCL's tree/ring over nodes on top of NVLink):
a reduce-scatter and an all-gather inside each node over NVLink, and the exchange of the 1/g
shard between the k nodes over each GPU's own NIC, 2(k−1)/k·S/g bytes at the inter-node curve.
The phases are pipelined chunk by chunk, so the slower one sets the time (the measured 4-node
time lies below the sum of the phases, stas00/ml-engineering, model 3).
This differs on purpose from a flat ring priced at the slowest link (what a simple model does):
at large messages leaving the node costs ~2×, not the intra/inter link ratio (stas00/ml-engineering,
"Inter-node speed depends on intra-node speed", 1× vs 4× 8-GPU B200 nodes).

Fitted: α, eff, half and γ for each link class (α as seen by a PyTorch-level benchmark that waits
for each call: an upper estimate of what a stream of asynchronous calls pays), on the B200 1- and
4-node sweeps. Link
rates (per GPU, per direction) come from the cluster spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.sim.truth.params import TruthParams


def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank moves per byte of payload (nccl-tests' bus-bandwidth factors)."""
    if kind == "allreduce":
        return 2.0 * (n - 1) / n
    if kind == "allgather":
        return (n - 1) / n
    if kind in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {kind!r}")


@dataclass(frozen=True, slots=True)
class Group:
    """Where a communicator's ranks sit: ``per_node`` ranks on each of ``nodes`` nodes."""

    per_node: int
    nodes: int

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.nodes < 1:
            raise ValueError(f"a group needs at least one rank on one node, got {self.per_node}×{self.nodes}")

    @property
    def size(self) -> int:
        return self.per_node * self.nodes

    @property
    def link(self) -> str:
        return "inter" if self.nodes > 1 else "intra"

    @staticmethod
    def of(gpus: tuple[int, ...] | list[int], gpus_per_node: int) -> Group:
        counts: dict[int, int] = {}
        for g in gpus:
            counts[g // gpus_per_node] = counts.get(g // gpus_per_node, 0) + 1
        return Group(max(counts.values()), len(counts))


def busbw(nbytes: float, link_bytes_s: float, eff: float, half: float, shape: float) -> float:
    """Achieved bus bandwidth (bytes/s) of a ``nbytes`` message over a link of ``link_bytes_s``."""
    s = float(max(nbytes, 1.0) ** shape)
    return float(eff * link_bytes_s * s / (s + float(half**shape)))


def flat_seconds(
    kind: str,
    ranks: int,
    nbytes: float,
    link_bytes_s: float,
    eff: float,
    half: float,
    alpha: float,
    shape: float,
) -> float:
    """One collective over ``ranks`` ranks on one kind of link."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    wire = ring_factor(kind, ranks) * nbytes
    return alpha + wire / busbw(nbytes, link_bytes_s, eff, half, shape)


def seconds(
    kind: str, group: Group, nbytes: float, intra_bytes_s: float, inter_bytes_s: float, p: TruthParams
) -> float:
    """True seconds of collective ``kind`` of ``nbytes`` per rank in ``group``."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if kind == "sendrecv" and group.nodes > 1:
        return flat_seconds(
            kind, 2, nbytes, inter_bytes_s, p.coll_eff_inter, p.coll_half_inter, p.coll_alpha_inter_s,
            p.coll_shape_inter,
        )  # fmt: skip
    if kind == "sendrecv" or group.nodes == 1:
        ranks = 2 if kind == "sendrecv" else group.size
        return flat_seconds(
            kind, ranks, nbytes, intra_bytes_s, p.coll_eff_intra, p.coll_half_intra, p.coll_alpha_intra_s,
            p.coll_shape_intra,
        )  # fmt: skip
    g, k = group.per_node, group.nodes
    inside = 0.0
    if g > 1:  # reduce-scatter (+ all-gather for all-reduce) inside the node, over NVLink
        factor = 2.0 if kind == "allreduce" else 1.0
        inside = (
            factor
            * (g - 1)
            / g
            * nbytes
            / busbw(nbytes, intra_bytes_s, p.coll_eff_intra, p.coll_half_intra, p.coll_shape_intra)
        )
    shard = nbytes / g
    across = (
        ring_factor(kind, k)
        * shard
        / busbw(shard, inter_bytes_s, p.coll_eff_inter, p.coll_half_inter, p.coll_shape_inter)
    )
    return p.coll_alpha_inter_s + max(inside, across)


def busbw_of(
    kind: str, group: Group, nbytes: float, intra_bytes_s: float, inter_bytes_s: float, p: TruthParams
) -> float:
    """What nccl-tests would print as busBW (bytes/s) for this collective."""
    t = seconds(kind, group, nbytes, intra_bytes_s, inter_bytes_s, p)
    return ring_factor(kind, group.size) * nbytes / t if t > 0 else 0.0
