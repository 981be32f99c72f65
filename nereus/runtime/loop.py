"""The job's step loop on every worker, with membership changes and failures at its edges.

Every step runs the RL algorithm (``job.algorithm_step``; an async job's generation ahead and
training, ``asynchrony.async_step``) and the weight sync; then, at the step boundary:

1. the monitor gathers every rank's report once, on the leader (stage seconds, held bytes,
   op-class timings, a pending preemption), into the controller's telemetry and its step record;
   the leader's helper thread probes the pool and prices the running plan ahead at the step's
   lengths from the moment the step generated (``Leader.ahead``), beside the rest of the step, and
   builds the record while the notice travels (``Leader.beside``);
2. **pool change**: the leader (GPU 0, which hosts the store and the controller) decides who is in
   the next generation — scripted losses, newcomers whose signed join requests it accepted (a
   ``grow`` job, or a scripted gain in local mode), nodes drained for shrink requests — and every
   member re-forms the world in place at the next generation; newcomers receive the job's state
   from the leader and enter the loop here;
3. the leader decides the boundary's ``Action`` (the controller's, or a drain's move) and every
   member executes it (``nereus.runtime.acting``): ``Keep``, ``Move`` (the priced transition,
   then engines re-bind) or ``Restart`` (the latest checkpoint onto a new plan). A replan whose
   outcome cannot be urgent runs beside the next step instead, and what it finds is the next
   boundary's action (``nereus.runtime.deferred``);
4. the leader writes the step's metrics.

Every rank learns 1–3 from one broadcast, the leader's ``Notice``: a stop, or the pool change
(the action follows in the next generation), or — no change — the action: a quiet boundary is
two collectives, the gather and that broadcast.

A collective that fails mid-step (a peer died) is caught on every survivor: the survivors form the
next generation, agree on the boundary snapshot they all hold (a peer that dies at a boundary can
leave them one snapshot apart: ``snapshot.py``) and roll back to it, step counter and plan
included; the controller replans urgently from the intact units (or the job restarts from its
checkpoint when the last copy of some state was lost), and the step runs again — so training
stays exactly on track. A stop signal (SLURM's preemption: SIGUSR2, SIGTERM; ``nereus run`` also
stops on SIGINT) is acted on at the next boundary: checkpoint, then stop as ``preempted`` (after
the last step the job just finishes).
Edge module (torch.distributed, processes).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from nereus.control.action import Action, Keep, Move, Outcome, RecordKind, TransitionRecord
from nereus.control.telemetry import Telemetry
from nereus.devices import StageOutOfMemoryError, set_world_timeout
from nereus.errors import TooFewGpusError
from nereus.plan import sweep
from nereus.plan.calibration import CalibrationStore
from nereus.plan.layout import Plan
from nereus.runtime import checkpoint as ckpt
from nereus.runtime import faults
from nereus.runtime.acting import Acting
from nereus.runtime.asynchrony import async_step
from nereus.runtime.comm import barrier, broadcast, is_peer_failure
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.export import export_models
from nereus.runtime.job import JobSetup, algorithm_step, first_state, initial_plan, make_worker
from nereus.runtime.leader import Leader, measured_setup
from nereus.runtime.membership import LeftBehindError, Membership
from nereus.runtime.metrics import StepRecord, drop_rows_after
from nereus.runtime.monitor import Notice, StepResult, gather_reports, step_record
from nereus.runtime.pending import share as share_pending
from nereus.runtime.pool import Change
from nereus.runtime.preemption import Preemption
from nereus.runtime.rollcall import HOLD_S
from nereus.runtime.rollout import Rollouts
from nereus.runtime.surviving import Surviving
from nereus.runtime.sweep import sweep_world
from nereus.runtime.validation import validate
from nereus.runtime.worker import Worker
from nereus.spec.workload import ExecutionMode


def start_up_sweep(m: Membership, setup: JobSetup) -> CalibrationStore:
    """Time the collectives of the world's groups (``nereus.runtime.sweep``) before the first plan;
    the calibration the first plan and the controller start from. Collective over the world."""
    timed = sweep_world(m.members, m.gpu, setup.cluster.gpus_per_node, m.devices)
    if m.leader:
        m.log(f"start-up collective sweep: {len(timed)} probes in {sweep.seconds_spent(timed):.1f} s")
    return sweep.calibration(setup.cluster, timed)


def time_groups(worker: Worker, spec: ExperimentSpec, m: Membership) -> None:
    """The groups a new worker forms: a pipeline's sends and receives wait the first step's
    collective timeout, their collectives the formation's until the first step sets its own."""
    worker.p2p_timeout = timedelta(seconds=spec.collective_timeout())
    worker.collective_timeout = m.timeout


@dataclass(frozen=True, slots=True)
class Boundary:
    """A step boundary after the monitor and the pool change: what its action and metrics need."""

    step: int  # the next step
    record: StepRecord | None  # the leader's record of the step that ended
    t_monitor: float = 0.0
    t_ckpt: float = 0.0
    change: Change | None = None
    member_s: float = 0.0  # the pool change: waiting for newcomers, re-forming the world
    action: Action | None = None  # the action, when the notice carried it (no pool change)
    parts: tuple[tuple[str, float], ...] = ()  # where monitor_s went (``StepRecord.monitor_parts``)


class JobLoop(Acting, Surviving):
    """One worker process's run of the job, from its first step (or boundary) to its outcome."""

    def __init__(
        self, m: Membership, spec: ExperimentSpec, out: Path, setup: JobSetup, worker: Worker, plan: Plan,
        step: int, leader: Leader | None = None, pending: Boundary | None = None,
        preemption: Preemption | None = None,
    ) -> None:  # fmt: skip
        self.m, self.spec, self.out, self.folder = m, spec, out, out / "checkpoints"
        self.setup, self.worker, self.plan, self.leader = setup, worker, plan, leader
        if m is not None:  # (stand-in loops in tests have no membership)
            worker.hold = m.holding  # the worker's full collections hold this member's heartbeat
        self.step = step  # the next step to run
        self.first_step = step  # scripted kills apply from the step this process started at
        self.pending = pending  # a boundary to finish first (a newcomer enters at one)
        self.lost: tuple[int, ...] | None = None  # GPUs lost in a failed step: recover first
        self.telemetry: Telemetry | None = None  # the latest step's, what the controller observes
        self.moved: list[TransitionRecord] = []  # a recovery's, reported with the next step
        self.ooms_at, self.oom_tries = -1, 0  # out-of-memory recoveries of one step, so far
        self.faulted: set[int] = set()  # steps whose scripted fault has struck
        self.frozen: set[int] = set()  # steps whose scripted hang or freeze has struck
        self.preemption = preemption or Preemption()
        self.dropped = 0  # async: batches generated ahead that a transition dropped, since the last record
        self.left_behind = False  # the job went on without this healthy GPU (``LeftBehindError``)
        self.slowest = 0.0  # seconds of the slowest step this process ran (the step's collective timeout)
        self.unwritten: StepRecord | None = None  # the leader's record of a step whose row is not written yet

    # ------------------------------------------------------------------ the two ways in
    @classmethod
    def start(
        cls, m: Membership, spec: ExperimentSpec, out: Path, resume: bool, control: Path | None = None,
        spawn_local: Callable[[int, bool], None] | None = None, preemption: Preemption | None = None,
    ) -> JobLoop:  # fmt: skip
        """Every initial member: the setup, the first plan, fresh or checkpointed state."""
        setup: JobSetup = broadcast(measured_setup(spec, out, m.log) if m.leader else None, JobSetup)
        worker = make_worker(m.gpu, setup, m.devices, out, m.members)
        time_groups(worker, spec, m)
        resume_from = ckpt.agreed_latest(out / "checkpoints", resume)
        first = ckpt.step_of(resume_from) + 1 if resume_from is not None else 0
        max_new = spec.max_new_tokens_at(first)
        store = start_up_sweep(m, setup) if spec.calibrate else None  # collective over the world
        plan: Plan = broadcast(initial_plan(setup, m.members, max_new, store) if m.leader else None, Plan)
        loaded = first_state(worker, plan, resume_from, spec)
        step = loaded.step + 1
        fixed = worker.bind_costs()
        if m.leader and resume_from is not None:  # steps after the checkpoint run again
            drop_rows_after(out / "metrics.jsonl", step - 1)
        leader = Leader(m, setup, plan, out, control, spawn_local, calibration=store) if m.leader else None
        if leader is not None:  # a move's rebuilds are priced at what they took here, until measured
            leader.controller.started(fixed)
            m.log(f"start-up built {fixed.describe()}: what a move's rebuilds cost until one is measured")
        loop = cls(m, spec, out, setup, worker, plan, step, leader, preemption=preemption)
        loop.dropped = loaded.dropped  # a resume's batches staler than a lowered max_staleness
        return loop

    @classmethod
    def enter(
        cls, m: Membership, spec: ExperimentSpec, out: Path, generation: int, members: tuple[int, ...],
        preemption: Preemption | None = None,
    ) -> JobLoop:  # fmt: skip
        """A newcomer whose join was accepted: form the generation, receive the job's state, and
        finish the boundary with the others."""
        m.form(members, generation)
        received: tuple[JobSetup, Plan, Change] = broadcast(None, tuple[JobSetup, Plan, Change])
        setup, plan, change = received
        worker = make_worker(m.gpu, setup, m.devices, out, m.members)  # GPU ids need not be 0…n − 1
        time_groups(worker, spec, m)
        if setup.workload.mode is ExecutionMode.ASYNC:
            worker.pending = share_pending(None)
        b = Boundary(change.step, None, change=change)
        return cls(m, spec, out, setup, worker, plan, change.step, pending=b, preemption=preemption)

    # ------------------------------------------------------------------ the loop
    def run(self) -> Outcome:
        """Steps to the end of the job; a peer's death or a model-stage out of memory rolls the
        step back, and it runs again (after the controller's urgent replan). The engines are
        shut down however it ends. What was built so far is out of the cyclic garbage
        collector's sight (``gc.freeze``): its full collections scanned it again and again —
        hundreds of ms under load, on any rank, which the others then waited for at the next
        boundary. An initial member collects first; a newcomer, awaited by the job, does not."""
        if self.pending is None:
            with self.m.holding(HOLD_S):  # a full collection holds the interpreter, the heartbeat's too
                gc.collect()
        gc.freeze()
        try:
            return self._run()
        finally:
            self.worker.close()

    def _run(self) -> Outcome:
        while self.step < self.spec.steps or self.lost is not None:  # a failure rolls the step back
            failed, outcome, oom = False, None, ""
            try:
                outcome = self._advance()
            except StageOutOfMemoryError as exc:  # the peers see this rank leave the world
                failed, oom = True, exc.model_stage
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                failed = True
            if failed:
                try:
                    self._survive(oom)  # outside the handler: its traceback pins the old groups
                except LeftBehindError as exc:  # the job went on without this GPU
                    print(f"nereus: {exc}", file=sys.stderr, flush=True)
                    self.m.close()
                    self.left_behind = True
                    return Outcome.LEFT
            elif outcome is not None:
                return outcome
        self._finish()
        return Outcome.DONE

    def _advance(self) -> Outcome | None:
        """What comes next: a pending boundary, or (after a recovery) a step and its boundary."""
        if self.pending is not None:
            b, self.pending = self.pending, None
            return self._finish_boundary(b)
        if self.lost is not None:
            self._recover(self.lost)
        return self._step()

    def _step(self) -> Outcome | None:
        step = self.step
        timeout = timedelta(seconds=self.spec.collective_timeout(self.slowest))
        self.worker.p2p_timeout = timeout  # a pipeline's sends and receives, in groups formed later
        self._time_collectives(timeout)  # a frozen peer: lost
        result = self._rl_step(step)
        self._time_collectives(self.m.timeout)  # the boundary: checkpoints, moves
        self.slowest = max(self.slowest, result.seconds)
        t_ckpt = time.perf_counter()
        saved = self._checkpoint_if_due(result)
        t_monitor = time.perf_counter()
        ready_at = time.time()  # wall clock: comparable across this job's processes
        notice, later, parts = None, None, dict[str, float]()
        if self.leader is None:
            gather_reports(self.worker, self.preemption.requested, ready_at)  # to the leader
            started = time.perf_counter()
        else:
            self.telemetry, notice, started, later, parts = self.leader.monitor(
                self.worker, self.preemption.requested, result, self.plan, ready_at, t_monitor
            )
        t_notice = time.perf_counter()
        try:
            notice = broadcast(notice, Notice)
        finally:  # the leader's record is built while the notice travels
            record = later.result() if later is not None else None
            if record is not None:  # until its row is written (``Surviving._write_unwritten``)
                self.unwritten = record
        parts["notice"] = time.perf_counter() - t_notice
        if notice.preempted:
            return self._preempted(step, saved, record)
        change, member_s = self._pool_change(notice.change, started)
        if change is not None and self.m.gpu in change.leaving:
            self.m.close()
            return Outcome.LEFT
        got = tuple(parts.items())
        b = Boundary(step + 1, record, t_monitor, t_ckpt, change, member_s, notice.action, got)
        return self._finish_boundary(b)

    def _rl_step(self, step: int) -> StepResult:
        """The boundary snapshot, then the algorithm and the weight sync on the plan (a scripted
        kill strikes after generation)."""
        worker, spec = self.worker, self.spec
        worker.take_snapshot(self.m.generation, step, self.plan)
        barrier()  # through it, every rank has taken this snapshot: none goes back further
        worker.snapshot.settle()
        t0 = time.perf_counter()
        worker.times.seconds.clear()
        worker.optimes.clear()
        worker.generation.clear()
        kill = self.m.gpu in spec.killed_at(step) and step >= self.first_step
        freeze = spec.frozen_at(step).get(self.m.gpu) if step not in self.frozen else None
        hook = faults.kill if kill else self._freeze(step, freeze) if freeze is not None else None
        worker.memory.clear()
        worker.fault = None
        if self.m.gpu in spec.unhealthy_at(step + 1):  # reported at this step's boundary
            worker.health.inject()
        oom = spec.oom_at(step).get(self.m.gpu)
        if oom is not None and step not in self.faulted:  # a scripted out-of-memory error, once
            self.faulted.add(step)
            worker.fault = faults.out_of_memory_in(oom)
        if self.setup.workload.mode is ExecutionMode.ASYNC:
            res = async_step(worker, self.plan, self.setup, step, spec.max_new_tokens_at, hook)
            sync_s = worker.weight_sync(self.plan)
            info = {
                "staleness": float(res.batch.staleness), "version": float(res.batch.version),
                "generated": float(len(res.generated)), "ahead": float(len(worker.pending)),
                **res.overlap.as_dict(),
            }  # fmt: skip
            seconds = time.perf_counter() - t0
            val = self._validate_if_due(step)
            return StepResult(step, res.batch.rollouts, res.metrics, seconds, sync_s, info, val)
        leader = self.leader

        def generated(rollouts: Rollouts) -> None:  # the step's lengths are known: the leader's
            if leader is not None:  # boundary work on them starts now, beside the rest of the step
                leader.ahead(step, rollouts)
            if hook is not None:
                hook()

        rollouts, _, metrics = algorithm_step(
            worker, self.plan, self.setup, step, spec.max_new_tokens_at(step), generated
        )
        sync_s = worker.weight_sync(self.plan)
        seconds = time.perf_counter() - t0
        return StepResult(step, rollouts, metrics, seconds, sync_s, validation=self._validate_if_due(step))

    def _validate_if_due(self, step: int) -> dict[str, float] | None:
        """After the step's weight sync, on every rank: the held-out prompts answered by the new
        weights (``validation.py``), when the experiment validates at ``step``."""
        if not self.spec.validates_at(step):
            return None
        return validate(self.worker, self.plan, self.setup, self.spec.max_new_tokens_at(step))

    def _freeze(self, step: int, seconds: float) -> Callable[[], None]:
        """A scripted freeze in ``step`` (once): this process stops, holding its connections."""

        def freeze() -> None:
            self.frozen.add(step)
            faults.hang(seconds)

        return freeze

    def _time_collectives(self, timeout: timedelta) -> None:
        """Each later collective, on the world and this worker's groups, waits at most ``timeout``:
        in a step the experiment's collective timeout (a peer that froze is then found lost), at
        the boundary the formation's (a checkpoint, a move's engine builds, a join take minutes)."""
        set_world_timeout(timeout)
        self.worker.time_collectives_out(timeout)

    def _checkpoint_if_due(self, result: StepResult) -> bool:
        step, every = result.step, self.spec.checkpoint_every
        saved = bool(every and (step + 1) % every == 0) or step + 1 == self.spec.steps
        if saved:
            if self.leader is not None:  # the step's row, should the boundary fail once it is saved
                self.unwritten = step_record(result, [], self.plan)  # until the monitor's full record
            ckpt.save(self.worker, self.plan, step, self.folder, self.spec.checkpoint_keep)
        return saved

    def _preempted(self, step: int, saved: bool, record: StepRecord | None) -> Outcome:
        """A stop signal (SLURM's preemption, or one to ``nereus run``): checkpoint (if this step
        did not), record it, stop; every rank learns which signal it was."""
        self.preemption.agree()
        if not saved:
            ckpt.save(self.worker, self.plan, step, self.folder, self.spec.checkpoint_keep)
        if self.leader is not None and record is not None:
            self.leader.write(self._dropped(record), [TransitionRecord(RecordKind.PREEMPTED, 0.0)], self.plan)
            self.leader.metrics.close()
            self.leader.save_calibration()
        return Outcome.PREEMPTED

    def _dropped(self, record: StepRecord) -> StepRecord:
        """An async step's record with the batches generated ahead that its boundary dropped."""
        if record.asynchrony is None:
            return record
        return replace(record, asynchrony={**record.asynchrony, "dropped": float(self.dropped)})

    # ------------------------------------------------------------------ the boundary
    def _pool_change(self, change: Change | None, started: float) -> tuple[Change | None, float]:
        """The pool change the leader decided (from ``started``), which every member learnt from
        its notice: the world re-forms when someone leaves or joins (newcomers then get the job's
        state). Returns it and its seconds."""
        if change is None:
            return None, 0.0
        if change.reforms and self.m.gpu not in change.leaving:
            self.m.form(change.members, change.generation)
            self.worker.set_world(change.members)
            broadcast((self.setup, self.plan, change), tuple[JobSetup, Plan, Change])
            if self.setup.workload.mode is ExecutionMode.ASYNC:  # the batches generated ahead, too
                self.worker.pending = share_pending(self.worker.pending if self.m.leader else None)
        return change, time.perf_counter() - started

    def _finish_boundary(self, b: Boundary) -> Outcome | None:
        """Every member runs the boundary's action (the notice's, or decided and broadcast in the
        new generation); the leader writes the step's metrics."""
        action = b.action
        if action is None:  # after a pool change: decided in the new generation
            started, leader = time.perf_counter(), self.leader
            try:
                decided = leader.action(self.telemetry, b.step, b.change) if leader is not None else None
            except TooFewGpusError:  # the step before was trained: its row stays (a resume drops later ones)
                record, moved = self._row(b, Keep("too few GPUs left"))
                if leader is not None and record is not None:
                    leader.write(self._dropped(record), moved, self.plan)
                raise
            if b.change is not None and b.change.reforms:  # the leader decided while the others
                barrier()  # re-formed the world (newcomers built engines): the membership's seconds
                planning = leader.decided_s if leader is not None else 0.0  # the decision: plan_s
                b = replace(b, member_s=b.member_s + time.perf_counter() - started - planning)
            action = broadcast(decided, Action)
        record, moved = self._row(b, action)
        change, reformed = b.change, b.change is not None and b.change.reforms
        self.step = b.step
        moved += self._act(action, rebind=reformed)
        if change is not None and change.draining and isinstance(action, Move) and action.drain:  # they leave
            if self.leader is not None:
                self.leader.drained()
            if self.m.gpu in change.draining:
                self.m.close()
                return Outcome.LEFT
            self._reform(change.after_drain)
            moved.append(TransitionRecord.membership(0.0, self.m.generation, change.draining, ()))
        if self.leader is not None and record is not None:
            self.leader.write(self._dropped(record), moved, self.plan)
        self.unwritten = None
        if self.leader is not None:  # a replan deferred at this boundary begins beside the next step
            self.leader.deferral.launch()
        self.dropped = 0
        return None

    def _row(self, b: Boundary, action: Action) -> tuple[StepRecord | None, list[TransitionRecord]]:
        """The leader's row of the step before ``b``, with ``action`` and the boundary's overheads
        (None elsewhere), and the transitions so far: the pool change's membership with them."""
        record, change = None, b.change
        if self.leader is not None and b.record is not None:
            times = (b.t_ckpt, b.t_monitor, b.member_s)
            reformed = change is not None and change.reforms
            record = self.leader.overheads(b.record, b.step - 1, action, reformed, *times, dict(b.parts))
        moved, self.moved = self.moved, []
        if change is not None and change.reforms:
            moved.append(
                TransitionRecord.membership(b.member_s, change.generation, change.leaving, change.joining)
            )
        return record, moved

    # ------------------------------------------------------------------ the end
    def _finish(self) -> None:
        companions = self.setup.tokenizer.companions()  # so the export serves as it is
        export_models(self.worker, companions, self.out, self.spec.steps, self.leader is not None)
        if self.leader is not None:
            self.leader.finish()
