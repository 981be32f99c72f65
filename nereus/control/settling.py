"""How long the GPU pool has been settled, and the replan its settling calls for (issue 19).

Spot capacity is least stable right after the pool changed (``FailureDomains.age_factors``): a
plan priced then pays for the work it expects to lose, so a replan may keep GPUs idle — not grow
onto capacity that just arrived, or fall back to the reserved floor in a crunch. As the pool
settles that price falls, yet nothing else need change: no signal crosses its threshold, so no
trigger would fire and the idle GPUs would stay idle. ``PoolAge`` keeps the time the pool last
changed (from telemetry: the first step that sees a new pool) and fires a ``settled`` trigger when
the pool has aged into a calmer bin of the rate than the last replan was priced at while the
running plan leaves pool GPUs idle.

Pure: times come in with the telemetry.
"""

from __future__ import annotations

import bisect

from nereus.control.telemetry import Telemetry
from nereus.control.triggers import GROWTH, Trigger, TriggerKind
from nereus.spec.domains import FailureDomains


class PoolAge:
    """The seconds since the pool last changed, as the job's telemetry shows them."""

    def __init__(self, domains: FailureDomains | None) -> None:
        self.domains = domains
        self._pool: frozenset[int] | None = None
        self._since_time_s = 0.0  # telemetry time at which the current pool was first seen
        self._priced_bin: int | None = None  # the age bin the last replan was priced in

    def observe(self, t: Telemetry) -> float:
        """Fold in ``t``; the seconds the pool has been as ``t`` shows it (0 on a new pool)."""
        pool = frozenset(t.pool)
        if pool != self._pool or t.lost:  # GPUs revoked within the step changed it too
            self._pool, self._since_time_s = pool, t.time_s
        return self.since(t.time_s)

    def since(self, time_s: float) -> float:
        return max(0.0, time_s - self._since_time_s)

    def priced(self, time_s: float) -> None:
        """A replan was priced at ``time_s``: settling is measured from its age bin on."""
        self._priced_bin = self._bin(self.since(time_s))

    def trigger(self, t: Telemetry, plan_gpus: frozenset[int], horizon_steps: float) -> Trigger | None:
        """``settled`` when the running plan leaves pool GPUs idle and the pool has aged into a
        later bin of ``age_factors`` (a different expected rate) since the last replan: a move
        onto the idle GPUs is a growth (``horizon_steps``: the ``pool.growth`` signal's)."""
        if self.domains is None or not self.domains.age_factors or not self.domains.at_risk:
            return None
        if self._priced_bin is None or not plan_gpus < frozenset(t.pool):
            return None
        since = self.since(t.time_s)
        if self._bin(since) <= self._priced_bin:
            return None
        return Trigger(TriggerKind.SETTLED, GROWTH, since, float(self._priced_bin), horizon_steps)

    def _bin(self, since_s: float) -> int:
        """The bin of ``age_factors`` that ``since_s`` falls in (0 without any)."""
        starts = [a for a, _ in self.domains.age_factors] if self.domains is not None else []
        return max(0, bisect.bisect_right(starts, since_s) - 1)
