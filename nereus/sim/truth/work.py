"""Shared pieces of the truth's time accounting: lengths, per-class accumulation, attention and
memory-bound work on one GPU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nereus.sim.truth import collectives
from nereus.sim.truth.collectives import Group
from nereus.sim.truth.gemm import achieved_fraction, best_fraction
from nereus.sim.truth.params import TruthParams
from nereus.sim.truth.shard import Shard
from nereus.spec.cluster import ClusterSpec

Z95 = 1.645  # standard normal 95th percentile: p95 − mean ≈ 1.645 σ
FA_BACKWARD = 2.5  # flash-attention backward runs 5 matmuls to the forward's 2 (Dao 2023, §3.1.2)


@dataclass(frozen=True, slots=True)
class Lengths:
    """Token lengths of the step's sequences: mean prompt, mean and p95 response."""

    prompt: float
    response_mean: float
    response_p95: float

    def __post_init__(self) -> None:
        if not (self.prompt > 0 and self.response_mean > 0 and self.response_p95 >= self.response_mean):
            raise ValueError(f"lengths need prompt, mean > 0 and p95 ≥ mean, got {self}")

    @property
    def mean(self) -> float:
        return self.prompt + self.response_mean

    @property
    def second_moment(self) -> float:
        """E[s²] of whole-sequence lengths (attention is quadratic in each sequence's own length)."""
        sigma = (self.response_p95 - self.response_mean) / Z95
        return self.mean**2 + sigma**2


@dataclass(frozen=True, slots=True)
class StageResult:
    """True seconds per op class (keys are op-class names such as ``gemm``, ``allreduce.inter``),
    the peak and idle-resident bytes of the fullest GPU, and (generation) the fraction of
    sequences preempted because the KV cache was full."""

    seconds: Mapping[str, float]
    peak_bytes: float
    resident_bytes: float
    preempted: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass(slots=True)
class Acc:
    """Seconds accumulated per op class."""

    cluster: ClusterSpec
    p: TruthParams
    by: dict[str, float] = field(default_factory=dict)

    def add(self, op: str, seconds: float) -> None:
        if seconds > 0:
            self.by[op] = self.by.get(op, 0.0) + seconds

    def merge(self, other: Acc, times: float) -> None:
        for op, t in other.by.items():
            self.add(op, t * times)

    def memory(self, nbytes: float) -> None:
        self.add("memory", nbytes / (self.cluster.hbm_bandwidth_gbs * 1e9 * self.p.decode_hbm_eff))

    def collective(self, kind: str, group: Group, nbytes: float, times: float = 1.0) -> None:
        c = self.cluster
        t = collectives.seconds(
            kind, group, nbytes, c.intra_node_bandwidth_gbs * 1e9, c.inter_node_bandwidth_gbs * 1e9, self.p
        )
        self.add(f"{kind}.{group.link}", t * times)

    def attention(self, s: Shard, sum_sq: float, backward: bool = False) -> None:
        """Causal attention of sequences whose squared lengths sum to ``sum_sq``, one layer: QKᵀ
        and AV over half the square each (2·Σs²·q FLOPs forward), run as batched GEMMs of depth
        head_dim whose efficiency follows the GEMM model at that depth and tile count."""
        flops = 2.0 * sum_sq * s.q * (FA_BACKWARD if backward else 1.0)
        frac = achieved_fraction(
            s.heads * sum_sq / 2.0, 1.0, s.head_dim, best_fraction(self.cluster.vendor, self.p), self.p
        )
        self.add("attention", flops / (self.cluster.peak_flops * frac))
