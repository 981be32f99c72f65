"""The monitor at a step boundary (paper §1): every rank's report, gathered once on the leader,
becomes the controller's ``Telemetry`` and the leader's ``StepRecord``; the leader's ``Notice``
(a stop, the pool change, or the boundary's action) is the one message every rank waits for.

Each rank reports the seconds each model-stage's work took on it, each model-stage's peak memory
on its device (its state plus its working memory, from the allocator: ``devices.StageMemory``;
nothing on a CPU, where there is no allocator to ask — the bytes of state a rank holds are not a
peak, and fed as one they drove the memory correction down to its floor), its op-class timings
and whether it was asked to stop (one ``gather`` to the leader: nobody else reads the reports).
A model-stage's time is its slowest rank's; its peak the largest of its ranks'. A worker on a GPU
also sends its GPU's health when a check is due (``health.py``). A report travels as float64s
(model-stages and op classes by their index; ``pack_report``) and its health JSON, not as a JSON
object: a fifth of the bytes, and decoded in microseconds. Edge module (torch.distributed).
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from nereus.backends.protocol import GenerationStats
from nereus.control.action import Action
from nereus.control.telemetry import Telemetry
from nereus.plan.layout import Plan
from nereus.plan.opclass import OpClass
from nereus.runtime.codec import MessageError
from nereus.runtime.comm import gather_bytes
from nereus.runtime.metrics import StepRecord
from nereus.runtime.optimes import OpTime, efficiencies, measurements
from nereus.runtime.pool import Change
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
    # when this rank reached the boundary (its step and checkpoint done; wall-clock seconds since
    # the epoch): the leader's wait for its slowest peer is the latest of these less its own
    ready_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Notice:
    """What the leader tells every rank once it has read the reports (one broadcast): stop
    (a rank was asked to), or the pool change (the action then follows in the next generation),
    or — no change, the common case — the boundary's action itself."""

    preempted: bool = False
    change: Change | None = None
    action: Action | None = None

    def __post_init__(self) -> None:
        if self.preempted + (self.change is not None) + (self.action is not None) != 1:
            raise ValueError("a notice is a stop, a pool change or an action: exactly one of them")


@dataclass(frozen=True, slots=True)
class Lengths:
    """A step's response lengths in tokens: their mean and 95th percentile, computed once for
    the controller's telemetry and the step's record."""

    mean: float
    p95: float

    def __post_init__(self) -> None:
        if not (self.mean >= 0 and self.p95 >= 0):
            raise ValueError(f"response lengths must be non-negative, got {self.mean} and {self.p95}")

    @classmethod
    def of(cls, rollouts: Rollouts) -> Lengths:
        lengths = rollouts.response_lengths().float()
        return cls(float(lengths.mean()), float(lengths.quantile(0.95)))

    @property
    def seen(self) -> tuple[float, float]:
        """The mean and p95 the controller sees (at least one token; p95 at least the mean)."""
        mean = max(1.0, self.mean)
        return mean, max(mean, self.p95)


@dataclass(frozen=True, slots=True)
class StepResult:
    """One RL step as the loop saw it on this rank."""

    step: int
    rollouts: Rollouts
    metrics: Mapping[str, float]
    seconds: float  # the algorithm and the weight sync
    sync_s: float
    asynchrony: Mapping[str, float] | None = None  # async: staleness, overlap, waits (``asynchrony.py``)
    validation: Mapping[str, float] | None = None  # data.val's scores after this step (``validation.py``)


def gather_reports(worker: Worker, preempt: bool, ready_at: float = 0.0) -> list[RankReport] | None:
    """Every rank's report, in rank order, on the leader (rank 0); None on the others
    (collective over the world). ``ready_at``: when this rank reached the boundary (``time.time``)."""
    report = RankReport(
        dict(worker.times.seconds), dict(worker.memory.peaks), preempt, tuple(worker.optimes),
        worker.health.report(), dict(worker.memory.reserved), dict(worker.generation), ready_at,
    )  # fmt: skip
    names = tuple(ms.name for ms in worker.workflow.model_stages)
    got = gather_bytes(pack_report(report, names), dst=0)
    return None if got is None else [unpack_report(data, names) for data in got]


OPS = tuple(OpClass)
EXACT = 2**53  # integers up to this travel exactly as float64s
HEADER = 9  # float64s: format, preempted, ready_at, five counts, the health JSON's bytes
WIDTHS = (2, 2, 2, 4, 5)  # float64s per stage time, peak, reserved peak, op time, generation


def pack_report(r: RankReport, names: Sequence[str]) -> bytes:
    """``r`` as float64s — model-stages by their index in ``names`` (the workflow's), op classes
    by theirs in ``OpClass`` — then its health JSON (UTF-8). Every value round-trips exactly."""
    at = {n: i for i, n in enumerate(names)}
    op_at = {op: i for i, op in enumerate(OPS)}
    health = r.health.encode()
    rows: list[tuple[float, ...]] = [
        (2, r.preempted, r.ready_at, len(r.stage_seconds), len(r.peak_bytes), len(r.reserved_bytes),
         len(r.optimes), len(r.generation), len(health)),
        *((at[n], v) for n, v in r.stage_seconds.items()),
        *((at[n], _exact(v)) for n, v in r.peak_bytes.items()),
        *((at[n], _exact(v)) for n, v in r.reserved_bytes.items()),
        *((at[t.model_stage], op_at[t.op_class], t.ideal_s, t.measured_s) for t in r.optimes),
        *((at[n], _exact(g.tokens), _exact(g.decode_steps), g.kv_usage, _exact(g.preemptions))
          for n, g in r.generation.items()),
    ]  # fmt: skip
    values = array("d", (float(x) for row in rows for x in row))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes() + health


def unpack_report(data: bytes, names: Sequence[str]) -> RankReport:
    """The report ``pack_report`` wrote; anything else is a ``MessageError``."""
    head = _floats(data[: 8 * HEADER])
    if len(head) != HEADER or head[0] != 2 or head[1] not in (0.0, 1.0) or head[2] < 0:
        raise MessageError("report: not a rank report")
    counts = [_count(x) for x in head[3:]]
    end = 8 * (HEADER + sum(c * w for c, w in zip(counts, WIDTHS, strict=False)))
    if len(data) != end + counts[-1]:
        raise MessageError(f"report: {len(data)} bytes, its header announces {end + counts[-1]}")
    body = iter(_floats(data[8 * HEADER : end]))
    rows = [
        [tuple(next(body) for _ in range(w)) for _ in range(c)] for c, w in zip(counts, WIDTHS, strict=False)
    ]

    def name(x: float) -> str:
        return names[_count(x, len(names))]

    try:
        return RankReport(
            {name(i): v for i, v in rows[0]}, {name(i): _count(v) for i, v in rows[1]}, bool(head[1]),
            tuple(OpTime(name(i), OPS[_count(k, len(OPS))], a, b) for i, k, a, b in rows[3]),
            data[end:].decode(), {name(i): _count(v) for i, v in rows[2]},
            {name(i): GenerationStats(_count(t), _count(d), kv, _count(p)) for i, t, d, kv, p in rows[4]},
            head[2],
        )  # fmt: skip
    except MessageError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:  # a GenerationStats refused its values, say
        raise MessageError(f"report: {exc}") from None


def _exact(n: int) -> int:
    if not 0 <= n < EXACT:
        raise ValueError(f"a report's count {n} is out of range")
    return n


def _floats(data: bytes) -> list[float]:
    if len(data) % 8:
        raise MessageError("report: not a whole number of float64s")
    values = array("d")
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    if not all(math.isfinite(x) for x in values):
        raise MessageError("report: a value that is not finite")
    return values.tolist()


def _count(x: float, below: int = EXACT) -> int:
    """``x`` as an index or count: a whole number in [0, below)."""
    if not (0 <= x < below and x == int(x)):
        raise MessageError(f"report: {x} is not a count below {below}")
    return int(x)


def straggler_s(reports: Sequence[RankReport], me: int = 0) -> float:
    """Seconds rank ``me`` waited at the boundary for its slowest peer to get there (to finish its
    step and checkpoint): the latest ``ready_at`` less ``me``'s. That wait is the step's time on
    that peer — the next step's barrier would wait for it with no monitor at all — not the
    monitor's. Wall clocks of different hosts agree only to NTP's precision; the caller bounds it."""
    return max(0.0, max(r.ready_at for r in reports) - reports[me].ready_at) if reports else 0.0


def stage_times(reports: Sequence[RankReport]) -> dict[str, float]:
    """Each model-stage's seconds: its slowest rank's."""
    names = {n for r in reports for n in r.stage_seconds}
    return {n: max(r.stage_seconds.get(n, 0.0) for r in reports) for n in names}


def peaks(reports: Sequence[RankReport]) -> dict[str, float]:
    """Each model-stage's peak memory: the largest its ranks measured (none measured, none here)."""
    names = {n for r in reports for n in r.peak_bytes}
    return {n: float(max(r.peak_bytes.get(n, 0) for r in reports)) for n in names}


def telemetry(
    result: StepResult, reports: Sequence[RankReport], pool: tuple[int, ...], time_s: float, calibrate: bool,
    lengths: Lengths | None = None,
) -> Telemetry:  # fmt: skip
    """The controller's view of the step (``calibrate``: with its op-class measurements;
    ``lengths``: the step's, when already computed)."""
    mean, p95 = (lengths or Lengths.of(result.rollouts)).seen
    ops = measurements([t for r in reports for t in r.optimes]) if calibrate else ()
    return Telemetry(result.step, time_s, mean, p95, pool, stage_times(reports), peaks(reports), ops)


def step_record(
    result: StepResult, reports: Sequence[RankReport], plan: Plan, lengths: Lengths | None = None
) -> StepRecord:
    """The leader's record of the step, before its boundary's decision and transitions."""
    ops = measurements([t for r in reports for t in r.optimes])
    mean = (lengths or Lengths.of(result.rollouts)).mean
    record = StepRecord.of(
        result.step, dict(result.metrics), result.seconds, mean, plan, result.sync_s, stage_times(reports)
    )
    record = record.with_efficiency(efficiencies(ops)).with_memory(memory_gib(reports))
    if result.asynchrony is not None:
        record = replace(record, asynchrony=dict(result.asynchrony))
    if result.validation is not None:
        record = replace(record, validation=dict(result.validation))
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
