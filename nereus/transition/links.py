"""Seconds a transition primitive takes, on the project's one link model (``nereus.plan.links``).

A node's transfers into one GPU share that GPU's link (they add up); transfers into different
GPUs run in parallel (the node takes the slowest GPU). A Split or Merge moves at the all-gather
rate of its link, an Extend at the broadcast rate, so measured transitions refine them like any
op class. A restore from shared storage reads at the node's storage bandwidth shared by its GPUs.
Local copies (a Merge slicing what is resident) run at HBM speed, read plus write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from nereus.plan.calibration import Efficiencies, Measurement
from nereus.plan.links import Links
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.spec.cluster import ClusterSpec
from nereus.transition.dag import Flow, Node, Primitive

# Creating a transition's communicators (NCCL/RCCL comm init for a rank pair or a small group;
# gloo: a store round-trip). Pairs of one node are created concurrently.
COMMUNICATOR_SETUP_S = 0.05


def collective_of(primitive: Primitive) -> Collective:
    """The collective whose calibrated rate a primitive's transfers run at."""
    return Collective.BROADCAST if primitive is Primitive.EXTEND else Collective.ALLGATHER


class LinkModel(Links):
    """``Links`` plus what a transition's nodes cost: transfers, hops, communicator setup."""

    def __init__(
        self, cluster: ClusterSpec, efficiencies: Efficiencies, setup_s: float = COMMUNICATOR_SETUP_S
    ) -> None:
        super().__init__(cluster, efficiencies)
        self.setup_s = setup_s
        self._seconds: dict[tuple[object, ...], float] = {}

    def rate(self, primitive: Primitive, link: Link | None) -> float:
        """Bytes per second into one GPU (link None: shared storage, the node's read bandwidth)."""
        return self.storage_rate if link is None else self.bandwidth(collective_of(primitive), link)

    def latency(self, link: Link | None) -> float:
        return self.hop_s(link)

    def ideal_s(self, primitive: Primitive, flows: Iterable[Flow]) -> tuple[float, Link | None]:
        """Seconds of a node's transfers at the links' peak (η = 1), and its slowest link."""
        per_gpu: dict[int, float] = defaultdict(float)
        worst: Link | None = Link.INTRA
        for f in flows:
            if f.bytes <= 0 or f.link is None:
                continue
            per_gpu[f.dst] += f.bytes / self.peak_bandwidth(f.link)
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
            out.append(Measurement(OpClass.of(collective_of(n.primitive), link), ideal, measured))
        return out

    def node_seconds(
        self,
        primitive: Primitive,
        flows: tuple[Flow, ...],
        hops: int = 1,
        local_bytes: int = 0,
        distinct: bool = False,
    ) -> float:
        """``seconds``, memoised on what it depends on when every flow goes into its own GPU (a
        node's flows do: one per rank of a unit): the (bytes, link) of each flow, in order.
        ``distinct``: the caller knows the flows' GPUs differ (one flow per GPU of a unit)."""
        if not distinct and len({f.dst for f in flows}) != len(flows):
            return self.seconds(primitive, flows, hops, local_bytes)
        key = (primitive, hops, local_bytes, *[(f.bytes, f.link) for f in flows])
        out = self._seconds.get(key)
        if out is None:
            out = self._seconds[key] = self.seconds(primitive, flows, hops, local_bytes)
        return out

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
        copy = 2.0 * local_bytes / self.copy_rate
        if not remote:
            return copy
        return max(per_gpu.values()) + hops * self.latency(worst_link) + self.setup_s + copy


_MODELS: list[tuple[ClusterSpec, Efficiencies, LinkModel]] = []


def link_model(cluster: ClusterSpec, efficiencies: Efficiencies) -> LinkModel:
    """The ``LinkModel`` of ``cluster`` under ``efficiencies``, shared while both are the same
    objects (both are frozen: the same snapshot, the same rates), so its memo of node seconds
    lives across the controller's replans; the last few pairs are kept."""
    for c, e, model in _MODELS:
        if c is cluster and e is efficiencies:
            return model
    model = LinkModel(cluster, efficiencies)
    _MODELS.insert(0, (cluster, efficiencies, model))
    del _MODELS[4:]
    return model
