"""The monitor at a step boundary (paper §1): every rank's report, gathered once, becomes the
controller's ``Telemetry`` and the leader's ``StepRecord``.

Each rank reports the seconds each model-stage's work took on it, each model-stage's peak memory
on its device (its state plus its working memory, from the allocator: ``devices.StageMemory``;
nothing on a CPU, where there is no allocator to ask — the bytes of state a rank holds are not a
peak, and fed as one they drove the memory correction down to its floor), its op-class timings
and whether it was asked to stop (one ``all_gather``). A model-stage's time is its slowest rank's;
its peak the largest of its ranks'. A worker on a GPU also sends its GPU's health when a check is
due (``health.py``). Edge module (torch.distributed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nereus.backends.protocol import GenerationStats
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
    peak_bytes: Mapping[str, int]  # allocator peaks per model-stage (empty on a CPU)
    preempted: bool
    optimes: tuple[OpTime, ...]
    health: str = ""  # its GPU's inventory as JSON when a health check was due (``health.py``)
    reserved_bytes: Mapping[str, int] = field(default_factory=dict)  # the allocator's reserved peaks
    generation: Mapping[str, GenerationStats] = field(default_factory=dict)  # its replicas' generation


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
    report = RankReport(
        dict(worker.times.seconds), dict(worker.memory.peaks), preempt, tuple(worker.optimes),
        worker.health.report(), dict(worker.memory.reserved), dict(worker.generation),
    )  # fmt: skip
    return all_gather(report, RankReport)


def stage_times(reports: Sequence[RankReport]) -> dict[str, float]:
    """Each model-stage's seconds: its slowest rank's."""
    names = {n for r in reports for n in r.stage_seconds}
    return {n: max(r.stage_seconds.get(n, 0.0) for r in reports) for n in names}


def peaks(reports: Sequence[RankReport]) -> dict[str, float]:
    """Each model-stage's peak memory: the largest its ranks measured (none measured, none here)."""
    names = {n for r in reports for n in r.peak_bytes}
    return {n: float(max(r.peak_bytes.get(n, 0) for r in reports)) for n in names}


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
    record = record.with_efficiency(efficiencies(ops)).with_memory(memory_gib(reports))
    return record.with_generation(generation(reports))


def generation(reports: Sequence[RankReport]) -> dict[str, dict[str, float]]:
    """Each generating model-stage's statistics over its replicas (the KV share: the largest)."""
    total: dict[str, GenerationStats] = {}
    for r in reports:
        for name, stats in r.generation.items():
            total[name] = total.get(name, GenerationStats()).plus(stats)
    return {name: total[name].as_dict() for name in sorted(total)}


def memory_gib(reports: Sequence[RankReport]) -> dict[str, dict[str, float]]:
    """Each model-stage's peak allocated and reserved GiB, the largest over its ranks (GPU only)."""
    names = {n for r in reports for n in r.peak_bytes}
    return {
        n: {
            "allocated": round(max(r.peak_bytes.get(n, 0) for r in reports) / 2**30, 3),
            "reserved": round(max(r.reserved_bytes.get(n, 0) for r in reports) / 2**30, 3),
        }
        for n in sorted(names)
    }
