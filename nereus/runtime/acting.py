"""Every member runs a step boundary's action: keep the plan (new groups when the world re-formed),
move (the priced transition, then groups and engines for the target) or restart (the latest
checkpoint onto a new plan); the drained leave after their move. A mixin of ``JobLoop``
(``nereus.runtime.loop``), which holds the state it reads. Edge module (torch.distributed).
"""

from __future__ import annotations

import time
from pathlib import Path

from nereus.control.action import Action, Keep, Move, Restart, TransitionRecord
from nereus.plan.layout import Plan
from nereus.runtime import checkpoint as ckpt
from nereus.runtime.comm import reduce_max
from nereus.runtime.job import JobSetup, first_state
from nereus.runtime.leader import Leader
from nereus.runtime.membership import Membership
from nereus.runtime.worker import Worker
from nereus.spec.workload import InFlight


class Acting:
    """The boundary's action on this member (``JobLoop``'s state)."""

    m: Membership
    setup: JobSetup
    worker: Worker
    plan: Plan
    leader: Leader | None
    folder: Path
    step: int
    dropped: int

    def _act(self, action: Action, rebind: bool) -> list[TransitionRecord]:
        """Every member runs ``action`` (``rebind``: the world re-formed, so a kept plan needs new
        groups). Returns what moved. An async job's batches generated ahead stay (``drain``) or
        are dropped (``drop``: the new plan generates them again) when the plan moves or restarts."""
        moved = self._action(action, rebind)  # a restart brings back the checkpoint's batches
        drop = self.setup.workload.in_flight is InFlight.DROP and isinstance(action, Move | Restart)
        if drop and self.worker.pending:
            self.dropped += len(self.worker.pending)
            self.worker.pending = {}
        return moved

    def _action(self, action: Action, rebind: bool) -> list[TransitionRecord]:
        match action:
            case Move():
                return [self._move(action)]
            case Restart():
                return [self._restart(action)]
            case Keep():
                if rebind:
                    self.worker.bind(self.plan)  # new groups, same state
                return []

    def _move(self, action: Move) -> TransitionRecord:
        """The priced transition, then groups and engines for the target; the measured seconds
        (what the controller learns its fixed costs from) include the regrouping and the engine
        rebuilds the estimate charges for."""
        started = time.perf_counter()
        self.worker.transition(action.transition)
        moving_s = reduce_max(time.perf_counter() - started)
        self.worker.take_rebuilds()
        self.worker.bind(action.target)
        rebuild_s = reduce_max(self.worker.take_rebuilds())
        seconds = reduce_max(time.perf_counter() - started)
        record = TransitionRecord.move(action, seconds, self.plan, rebuild_s)
        self.plan = action.target
        if self.leader is not None:
            self.leader.controller.moved(action, seconds, moving_s)
        return record

    def _restart(self, action: Restart) -> TransitionRecord:
        """The latest checkpoint onto the action's plan; the steps after it run again. Before
        the first checkpoint, the job's start: the seed's weights and the ``init:`` folders (as
        layout-independent as a checkpoint), and every step runs again."""
        began, target, path = time.perf_counter(), action.plan, ckpt.agreed_latest(self.folder)
        if target is None:
            raise RuntimeError(f"step {self.step}: {action.reason}, and no plan to restart on")
        if path is None:
            self.dropped += len(self.worker.pending)  # async: the start had nothing generated ahead
            self.worker.pending = {}
            self.worker.close()  # every unit and engine goes: the start places them afresh
            self.worker.drop()
            resumed = first_state(self.worker, target, None, self.setup.spec).step
        else:
            resumed, dropped = ckpt.load(self.worker, target, path)
            self.dropped += dropped
            self.worker.bind(target)
            self.worker.weight_sync(target)
        seconds = reduce_max(time.perf_counter() - began)
        record = TransitionRecord.restart(seconds, action.reason, resumed, self.plan, target)
        self.plan, self.step = target, resumed + 1
        if self.leader is not None:
            self.leader.controller.restarted(target)
        return record

    def _reform(self, members: tuple[int, ...]) -> None:
        """The next generation with ``members``; the plan stays, its groups are new."""
        self.m.form(members, self.m.generation + 1)
        self.worker.set_world(members)
        self.worker.bind(self.plan)
