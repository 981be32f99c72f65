"""Stop signals inside a worker: a flag the job loop acts on at the next step boundary.

SLURM's preemption signals (SIGUSR2, SIGTERM) — and, for ``nereus run``'s workers, SIGINT too
(``nereus.runtime.signals.STOP_SIGNALS``) — only set a flag; the loop checkpoints at the next
boundary and stops, every rank agreeing on which signal it was. After a SIGUSR2 the handler
installed before (submitit's requeue) runs after the checkpoint; a SIGTERM (``scancel``) ends the
job there. Edge module (a collective in ``agree``).
"""

from __future__ import annotations

import signal
from typing import Any

from nereus.runtime.comm import all_gather
from nereus.runtime.signals import PREEMPT_SIGNALS, release


class Preemption:
    """Stop signals — SLURM's preemption (SIGUSR2, SIGTERM) by default; ``nereus run``'s workers
    also stop on SIGINT (``nereus.runtime.signals.STOP_SIGNALS``) — set a flag the loop acts on at
    the next boundary, and ``signum`` remembers the first; the handlers installed before
    (submitit's requeue) run after the checkpoint (``hand_over``)."""

    def __init__(self, signals: tuple[int, ...] = PREEMPT_SIGNALS) -> None:
        self.signals = signals
        self.requested = False
        self.signum: int | None = None  # the first stop signal (after ``agree``: the job's)
        self._previous: dict[int, Any] = {}

    def install(self) -> Preemption:
        """Handle the signals from now on, and let through any held back while the process
        started (``nereus.runtime.signals.held``)."""
        self._previous = {s: signal.getsignal(s) for s in self.signals}

        def flag(signum: int, frame: Any) -> None:
            self.requested = True
            if self.signum is None:
                self.signum = signum

        for s in self.signals:
            signal.signal(s, flag)
        release(self.signals)
        return self

    def agree(self) -> int | None:
        """The job's stop signal on every rank: a SIGTERM if any rank saw one (a cancel beats a
        requeue, whichever came first), else the first one a rank saw, in rank order (collective;
        a rank the signal never reached learns it here)."""
        seen = [s for s in all_gather(int(self.signum or 0), int) if s]
        if seen:
            self.signum = signal.SIGTERM if signal.SIGTERM in seen else seen[0]
        return self.signum

    def hand_over(self, leader: bool) -> None:
        """Give the signals back; after a SIGUSR2 (SLURM's warning before the time limit or a
        preemption, ``scancel --signal=USR2``) the leader runs the previous SIGUSR2 handler, the
        requeue. A SIGTERM is ``scancel`` (or a preemption SLURM requeues or cancels itself): the
        job has its checkpoint and ends, as submitit's own handler lets SIGTERM end it."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        prev = self._previous.get(signal.SIGUSR2)
        if leader and callable(prev) and self.signum == signal.SIGUSR2:
            prev(signal.SIGUSR2, None)
