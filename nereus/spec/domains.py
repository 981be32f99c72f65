"""Failure domains: which GPUs can be taken away, in what units, and how often.

Shared clusters mix GPUs the job holds for its whole allocation (*reserved*: on-demand instances,
a SLURM reservation) with GPUs that may be revoked at any time (*revocable*: spot instances,
preemptible partitions). Revocations take whole instances (an instance's GPUs go together). Two
models of when: independent Poisson revocations at ``revocations_per_hour`` per revocable
instance, or — what spot traces show, a capacity crunch taking many instances at once —
revocation *events* at ``events_per_hour``, each taking a fraction of the revocable instances
held, drawn from ``event_fractions`` (the trace's history), the instances chosen at random. Two
things follow (issue 19, paper-notes §2.9):

* placement keeps at least one replica of every trainer's state on reserved GPUs when it fits,
  so a revocation never takes a trainer's last copy and the job moves in place instead of
  restarting from a checkpoint;
* admission prices what a plan still risks: the probability that some trainer loses every copy
  during a step, times the seconds a restart costs, and the step's own work, lost when any of its
  GPUs goes (``any_lost_probability``).

Spot capacity is least stable right after the pool changed: the shipped AWS traces drop 10–20%
of ticks within the first few after a change and ~1% after hours of calm. ``age_factors`` carries
that as a piecewise-constant multiplier of the rate by the time since the pool last changed
(estimated from a trace's history by ``nereus.sim.trace``); a caller that knows that time passes
it as ``since_s``, one that does not gets the mean rate.

Pure: no clocks, no I/O; GPU ids are the cluster's global ids.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

MAX_RATE_PER_HOUR = 1e6


@dataclass(frozen=True, slots=True)
class FailureDomains:
    """GPUs ``reserved`` are never revoked; every other GPU belongs to a revocable instance of
    ``gpus_per_instance`` consecutive ids (instance ``g // gpus_per_instance``), each revoked at
    ``revocations_per_hour`` (0: revocable, rate unknown — placement still prefers reserved GPUs,
    admission prices no risk)."""

    reserved: frozenset[int]
    gpus_per_instance: int
    revocations_per_hour: float = 0.0
    events_per_hour: float = 0.0  # correlated model (used when event_fractions is not empty)
    event_fractions: tuple[float, ...] = ()  # share of the revocable instances each event took
    # (seconds since the pool last changed, rate multiplier) from that age on; () = always 1
    age_factors: tuple[tuple[float, float], ...] = ()
    # the distinct event fractions and how often each occurred: a risk prices each once, however
    # long the history (a trace of 10⁵ ticks holds thousands of events and a few dozen fractions)
    fraction_counts: tuple[tuple[float, int], ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "reserved", frozenset(self.reserved))
        if isinstance(self.gpus_per_instance, bool) or self.gpus_per_instance <= 0:
            raise ValueError(f"gpus_per_instance must be a positive integer, got {self.gpus_per_instance}")
        rate = self.revocations_per_hour
        if not (math.isfinite(rate) and 0.0 <= rate <= MAX_RATE_PER_HOUR):
            raise ValueError(f"revocations_per_hour must be in [0, {MAX_RATE_PER_HOUR:g}], got {rate}")
        if any(g < 0 for g in self.reserved):
            raise ValueError("reserved GPU ids must be non-negative")
        object.__setattr__(self, "event_fractions", tuple(float(f) for f in self.event_fractions))
        events = self.events_per_hour
        if not (math.isfinite(events) and 0.0 <= events <= MAX_RATE_PER_HOUR):
            raise ValueError(f"events_per_hour must be in [0, {MAX_RATE_PER_HOUR:g}], got {events}")
        if any(not 0.0 < f <= 1.0 for f in self.event_fractions):
            raise ValueError("event_fractions must lie in (0, 1]")
        object.__setattr__(self, "fraction_counts", tuple(sorted(Counter(self.event_fractions).items())))
        ages = tuple((float(a), float(m)) for a, m in self.age_factors)
        object.__setattr__(self, "age_factors", ages)
        if ages and (
            ages[0][0] != 0.0
            or any(b[0] <= a[0] for a, b in itertools.pairwise(ages))
            or not all(
                math.isfinite(a) and math.isfinite(m) and 0.0 <= m <= MAX_RATE_PER_HOUR for a, m in ages
            )
        ):
            raise ValueError(
                "age_factors must be (age seconds, multiplier) pairs with ages increasing from 0 "
                f"and multipliers in [0, {MAX_RATE_PER_HOUR:g}], got {ages}"
            )

    @property
    def correlated(self) -> bool:
        return bool(self.event_fractions)

    @property
    def at_risk(self) -> bool:
        """Revocations are expected at all (a known, non-zero rate)."""
        return (self.events_per_hour if self.correlated else self.revocations_per_hour) > 0

    def on_reserved(self, gpus: Iterable[int]) -> bool:
        """Every GPU of ``gpus`` is reserved."""
        return all(g in self.reserved for g in gpus)

    def revocable_instances(self, gpus: Iterable[int]) -> frozenset[int]:
        """The revocable instances that ``gpus`` touch."""
        return frozenset(g // self.gpus_per_instance for g in gpus if g not in self.reserved)

    def exposure_hours(self, seconds: float, since_s: float | None = None) -> float:
        """Hours at the mean rate that ``seconds`` starting ``since_s`` after the pool last
        changed are worth: ∫ multiplier(age) d(age) over [since_s, since_s + seconds], in hours
        (``seconds`` / 3600 where the age is unknown or no ``age_factors`` are known)."""
        if seconds <= 0:
            return 0.0
        if since_s is None or not self.age_factors:
            return seconds / 3600.0
        start, end, total = max(0.0, since_s), max(0.0, since_s) + seconds, 0.0
        bounds = [a for a, _ in self.age_factors[1:]] + [math.inf]
        for (lo, factor), hi in zip(self.age_factors, bounds, strict=True):
            total += factor * max(0.0, min(end, hi) - max(start, lo))
        return total / 3600.0

    def all_lost_probability(
        self, replicas: Iterable[Iterable[int]], seconds: float, held: int = 0, since_s: float | None = None
    ) -> float:
        """Probability that every one of ``replicas`` loses a GPU within ``seconds`` (starting
        ``since_s`` after the pool last changed, if known), with ``held`` revocable instances in
        the pool (the correlated model draws from them). Replicas sharing an instance fail
        together, so they count per distinct set of instances (an upper bound when sets overlap)."""
        groups = {self.revocable_instances(r) for r in replicas}
        hours = self.exposure_hours(seconds, since_s)
        if not groups or frozenset() in groups or hours <= 0:
            return 0.0
        if self.correlated:
            sizes = [len(g) for g in groups]
            return self._event_loss(lambda n, k: _all_drawn(n, sizes, k), hours, max(held, *sizes))
        # independent: each replica lost with any of its instances
        return math.prod(-math.expm1(-self.revocations_per_hour * len(g) * hours) for g in groups)

    def any_lost_probability(
        self, gpus: Iterable[int], seconds: float, held: int = 0, since_s: float | None = None
    ) -> float:
        """Probability that some GPU of ``gpus`` is revoked within ``seconds`` (starting
        ``since_s`` after the pool last changed, if known), with ``held`` revocable instances in
        the pool: a step on ``gpus`` loses its work."""
        touched = len(self.revocable_instances(gpus))
        hours = self.exposure_hours(seconds, since_s)
        if touched == 0 or hours <= 0:
            return 0.0
        if self.correlated:
            return self._event_loss(lambda n, k: 1.0 - _none_drawn(n, touched, k), hours, max(held, touched))
        return -math.expm1(-self.revocations_per_hour * touched * hours)

    def _event_loss(self, hit: Callable[[int, int], float], hours: float, held: int) -> float:
        """Events at ``events_per_hour`` over ``hours``, each revoking ⌈f · held⌉ random
        instances (f from the history), each a loss with probability ``hit(held, drawn)``."""
        per_event = 0.0
        for f, count in self.fraction_counts:
            k = min(held, max(1, math.ceil(f * held - 1e-9)))
            per_event += count * hit(held, k)
        per_event /= len(self.event_fractions)
        return -math.expm1(-self.events_per_hour * hours * per_event)

    @classmethod
    def from_nodes(
        cls, reserved_nodes: int, gpus_per_node: int, total_gpus: int, revocations_per_hour: float
    ) -> FailureDomains:
        """Nodes ``[0, reserved_nodes)`` reserved, every later node a revocable instance."""
        reserved = frozenset(range(min(total_gpus, reserved_nodes * gpus_per_node)))
        return cls(reserved, gpus_per_node, revocations_per_hour)


def _all_drawn(total: int, sizes: list[int], drawn: int) -> float:
    """Probability that ``drawn`` of ``total`` instances, chosen at random, hit every one of the
    disjoint sets of ``sizes`` instances. Counted with positive terms only: ways[t], the number of
    t-subsets of the sets' instances that hit every set (the coefficients of Π_i ((1 + x)^m_i − 1)),
    each completed by drawn − t of the other total − Σm instances, over C(total, drawn). Floats,
    rescaled as the product grows and combined in logs: relative error ~1e-9 at any pool size, in
    O(replicas · Σm · max m) (exact integers cost seconds a call at 10⁵ instances, and an
    inclusion–exclusion over many replicas cancels terms far larger than its result)."""
    marked = sum(sizes)
    if marked > total or drawn < len(sizes):
        return 0.0
    ways, scale = np.ones(1), 0.0
    for m in sizes:
        hits = np.exp([_log_comb(m, j) - _log_comb(m, m // 2) for j in range(m + 1)])
        hits[0] = 0.0  # the set must be hit
        ways = np.convolve(ways, hits)
        peak = float(ways.max())
        ways /= peak
        scale += math.log(peak) + _log_comb(m, m // 2)
    whole = _log_comb(total, drawn)
    got = 0.0
    for t in range(len(sizes), min(drawn, marked) + 1):
        if ways[t] > 0.0 and drawn - t <= total - marked:
            got += math.exp(math.log(ways[t]) + scale + _log_comb(total - marked, drawn - t) - whole)
    return min(1.0, got)


def _none_drawn(total: int, marked: int, drawn: int) -> float:
    """Probability that ``drawn`` of ``total`` instances, chosen at random, miss all ``marked``."""
    if marked + drawn > total:
        return 0.0
    return math.exp(_log_comb(total - marked, drawn) - _log_comb(total, drawn))


def _log_comb(n: int, k: int) -> float:
    """log C(n, k)."""
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
