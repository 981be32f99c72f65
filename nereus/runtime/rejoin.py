"""A healthy worker that a recovery left behind asks to be admitted again (edge module).

A worker can be healthy and still miss a recovery: it checked in too late, held in a connect to a
dead peer, or it hung through the recovery's wait. The job goes on without it. The worker then asks
to be admitted again as its own GPU, through the signed join path a newcomer takes, for as long as
the job's store answers. It is left behind again if the next recovery misses it too, and then it
asks again. Both launchers run the same loop (``nereus.runtime.local`` for local worker processes,
``nereus.runtime.node`` on SLURM nodes); each says how to find out whether the job's store answers
and how to enter the job.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

from nereus.control.action import Outcome
from nereus.runtime.joins import JoinRefusedError

Enter = Callable[[], tuple[Outcome, bool]]  # join and run: (outcome, whether left behind again)


def rejoin(gpu: int | None, store_answers: Callable[[], bool], enter: Enter) -> Outcome:
    """Ask to rejoin the job as GPU ``gpu`` while ``store_answers()``, and run in it (``enter``)
    until it ends or a recovery leaves this worker behind again, then ask again. ``left`` when the
    store does not answer (the job is over) or the leader refuses the request."""
    while True:
        if not store_answers():
            return Outcome.LEFT
        gc.unfreeze()  # the run froze its objects (``JobLoop.run``): let the old state go
        gc.collect()
        print(f"GPU {gpu}: left behind by a recovery; asking to rejoin the job", file=sys.stderr, flush=True)
        try:
            status, behind = enter()
        except JoinRefusedError as exc:
            print(f"GPU {gpu}: {exc}; leaving the job", file=sys.stderr, flush=True)
            return Outcome.LEFT
        if not behind:
            return status
