"""Faults a local experiment's ``drift:`` injects where real ones come from: a process killed, an
out-of-memory error at the start of a model-stage's work, a process that hangs and comes back."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import torch


def kill() -> None:
    """SIGKILL this process (a node that died)."""
    os.kill(os.getpid(), signal.SIGKILL)


def out_of_memory_in(model_stage: str) -> Callable[[str], None]:
    """A fault at the start of ``model_stage``'s work: the error a GPU raises when memory runs out."""

    def fault(name: str) -> None:
        if name == model_stage:
            raise torch.OutOfMemoryError(f"{name}: an injected out-of-memory error (the experiment's drift)")

    return fault


def hang(seconds: float) -> None:
    """Stop this process, every thread (its heartbeat's too), for ``seconds``, as a node that
    froze and came back: a helper process it starts first sends SIGCONT."""
    wake = f"sleep {seconds:g}; kill -CONT {os.getpid()}"
    subprocess.Popen(
        ["/bin/sh", "-c", wake], start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.kill(os.getpid(), signal.SIGSTOP)
