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

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MAX_RATE_PER_HOUR = 1e6
MAX_COUNT_CELLS = 50_000_000  # element operations of an exact all-replicas-hit count (~1 s)


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
    disjoint sets of ``sizes`` instances: Σ_t P(t of the draws land in the sets) · P(t random
    picks among the sets' instances hit every set), every term a probability (no cancellation,
    no overflow). The second factor, f(t), is built set by set: with the first k sets holding M_k
    instances, f_k(s) = Σ_{j≥1} H(j; M_k, m_k, s) · f_{k−1}(s − j), H the hypergeometric chance
    that j of s picks fall in set k. Relative error ~1e-9 at any pool size (log-factorials);
    O(Σ min(m, w) · w) with w = min(drawn, Σm) + 1. Past ``MAX_COUNT_CELLS`` of that, the
    replicas are counted as if hit independently: an upper bound (under sampling without
    replacement, hits are negatively associated), so a risk is never under-priced."""
    marked = sum(sizes)
    if marked > total or drawn < len(sizes):
        return 0.0
    width = min(drawn, marked) + 1
    if sum(min(m, width) for m in sizes) * width > MAX_COUNT_CELLS:
        return math.prod(1.0 - _none_drawn(total, m, drawn) for m in sizes)
    lf = _log_factorials(total)
    f = np.zeros(width)
    f[0] = 1.0  # no sets yet: 0 picks among their 0 instances, all (none) hit
    held = 0
    for m in sizes:
        grown = held + m
        top = min(grown, width - 1)
        nxt = np.zeros(width)
        for j in range(1, min(m, top) + 1):
            s = np.arange(j, min(top, held + j) + 1)  # s − j picks among the earlier sets' held
            logh = _lc(lf, m, j) + _lc(lf, held, s - j) - _lc(lf, grown, s)
            nxt[s] += np.exp(logh) * f[s - j]
        f, held = nxt, grown
    t = np.arange(len(sizes), width)
    t = t[drawn - t <= total - marked]
    logq = _lc(lf, marked, t) + _lc(lf, total - marked, drawn - t) - _lc(lf, total, np.asarray(drawn))
    return float(min(1.0, np.sum(np.exp(logq) * f[t])))


def _lc(lf: FloatArray, n: int, k: IntArray | np.integer | int) -> FloatArray:
    """log C(n, k) from the log-factorial table ``lf``."""
    k = np.asarray(k)
    return np.asarray(lf[n] - lf[k] - lf[n - k], dtype=np.float64)


@functools.lru_cache(maxsize=8)
def _log_factorials(n: int) -> FloatArray:
    """log(i!) for i = 0 … n."""
    out = np.zeros(n + 1)
    np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)), out=out[1:])
    return out


def _none_drawn(total: int, marked: int, drawn: int) -> float:
    """Probability that ``drawn`` of ``total`` instances, chosen at random, miss all ``marked``."""
    if marked + drawn > total:
        return 0.0
    return math.exp(_log_comb(total - marked, drawn) - _log_comb(total, drawn))


def _log_comb(n: int, k: int) -> float:
    """log C(n, k)."""
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
