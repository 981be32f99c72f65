"""Op-class timings: what a worker measured, next to what it would take at efficiency 1.

Every model-stage run on a rank is split into the operation classes the cost model prices
(``nereus.plan.opclass``) and paired with that class's ideal seconds, so the controller's
calibration learns achieved efficiencies from real steps (paper §2.5):

- training: dense matmuls (GEMM, 6 FLOPs per parameter per token), and the data-parallel gradient
  all-reduce, timed apart (ring: 2(n−1)/n of the bytes over the slowest link of the group, at the
  link model's peak, ``nereus.plan.links``);
- inference (log-probs, values): GEMM at 2 FLOPs per parameter per token;
- generation: memory-bound decoding, one read of the rank's weights per generated token.

Attention is counted inside GEMM here (tiny sequences); the cost model's own split is finer.
Pure (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.plan.calibration import Efficiencies, Measurement
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.opclass import Collective, OpClass
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec


@dataclass(frozen=True, slots=True)
class OpTime:
    """One timed piece of a model-stage's work on one rank."""

    model_stage: str
    op_class: OpClass
    ideal_s: float
    measured_s: float

    def measurement(self) -> Measurement | None:
        if self.ideal_s <= 0 or self.measured_s <= 0:
            return None
        return Measurement(self.op_class, self.ideal_s, self.measured_s)


def rank_params(model: ModelSpec, layout: Layout) -> float:
    """Parameters one rank of a unit holds (an even share of the unit's)."""
    return model.param_count() / (layout.tp * layout.pp)


def gemm_s(model: ModelSpec, layout: Layout, tokens: int, flops_per_param: float, peak_flops: float) -> float:
    """Ideal matmul seconds of ``tokens`` on one rank at ``peak_flops`` (the cluster's at the
    workload's precision, ``ClusterSpec.peak_flops_at``, as the planner prices them)."""
    return flops_per_param * rank_params(model, layout) * tokens / peak_flops


def decode_s(
    model: ModelSpec, layout: Layout, steps: int, bytes_per_param: int, cluster: ClusterSpec
) -> float:
    return steps * rank_params(model, layout) * bytes_per_param / (cluster.hbm_bandwidth_gbs * 1e9)


def measurements(times: list[OpTime]) -> tuple[Measurement, ...]:
    return tuple(m for t in times if (m := t.measurement()) is not None)


def train_times(
    name: str, model: ModelSpec, layout: Layout, tokens: int, seconds: float, dp_s: float, dp_bytes: int,
    dp_gpus: tuple[int, ...], cluster: ClusterSpec, peak_flops: float,
) -> list[OpTime]:  # fmt: skip
    out = [OpTime(name, OpClass.GEMM, gemm_s(model, layout, tokens, 6.0, peak_flops), seconds - dp_s)]
    if dp_bytes and len(dp_gpus) > 1:
        links = Links(cluster, Efficiencies.unit())
        link = links.group_link(dp_gpus)
        ideal = links.ideal_ring_s(Collective.ALLREDUCE, len(dp_gpus), dp_bytes, link)
        out.append(OpTime(name, OpClass.of(Collective.ALLREDUCE, link), ideal, dp_s))
    return out


def efficiencies(ms: tuple[Measurement, ...]) -> dict[str, float]:
    """Achieved efficiency per op class (Σ ideal / Σ measured)."""
    ideal: dict[str, float] = {}
    measured: dict[str, float] = {}
    for m in ms:
        ideal[m.op_class.value] = ideal.get(m.op_class.value, 0.0) + m.ideal_s
        measured[m.op_class.value] = measured.get(m.op_class.value, 0.0) + m.measured_s
    return {k: ideal[k] / measured[k] for k in sorted(ideal) if measured[k] > 0}
