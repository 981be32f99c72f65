"""Seconds a primitive takes: bytes over the links they cross, plus latency and communicator setup.

A node's transfers into one GPU share that GPU's link (they add up); transfers into different
GPUs run in parallel (the node takes the slowest GPU). Bandwidths are the cluster's per-GPU,
per-direction figures scaled by the calibrated efficiency of the collective (all-gather for
Split and Merge, broadcast for Extend), so measured transitions refine them like any op class.
A restore from shared storage reads at the node's storage bandwidth shared by its GPUs. Local
copies (a Merge slicing what is resident) run at HBM speed, read plus write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from nereus.plan.calibration import Efficiencies
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.spec.cluster import ClusterSpec
from nereus.transition.dag import Flow, Primitive

# Creating a transition's communicators (NCCL/RCCL comm init for a rank pair or a small group;
# gloo: a store round-trip). Pairs of one node are created concurrently.
COMMUNICATOR_SETUP_S = 0.05


@dataclass(frozen=True, slots=True)
class LinkModel:
    cluster: ClusterSpec
    efficiencies: Efficiencies
    setup_s: float = COMMUNICATOR_SETUP_S

    def node_of(self, gpu: int) -> int:
        return gpu // self.cluster.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        return Link.INTRA if self.node_of(a) == self.node_of(b) else Link.INTER

    def group_link(self, gpus: Iterable[int]) -> Link:
        return Link.INTRA if len({self.node_of(g) for g in gpus}) <= 1 else Link.INTER

    def rate(self, primitive: Primitive, link: Link | None) -> float:
        """Bytes per second into one GPU."""
        c = self.cluster
        if link is None:
            return c.storage_read_gbs * 1e9 / c.gpus_per_node
        kind = Collective.BROADCAST if primitive is Primitive.EXTEND else Collective.ALLGATHER
        bw = c.intra_node_bandwidth_gbs if link is Link.INTRA else c.inter_node_bandwidth_gbs
        return self.efficiencies[OpClass.of(kind, link)] * bw * 1e9

    def latency(self, link: Link | None) -> float:
        c = self.cluster
        return (c.intra_node_latency_us if link is Link.INTRA else c.inter_node_latency_us) * 1e-6

    def seconds(
        self, primitive: Primitive, flows: Iterable[Flow], hops: int = 1, local_bytes: int = 0
    ) -> float:
        """Time of a node: its slowest receiving GPU, ``hops`` collective steps of latency, setup.

        ``local_bytes`` is the largest on-GPU copy (read + write at HBM bandwidth).
        """
        per_gpu: dict[int, float] = defaultdict(float)
        worst_link: Link | None = Link.INTRA
        remote = False
        for f in flows:
            if f.bytes <= 0:
                continue
            remote = True
            per_gpu[f.dst] += f.bytes / self.rate(primitive, f.link)
            if f.link is not Link.INTRA:
                worst_link = f.link if worst_link is Link.INTRA else worst_link
        copy = 2.0 * local_bytes / (self.cluster.hbm_bandwidth_gbs * 1e9 * self.efficiencies[OpClass.MEMORY])
        if not remote:
            return copy
        return max(per_gpu.values()) + hops * self.latency(worst_link) + self.setup_s + copy
