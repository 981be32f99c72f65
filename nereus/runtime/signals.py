"""How a run stops on a signal, and the exit code that says so (torch-free).

``nereus run`` treats SIGINT (Ctrl-C), SIGTERM and SIGUSR2 alike, whether they reach the
supervisor alone (it passes them on to every worker) or the whole process group: every worker
stops at the next step boundary after a checkpoint, and the run exits with the signal's code —
130 for SIGINT and 143 for SIGTERM (128 + the signal number, the shell's convention), and 144
for SIGUSR2, the code submitit's ``LocalExecutor`` requeues a task on
(``submitit.local.local.LOCAL_REQUEUE_RETURN_CODE``): a SIGUSR2 is a preemption, and the run is
meant to continue with ``--resume``. A launched job (``nereus.runtime.node``) stops on SLURM's
preemption signals (SIGUSR2, SIGTERM) and hands over to submitit's own requeue instead.

Processes are started with these signals held (``held``): a signal that arrives while a worker
imports torch waits until the worker's handler is installed (``Preemption.install`` releases
them) instead of killing it or raising ``KeyboardInterrupt`` in the middle of an import.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import resource_tracker
from multiprocessing.process import BaseProcess

PREEMPT_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)  # SLURM's preemption (a launched job)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)  # nereus run
REQUEUE_EXIT = 144  # submitit's LocalExecutor requeues a task that exits with this code
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGUSR2: REQUEUE_EXIT}


def stop_with(supervisor: int, signum: int = signal.SIGTERM) -> None:
    """Send ``signum`` to this process once process ``supervisor`` has ended, so a worker whose
    supervisor was killed outright (SIGKILL, the OOM killer) stops at its next boundary after a
    checkpoint instead of running on headless. A daemon thread waits on the supervisor's pidfd
    (Linux; elsewhere it looks once a second). Not the kernel's parent-death signal: a fork
    server's children keep it alive (they hold its liveness pipe), so it outlives the supervisor."""
    try:
        fd = os.pidfd_open(supervisor) if hasattr(os, "pidfd_open") else None
    except ProcessLookupError:  # already gone
        os.kill(os.getpid(), signum)
        return
    except OSError:  # no pidfds here (an old kernel, a sandbox)
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while _alive(supervisor):
                time.sleep(1.0)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="nereus-supervisor-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's process under its pid
        return False
    return True


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by ``signum``."""
    return EXIT_CODES.get(signal.Signals(signum), 128 + signum)


def stopped_by(code: int) -> int | None:
    """The signal a run that exited with ``code`` was stopped by, if the code is one of ours."""
    return next((int(s) for s, c in EXIT_CODES.items() if c == code), None)


def name(signum: int) -> str:
    return signal.Signals(signum).name


@contextmanager
def held(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Hold ``signals`` back while processes start: children inherit the held set across
    ``exec``, so a signal reaches a worker only once its handler is installed. Signals that
    arrive here meanwhile are delivered when the block ends."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def release(signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Let ``signals`` through in this process (after its handlers are installed)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def start(processes: Sequence[BaseProcess], signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Start ``processes`` with ``signals`` held (each releases them once its handler is in
    place). multiprocessing's resource tracker is started first, on its own: it releases SIGINT
    and SIGTERM in the starting thread, which would let them through to the processes after it
    (and with SIGUSR2 held it outlives a SIGUSR2 to the process group)."""
    with held(signals):
        resource_tracker.ensure_running()
    with held(signals):
        for p in processes:
            p.start()
