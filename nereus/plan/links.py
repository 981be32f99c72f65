"""The cluster's links under calibrated efficiencies: the project's one bandwidth model.

Every transfer the project prices reads its rate here: the cost model's collectives (TP
all-reduce, PP send/recv, DP gradient sync, weight syncs), a transition's Split, Merge and Extend
(``nereus.transition.links``), and the ideal seconds a worker's measured all-reduce is compared to
(``nereus.runtime.optimes``). A link is the slowest one a group of GPUs crosses: inside one node
(NVLink, Infinity Fabric) or between nodes (InfiniBand, Slingshot). Rates are the cluster's
per-GPU, per-direction figures times the calibrated efficiency of the collective's op class.

Ring collectives (n ranks, B bytes per rank): all-reduce 2(n−1)/n·B, all-gather (n−1)/n·B, broadcast
and send/recv B, over the link's peak bandwidth, plus one hop latency per ring step (NCCL-tests
PERFORMANCE.md, "bus bandwidth"), all over the collective's efficiency η: a measured collective's η is
that whole ideal over what it took, so latency-bound collectives price back as measured. Pure (NumPy).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from nereus.plan.calibration import Efficiencies
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.replica import FloatArray
from nereus.spec.cluster import ClusterSpec

BoolArray = npt.NDArray[np.bool_]


def ring(kind: Collective, ranks: FloatArray) -> tuple[FloatArray, FloatArray]:
    """(bus-bandwidth factor, ring steps) of a ring collective over ``ranks`` ranks."""
    one = np.ones_like(ranks)
    if kind is Collective.ALLREDUCE:
        return 2.0 * (ranks - 1) / ranks, 2.0 * (ranks - 1)
    if kind is Collective.ALLGATHER:
        return (ranks - 1) / ranks, ranks - 1.0
    if kind is Collective.BROADCAST:
        return one, ranks - 1.0
    return one, one


class Links:
    """Bandwidth, hop latency and calibrated efficiency of a cluster's links, per collective."""

    def __init__(self, cluster: ClusterSpec, efficiencies: Efficiencies) -> None:
        self.cluster = cluster
        self.efficiencies = efficiencies
        self.gpus_per_node = cluster.gpus_per_node
        self._peak = {
            Link.INTRA: cluster.intra_node_bandwidth_gbs * 1e9,
            Link.INTER: cluster.inter_node_bandwidth_gbs * 1e9,
        }
        self._eta = {
            (kind, link): efficiencies[OpClass.of(kind, link)] for kind in Collective for link in self._peak
        }
        self._bw = {(kind, link): eta * self._peak[link] for (kind, link), eta in self._eta.items()}
        self._hop = {
            Link.INTRA: cluster.intra_node_latency_us * 1e-6,
            Link.INTER: cluster.inter_node_latency_us * 1e-6,
        }
        # a restore from shared storage: the node's read bandwidth shared by its GPUs
        self.storage_rate = cluster.storage_read_gbs * 1e9 / cluster.gpus_per_node
        # an on-GPU copy (a Merge slicing what is resident): HBM at the memory-bound efficiency
        self.copy_rate = cluster.hbm_bandwidth_gbs * 1e9 * efficiencies[OpClass.MEMORY]

    # ------------------------------------------------------------------ which link
    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def link(self, a: int, b: int) -> Link:
        """The link between GPUs ``a`` and ``b`` (``node_of`` inlined: transition planning asks
        per rank)."""
        gpn = self.gpus_per_node
        return Link.INTRA if a // gpn == b // gpn else Link.INTER

    def group_link(self, gpus: Iterable[int]) -> Link:
        """The slowest link a group of GPUs crosses: nodes are GPU-id ranges (``node_of``), so
        the group stays on one node when its smallest and largest GPU do."""
        seq = gpus if isinstance(gpus, tuple | list) else tuple(gpus)
        if not seq:
            return Link.INTRA
        gpn = self.gpus_per_node
        return Link.INTRA if min(seq) // gpn == max(seq) // gpn else Link.INTER

    def link_for(self, span: int) -> Link:
        """The slowest link a group of ``span`` consecutive, node-aligned GPUs crosses."""
        return Link.INTRA if span <= self.gpus_per_node else Link.INTER

    # ------------------------------------------------------------------ rates
    def bandwidth(self, kind: Collective, link: Link) -> float:
        """Bytes per second into one GPU for collective ``kind`` over ``link`` (calibrated)."""
        return self._bw[kind, link]

    def peak_bandwidth(self, link: Link) -> float:
        """Bytes per second into one GPU over ``link`` at efficiency 1."""
        return self._peak[link]

    def hop_s(self, link: Link | None) -> float:
        """One ring step's latency over ``link`` (None, shared storage, counts as inter-node)."""
        return self._hop[Link.INTRA if link is Link.INTRA else Link.INTER]

    # ------------------------------------------------------------------ ring collectives
    def ring_s(
        self,
        kind: Collective,
        span: FloatArray | float,
        ranks: FloatArray | float,
        nbytes: FloatArray | float,
    ) -> tuple[FloatArray, BoolArray]:
        """(seconds, inside-a-node mask) of one ring collective of ``nbytes`` per rank among
        ``ranks`` ranks whose GPUs span ``span`` consecutive GPUs, vectorised over rows."""
        r = np.asarray(ranks, dtype=np.float64)
        intra: BoolArray = np.asarray(span) <= self.gpus_per_node
        eta = np.where(intra, self._eta[kind, Link.INTRA], self._eta[kind, Link.INTER])
        peak = np.where(intra, self._peak[Link.INTRA], self._peak[Link.INTER])
        hop = np.where(intra, self._hop[Link.INTRA], self._hop[Link.INTER])
        factor, steps = ring(kind, np.maximum(r, 1.0))
        # η divides the whole ideal, the hops' latency too: a measured collective's η is its
        # whole ideal (``ideal_ring_s``) over what it took
        b = np.asarray(nbytes, dtype=np.float64)
        t: FloatArray = np.where(r > 1, (factor * b / peak + steps * hop) / eta, 0.0)
        return t, intra

    def ideal_ring_s(self, kind: Collective, ranks: int, nbytes: float, link: Link) -> float:
        """Seconds of a ring collective at the link's peak and hop latency (efficiency 1): what a
        measured collective is compared to for calibration. Its η is this whole ideal over what
        it took, and ``ring_s`` divides the whole ideal by η, so a latency-bound collective's
        measured η prices it back as measured."""
        if ranks <= 1:
            return 0.0
        factor, steps = ring(kind, np.asarray(float(ranks)))
        return float(factor) * nbytes / self._peak[link] + float(steps) * self._hop[link]
