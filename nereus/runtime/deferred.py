"""A replan whose outcome cannot be urgent, run beside the next step instead of on the boundary.

At a boundary where the controller's triggers fire but none is urgent (no GPU lost, the running plan
not predicted over the GPUs' memory for the next step — ``Controller.prepare`` priced it at the step's
lengths — no out-of-memory error; the caller has already ruled out a pool change, a drain, a stop
and a recovery), the leader keeps the plan at once and the controller's decision on that boundary's
telemetry and clock runs on the leader's helper thread while the next step runs (launched once the
boundary is over, ``Deferral.launch``: Python on the helper would hold the GIL in turns with the
boundary's own work). At the next boundary the leader takes it first: a move or restart it found is
that boundary's action (one boundary later than a decision on the boundary), a keep costs nothing.
Anything urgent there (a pool change, a stop, a failed step) supersedes it: it is dropped —
committed, as the replan it was, and its action discarded — and the boundary decides afresh.

The decision sees exactly the telemetry and clock it would have seen on the boundary, and the
controller in the state it was left in (``Controller.replan`` changes nothing but its plan cache;
``commit`` happens on the leader's own thread when the decision is taken). Nothing else touches the
controller until then: the helper thread is one thread, so the next boundary's early work
(``Leader.early``) waits behind it, and the leader's thread touches the controller only at the next
boundary, after taking or dropping it. Edge module (threads).
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
    beside that step: triggers fired, none of them urgent (a GPU lost, memory predicted over the
    GPUs' memory for the next step, an out-of-memory error), and a boundary after ``step`` where the
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
        self._later: tuple[Telemetry, list[Trigger]] | None = None
        self._work: Future[tuple[Decision, float]] | None = None

    @property
    def pending(self) -> bool:
        return self._later is not None

    def start(self, tel: Telemetry, fired: list[Trigger]) -> None:
        """The replan on ``fired`` (``Controller.triggers(tel)``) is deferred; it begins on the
        helper at ``launch``."""
        if self._later is not None:
            raise RuntimeError("a deferred decision is already under way")
        self._later = (tel, fired)

    def launch(self) -> None:
        """The deferred replan begins on the helper thread, if it has not. The leader launches it
        once its boundary is over (the notice sent, the metrics written): Python on the helper
        holds the GIL in turns, and the main thread would wait for it (up to the interpreter's
        switch interval, 5 ms, each time) in the boundary's own work."""
        if self._later is None or self._work is not None:
            return
        tel, fired = self._later
        controller = self.controller

        def work() -> tuple[Decision, float]:
            began = time.perf_counter()
            decision = controller.replan(tel, fired)
            return decision, time.perf_counter() - began

        self._work = self.beside(work)

    def take(self) -> Taken:
        """The decision (waited for) made the controller's: its action is the caller's to apply."""
        if self._later is None:
            raise RuntimeError("no deferred decision to take")
        self.launch()
        assert self._work is not None
        (tel, _), work = self._later, self._work
        self._later, self._work = None, None
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
            self.controller.adopt(self.controller.plan, rebuilt=False)  # nothing ran: no warm-up
        return Taken(taken.decision, taken.seconds, dropped=True)
