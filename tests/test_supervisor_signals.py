"""``nereus run``'s supervisor passes stop signals on to its workers: the first SIGINT stops them
after a checkpoint; a copy of it (``timeout -s INT`` signals the process, then its group) is not a
second Ctrl-C; a signal that comes while the workers start reaches every worker once."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import pytest

from nereus.runtime import local

pytestmark = pytest.mark.pure


@dataclass
class _Proc:
    pid: int | None
    exitcode: int | None = None


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append((pid, signum)))
    return sent


def test_a_copy_of_the_first_sigint_is_not_a_second_ctrl_c(kills: list[tuple[int, int]]) -> None:
    clock = _Clock()
    sup = local._Supervisor([_Proc(11), _Proc(12)], clock)  # type: ignore[list-item]
    sup(signal.SIGINT, None)
    clock.now += 0.001  # timeout's signal to the process group, right behind the first
    sup(signal.SIGINT, None)
    assert not sup.forced and kills == [(11, signal.SIGINT), (12, signal.SIGINT)]
    clock.now += 2.0  # the user pressed Ctrl-C again
    sup(signal.SIGINT, None)
    assert sup.forced and kills[2:] == [(11, signal.SIGKILL), (12, signal.SIGKILL)]


def test_a_stop_during_the_start_reaches_the_workers_that_had_no_pid(kills: list[tuple[int, int]]) -> None:
    procs = [_Proc(11), _Proc(None), _Proc(None)]
    sup = local._Supervisor(procs, _Clock())  # type: ignore[arg-type]
    sup(signal.SIGTERM, None)  # while the second and third were starting
    assert kills == [(11, signal.SIGTERM)]
    procs[1].pid, procs[2].pid = 12, 13
    sup.started()
    assert kills == [(11, signal.SIGTERM), (12, signal.SIGTERM), (13, signal.SIGTERM)]  # each once
    sup.started()
    assert len(kills) == 3


def test_started_without_a_signal_sends_nothing(kills: list[tuple[int, int]]) -> None:
    local._Supervisor([_Proc(11)], _Clock()).started()  # type: ignore[list-item]
    assert kills == []
