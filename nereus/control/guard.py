"""The headroom the running plan is held to, and its memory checked ahead against it.

A plan is held to the job's headroom (the share of each GPU's memory kept free for model error).
A plan the job runs knowing it is past that headroom, inside the memory (a memory replan kept it,
or found nothing else, or a restart took it without the headroom) is *tolerated*: it is held to
``TOLERATED_SHARE`` of the headroom, so that a deviation already answered does not replan every
step; kept again past that (nothing else fits), to the memory itself. The checks ahead
(``nereus.control.ahead``) are kept per headroom checked, while the plan and the calibration they
were priced with hold.

Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nereus.control.ahead import MemoryAhead
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SeqStats

# The share of the headroom that a plan the job runs past it still keeps free. Held to the memory
# itself (our first cut), such a plan predicted at 99.6% of an MI250X GCD's memory ran out of it
# at the next step: measured peaks vary from step to step, and the next lengths are extrapolated.
TOLERATED_SHARE = 0.5


class MemoryGuard:
    """The job's headroom, the plan it tolerates past it, and the checks ahead kept for both."""

    def __init__(self, headroom: float) -> None:
        if not 0.0 <= headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
        self.headroom = headroom
        self._ahead: dict[float, MemoryAhead] = {}  # per headroom checked
        self._tolerated: Plan | None = None
        self._held = 0.0  # the headroom ``_tolerated`` is held to

    @property
    def tolerated_headroom(self) -> float:
        """What a plan the job runs past its headroom still keeps free (``TOLERATED_SHARE`` of the
        headroom): its peaks are measured, but they vary from step to step (the allocator, the
        longest sequences of a batch) and the next step's lengths are extrapolated. Predicted past
        it, the plan is urgent as one past the memory itself is."""
        return self.headroom * TOLERATED_SHARE

    def tolerates(self, plan: Plan) -> bool:
        """Whether the job runs ``plan`` knowing it is past the headroom."""
        return self._tolerated is plan

    def held(self, plan: Plan) -> float:
        """The headroom ``plan`` is held to: the job's, or less for a tolerated plan."""
        return self._held if self._tolerated is plan else self.headroom

    def over_capacity(
        self, plan: Plan, seq: SeqStats, held: float, problem_at: Callable[[SeqStats], PlanningProblem]
    ) -> bool:
        """Whether ``plan`` is predicted over capacity within ``held`` at the lengths ``seq``, from
        a kept check where one answers (``problem_at``: the job's problem at some lengths, with
        that headroom)."""
        ahead = self._ahead.get(held)
        if ahead is None or ahead.plan is not plan:
            ahead = self._ahead[held] = MemoryAhead(plan, held)
        return ahead.over_capacity(seq, problem_at)

    def running(self, plan: Plan, problem: PlanningProblem) -> tuple[float | None, bool]:
        """``plan``'s step latency in ``problem`` where it fits the headroom it is held to, or
        past that inside the memory (then True: a plan the job may keep running, its memory
        measured every step, which a move away must pay back; kept, it is tolerated); None where
        it is over the memory."""
        cost = price(problem, shapes_of(plan))
        if not cost.over_capacity(replace(problem, headroom=self.held(plan))):
            return cost.step_latency_s, False
        if not cost.over_capacity(replace(problem, headroom=0.0)):
            return cost.step_latency_s, True
        return None, False

    def forget(self) -> None:
        """The calibration changed: no kept check holds."""
        self._ahead = {}

    def kept_past(self, plan: Plan, urgent: bool) -> None:
        """A replan kept ``plan`` past its headroom: from now on it is held to the tolerated share,
        or, kept again urgently past that (nothing else fits), to the memory itself."""
        again = self._tolerated is plan and urgent
        self._tolerated = plan
        self._held = 0.0 if again else self.tolerated_headroom

    def restarted(self, plan: Plan, headroom: float | None) -> None:
        """The job restarted on ``plan``, chosen with ``headroom`` (None: the job's): tolerated
        where that is less than the job's."""
        self._tolerated = plan if headroom is not None and headroom < self.headroom else None
        self._held = headroom if headroom is not None else self.headroom
