"""GPU availability traces (AWS spot format) and their mapping to a GPU pool over simulated time.

Format (``shared/data/traces/spot/*.json``): ``{"metadata": {"gap_seconds": 300}, "data": [n, ...]}``
— available instances per tick. The pool at simulated time t is the tick ``⌊t / gap⌋ + offset``
(the last tick holds beyond the end), times GPUs per instance, clamped to [min_gpus, max_gpus].
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from nereus.errors import ConfigError
from nereus.spec.domains import MAX_RATE_PER_HOUR, FailureDomains
from nereus.spec.files import MAX_DATA_BYTES, brief, load_json

MIN_GAP_S, MAX_GAP_S = 1e-3, 1e9  # seconds per tick
MAX_COUNT = 1 << 20  # instances in one tick
AGE_BINS = (0, 1, 2, 4, 8, 16, 32, 64)  # ticks since the pool last changed: each bin's first
TICK_TOLERANCE = 1e-9  # relative: a time this close below a tick's start is in that tick
AGE_PRIOR_EVENTS = 2.0  # pseudo-events at the mean rate that each age bin's estimate starts from


@dataclass(frozen=True, slots=True)
class SpotTrace:
    name: str
    gap_seconds: float
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not MIN_GAP_S <= self.gap_seconds <= MAX_GAP_S:
            raise ValueError(f"gap_seconds must be in [{MIN_GAP_S:g}, {MAX_GAP_S:g}], got {self.gap_seconds}")
        if not self.counts:
            raise ValueError("the trace has no ticks")
        if any(not 0 <= c <= MAX_COUNT for c in self.counts):
            raise ValueError(f"instance counts must be in [0, {MAX_COUNT}]")

    @classmethod
    def load(cls, path: Path) -> SpotTrace:
        """Read and validate a trace; errors name the file and the field."""
        try:
            doc = load_json(path, "trace", MAX_DATA_BYTES)
        except ConfigError as exc:
            if "not valid JSON" not in str(exc) or path.suffix == ".json":
                raise
            shape = '{"metadata": {"gap_seconds": S}, "data": [...]}'
            raise ConfigError(f"{exc} (a trace is a JSON file: {shape})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a JSON object with 'metadata' and 'data'")
        meta = doc.get("metadata")
        gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
        if (
            isinstance(gap, bool)
            or not isinstance(gap, int | float)
            or not math.isfinite(gap)
            or not MIN_GAP_S <= gap <= MAX_GAP_S
        ):
            raise ConfigError(
                f"{path}: field 'metadata.gap_seconds': expected a number of seconds in "
                f"[{MIN_GAP_S:g}, {MAX_GAP_S:g}], got {brief(gap)}"
            )
        data = doc.get("data")
        if not isinstance(data, list) or not data:
            raise ConfigError(f"{path}: field 'data': expected a non-empty list of instance counts")
        counts = []
        for i, raw in enumerate(data):
            v = int(raw) if isinstance(raw, float) and raw.is_integer() else raw  # 8.0: numpy's dump
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT:
                raise ConfigError(
                    f"{path}: field 'data[{i}]': expected a whole instance count in [0, {MAX_COUNT}], "
                    f"got {brief(raw)}"
                )
            counts.append(v)
        return cls(path.stem, float(gap), tuple(counts))


@dataclass(frozen=True, slots=True)
class GpuSupply:
    """GPUs available over simulated time: a trace scaled to a pool of instances.

    Instance i owns GPU ids [i·g, (i+1)·g) with g GPUs per instance. The first ⌈min_gpus / g⌉
    instances are a reserved allocation that never goes away; the others come and go with the
    trace: when the count drops, *random* instances are revoked (seeded per tick, so every policy
    replayed on the same scenario sees the same revocations); when it grows, random free ones
    return. The pool at time t is tick ⌊t·speedup / gap⌋ + offset (the last tick holds).
    """

    trace: SpotTrace
    gpus_per_instance: int
    max_gpus: int
    min_gpus: int = 0
    offset_ticks: int = 0  # where in the trace the run starts
    speedup: float = 1.0  # trace seconds per simulated second (> 1: a more volatile cluster)
    seed: int = 0
    _ticks: list[tuple[int, ...]] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.gpus_per_instance <= 0 or self.max_gpus <= 0:
            raise ValueError("gpus_per_instance and max_gpus must be positive")
        if not 0 <= self.min_gpus <= self.max_gpus:
            raise ValueError("min_gpus must be in [0, max_gpus]")
        if not 0 <= self.offset_ticks < len(self.trace.counts):
            raise ValueError(f"offset_ticks must be in [0, {len(self.trace.counts)})")
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")

    def tick(self, time_s: float) -> int:
        # a tick's start computed in floating point (``next_change_after``'s k·gap/speedup) may
        # land a hair before it (3·(300/7)·7/300 = 2.999…): it belongs to that tick, or a run
        # waiting for the pool to change would never get past it
        x = time_s * self.speedup / self.trace.gap_seconds
        t = int(x + TICK_TOLERANCE * max(1.0, x)) + self.offset_ticks
        return min(t, len(self.trace.counts) - 1)

    def _instances(self, tick: int) -> tuple[int, ...]:
        g = self.gpus_per_instance
        total = self.max_gpus // g
        reserved = self.reserved_instances
        held: set[int] = set(range(reserved))
        while len(self._ticks) <= tick - self.offset_ticks:
            k = self.offset_ticks + len(self._ticks)
            if self._ticks:
                held = set(self._ticks[-1])
            want = max(reserved, min(total, self.trace.counts[k]))
            rng = random.Random(self.seed * 1_000_003 + k)
            spot = sorted(held - set(range(reserved)))
            if len(held) > want:
                for inst in rng.sample(spot, len(held) - want):
                    held.discard(inst)
            elif len(held) < want:
                free = sorted(set(range(reserved, total)) - held)
                held.update(rng.sample(free, want - len(held)))
            self._ticks.append(tuple(sorted(held)))
        return self._ticks[tick - self.offset_ticks]

    @property
    def reserved_instances(self) -> int:
        return min(self.max_gpus // self.gpus_per_instance, -(-self.min_gpus // self.gpus_per_instance))

    def _held_revocable(self) -> list[int]:
        """Revocable instances held per tick (counts clamped to the pool's [reserved, max])."""
        total, floor = self.max_gpus // self.gpus_per_instance, self.reserved_instances
        return [min(total, max(floor, c)) - floor for c in self.trace.counts]

    def revocations_per_hour(self) -> float:
        """Revocations per revocable instance per simulated hour, estimated from the whole trace
        as a planner would from its history: instances lost between ticks over the instance-hours
        held beyond the reserved floor."""
        held = self._held_revocable()
        lost = sum(max(0, a - b) for a, b in itertools.pairwise(held))
        hours = sum(held[:-1]) * self.trace.gap_seconds / self.speedup / 3600.0
        return lost / hours if hours > 0 else 0.0

    def revocation_events(self, first: int = 0, end: int | None = None) -> tuple[float, tuple[float, ...]]:
        """Revocation events per simulated hour while revocable instances are held, and the
        share of them each event took: drops in the trace come in bursts, not one by one. Over
        the trace's ticks ``[first, end)`` (``age_counts``' window; the whole trace by default)."""
        held = self._held_revocable()[first : None if end is None else end + 1]
        fractions = tuple((a - b) / a for a, b in itertools.pairwise(held) if b < a)
        hours = sum(1 for a in held[:-1] if a > 0) * self.trace.gap_seconds / self.speedup / 3600.0
        return (len(fractions) / hours if hours > 0 else 0.0), fractions

    def age_factors(self) -> tuple[tuple[float, float], ...]:
        """The revocation rate by the time since the pool last changed, relative to the mean
        (``FailureDomains.age_factors``), from the trace's history: ticks holding revocable
        instances binned by their age in ticks (0, 1, 2–3, 4–7, … , ≥ 64), each bin's drops per
        tick over the mean's, shrunk toward 1 by ``AGE_PRIOR_EVENTS`` pseudo-events so a thin
        bin says little. In simulated seconds."""
        exposed, drops = self.age_counts()
        ticks = sum(exposed)
        if ticks == 0 or sum(drops) == 0:
            return ()
        mean = sum(drops) / ticks
        tick_s = self.trace.gap_seconds / self.speedup
        return tuple(
            (lo * tick_s, (d + AGE_PRIOR_EVENTS) / (n * mean + AGE_PRIOR_EVENTS))
            for lo, n, d in zip(AGE_BINS, exposed, drops, strict=True)
        )

    def age_counts(self, first: int = 0, end: int | None = None) -> tuple[list[int], list[int]]:
        """Per age bin (``AGE_BINS``, ticks since the pool last changed): the ticks of the trace
        in ``[first, end)`` that held revocable instances, and those after which the pool lost
        some. Ages count from the trace's start, whatever ``first``."""
        held = self._held_revocable()
        exposed, drops = [0] * len(AGE_BINS), [0] * len(AGE_BINS)
        age = 0
        for tick, (a, b) in enumerate(itertools.pairwise(held)):
            if a > 0 and first <= tick and (end is None or tick < end):
                k = bisect.bisect_right(AGE_BINS, age) - 1
                exposed[k] += 1
                drops[k] += b < a
            age = 0 if b != a else age + 1
        return exposed, drops

    def domains(self) -> FailureDomains:
        """The reserved floor's GPUs and the trace's revocation history, as the planner knows
        them: the correlated model (events and their sizes), with the per-instance rate and the
        rate's dependence on the time since the pool last changed too."""
        reserved = frozenset(range(self.reserved_instances * self.gpus_per_instance))
        events, fractions = self.revocation_events()
        rate = self.revocations_per_hour()
        fastest = max(events, rate)
        if fastest > MAX_RATE_PER_HOUR:
            raise ConfigError(
                f"trace {self.trace.name}: revocations come {fastest:.3g} times per simulated hour, "
                f"more than {MAX_RATE_PER_HOUR:g}: its gap_seconds {self.trace.gap_seconds:g} at speed-up "
                f"{self.speedup:g} is too fast to simulate (a larger gap_seconds or a smaller --speedup)"
            )
        return FailureDomains(
            reserved, self.gpus_per_instance, rate, events, fractions,
            self.age_factors(),
        )  # fmt: skip

    def pool_at(self, time_s: float) -> tuple[int, ...]:
        g = self.gpus_per_instance
        return tuple(i * g + j for i in self._instances(self.tick(time_s)) for j in range(g))

    def held_through(self, start_s: float, end_s: float) -> frozenset[int]:
        """The GPUs the pool held at every tick from ``start_s`` to ``end_s``: one revoked in
        between is not among them even if the pool holds it again by ``end_s`` (its instance was
        replaced; whatever ran there is gone)."""
        first, last = self.tick(start_s), self.tick(max(start_s, end_s))
        kept = set(self._instances(first))
        for k in range(first + 1, last + 1):
            kept &= set(self._instances(k))
        g = self.gpus_per_instance
        return frozenset(i * g + j for i in kept for j in range(g))

    def next_change_after(self, time_s: float) -> float | None:
        """Simulated time at which the pool next differs, or None if it never does again."""
        now = self._instances(self.tick(time_s))
        gap = self.trace.gap_seconds / self.speedup
        k = self.tick(time_s)
        while k + 1 < len(self.trace.counts):
            k += 1
            if self._instances(k) != now:
                return (k - self.offset_ticks) * gap
        return None
