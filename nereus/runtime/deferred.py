"""A replan whose outcome cannot be urgent, run beside the next step instead of on the boundary.

At a boundary where the controller's triggers fire but none is urgent (no GPU lost, the running
plan not predicted over capacity for the next step — ``Controller.prepare`` priced it at the
step's lengths — no out-of-memory error; the caller has already ruled out a pool change, a drain,
a stop and a recovery), the leader keeps the plan at once and the controller's decision on that
boundary's telemetry and clock runs on the leader's helper thread while the next step runs. At
the next boundary the leader takes it first: a move or restart it found is that boundary's action
(one boundary later than a decision on the boundary), a keep costs nothing. Anything urgent there
(a pool change, a stop, a failed step) supersedes it: it is dropped — committed, as the replan it
was, and its action discarded — and the boundary decides afresh.

The decision sees exactly the telemetry and clock it would have seen on the boundary, and the
controller in the state it was left in (``Controller.replan`` changes nothing but its plan cache;
``commit`` happens on the leader's own thread when the decision is taken). Nothing else touches
the controller until then: the helper thread is one thread, so the next boundary's early work
(``Leader.early``) waits behind it, and the leader's thread touches the controller only at the
next boundary, after taking or dropping it. Edge module (threads).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from nereus.control.admission import Decision, Verdict
from nereus.control.controller import Controller
from nereus.control.telemetry import Telemetry
from nereus.control.triggers import Trigger

Beside = Callable[[Callable[[], tuple[Decision, float]]], Future[tuple[Decision, float]]]


def deferrable(fired: Sequence[Trigger], step: int, steps: int) -> bool:
    """Whether the replan on ``fired`` at the boundary before ``step`` (of ``steps``) may run
    beside that step: triggers fired, none of them urgent (a GPU lost, memory predicted over
    capacity for the next step, an out-of-memory error), and a boundary after ``step`` where the
    decision can still be applied."""
    return bool(fired) and not any(f.urgent for f in fired) and step + 1 < steps


@dataclass(frozen=True, slots=True)
class Taken:
    """A deferred decision once taken: the decision, its seconds on the helper thread, and
    whether it was dropped (its action superseded by something urgent)."""

    decision: Decision
    seconds: float
    dropped: bool = False

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError(f"seconds: {self.seconds} < 0")

    @property
    def keeps(self) -> bool:
        return self.decision.verdict is Verdict.KEEP


class Deferral:
    """At most one controller decision under way beside a step (``beside``: runs work on the
    leader's helper thread)."""

    def __init__(self, controller: Controller, beside: Beside) -> None:
        self.controller = controller
        self.beside = beside
        self._later: tuple[Telemetry, Future[tuple[Decision, float]]] | None = None

    @property
    def pending(self) -> bool:
        return self._later is not None

    def start(self, tel: Telemetry, fired: list[Trigger]) -> None:
        """The replan on ``fired`` (``Controller.triggers(tel)``) begins beside the next step."""
        if self._later is not None:
            raise RuntimeError("a deferred decision is already under way")
        controller = self.controller

        def work() -> tuple[Decision, float]:
            began = time.perf_counter()
            decision = controller.replan(tel, fired)
            return decision, time.perf_counter() - began

        self._later = (tel, self.beside(work))

    def take(self) -> Taken:
        """The decision (waited for) made the controller's: its action is the caller's to apply."""
        if self._later is None:
            raise RuntimeError("no deferred decision to take")
        (tel, work), self._later = self._later, None
        decision, seconds = work.result()
        return Taken(self.controller.commit(tel, decision), seconds)

    def drop(self) -> Taken | None:
        """Something urgent supersedes the decision under way, if any: it is taken as the replan
        it was (new trigger references, logged) and its action discarded — the controller keeps
        the running plan and decides afresh."""
        if self._later is None:
            return None
        taken = self.take()
        if not taken.keeps:
            self.controller.adopt(self.controller.plan)
        return Taken(taken.decision, taken.seconds, dropped=True)
