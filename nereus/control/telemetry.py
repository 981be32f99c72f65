"""What the monitor reports at the end of every RL step (paper §1, "Monitor")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nereus.plan.calibration import Measurement
from nereus.plan.opclass import OpClass


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One step's signals: lengths, the GPU pool, measured times and memory peaks.

    ``peak_memory`` is, per model-stage, the largest bytes its own state and work took on one of
    its GPUs during the step (what ``torch.cuda.max_memory_allocated`` shows around its run, less
    what other stages left resident). ``measurements`` pair each timed op class's ideal seconds
    (at efficiency 1) with the measured ones.
    """

    step: int
    time_s: float  # clock at the end of the step
    seq_len_mean: float  # response tokens
    seq_len_p95: float
    pool: tuple[int, ...]  # GPU ids available now
    stage_times: Mapping[str, float] = field(default_factory=dict)
    peak_memory: Mapping[str, float] = field(default_factory=dict)
    measurements: tuple[Measurement, ...] = ()
    oom: bool = False  # the step ran out of memory (and was lost)
    oom_stage: str = ""  # the model-stage whose work ran out, when known
    # The job's world re-forms at this boundary (a worker joined or left): every model-stage's
    # groups and engines are rebuilt whatever the controller decides, so a transition is charged
    # only for what it adds (moving state), not for those rebuilds.
    reformed: bool = False
    # GPUs whose workers died during the step (their instance was revoked), whether or not the
    # pool holds them again at its end: a replacement starts empty, so their state is lost
    lost: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be non-negative, got {self.step}")
        if self.seq_len_mean <= 0 or self.seq_len_p95 < self.seq_len_mean:
            raise ValueError("sequence lengths must be positive with p95 ≥ mean")
        if len(set(self.pool)) != len(self.pool):
            raise ValueError("pool GPU ids repeat")
        if len(set(self.lost)) != len(self.lost):
            raise ValueError("lost GPU ids repeat")
        object.__setattr__(self, "stage_times", MappingProxyType(dict(self.stage_times)))
        object.__setattr__(self, "peak_memory", MappingProxyType(dict(self.peak_memory)))

    def lost_of(self, gpus: frozenset[int]) -> frozenset[int]:
        """The GPUs of ``gpus`` whose state is gone: out of the pool, or died during the step
        (``lost``) though the pool holds them again."""
        return (gpus - frozenset(self.pool)) | (gpus & frozenset(self.lost))

    def efficiency(self, op: OpClass) -> float | None:
        """Achieved efficiency of ``op`` this step (Σ ideal / Σ measured), if it was timed."""
        ideal = sum(m.ideal_s for m in self.measurements if m.op_class is op)
        measured = sum(m.measured_s for m in self.measurements if m.op_class is op)
        return ideal / measured if measured > 0 else None
