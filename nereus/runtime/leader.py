"""What only the job's leader does (the worker on GPU 0, which hosts the store and the controller).

At every step boundary it decides the pool change — scripted losses, newcomers whose signed join
requests it accepts (a ``grow`` job, or a scripted gain it starts itself in local mode), nodes
to drain for shrink requests — and the action: the controller's decision on the step's telemetry
(a restart resolved to the plan it reloads onto), or a drain's move off the leaving GPUs. It
writes each step's metrics. Every other worker learns the outcome by broadcast. Edge module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from nereus.control.action import Action, Keep, Move, Restart, TransitionRecord
from nereus.control.admission import Decision
from nereus.control.controller import Controller, policy_config
from nereus.control.telemetry import Telemetry
from nereus.errors import ConfigError, InfeasibleError, TooFewGpusError
from nereus.plan.calibration import CalibrationStore
from nereus.plan.layout import Plan
from nereus.plan.problem import SeqStats
from nereus.runtime.deferred import Deferral, Taken, deferrable
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import JobSetup, restart_plan
from nereus.runtime.membership import Membership
from nereus.runtime.metrics import MetricsWriter, StepRecord
from nereus.runtime.monitor import (
    Lengths,
    Notice,
    RankReport,
    StepResult,
    gather_reports,
    step_record,
    straggler_s,
    telemetry,
)  # fmt: skip
from nereus.runtime.pool import (
    Change,
    refuse_shrinks,
)
from nereus.runtime.poolkeeping import PoolKeeping
from nereus.runtime.rollout import Rollouts
from nereus.runtime.worker import Worker
from nereus.spec import ClusterSpec
from nereus.telemetry import NodeInventory, read_node, reconcile

T = TypeVar("T")


def too_few_gpus(members: Sequence[int], exc: InfeasibleError) -> TooFewGpusError:
    """The job cannot go on on ``members``, the GPUs a loss left (no plan fits them: ``exc``)."""
    return TooFewGpusError(
        f"the {len(members)} GPUs left {list(members)} cannot run the job ({exc}); "
        "its latest checkpoint stays: resume from it on more GPUs"
    )


class Leader(PoolKeeping):
    """The controller, the metrics and the pool on GPU 0."""

    def __init__(
        self, m: Membership, setup: JobSetup, plan: Plan, out: Path, control: Path | None = None,
        spawn_local: Callable[[int, bool], None] | None = None, defer: bool = True,
        calibration: CalibrationStore | None = None,
    ) -> None:  # fmt: skip
        spec = setup.spec
        self.m, self.setup, self.spec = m, setup, spec
        self.control = control  # shrink requests (``shrink-*.json``) from nereus-launch
        self.shrinks: tuple[Path, ...] = ()  # the requests the last pool change read
        self.draining: tuple[int, ...] = ()  # GPUs a drain is moving off, until they leave
        self.spawn_local = spawn_local  # local mode: start a scripted newcomer
        self.spawned: set[tuple[int, int]] = set()  # (step, GPU): each scripted newcomer starts once
        self.cluster = setup.cluster
        self.controller = Controller(
            setup.workload, setup.models, self.cluster, plan, policy_config(spec.policy), calibration,
            space=setup.space,
        )  # fmt: skip
        self.metrics = MetricsWriter(out, spec)
        self.out = Path(out)
        self.started = time.perf_counter()  # the controller's clock
        self.decided_s = 0.0  # seconds the latest ``action`` took (a transition's own planning)
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="nereus-leader")  # ``beside``
        self.probe_store = m.store.clone()  # type: ignore[attr-defined]  # the helper's own connection
        self.calm = False  # nothing can change the pool at this boundary (``calm_pool``)
        self.early_s = 0.0  # the helper's seconds of early work for the latest boundary (``early``)
        self._early: tuple[int, Future[Lengths]] | None = None  # (step, work) begun by ``ahead``
        self.defer = defer  # replans that cannot be urgent run beside the next step (``deferred``)
        self.deferral = Deferral(self.controller, self.beside)
        self.taken: Taken | None = None  # a deferred decision taken (or dropped) at this boundary

    def beside(self, work: Callable[[], T]) -> Future[T]:
        """``work`` on the leader's helper thread while this one waits in a collective (gloo lets
        go of the GIL there): the monitor's own work overlaps the wait for the other ranks. The
        caller takes the result before it touches anything ``work`` touches."""
        return self.helper.submit(work)

    # ------------------------------------------------------------------ the monitor
    def ahead(self, step: int, rollouts: Rollouts) -> None:
        """Step ``step`` generated ``rollouts``: its boundary's work that needs nothing else starts
        on the helper now, beside the rest of the step (``early``)."""
        self.settle()
        self._early = (step, self.beside(lambda: self.early(step, rollouts)))

    def early(self, step: int, rollouts: Rollouts) -> Lengths:
        """The boundary after ``step``'s work that needs only its rollouts: whether nothing can
        change the pool there (``calm_pool``), the step's lengths, and the running plan priced
        ahead at them (``Controller.prepare``: the boundary's memory check)."""
        began = time.perf_counter()
        self.calm = self.calm_pool(step + 1)
        lengths = Lengths.of(rollouts)
        self.controller.prepare(*lengths.seen)
        self.early_s = time.perf_counter() - began
        return lengths

    def settle(self) -> None:
        """Wait for the helper's early work, if any is under way (before anything else touches the
        controller: a failed step's recovery, say); its answer is dropped."""
        if self._early is not None:
            _, work = self._early
            self._early = None
            work.exception()  # waits (what it found is dropped with it)
        self.calm = False

    def gather(
        self, worker: Worker, preempt: bool, result: StepResult, ready_at: float = 0.0
    ) -> tuple[list[RankReport], Lengths]:
        """Every rank's report (``gather_reports``) and the step's lengths. The helper's early work
        (``early``) began when the step generated (``ahead``); a step that did not say so (async
        RL) starts it now, while this thread waits for the reports."""
        early, self._early = self._early, None
        if early is not None and early[0] == result.step:
            ready = early[1]
        else:
            if early is not None:
                early[1].exception()
            self.early_s = 0.0
            ready = self.beside(lambda: self.early(result.step, result.rollouts))
        try:
            reports = gather_reports(worker, preempt, ready_at)
        finally:  # a failed gather waits for the helper too: nothing else may touch the controller
            lengths = ready.result()
        assert reports is not None
        return reports, lengths

    def monitor(
        self, worker: Worker, preempt: bool, result: StepResult, plan: Plan, ready_at: float, t_monitor: float
    ) -> tuple[Telemetry, Notice, float, Future[StepRecord], dict[str, float]]:  # fmt: skip
        """The leader's side of the boundary after ``result`` (``plan``: the plan it ran on; from
        ``t_monitor``): every rank's report (``gather``), the step's telemetry, the notice for
        every rank, when the pool change began, and the step's record, built on the helper while
        the action is decided and the notice travels; and where the seconds went
        (``StepRecord.monitor_parts``: "gather", of it "straggler", the helper's early work
        "beside", "decide", the helper's seconds on a decision deferred from the boundary before
        "deferred" (``nereus.runtime.deferred``), and "record")."""
        reports, lengths = self.gather(worker, preempt, result, ready_at)
        parts = {"gather": time.perf_counter() - t_monitor}
        parts["straggler"] = min(straggler_s(reports), parts["gather"])  # the step's, not the monitor's
        parts["beside"] = self.early_s
        tel = telemetry(result, reports, self.m.members, 0.0, self.spec.calibrate, lengths)

        def build() -> StepRecord:
            began = time.perf_counter()
            record = step_record(result, reports, plan, lengths)
            parts["record"] = time.perf_counter() - began
            return record

        later = self.beside(build)  # before a decision deferred at this boundary queues behind it
        notice, started = self.notice(result.step, reports, tel)
        parts["decide"] = time.perf_counter() - started
        if self.taken is not None:  # the decision on the last step's telemetry, made beside this one
            parts["deferred"] = self.taken.seconds
        return tel, notice, started, later, parts

    # ------------------------------------------------------------------ the action
    def notice(self, step: int, reports: Sequence[RankReport], tel: Telemetry) -> tuple[Notice, float]:
        """What every rank learns after step ``step`` (``reports``: every rank's, ``tel``: the
        step's telemetry): stop, or the pool change, or (none) the boundary's action; and when the
        pool change began (what its membership seconds count from)."""
        nxt, self.taken = step + 1, None
        if any(r.preempted for r in reports) and nxt < self.spec.steps:
            self.drop("the job stops")
            return Notice(preempted=True), time.perf_counter()
        started = time.perf_counter()
        health = [r.health for r in reports]
        calm, self.calm = self.calm and not any(health), False  # looked at while the reports came
        change = self.pool_change(nxt, health) if nxt < self.spec.steps and not calm else None
        if change is not None:
            self.drop("the pool changes")
            return Notice(change=change), started
        return Notice(action=self.action(tel, nxt, None)), started

    def action(self, tel: Telemetry | None, step: int, change: Change | None) -> Action:
        """The action at the boundary before ``step`` after ``change``: a drain's move, else the
        controller's action on ``tel`` (the last step's telemetry) with the clock and pool of now."""
        assert tel is not None, "a boundary before any step"
        started = time.perf_counter()
        reformed = change is not None and change.reforms
        tel = replace(tel, time_s=self.clock(), pool=self.m.members, reformed=reformed)
        action: Action | None = None
        if change is not None and change.draining:
            action = self.drain(tel, change.draining)
            if isinstance(action, Keep) and change.leaving:
                action = None  # the drain refused (said so): the GPUs lost beside it need a plan
        if action is None and step < self.spec.steps:
            max_new, defer = self.spec.max_new_tokens_at(step), self.defer and change is None
            try:
                action = self.decide(tel, max_new, defer=defer)
            except InfeasibleError as exc:  # GPUs that left (scripted, condemned) took the last plan
                if change is None or not change.leaving:
                    raise
                raise too_few_gpus(self.m.members, exc) from None
        self.decided_s = time.perf_counter() - started
        return action if action is not None else Keep()

    def decide(
        self, tel: Telemetry, max_new: int, rebuilt: frozenset[str] = frozenset(), defer: bool = False
    ) -> Action:
        """The controller's action on ``tel``; a restart goes to the plan ``restart_plan`` picks.
        A decision deferred from the boundary before is taken first: a move or restart it found is
        this boundary's action (``tel``'s step ran on the plan it leaves: its measurements and
        lengths are folded into calibration and the growth, ``Controller.fold``); a keep lets
        ``tel`` be observed as usual. ``defer``: a replan whose triggers cannot be
        urgent runs beside the next step, and the plan is kept for it (``deferred``)."""
        if self.deferral.pending:
            self.taken = self.deferral.take()
            if not self.taken.keeps:
                self.controller.fold(tel)
                return self.resolve(self.taken.decision, tel.pool, max_new)
        fired = self.controller.triggers(tel)
        if not fired:
            return Keep()
        if defer and deferrable(fired, tel.step + 1, self.spec.steps):
            self.deferral.start(tel, fired)
            return Keep("decided beside the next step")
        return self.resolve(self.controller.decide(tel, fired, rebuilt), tel.pool, max_new)

    def resolve(self, decision: Decision, pool: tuple[int, ...], max_new: int) -> Action:
        """``decision``'s action; a restart goes to the plan ``restart_plan`` picks on ``pool``."""
        action = decision.action
        if isinstance(action, Restart):
            problem = self.controller.problem(pool, SeqStats.fixed(self.setup.workload.prompt_len, max_new))
            plan = restart_plan(self.setup, problem, max_new, self.controller.planner)
            return replace(action, plan=plan)
        return action

    def drop(self, why: str) -> None:
        """Something urgent at this boundary (``why``) supersedes a decision deferred from the
        boundary before, if one is under way (``Deferral.drop``)."""
        self.taken = self.deferral.drop()
        if self.taken is not None:
            d = self.taken.decision
            self.m.log(f"the decision deferred from step {d.step} ({d.verdict.value}) is dropped: {why}")

    def drain(self, tel: Telemetry, gpus: tuple[int, ...]) -> Action:
        """The move off ``gpus`` while they still hold their state (a shrink)."""
        pool = tuple(g for g in self.m.members if g not in gpus)
        seq = SeqStats.fixed(self.setup.workload.prompt_len, tel.seq_len_mean)
        action = self.controller.drain(pool, seq, f"shrink: GPUs {list(gpus)} leave")
        if isinstance(action, Keep):
            self.m.log(f"shrink refused: {action.reason}")
            refuse_shrinks(self.shrinks, action.reason)
        else:
            self.draining = gpus
        return action

    def recover(
        self, plan: Plan, last: Telemetry | None, step: int, rebuilt: frozenset[str], oom: str = ""
    ) -> Action:
        """After a failed step rolled back to ``plan``: the urgent replan on the survivors
        (``oom``: the model-stage that ran out of memory, which the controller corrects for)."""
        self.settle()
        self.drop("a step failed")
        self.unfinished_drain()
        self.controller.adopt(plan)
        mean, p95 = (last.seq_len_mean, last.seq_len_p95) if last is not None else (1.0, 1.0)
        tel = Telemetry(step, self.clock(), mean, p95, self.m.members, oom=bool(oom), oom_stage=oom)
        return self.decide(tel, self.spec.max_new_tokens_at(step), rebuilt)

    def clock(self) -> float:
        """Seconds since the leader started: the telemetry's time."""
        return time.perf_counter() - self.started

    # ------------------------------------------------------------------ GPU inventory and health
    def check_inventory(self, inventory: NodeInventory) -> ClusterSpec:
        """At start-up: the cluster spec with what ``inventory`` (``nereus.telemetry.read_node()``
        on this node) measured in place of the GPUs per node, memory per GPU and model it gets
        wrong. A mismatch is one warning line, in ``membership.log`` and once on stderr; the
        measured values win. Nothing measured (a CPU node) leaves the spec as it is. The caller
        decides what uses the returned spec (``self.cluster`` and the controller are untouched)."""
        return measured_cluster(self.cluster, inventory, self.m.log)

    # ------------------------------------------------------------------ metrics
    def with_decision(self, record: StepRecord, step: int) -> StepRecord:
        """``record`` with the controller's replan at its boundary, if there was one, else the
        decision deferred from the boundary before and taken at this one ("deferred": the step
        whose telemetry it decided on; a dropped one is not the boundary's)."""
        decisions, taken = self.controller.decisions, self.taken
        if decisions and decisions[-1].step == step:
            d = decisions[-1].to_json()
            return record.with_decision({k: d[k] for k in DECISION_KEYS})
        if taken is None or taken.dropped:
            return record
        d = taken.decision.to_json()
        return record.with_decision({**{k: d[k] for k in DECISION_KEYS}, "deferred": taken.decision.step})

    def overheads(
        self, record: StepRecord, step: int, action: Action, reformed: bool, t_ckpt: float, t_monitor: float,
        member_s: float, parts: dict[str, float] | None = None,
    ) -> StepRecord:  # fmt: skip
        """``record`` (of ``step``) with its boundary's decision, its checkpoint's seconds (from
        ``t_ckpt`` to ``t_monitor``) and its monitoring seconds since ``t_monitor``, now that every
        rank has ``action``. Not monitoring: the pool change
        (``member_s``), and deciding the action of a boundary that runs a transition — a move, a
        restart, or the plan of the world a pool change re-formed (``reformed``) — which is that
        transition's own planning (``plan_s``); and the wait for the slowest rank to finish its
        step (``parts["straggler"]``: the step's time on that rank, which the next step's barrier
        would wait for with no monitor at all). Deciding to keep the plan on an unchanged world is
        monitoring."""
        record = self.with_decision(record, step)
        parts = dict(parts or {})
        plan_s = self.decided_s if reformed or isinstance(action, Move | Restart) else 0.0
        straggler = parts.get("straggler", 0.0)
        monitor_s = time.perf_counter() - t_monitor - member_s - plan_s - straggler
        return record.with_overheads(monitor_s, t_monitor - t_ckpt, plan_s, parts, straggler)

    def write(self, record: StepRecord, moved: list[TransitionRecord], plan: Plan) -> None:
        self.metrics.write(record.with_transitions([t.to_json() for t in moved]), plan)

    def finish(self) -> None:
        """Newcomers still waiting hear that there is nothing left to join; metrics close; a
        calibrating job's calibration is saved."""
        for req in self.m.pending_joins():
            self.m.refuse(req, "the job has finished")
        self.drop("the job ends")
        self.metrics.close()
        self.save_calibration()
        self.helper.shutdown()

    def save_calibration(self) -> None:
        """``calibrate: true``: what the job measured, in ``calibration.json`` (``nereus plan`` and
        ``nereus price --calibration`` read it, keyed by the cluster's name)."""
        if not self.spec.calibrate:
            return
        try:  # the job trained: a file that cannot take it is a warning, not the job's failure
            self.controller.calibration.save(self.out / CALIBRATION)
        except (OSError, ConfigError) as exc:
            print(
                f"nereus: warning: {self.out / CALIBRATION} not written ({exc})", file=sys.stderr, flush=True
            )


CALIBRATION = "calibration.json"  # a calibrating job's measurements, in the output folder

DECISION_KEYS = (
    "verdict", "urgent", "triggers", "reason", "target_label", "current_latency_s", "target_latency_s",
    "delta_s", "l_tran_s", "payback_steps", "horizon_steps", "sunk_rebuilds", "current_risk_s",
    "target_risk_s", "revocation_rate",
)  # fmt: skip
"""What a step's metrics row keeps of the controller's decision: the verdict and why, and the
numbers admission weighed (predicted step latencies, ΔL, L_tran, payback and horizon in steps,
the risks priced and the revocation rate they were priced at)."""


def measured_setup(spec: ExperimentSpec, out: Path, log: Callable[[str], None]) -> JobSetup:
    """The leader: the job's setup, with its node's GPUs as measured where the cluster spec says
    otherwise (``nereus.telemetry``; nothing measured on a CPU node)."""
    setup = JobSetup.build(spec, out)
    return replace(setup, cluster=measured_cluster(setup.cluster, read_node(topology=False), log))


def measured_cluster(
    cluster: ClusterSpec, inventory: NodeInventory, log: Callable[[str], None]
) -> ClusterSpec:
    """``cluster`` with what ``inventory`` measured where they differ (the measured values win);
    a difference is one warning line, logged and printed once."""
    fixed, warning = reconcile(inventory, cluster)
    if warning is not None:
        log(f"inventory: {warning}")
        print(f"nereus: warning: {warning}", file=sys.stderr, flush=True)
    return fixed
