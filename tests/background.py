"""``nereus run`` in the background, for tests that compare (or check) runs that do not depend on
each other's timing: started together, they run side by side, and each alone leaves a core idle
part of the time (process and engine start-up, restarts, rebuilds, the leader's waits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Run:
    """A ``nereus run`` started by ``start``: its output folder, its stderr file, its process."""

    out: Path
    err: Path
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """End the run and its workers (its own session) if it is still going."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start(args: Iterable[str], out: Path, cwd: Path | None = None) -> Run:
    """``nereus run ARGS --out OUT`` in a session of its own; stderr in ``OUT.err`` (next to OUT)."""
    err = out.with_name(f"{out.name}.err")
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nereus.cli", "run", *args, "--out", str(out)],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=cwd, start_new_session=True,
        )  # fmt: skip
    return Run(out, err, proc)


def finished(runs: Iterable[Run], timeout: float) -> list[Path]:
    """Wait for every run (all within ``timeout``); each must exit 0, or the assertion shows its
    stderr's tail. Runs still going when one fails or time is up are killed with their workers."""
    runs = list(runs)
    deadline = time.monotonic() + timeout
    try:
        for run in runs:
            try:
                code = run.proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{run.out.name} did not finish within {timeout:.0f} s") from None
            assert code == 0, run.err.read_text()[-3000:]
    finally:
        for run in runs:
            run.kill()
    return [run.out for run in runs]
