"""Preempting a ``nereus run`` the way SLURM does, for the end-to-end tests (processes)."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def stop_after_rows(cmd: list[str], metrics: Path, rows: int, timeout: float = 240) -> tuple[int, str]:
    """Start ``cmd`` (a ``nereus run``), send it SIGUSR2 (SLURM's preemption signal) once
    ``metrics`` holds ``rows`` lines, and wait for it; its exit code and stderr."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            proc.send_signal(signal.SIGUSR2)
            break
        time.sleep(0.1)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err
