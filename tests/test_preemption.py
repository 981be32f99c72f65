"""Stop signals in a launched job's worker (``nereus.runtime.preemption``): a SIGUSR2 (SLURM's
warning before the time limit, a preemption) hands over to the requeue after the checkpoint; a
SIGTERM (``scancel``) does not, so a cancelled job stays cancelled."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from nereus.runtime.preemption import Preemption

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(("signum", "requeued"), [(signal.SIGUSR2, True), (signal.SIGTERM, False)])
def test_only_sigusr2_hands_over_to_the_requeue(signum: int, requeued: bool) -> None:
    calls: list[int] = []

    def requeue(s: int, frame: Any) -> None:  # submitit's SIGUSR2 handler: checkpoint and requeue
        calls.append(s)

    before = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGUSR2, requeue)
        p = Preemption((signal.SIGUSR2, signal.SIGTERM)).install()
        os.kill(os.getpid(), signum)
        assert p.requested and p.signum == signum and calls == []  # a flag only, until the boundary
        p.hand_over(leader=True)
        assert calls == ([signal.SIGUSR2] if requeued else [])
        assert signal.getsignal(signal.SIGUSR2) is requeue  # the signals are given back
        p.signum = signal.SIGUSR2
        p.hand_over(leader=False)  # only the leader requeues
        assert len(calls) == int(requeued)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
