"""The monitor at a step boundary (paper §1): every rank's report, gathered once, becomes the
controller's ``Telemetry`` and the leader's ``StepRecord``.

Each rank reports the seconds each model-stage's work took on it, the bytes of state it holds per
model-stage, its op-class timings and whether SLURM asked it to stop (one ``all_gather``). A
model-stage's time is its slowest rank's; its peak memory the largest bytes one of its ranks
holds. Edge module (torch.distributed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nereus.control.telemetry import Telemetry
from nereus.plan.layout import Plan
from nereus.runtime.comm import all_gather
from nereus.runtime.metrics import StepRecord
from nereus.runtime.optimes import OpTime, efficiencies, measurements
from nereus.runtime.rollout import Rollouts
from nereus.runtime.worker import Worker


@dataclass(frozen=True, slots=True)
class RankReport:
    """What one rank tells the others at a step boundary."""

    stage_seconds: Mapping[str, float]
    held_bytes: Mapping[str, int]
    preempted: bool
    optimes: tuple[OpTime, ...]


@dataclass(frozen=True, slots=True)
class StepResult:
    """One RL step as the loop saw it on this rank."""

    step: int
    rollouts: Rollouts
    metrics: Mapping[str, float]
    seconds: float  # the algorithm and the weight sync
    sync_s: float


def gather_reports(worker: Worker, preempt: bool) -> list[RankReport]:
    """Every rank's report, in rank order (collective over the world)."""
    held = {n: rs.nbytes for n, rs in worker.holder.units.items()}
    return all_gather(
        RankReport(dict(worker.times.seconds), held, preempt, tuple(worker.optimes)), RankReport
    )


def stage_times(reports: Sequence[RankReport]) -> dict[str, float]:
    """Each model-stage's seconds: its slowest rank's."""
    names = {n for r in reports for n in r.stage_seconds}
    return {n: max(r.stage_seconds.get(n, 0.0) for r in reports) for n in names}


def peaks(reports: Sequence[RankReport]) -> dict[str, float]:
    """Each model-stage's largest bytes held on one rank."""
    names = {n for r in reports for n in r.held_bytes}
    return {n: float(max(r.held_bytes.get(n, 0) for r in reports)) for n in names}


def telemetry(
    result: StepResult, reports: Sequence[RankReport], pool: tuple[int, ...], time_s: float, calibrate: bool
) -> Telemetry:
    """The controller's view of the step (``calibrate``: with its op-class measurements)."""
    lengths = result.rollouts.response_lengths().float()
    mean = max(1.0, float(lengths.mean()))
    ops = measurements([t for r in reports for t in r.optimes]) if calibrate else ()
    return Telemetry(
        result.step, time_s, mean, max(mean, float(lengths.quantile(0.95))), pool, stage_times(reports),
        peaks(reports), ops,
    )  # fmt: skip


def step_record(result: StepResult, reports: Sequence[RankReport], plan: Plan) -> StepRecord:
    """The leader's record of the step, before its boundary's decision and transitions."""
    ops = measurements([t for r in reports for t in r.optimes])
    lengths = result.rollouts.response_lengths().float()
    record = StepRecord.of(
        result.step, dict(result.metrics), result.seconds, float(lengths.mean()), plan, result.sync_s,
        stage_times(reports),
    )  # fmt: skip
    return record.with_efficiency(efficiencies(ops))
