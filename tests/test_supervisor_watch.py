"""A local worker stops when its supervisor ends (``signals.stop_with``): the signal arrives once
the watched process has exited, through its pidfd or, where there is none, by looking."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from nereus.runtime import signals

pytestmark = pytest.mark.pure


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_the_signal_comes_once_the_supervisor_has_ended(monkeypatch: pytest.MonkeyPatch, pidfd: bool) -> None:
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    arrived = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: arrived.set())
    try:
        supervisor = subprocess.Popen(["sleep", "1.5"])
        signals.stop_with(supervisor.pid, signal.SIGUSR1)
        assert not arrived.wait(0.5)  # still running: nothing yet
        supervisor.wait()
        assert arrived.wait(10)
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.timeout(30)
def test_a_supervisor_gone_before_the_watch_is_the_signal_at_once() -> None:
    arrived = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: arrived.set())
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        signals.stop_with(gone.pid, signal.SIGUSR1)
        assert arrived.wait(5)
    finally:
        signal.signal(signal.SIGUSR1, previous)
