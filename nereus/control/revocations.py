"""The revocation rate a job learns from its own pool (issue 19, failure domains).

A cluster YAML states revocable nodes and, at best, a flat ``revocations_per_node_hour`` (often
0: revocable, rate unknown). The simulator knows more: a spot trace's history gives the rate and
how it depends on the time since the pool last changed (``FailureDomains.age_factors``). A job
on a real cluster sees that history as it happens: each step's telemetry says which GPUs are in
the pool. ``RevocationHistory`` keeps what it saw — instance-hours of revocable nodes held, by
the pool's age, and the revocable nodes that left without the launcher draining them — and
turns it into the rate and age factors admission prices with:

* the rate: (nodes lost + r₀ · h₀) / (instance-hours held + h₀), the YAML's rate r₀ as a prior
  worth ``PRIOR_HOURS`` instance-hours (with r₀ = 0 the rate stays 0 until a node is lost);
* the age factors: per bin of the pool's age (0, 1, 2, 4, … , 64 minutes), the nodes lost over
  the losses the rate predicts for the hours held in that bin, shrunk toward 1 by
  ``PRIOR_EVENTS`` pseudo-losses, as ``GpuSupply.age_factors`` estimates them from a trace.

Pure: times and pools come in with the telemetry.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import replace

from nereus.control.telemetry import Telemetry
from nereus.spec.domains import FailureDomains

PRIOR_HOURS = 24.0  # instance-hours the YAML's rate is worth against what the job observes
PRIOR_EVENTS = 2.0  # pseudo-losses each age bin is shrunk toward the mean rate by
AGE_BINS_S = tuple(60.0 * m for m in (0, 1, 2, 4, 8, 16, 32, 64))  # each bin's first age, seconds


class RevocationHistory:
    """Revocable nodes held and lost, from the job's telemetry; ``domains`` prices with them."""

    def __init__(self, prior: FailureDomains, bins_s: tuple[float, ...] = AGE_BINS_S) -> None:
        if not bins_s or bins_s[0] != 0.0 or any(b <= a for a, b in itertools.pairwise(bins_s)):
            raise ValueError(f"age bins must increase from 0, got {bins_s}")
        self.prior, self.bins_s = prior, bins_s
        self.held_s = [0.0] * len(bins_s)  # instance-seconds of revocable nodes held, by age bin
        self.lost = [0] * len(bins_s)  # revocable nodes lost, by the pool's age when they went
        self._last: Telemetry | None = None
        self._changed_s = 0.0  # telemetry time the pool last changed
        self._leaving: set[int] = set()  # nodes the launcher is draining: not revocations

    def draining(self, pool: Iterable[int]) -> None:
        """The launcher is shrinking the pool to ``pool`` (a planned shrink): the nodes that
        leave are not revoked."""
        if self._last is not None:
            kept = self.prior.revocable_instances(pool)
            self._leaving |= self.prior.revocable_instances(self._last.pool) - kept

    def observe(self, t: Telemetry) -> None:
        """Fold in one step's telemetry: the revocable nodes held since the last, and those lost."""
        last, self._last = self._last, t
        if last is None:
            self._changed_s = t.time_s
            return
        before = self.prior.revocable_instances(last.pool)
        now = self.prior.revocable_instances(t.pool)
        k = self._bin(last.time_s - self._changed_s)
        self.held_s[k] += len(before) * max(0.0, t.time_s - last.time_s)
        died = self.prior.revocable_instances(t.lost) & before  # replaced within the step: revoked too
        gone = ((before - now) | died) - self._leaving
        self._leaving -= before - now
        if frozenset(last.pool) != frozenset(t.pool) or died:
            self._changed_s = t.time_s
        self.lost[k] += len(gone)

    def rate_per_hour(self) -> float:
        """Revocations per revocable node-hour: what was seen, with the YAML's rate as a prior."""
        hours = sum(self.held_s) / 3600.0
        return (sum(self.lost) + self.prior.revocations_per_hour * PRIOR_HOURS) / (hours + PRIOR_HOURS)

    def age_factors(self) -> tuple[tuple[float, float], ...]:
        """The rate by the pool's age over the mean, shrunk toward 1; () before any loss."""
        total = sum(self.lost)
        if total == 0:
            return ()
        mean = total / sum(self.held_s)  # per instance-second
        return tuple(
            (lo, (lost + PRIOR_EVENTS) / (held * mean + PRIOR_EVENTS))
            for lo, held, lost in zip(self.bins_s, self.held_s, self.lost, strict=True)
        )

    def domains(self) -> FailureDomains:
        """The prior's reserved GPUs and nodes, priced at the learned rate and age factors
        (the independent model: a node is a revocable instance)."""
        return replace(
            self.prior,
            revocations_per_hour=self.rate_per_hour(),
            events_per_hour=0.0,
            event_fractions=(),
            age_factors=self.age_factors(),
        )

    def _bin(self, age_s: float) -> int:
        return max(0, bisect.bisect_right(self.bins_s, age_s) - 1)
