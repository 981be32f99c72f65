"""The simulator's ground truth: how the hardware really behaves, which the planner never sees.

The planner prices with its calibrated efficiencies (conservative priors at first); the truth has
its own per-op-class efficiencies that also depend on shape (smaller GEMMs at higher TP, more
hops in larger groups), per-step noise, optional episodes (congestion, throttling), a true memory
footprint above the model's prediction, and transitions slower than estimated. The controller
learns the truth only through the measurements the simulator hands it, as on real hardware.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nereus.errors import ConfigError
from nereus.plan.calibration import Measurement
from nereus.plan.layout import Layout
from nereus.plan.opclass import Link, OpClass
from nereus.spec.files import brief, shorten
from nereus.spec.workload import Stage

TRUE_EFFICIENCY: dict[OpClass, float] = {
    OpClass.GEMM: 0.68,
    OpClass.ATTENTION: 0.50,
    OpClass.MEMORY: 0.78,
    OpClass.ALLREDUCE_INTRA: 0.80,
    OpClass.ALLREDUCE_INTER: 0.62,
    OpClass.ALLGATHER_INTRA: 0.78,
    OpClass.ALLGATHER_INTER: 0.60,
    OpClass.BROADCAST_INTRA: 0.85,
    OpClass.BROADCAST_INTER: 0.70,
    OpClass.SENDRECV_INTRA: 0.85,
    OpClass.SENDRECV_INTER: 0.68,
}
TRUE_MEMORY_FACTOR = {Stage.GEN: 1.05, Stage.INF: 1.09, Stage.TRAIN: 1.08}  # true peak / raw model
TRANSITION_BIAS = 1.15  # state moves take this much longer than the bandwidth estimate
# Fixed costs a transition pays beyond moving bytes, which the planner's estimate does not model:
# rebuilding an engine for a new layout (generation: vLLM weights reload + CUDA-graph capture;
# others: module re-init) and re-forming process groups when only DP changes.
REBUILD_S = {Stage.GEN: 30.0, Stage.INF: 8.0, Stage.TRAIN: 8.0}
REGROUP_S = 2.0
COMPUTE = (OpClass.GEMM, OpClass.ATTENTION, OpClass.MEMORY)
SCOPES = ("inter", "intra", "compute", "all")


@dataclass(frozen=True, slots=True)
class Episode:
    """Steps [start, end) during which op classes in ``scope`` run at ``factor`` of their efficiency."""

    start: int
    end: int
    scope: str
    factor: float

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"episode steps must satisfy 0 ≤ start < end, got {self.start}-{self.end}")
        if self.scope not in SCOPES:
            raise ValueError(f"episode scope must be one of {', '.join(SCOPES)}, got {brief(self.scope)}")
        if not 0 < self.factor <= 1:
            raise ValueError(f"episode factor must be in (0, 1], got {self.factor}")

    @classmethod
    def parse(cls, text: str) -> Episode:
        """``START-END:SCOPE:FACTOR``, e.g. ``100-140:inter:0.5`` (congested network)."""
        try:
            steps, scope, factor = text.split(":")
            start, end = steps.split("-")
            return cls(int(start), int(end), scope, float(factor))
        except ValueError as exc:
            raise ConfigError(
                f"--episode {brief(text)}: expected START-END:SCOPE:FACTOR with SCOPE one of "
                f"{', '.join(SCOPES)} ({shorten(str(exc))})"
            ) from None

    def covers(self, op: OpClass, step: int) -> bool:
        if not self.start <= step < self.end:
            return False
        if self.scope == "all":
            return True
        if self.scope == "compute":
            return op in COMPUTE
        return op.value.endswith("." + (Link.INTER if self.scope == "inter" else Link.INTRA).value)


class Hardware:
    """True efficiencies, memory and transition times, with seeded noise."""

    def __init__(self, seed: int, noise: float = 0.03, episodes: Sequence[Episode] = ()) -> None:
        self.rng = np.random.default_rng(seed)
        self.noise = noise
        self.episodes = tuple(episodes)

    def efficiency(self, op: OpClass, layout: Layout, step: int) -> float:
        eff = TRUE_EFFICIENCY[op]
        if op in (OpClass.GEMM, OpClass.ATTENTION):
            eff *= 1.0 - 0.04 * math.log2(layout.tp)  # thinner GEMMs per rank
        elif op is not OpClass.MEMORY:
            eff *= 1.0 - 0.03 * math.log2(layout.size)  # more hops and contention in larger groups
        for ep in self.episodes:
            if ep.covers(op, step):
                eff *= ep.factor
        return eff

    def _jitter(self) -> float:
        return float(self.rng.lognormal(0.0, self.noise)) if self.noise > 0 else 1.0

    def run(
        self, ideal_by_class: Mapping[OpClass, float], layout: Layout, step: int
    ) -> tuple[float, list[Measurement]]:
        """Measured seconds of one model-stage and the per-class measurements behind them."""
        measurements = []
        for op, ideal in ideal_by_class.items():
            if ideal > 0:
                measured = ideal / self.efficiency(op, layout, step) * self._jitter()
                measurements.append(Measurement(op, ideal, measured))
        return sum(m.measured_s for m in measurements), measurements

    def peak(self, raw_active_bytes: float, stage: Stage) -> float:
        """True peak bytes of a model-stage's own state and work on one GPU."""
        return raw_active_bytes * TRUE_MEMORY_FACTOR[stage] * min(1.02, self._jitter())

    def transition(self, estimated_s: float, rebuilt: Sequence[Stage], regrouped: int) -> float:
        """True seconds of a transition whose state moves take ``estimated_s`` by the bandwidth
        model: a little slower in truth, plus engine rebuilds for re-laid-out model-stages and
        group re-formation for model-stages that only changed DP."""
        fixed = sum(REBUILD_S[s] for s in rebuilt) + REGROUP_S * regrouped
        return (estimated_s * TRANSITION_BIAS + fixed) * self._jitter()
