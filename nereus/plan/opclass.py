"""Operation classes: the unit of calibration (paper §2.5).

One achieved-to-peak efficiency η is kept per class, not per operation, so plans built from the
same classes share calibration and a new model on the same cluster reuses it. Collectives are
classed by kind and by the link they cross (inside a node or between nodes).
"""

from __future__ import annotations

from enum import StrEnum


class Link(StrEnum):
    INTRA = "intra"  # NVLink / Infinity Fabric / shared memory
    INTER = "inter"  # InfiniBand / Slingshot / TCP


class Collective(StrEnum):
    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    SENDRECV = "sendrecv"


class OpClass(StrEnum):
    GEMM = "gemm"  # dense matmuls, against peak FLOP/s
    ATTENTION = "attention"  # fused attention kernels, against peak FLOP/s
    MEMORY = "memory"  # trainers' memory-bound work (optimizer step), against HBM bandwidth
    ALLREDUCE_INTRA = "allreduce.intra"
    ALLREDUCE_INTER = "allreduce.inter"
    ALLGATHER_INTRA = "allgather.intra"
    ALLGATHER_INTER = "allgather.inter"
    BROADCAST_INTRA = "broadcast.intra"
    BROADCAST_INTER = "broadcast.inter"
    SENDRECV_INTRA = "sendrecv.intra"
    SENDRECV_INTER = "sendrecv.inter"
    # generation's per-token HBM reads of weights and KV cache, against HBM bandwidth: its own
    # class (not MEMORY) because decode passes run near the bandwidth while the trainers' small
    # optimizer passes pay fixed costs, and one η-by-size curve over both priced neither (issue 19).
    # Last, so the classes before it keep their index (``nereus.runtime.monitor`` packs by it).
    DECODE = "decode"

    @staticmethod
    def of(kind: Collective, link: Link) -> OpClass:
        return OpClass(f"{kind.value}.{link.value}")


# Conservative starting efficiencies (paper §2.5: classes not yet measured start low). Typical
# achieved fractions are higher (GEMM 0.6–0.8, NCCL bus bandwidth 0.7–0.9 of link peak), so a fresh
# planner over-estimates latency rather than promising speed it cannot deliver.
PRIOR_EFFICIENCY: dict[OpClass, float] = {
    OpClass.GEMM: 0.45,
    OpClass.ATTENTION: 0.30,
    OpClass.MEMORY: 0.50,
    OpClass.ALLREDUCE_INTRA: 0.50,
    OpClass.ALLREDUCE_INTER: 0.40,
    OpClass.ALLGATHER_INTRA: 0.50,
    OpClass.ALLGATHER_INTER: 0.40,
    OpClass.BROADCAST_INTRA: 0.60,
    OpClass.BROADCAST_INTER: 0.50,
    OpClass.SENDRECV_INTRA: 0.60,
    OpClass.SENDRECV_INTER: 0.50,
    OpClass.DECODE: 0.50,
}
