"""Stand-ins for the rollback tests (``test_snapshot.py`` without processes, ``test_rollback.py``
in a gloo world): a trainer's unit and its updates, a second plan, and a worker and a job loop
with only what ``JobLoop._survive`` and ``JobLoop._roll_back`` use."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nereus.devices import CPU, Devices
from nereus.plan.layout import Candidate, Plan
from nereus.runtime.loop import JobLoop
from nereus.runtime.membership import Membership
from nereus.runtime.snapshot import Snapshot
from nereus.runtime.worker import Worker
from nereus.spec.workload import ExecutionMode
from nereus.state.emu import LogicalState
from nereus.state.holder import RankState
from tests.device_checks import trainer

SOURCES = frozenset({"actor.train"})


def update(rs: RankState) -> None:
    """One optimizer step, as a step applies it: in place, the logical state one ahead."""
    for b in rs.buffers.values():
        b.add_(1)
    rs.state = replace(rs.state, updates=rs.state.updates + 1, version=rs.state.version + 1)


def trainer_at(updates: int = 0) -> RankState:
    rs = trainer(Devices(CPU))
    rs.state = LogicalState(updates=updates, version=updates)
    return rs


def moved_plan(plan: Plan) -> Plan:
    """Another plan of the same workflow (the target of a move at a boundary)."""
    cands = tuple(
        Candidate(c.model_stage, c.layout, 2, (0, 3)) if c.model_stage == "actor.train" else c
        for c in plan.candidates
    )
    return Plan(plan.workflow, cands, (*plan.pool, 3))


class StandInHolder:
    def __init__(self, units: dict[str, RankState]) -> None:
        self.units = units

    def by_stage(self) -> dict[str, RankState]:
        return dict(self.units)


class StandInWorker:
    """What ``JobLoop._roll_back`` and ``Worker.rollback`` use of a worker."""

    rollback = Worker.rollback
    take_snapshot = Worker.take_snapshot

    def __init__(self, gpu: int, units: dict[str, RankState]) -> None:
        self.gpu = gpu
        self.holder = StandInHolder(units)
        self.snapshot = Snapshot(CPU)
        self.engines: dict[str, Any] = {"actor.gen": object()}
        self.pending: dict[int, Any] = {}  # async RL's batches generated ahead (none: a sync job)

    def sources(self) -> frozenset[str]:
        return SOURCES

    def release(self) -> None:
        self.engines = {}

    def set_world(self, members: tuple[int, ...]) -> None:
        self.release()


def stand_in_loop(
    worker: StandInWorker, plan: Plan, step: int, leader: bool, m: Membership | None = None
) -> JobLoop:
    return JobLoop(
        m,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        Path("unused"),
        SimpleNamespace(workload=SimpleNamespace(mode=ExecutionMode.SYNC)),  # type: ignore[arg-type]
        worker,  # type: ignore[arg-type]
        plan,
        step,
        leader=object() if leader else None,  # type: ignore[arg-type]
    )
