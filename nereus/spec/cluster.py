"""ClusterSpec: the hardware a job runs on, as the cost model sees it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum, auto
from pathlib import Path

from nereus.errors import ConfigError
from nereus.spec.domains import FailureDomains
from nereus.spec.schema import (
    coerce_enums,
    load_spec,
    require_at_least,
    require_at_most,
    require_finite,
    require_positive,
)
from nereus.spec.workload import Precision

GIB = 1024**3
MAX_NODES = 1 << 16
MAX_GPUS_PER_NODE = 1024
MAX_RATE = 1e6  # TFLOP/s, GB/s, µs and GiB: a million of any is beyond hardware of this age
SPEEDS = (  # positive, and at least MIN_RATE: their reciprocals price every op
    "peak_bf16_tflops",
    "hbm_bandwidth_gbs",
    "intra_node_bandwidth_gbs",
    "inter_node_bandwidth_gbs",
    "storage_read_gbs",
)
MIN_RATE = 1e-3  # TFLOP/s and GB/s: a thousandth of either is below hardware that runs a model


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"
    CPU = "cpu"  # virtual GPUs: worker processes on one machine


class CollectiveLibrary(StrEnum):
    """What a cluster's YAML says its collectives run on (data about the cluster; which backend a
    worker uses is ``nereus.devices``'s choice). ``auto()``: the lowercase name."""

    NCCL = auto()
    RCCL = auto()
    GLOO = auto()


_LIBRARY_OF = {
    Vendor.NVIDIA: CollectiveLibrary.NCCL,
    Vendor.AMD: CollectiveLibrary.RCCL,
    Vendor.CPU: CollectiveLibrary.GLOO,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    """Nodes of identical GPUs. Bandwidths are per GPU and per direction, in GB/s (10⁹ B/s)."""

    name: str
    description: str = ""
    vendor: Vendor
    collective_library: CollectiveLibrary
    nodes: int
    gpus_per_node: int
    gpu_model: str
    gpu_memory_gib: float  # HBM per GPU (one MI250X GCD counts as one GPU)
    peak_bf16_tflops: float  # dense, no sparsity
    # dense FP32 matmul rate (PyTorch's default: TF32 off); None: not given, and a workload of
    # precision fp32 cannot be priced on this cluster
    peak_fp32_tflops: float | None = None
    hbm_bandwidth_gbs: float
    intra_node_bandwidth_gbs: float  # NVLink / Infinity Fabric / shared memory
    inter_node_bandwidth_gbs: float  # node NIC bandwidth / GPUs per node
    intra_node_latency_us: float = 5.0  # per collective hop
    inter_node_latency_us: float = 15.0
    runtime_reserved_gib: float = 1.0  # driver context, collective buffers, allocator slack
    storage_read_gbs: float = 2.0  # checkpoint / weight reads from shared storage, per node, GB/s
    # failure domains: nodes [0, reserved_nodes) are held for the whole job, later nodes may be
    # revoked (spot / preemptible), each at revocations_per_node_hour; None: nothing is revoked
    reserved_nodes: int | None = None
    revocations_per_node_hour: float = 0.0

    def __post_init__(self) -> None:
        coerce_enums(self, vendor=Vendor, collective_library=CollectiveLibrary)
        require_positive(self, "nodes", "gpus_per_node", "gpu_memory_gib", *SPEEDS)
        rates = (
            "gpu_memory_gib",
            *SPEEDS,
            "intra_node_latency_us",
            "inter_node_latency_us",
            "runtime_reserved_gib",
        )
        require_finite(self, *rates)
        require_at_most(self, MAX_RATE, *rates)
        require_at_least(self, MIN_RATE, *SPEEDS)
        require_at_most(self, MAX_NODES, "nodes")
        require_at_most(self, MAX_GPUS_PER_NODE, "gpus_per_node")
        for name in ("intra_node_latency_us", "inter_node_latency_us", "runtime_reserved_gib"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.reserved_nodes is not None and not 0 <= self.reserved_nodes <= self.nodes:
            raise ValueError(f"reserved_nodes must be in [0, nodes={self.nodes}], got {self.reserved_nodes}")
        if self.peak_fp32_tflops is not None:
            require_finite(self, "peak_fp32_tflops")
            require_at_least(self, MIN_RATE, "peak_fp32_tflops")
            require_at_most(self, MAX_RATE, "peak_fp32_tflops")
        require_finite(self, "revocations_per_node_hour")
        require_at_most(self, MAX_RATE, "revocations_per_node_hour")
        if self.revocations_per_node_hour < 0:
            rate = self.revocations_per_node_hour
            raise ValueError(f"revocations_per_node_hour must be non-negative, got {rate}")
        if self.revocations_per_node_hour > 0 and self.reserved_nodes is None:
            raise ValueError(
                "revocations_per_node_hour needs reserved_nodes (nodes [0, reserved_nodes) are held, "
                f"later ones revocable; allowed: 0 to {self.nodes})"
            )
        if self.runtime_reserved_gib >= self.gpu_memory_gib:
            raise ValueError("runtime_reserved_gib must be below gpu_memory_gib")
        expected = _LIBRARY_OF[self.vendor]
        if self.collective_library is not expected:
            raise ValueError(
                f"collective_library {self.collective_library.value} does not match vendor "
                f"{self.vendor.value} (expected {expected.value})"
            )

    @classmethod
    def from_yaml(cls, path: Path) -> ClusterSpec:
        return load_spec(cls, path)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB

    @property
    def peak_flops(self) -> float:
        return self.peak_bf16_tflops * 1e12

    def peak_flops_at(self, precision: Precision) -> float:
        """FLOP/s of the matmuls a workload of ``precision`` runs (bf16-mixed: bf16 tensor cores;
        fp32: ``peak_fp32_tflops``, refused in one line when the cluster does not give it)."""
        if precision is Precision.BF16_MIXED:
            return self.peak_flops
        if self.peak_fp32_tflops is None:
            raise ConfigError(
                f"cluster {self.name}: precision fp32 needs peak_fp32_tflops (dense FP32 TFLOPS per GPU) "
                "in the cluster's YAML (allowed: a positive number; or precision bf16-mixed)"
            )
        return self.peak_fp32_tflops * 1e12

    def failure_domains(self) -> FailureDomains | None:
        """Reserved and revocable nodes as the YAML marks them; None when nothing is revocable."""
        if self.reserved_nodes is None:
            return None
        return FailureDomains.from_nodes(
            self.reserved_nodes, self.gpus_per_node, self.total_gpus, self.revocations_per_node_hour
        )

    def node_of(self, gpu: int) -> int:
        """GPU ids are global: node ``k`` holds ``[k·gpus_per_node, (k+1)·gpus_per_node)``."""
        return gpu // self.gpus_per_node
