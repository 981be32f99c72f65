"""A step that trained and was checkpointed keeps its metrics row when its boundary fails before
the leader wrote it and the recovery restarts from that checkpoint (which does not run the step
again). Found by killing a worker 0.8 s after row 2 while the survivors re-formed for a scripted
loss: the restart resumed from step 3's checkpoint and step 3 had no row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from nereus.runtime.metrics import StepRecord
from nereus.runtime.surviving import Surviving

pytestmark = pytest.mark.pure


def _record(step: int) -> StepRecord:
    return StepRecord(step, 0.5, 0.0, 0.0, 0.0, None, None, 1.0, 0.0, 4.0, 4, {}, {})


@dataclass
class _Metrics:
    last: int | None


@dataclass
class _Leader:
    metrics: _Metrics
    written: list[tuple[int, list[Any]]] = field(default_factory=list)

    def write(self, record: StepRecord, moved: list[Any], plan: Any) -> None:
        self.written.append((record.step, moved))
        self.metrics.last = record.step


def _loop(step: int, unwritten: StepRecord | None, last: int | None, leader: bool = True) -> Surviving:
    loop = Surviving()
    loop.leader = _Leader(_Metrics(last)) if leader else None  # type: ignore[assignment]
    loop.step, loop.unwritten, loop.plan = step, unwritten, None  # type: ignore[assignment]
    return loop


def test_a_restart_past_a_step_without_its_row_writes_the_row() -> None:
    loop = _loop(4, _record(3), last=2)  # restarted from step 3's checkpoint: the next step is 4
    loop._write_unwritten()
    assert loop.leader.written == [(3, [])] and loop.unwritten is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("step", "last", "why"),
    [
        (3, 2, "rolled back: step 3 runs again and writes its own row"),
        (2, 2, "restarted from an older checkpoint: step 3 runs again"),
        (4, 3, "the row is already there"),
    ],
)
def test_no_row_is_written_twice_or_for_a_step_that_runs_again(step: int, last: int, why: str) -> None:
    loop = _loop(step, _record(3), last)
    loop._write_unwritten()
    assert loop.leader.written == [], why  # type: ignore[union-attr]
    assert loop.unwritten is None


def test_only_the_leader_writes_rows() -> None:
    loop = _loop(4, None, last=None, leader=False)
    loop._write_unwritten()
    assert loop.unwritten is None
