"""The next step's response lengths, forecast from the last step's and the lengths' growth.

Replans price the step ahead: the lengths the last step measured, grown by an EMA of the per-step
growth of the mean response length (weight ½), capped by the workload's longest response. The
p95 grows alike and is never under the mean.

Pure.
"""

from __future__ import annotations

from nereus.plan.problem import SeqStats

WEIGHT = 0.5  # the EMA weight of the latest step's growth


class LengthForecast:
    """The growth of the mean response length, step over step, and the lengths it forecasts."""

    def __init__(self, prompt_len: int, max_response_len: int) -> None:
        self.prompt_len = prompt_len
        self.cap = max_response_len
        self.growth = 1.0  # EMA of the per-step growth of the mean response length
        self.last: float | None = None  # the last step's mean response length

    def grown(self, mean: float) -> float:
        """The growth EMA once a step with mean response length ``mean`` is folded in."""
        if self.last is not None and self.last > 0:
            return (1.0 - WEIGHT) * self.growth + WEIGHT * (mean / self.last)
        return self.growth

    def observe(self, mean: float) -> None:
        """A step measured mean response length ``mean``."""
        self.growth, self.last = self.grown(mean), mean

    def at(self, mean: float, p95: float, growth: float) -> SeqStats:
        """The lengths ``mean`` and ``p95`` grown by ``growth``, within the cap."""
        grown = min(mean * growth, self.cap)
        return SeqStats(self.prompt_len, grown, max(grown, min(p95 * growth, self.cap)))

    def ahead(self, mean: float, p95: float, steps: float = 1.0) -> SeqStats:
        """The lengths ``steps`` steps after a step that measured ``mean`` and ``p95`` (0: its own)."""
        return self.at(mean, p95, self.growth**steps)
