"""The running plan's memory, checked ahead at the next step's lengths, with kept answers.

Every boundary asks whether the running plan will still fit at the lengths the next step is
expected to reach (a ``memory`` trigger fires when it will not). A plan's memory grows with the
lengths: every term is non-decreasing in the mean and the p95 response (``test_monitor_overhead``).
So lengths within some that fit fit too, and lengths beyond some over capacity are over too: a
quiet step is answered from the checks kept since the plan or the calibration last changed, and
prices nothing. The controller makes a fresh ``MemoryAhead`` when either changes.

Pure.
"""

from __future__ import annotations

from collections.abc import Callable

from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SeqStats

KEPT_CHECKS = 8  # checks kept each way (fitting, over capacity)


class MemoryAhead:
    """Kept memory checks of one plan under one calibration."""

    def __init__(self, plan: Plan, headroom: float) -> None:
        self.plan = plan
        self.headroom = headroom  # what the checks were priced with
        self.fits: list[SeqStats] = []  # lengths priced within capacity
        self.overs: list[SeqStats] = []  # lengths priced over it

    def over_capacity(self, seq: SeqStats, problem_at: Callable[[SeqStats], PlanningProblem]) -> bool:
        """Whether the plan is over capacity at ``seq``: from a kept answer, else priced in
        ``problem_at(seq)`` (the job's problem on the plan's pool) and kept."""
        if any(within(seq, f) for f in self.fits):
            return False
        if any(within(o, seq) for o in self.overs):
            return True
        ahead = problem_at(seq)
        over = bool(price(ahead, shapes_of(self.plan)).over_capacity(ahead))
        kept = self.overs if over else self.fits
        kept.append(seq)
        del kept[:-KEPT_CHECKS]
        return over


def within(a: SeqStats, b: SeqStats) -> bool:
    """Lengths ``a`` no longer than ``b``, mean and p95 (the same prompts)."""
    same = a.prompt_len == b.prompt_len
    return same and a.response_len <= b.response_len and a.response_p95 <= b.response_p95
