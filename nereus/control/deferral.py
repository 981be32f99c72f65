"""A rejected target kept for later (paper §2.8): a move refused because it would not pay back
within γ·H may pay back once its signals have held still long enough — H grows with the steps a
signal has been stable (``Horizon.effective``). ``Deferral`` remembers the signals that fired and
the payback, and fires a ``deferred`` trigger when γ·H reaches it. Pure logic."""

from __future__ import annotations

import math

from nereus.control.admission import Decision, Profit, Rule, Verdict
from nereus.control.triggers import POOL, Trigger, TriggerKind, TriggerMonitor


class Deferral:
    """The last payback rejection of one job: (signals that fired, payback in steps), or None."""

    def __init__(self) -> None:
        self.pending: tuple[tuple[str, ...], float] | None = None

    def after(self, d: Decision, rule: Rule) -> None:
        """``d`` committed: after a payback rejection, what to wait for; otherwise nothing."""
        if (
            d.verdict is not Verdict.KEEP
            or d.payback_steps is None
            or rule.profit is not Profit.PAYBACK
            or rule.gamma <= 0
            or not math.isfinite(d.payback_steps)
        ):
            self.pending = None
            return
        fired = [t for t in d.triggers if not t.urgent and t.kind is not TriggerKind.DEFERRED]
        named = {t.signal for t in fired if t.kind is not TriggerKind.MARGIN}
        if not named and fired:  # past the headroom alone: its H is the pool's (``triggers.horizon``)
            named = {POOL}
        signals = tuple(sorted(named))
        previous = self.pending[0] if self.pending else ()
        self.pending = (signals or previous, d.payback_steps) if (signals or previous) else None

    def trigger(self, monitor: TriggerMonitor, step: int, gamma: float) -> list[Trigger]:
        """``deferred`` once the waiting signals have been stable long enough to repay the move."""
        if self.pending is None:
            return []
        signals, payback = self.pending
        h = min(monitor.horizon_now(s, step) for s in signals)
        if payback > gamma * h:
            return []
        return [Trigger(TriggerKind.DEFERRED, ",".join(signals), h, payback, h)]
