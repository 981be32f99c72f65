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
from collections.abc import Iterable, Mapping

from nereus.plan.calibration import Efficiencies, Measurement
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.spec.cluster import ClusterSpec
from nereus.transition.dag import Flow, Node, Primitive

# Creating a transition's communicators (NCCL/RCCL comm init for a rank pair or a small group;
# gloo: a store round-trip). Pairs of one node are created concurrently.
COMMUNICATOR_SETUP_S = 0.05


class LinkModel:
    """Per-GPU transfer rates and latencies of a cluster under calibrated efficiencies."""

    def __init__(
        self, cluster: ClusterSpec, efficiencies: Efficiencies, setup_s: float = COMMUNICATOR_SETUP_S
    ) -> None:
        self.cluster = cluster
        self.efficiencies = efficiencies
        self.setup_s = setup_s
        self.gpus_per_node = cluster.gpus_per_node
        self._rate: dict[tuple[Primitive, Link | None], float] = {}
        for primitive in Primitive:
            kind = Collective.BROADCAST if primitive is Primitive.EXTEND else Collective.ALLGATHER
            for link in Link:
                bw = (
                    cluster.intra_node_bandwidth_gbs
                    if link is Link.INTRA
                    else cluster.inter_node_bandwidth_gbs
                )
                self._rate[primitive, link] = efficiencies[OpClass.of(kind, link)] * bw * 1e9
            self._rate[primitive, None] = cluster.storage_read_gbs * 1e9 / cluster.gpus_per_node
        self._copy = cluster.hbm_bandwidth_gbs * 1e9 * efficiencies[OpClass.MEMORY]

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        return Link.INTRA if a // self.gpus_per_node == b // self.gpus_per_node else Link.INTER

    def group_link(self, gpus: Iterable[int]) -> Link:
        return Link.INTRA if len({g // self.gpus_per_node for g in gpus}) <= 1 else Link.INTER

    def rate(self, primitive: Primitive, link: Link | None) -> float:
        """Bytes per second into one GPU (link None: shared storage, the node's read bandwidth)."""
        return self._rate[primitive, link]

    def ideal_s(self, primitive: Primitive, flows: Iterable[Flow]) -> tuple[float, Link | None]:
        """Seconds of a node's transfers at the links' peak (η = 1), and its slowest link."""
        c = self.cluster
        per_gpu: dict[int, float] = defaultdict(float)
        worst: Link | None = Link.INTRA
        for f in flows:
            if f.bytes <= 0 or f.link is None:
                continue
            bw = c.intra_node_bandwidth_gbs if f.link is Link.INTRA else c.inter_node_bandwidth_gbs
            per_gpu[f.dst] += f.bytes / (bw * 1e9)
            if f.link is Link.INTER:
                worst = Link.INTER
        return max(per_gpu.values(), default=0.0), worst

    def measurements(self, nodes: Iterable[Node], seconds: Mapping[int, float]) -> list[Measurement]:
        """Calibration samples from measured node times (the slowest rank's, per node id): a
        Split or Merge refines the all-gather class of its link, an Extend the broadcast class.
        Communicator setup and latency are taken off first; restores from storage are skipped."""
        out = []
        for n in nodes:
            if n.id not in seconds or not n.bytes:
                continue
            ideal, link = self.ideal_s(n.primitive, n.flows)
            measured = seconds[n.id] - self.setup_s
            if ideal <= 0 or measured <= 0 or link is None:
                continue
            kind = Collective.BROADCAST if n.primitive is Primitive.EXTEND else Collective.ALLGATHER
            out.append(Measurement(OpClass.of(kind, link), ideal, measured))
        return out

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
        copy = 2.0 * local_bytes / self._copy
        if not remote:
            return copy
        return max(per_gpu.values()) + hops * self.latency(worst_link) + self.setup_s + copy
