"""Every survivor of a failed step recovers: a peer died (or froze past the step's collective
timeout), or a model-stage ran out of memory here. The survivors let go of the failed world, form
the next generation, roll back to the newest boundary snapshot they all hold (step counter and
plan included), and run the leader's urgent replan from the intact units, or the restart from the
latest checkpoint; the step then runs again, so training stays exactly on track. A mixin of
``JobLoop`` (``nereus.runtime.loop``), which holds the state it reads. Edge module
(torch.distributed).
"""

from __future__ import annotations

import time

from nereus.control.action import Action, Restart, TransitionRecord
from nereus.control.telemetry import Telemetry
from nereus.errors import InfeasibleError
from nereus.plan.layout import Plan
from nereus.runtime import faults
from nereus.runtime.comm import all_gather, broadcast, first_line, is_peer_failure, reduce_max
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import JobSetup
from nereus.runtime.leader import Leader, too_few_gpus
from nereus.runtime.membership import Membership
from nereus.runtime.metrics import StepRecord
from nereus.runtime.pending import share as share_pending
from nereus.runtime.snapshot import Mark, agreed
from nereus.runtime.worker import Worker
from nereus.spec.workload import ExecutionMode

MAX_OOM_TRIES = 3  # a step that runs out of memory after this many urgent replans fails the job
MAX_FORM_TRIES = 8  # recoveries in a row whose next generation failed to form: then the job fails


class Surviving:
    """A failed step's recovery on this member (``JobLoop``'s state)."""

    m: Membership
    spec: ExperimentSpec
    setup: JobSetup
    worker: Worker
    plan: Plan
    leader: Leader | None
    step: int
    lost: tuple[int, ...] | None
    telemetry: Telemetry | None
    moved: list[TransitionRecord]
    ooms_at: int
    oom_tries: int
    frozen: set[int]
    unwritten: StepRecord | None

    def _act(self, action: Action, rebind: bool) -> list[TransitionRecord]:  # ``Acting``'s, first in the MRO
        raise NotImplementedError

    def _dropped(self, record: StepRecord) -> StepRecord:  # ``JobLoop``'s
        return record

    def _survive(self, oom: str = "") -> None:
        """A peer died, or ``oom`` ran out of memory here: let go of every group, form the next
        generation with the survivors; ``_recover`` rolls back to the boundary (its collectives
        can fail too, so it runs where a failure is caught)."""
        before = self.m.members
        self.worker.release()
        hang = self.spec.hung_at(self.step).get(self.m.gpu) if self.spec is not None else None
        if hang is not None and self.step not in self.frozen:  # a scripted freeze, once
            self.frozen.add(self.step)
            self.m.abandon()  # its groups go first: no peer waits on it in a collective
            faults.hang(hang)  # then it checks in late: its heartbeat stopped too
        for attempt in range(1, MAX_FORM_TRIES + 1):  # a survivor lost while the next generation
            survivors = self.m.recover(oom=oom)  # forms: recover again (a store that went away
            try:  # meanwhile: the next recovery finds it gone, and this GPU leaves)
                self.m.form(survivors, self.m.generation + 1)
                break
            except Exception as exc:
                if not is_peer_failure(exc) or attempt == MAX_FORM_TRIES:
                    raise
                self.m.log(f"GPU {self.m.gpu}: {first_line(exc)}; recovering again")
        self.worker.set_world(survivors)
        self.lost = tuple(g for g in before if g not in survivors)

    def _roll_back(self) -> None:
        """Every survivor back to the newest boundary snapshot all of them hold: the oldest of
        their newest (``agreed``; a newcomer without one does not count). The step counter and
        the plan go back with the state, so the step runs again on the plan it ran on, and its
        metrics row is written again. The leader (which always holds the snapshot) says which
        step and plan that is, so a newcomer without it learns them too."""
        newest: list[tuple[int, int] | None] = all_gather(
            self.worker.snapshot.newest(), tuple[int, int] | None
        )
        mark = agreed(Mark(*m) if m is not None else None for m in newest)
        if mark is None:  # no survivor kept one (no step ran yet): nothing to go back to
            self.worker.rollback(None)
            return
        here: tuple[int, Plan] | None = (
            self.worker.snapshot.boundary(mark) if self.leader is not None else None
        )
        step, plan = broadcast(here, tuple[int, Plan])
        self.worker.rollback(mark, plan)
        if self.setup.workload.mode is ExecutionMode.ASYNC:  # a newcomer holds no snapshot's batches
            self.worker.pending = share_pending(self.worker.pending if self.leader is not None else None)
        self.plan, self.step = plan, step

    def _recover(self, lost: tuple[int, ...]) -> None:
        """Survivors roll back to the boundary before the step, then the urgent replan from intact
        units (weight copies are rebuilt by a weight sync after it), or the restart from the
        latest checkpoint."""
        t0 = time.perf_counter()
        self._roll_back()
        rebuilt = frozenset(self.worker.receivers())
        oom = next(iter(self.m.oom.values()), "")  # every member learnt it from the leader
        if oom:
            self.oom_tries = self.oom_tries + 1 if self.ooms_at == self.step else 1
            self.ooms_at = self.step
            if self.oom_tries > MAX_OOM_TRIES:
                raise RuntimeError(
                    f"step {self.step}: {oom} ran out of memory {self.oom_tries} times; no plan the "
                    "controller found fits (lower max_new_tokens or the batch, or add GPUs)"
                )
        decided: Action | None = None
        if self.leader is not None:
            try:
                decided = self.leader.recover(self.plan, self.telemetry, self.step, rebuilt, oom)
            except InfeasibleError as exc:  # the others see the leader leave and leave too
                raise too_few_gpus(self.m.members, exc) from None
        action: Action = broadcast(decided, Action)
        moved = self._act(action, rebind=True)
        self._write_unwritten()
        if not isinstance(action, Restart):
            self.worker.weight_sync(self.plan)  # the rollback dropped the weight copies
        seconds = reduce_max(time.perf_counter() - t0)
        record = TransitionRecord.recovered(seconds, lost, self.m.members, self.m.generation, oom)
        self.moved = [record, *moved]
        self.lost = None

    def _write_unwritten(self) -> None:
        """The row of a step that trained and was checkpointed, but whose boundary failed before
        the leader wrote it (a peer died in the pool change, say), when the recovery resumed past
        it: a restart from that checkpoint does not run the step again. Written as the leader
        recorded it at that boundary (before its reports arrived, when the boundary failed as soon
        as its checkpoint was written: its metrics, lengths and plan, without its timings); the
        recovery's transitions go with the next step's row. A step that runs again (a rollback,
        an older checkpoint) writes its own row instead."""
        record, self.unwritten = self.unwritten, None
        if self.leader is None or record is None or record.step >= self.step:
            return
        last = self.leader.metrics.last
        if last is None or last < record.step:
            self.leader.write(self._dropped(record), [], self.plan)
