"""The job's step loop on every worker, with membership changes and failures at its edges.

Every step runs the RL algorithm (``job.algorithm_step``) and the weight sync; then, at the step
boundary:

1. telemetry is gathered (stage seconds, held bytes, a pending preemption);
2. **membership**: the leader (GPU 0, which hosts the store and the controller) collects what
   changed — scripted losses, newcomers whose signed join requests it accepted (a ``grow`` job, or a
   scripted gain in local mode) — and every member re-forms the world in place at the next
   generation; newcomers receive the job's state from the leader and enter the loop here;
3. the controller decides on the leader (``job.decide``) and every member runs the admitted
   transition (or the restart from the latest checkpoint) and re-binds its engines;
4. the leader writes the step's metrics.

A collective that fails mid-step (a peer died) is caught on every survivor: it rolls the step back
to the boundary snapshot, the survivors form the next generation, the controller replans urgently
from the intact units (or the job restarts from its checkpoint when the last copy of some state
was lost), and the step runs again — so training stays exactly on track. A SIGUSR2/SIGTERM (SLURM
preemption) is acted on at the next boundary: checkpoint, then stop as ``preempted``.
Edge module (torch.distributed, processes).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nereus.backends.optim import AdamWConfig
from nereus.control.controller import Controller, policy_config
from nereus.control.telemetry import Telemetry
from nereus.errors import InfeasibleError
from nereus.plan.layout import Plan
from nereus.plan.problem import SeqStats
from nereus.plan.search import search
from nereus.runtime import checkpoint as ckpt
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import JobSetup, algorithm_step, broadcast, decide, initial_plan, reduce_max
from nereus.runtime.membership import JoinRequest, Membership
from nereus.runtime.metrics import MetricsWriter, StepRecord, plan_summary
from nereus.runtime.optimes import efficiencies, measurements
from nereus.runtime.worker import Worker
from nereus.spec import load_cluster
from nereus.spec.workload import Role
from nereus.transition.between import plan_transition

PREEMPT_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
JOIN_WAIT_S = 120.0  # a scripted local gain: how long the leader waits for the new process


def is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because a peer is gone (gloo closes the connection; NCCL reports a
    backend error), as opposed to a bug in this process."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out")
    )


@dataclass(frozen=True, slots=True)
class Change:
    """A membership change the leader decided at the boundary before ``step``."""

    step: int
    members: tuple[int, ...]  # of the next generation
    generation: int
    leaving: tuple[int, ...]  # processes that stop (a scripted loss)
    joining: tuple[int, ...]  # newcomers' GPU ids
    draining: tuple[int, ...] = ()  # processes that hand their state over, then stop (a shrink)

    @property
    def reforms(self) -> bool:
        return bool(self.leaving or self.joining)


@dataclass(frozen=True, slots=True)
class Boundary:
    """A step boundary after telemetry and membership: what its decision and metrics need."""

    step: int  # the next step
    record: StepRecord | None  # the leader's record of the step that ended
    t_monitor: float
    t_ckpt: float
    change: Change | None
    member_s: float = 0.0  # the membership change: waiting for newcomers, re-forming the world


class JobLoop:
    """One worker process's run of the job."""

    def __init__(
        self, m: Membership, spec: ExperimentSpec, out: Path,
        spawn_local: Callable[[int], None] | None = None, control: Path | None = None,
    ) -> None:  # fmt: skip
        self.m = m
        self.control = control  # shrink requests (``shrink-*.json``) from nereus-launch
        self.spec = spec
        self.out = out
        self.folder = out / "checkpoints"
        self.spawn_local = spawn_local  # the leader in local mode: start a scripted newcomer
        self.preempt = False
        self.setup: JobSetup | None = None
        self.worker: Worker | None = None
        self.plan: Plan | None = None
        self.controller: Controller | None = None
        self.metrics: MetricsWriter | None = None
        self.started = time.perf_counter()
        self._previous: dict[int, Any] = {}  # the signal handlers ours replaced
        self.first_step = 0  # scripted kills apply from the step this process started at
        self.snapshot_plan: Plan | None = None
        self.last_tel: tuple[Any, ...] | None = None
        self.moved: list[dict[str, Any]] = []  # a recovery's actions, reported with the next step

    @property
    def leader(self) -> bool:
        return self.m.leader

    # ------------------------------------------------------------------ start
    def install_signals(self) -> None:
        """SLURM's preemption signals set a flag acted on at the next boundary; the handler
        installed before (submitit's requeue) runs after the checkpoint (``after_preempt``)."""
        self._previous = {s: signal.getsignal(s) for s in PREEMPT_SIGNALS}

        def flag(signum: int, frame: Any) -> None:
            self.preempt = True

        for s in PREEMPT_SIGNALS:
            signal.signal(s, flag)

    def after_preempt(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self.leader:
            prev = self._previous.get(signal.SIGUSR2)
            if callable(prev):
                prev(signal.SIGUSR2, None)

    def _worker(self, setup: JobSetup) -> Worker:
        rl = self.spec.rl
        optim = {
            Role.ACTOR: AdamWConfig(lr=rl.lr, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm),
            Role.CRITIC: AdamWConfig(
                lr=rl.critic_lr, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm
            ),
        }
        return Worker(self.m.gpu, setup.workload, setup.models, self.spec.cluster, optim, self.spec.seed)

    def start(self, resume: bool) -> int:
        """Every initial member: the setup, the first plan, fresh or checkpointed state; returns
        the first step."""
        spec = self.spec
        setup = broadcast(JobSetup.build(spec, self.out) if self.leader else None)
        self.setup, self.worker = setup, self._worker(setup)
        self.worker.set_world(self.m.members)
        resume_from = broadcast(ckpt.latest(self.folder) if self.leader and resume else None)
        first = ckpt.step_of(resume_from) + 1 if resume_from is not None else 0
        pool = self.m.members
        self.plan = broadcast(
            initial_plan(setup, pool, spec.max_new_tokens_at(first)) if self.leader else None
        )
        step = 0
        if resume_from is not None:
            step = ckpt.load(self.worker, self.plan, resume_from) + 1
            self.worker.bind(self.plan)
            self.worker.weight_sync(self.plan)
        else:
            self.worker.init_state(self.plan)
            self.worker.bind(self.plan)
            for name, engine in self.worker.engines.items():  # Hugging Face weights to start from
                path = spec.init.path(self.worker.workflow.get(name).role.value)
                if path:
                    engine.load_hf(Path(path))
        if self.leader:
            self.controller = Controller(
                setup.workload,
                setup.models,
                load_cluster(spec.cluster),
                self.plan,
                policy_config(spec.policy),
            )
            self.metrics = MetricsWriter(self.out, spec)
        return step

    # ------------------------------------------------------------------ the loop
    def run(self, step: int, boundary: Boundary | None = None) -> str:
        """Steps from ``step`` to the end; ``boundary``: one to finish first (a newcomer enters
        at one). Returns ``done``, ``preempted`` or ``left``."""
        self.first_step = step
        lost: tuple[int, ...] | None = None
        while step < self.spec.steps:
            try:
                if boundary is not None:
                    done, boundary = self._finish_boundary(boundary), None
                    if isinstance(done, str):
                        return done
                    step = done
                    continue
                if lost is not None:
                    step, lost = self._recover(step, lost), None
                self.snapshot_plan = self.plan
                outcome = self._step(step)
                if isinstance(outcome, str):
                    return outcome
                step = outcome
            except Exception as exc:
                if not is_peer_failure(exc):
                    raise
                failed = True  # recover outside the handler: the traceback pins the old groups
            else:
                failed = False
            if failed:
                lost, boundary = self._survive(), None
        self._finish()
        return "done"

    def _survive(self) -> tuple[int, ...]:
        """A peer died: let go of every group, form the next generation with the survivors,
        roll back to the boundary. Returns the GPUs lost."""
        assert self.worker is not None
        before = self.m.members
        self.worker.release()
        survivors = self.m.recover()
        self.m.form(survivors, self.m.generation + 1)
        self.worker.set_world(survivors)
        self.worker.rollback()
        self.plan = self.snapshot_plan
        return tuple(g for g in before if g not in survivors)

    def _step(self, step: int) -> int | str:
        spec, worker, setup, plan = self.spec, self.worker, self.setup, self.plan
        assert worker is not None and setup is not None and plan is not None
        worker.take_snapshot()
        t0 = time.perf_counter()
        worker.times.seconds.clear()
        worker.optimes.clear()
        kill = self.m.gpu in spec.killed_at(step) and step >= self.first_step
        hook = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if kill else None
        r, _, m = algorithm_step(worker, plan, setup, step, spec.max_new_tokens_at(step), hook)
        sync_s = worker.weight_sync(plan)
        step_s = time.perf_counter() - t0
        t_ckpt = time.perf_counter()
        saved = (
            bool(spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0) or step + 1 == spec.steps
        )
        if saved:
            ckpt.save(worker, plan, step, self.folder)
        t_monitor = time.perf_counter()
        reports: list[Any] = [None] * dist.get_world_size()
        held = {n: rs.nbytes for n, rs in worker.holder.units.items()}
        dist.all_gather_object(reports, (dict(worker.times.seconds), held, self.preempt, worker.optimes))
        lengths = r.response_lengths().float()
        stage_times = {
            n: max(t.get(n, 0.0) for t, _, _, _ in reports) for n in {k for t, _, _, _ in reports for k in t}
        }
        held_by = [h for _, h, _, _ in reports]
        peaks = {n: float(max(h.get(n, 0) for h in held_by)) for n in {k for h in held_by for k in h}}
        record = None
        ops = measurements([t for _, _, _, times in reports for t in times])
        if self.leader:
            record = StepRecord.of(step, m, step_s, float(lengths.mean()), plan, sync_s, stage_times)
            record = record.with_efficiency(efficiencies(ops))
        if any(p for _, _, p, _ in reports):  # preempted: checkpoint, and stop
            if not saved:
                ckpt.save(worker, plan, step, self.folder)
            if self.leader:
                assert self.metrics is not None and record is not None
                self.metrics.write(record.with_transitions([{"kind": "preempted", "seconds": 0.0}]), plan)
                self.metrics.close()
            return "preempted"
        nxt = step + 1
        mean = max(1.0, float(lengths.mean()))
        self.last_tel = (step, mean, max(mean, float(lengths.quantile(0.95))), stage_times, peaks, ops)
        t_member = time.perf_counter()
        change = self._membership(nxt) if nxt < spec.steps else None
        if change is not None and self.m.gpu in change.leaving:
            self.m.close()
            return "left"
        if change is not None and change.reforms:
            self._apply(change)
        member_s = time.perf_counter() - t_member if change is not None else 0.0
        return self._finish_boundary(Boundary(nxt, record, t_monitor, t_ckpt, change, member_s))

    # ------------------------------------------------------------------ membership
    def _membership(self, nxt: int) -> Change | None:
        """The leader decides who is in the next generation; every member learns it."""
        change = None
        if self.leader:
            leaving = tuple(g for g in self.spec.lost_at(nxt) if g in self.m.members)
            accepted = self._joins(nxt)
            draining = tuple(g for g in self._shrink_requests() if g not in leaving)
            if leaving or accepted or draining:
                joining = tuple(g for g, _ in accepted)
                members = tuple(sorted((set(self.m.members) - set(leaving)) | set(joining)))
                generation = self.m.generation + (1 if leaving or joining else 0)
                change = Change(nxt, members, generation, leaving, joining, draining)
                for gpu, req in accepted:
                    self.m.answer(req, gpu, change.generation, members)
        out: Change | None = broadcast(change)
        return out

    def _joins(self, nxt: int) -> list[tuple[int, JoinRequest]]:
        """The leader: newcomers to admit now (scripted local gains are started and awaited)."""
        expected = [g for g in self.spec.gained_at(nxt) if g not in self.m.members]
        if expected and self.spawn_local is not None:
            for g in expected:
                self.spawn_local(g)
        accepted: list[tuple[int, JoinRequest]] = []
        deadline = time.monotonic() + JOIN_WAIT_S
        taken = set(self.m.members)
        limit = load_cluster(self.spec.cluster).total_gpus
        while True:
            for req in self.m.pending_joins():
                gpu = req.gpu if req.gpu is not None and req.gpu not in taken else _free(taken)
                if gpu >= limit:
                    self.m.refuse(req, f"the cluster has {limit} GPUs and all are in the job")
                    continue
                taken.add(gpu)
                accepted.append((gpu, req))
            missing = [g for g in expected if g not in {a for a, _ in accepted}]
            if not missing or self.spawn_local is None:
                break
            if time.monotonic() > deadline:
                self.m.log(f"scripted newcomers {missing} did not ask to join in {JOIN_WAIT_S:.0f} s")
                break
            time.sleep(0.05)
        return accepted

    def _shrink_requests(self) -> tuple[int, ...]:
        """The leader: GPUs to drain for the shrink requests in the control folder — whole nodes,
        the most recently added first, never the leader's."""
        if self.control is None or not self.control.is_dir():
            return ()
        nodes = 0
        for path in sorted(self.control.glob("shrink-*.json")):
            try:
                k = int(json.loads(path.read_text())["nodes"])
                if k <= 0:
                    raise ValueError(k)
                nodes += k
                path.rename(path.with_name(f".done-{path.name}"))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.m.log(f"ignored shrink request {path.name}: {exc!r}")
                path.rename(path.with_name(f".bad-{path.name}"))
        if not nodes:
            return ()
        hosts = self.m.hosts()
        mine = hosts.get(self.m.gpu)
        by_host: dict[str, list[int]] = {}
        for g in self.m.members:
            by_host.setdefault(hosts.get(g, f"gpu{g}"), []).append(g)
        candidates = sorted((h for h in by_host if h != mine), key=lambda h: -max(by_host[h]))
        if nodes > len(candidates):
            self.m.log(f"shrink by {nodes} nodes refused: only {len(candidates)} can leave")
            return ()
        return tuple(sorted(g for h in candidates[:nodes] for g in by_host[h]))

    def _drain(self, gpus: tuple[int, ...]) -> Any:
        """The leader: the plan without ``gpus``, moved to while they still hold their state."""
        assert self.controller is not None and self.plan is not None and self.last_tel is not None
        pool = tuple(g for g in self.m.members if g not in gpus)
        seq = SeqStats.fixed(self.setup.workload.prompt_len if self.setup else 1, self.last_tel[1])
        problem = self.controller.problem(pool, seq)
        try:
            target = search(problem).plan
        except InfeasibleError as exc:
            self.m.log(f"shrink refused: the job does not fit on GPUs {list(pool)} ({exc})")
            return None
        tr = plan_transition(problem, self.plan, target, frozenset())
        return ("drain", target, tr, f"shrink: GPUs {list(gpus)} leave")

    def _apply(self, change: Change) -> None:
        """Every continuing member: the next generation; then the newcomers get the job's state."""
        self.m.form(change.members, change.generation)
        assert self.worker is not None
        self.worker.set_world(change.members)
        broadcast((self.setup, self.plan, change))

    def enter(self, generation: int, members: tuple[int, ...]) -> Boundary:
        """A newcomer whose join was accepted: form the generation, receive the job's state, and
        return the boundary to finish with the others."""
        self.m.form(members, generation)
        state: tuple[JobSetup, Plan, Change] = broadcast(None)
        self.setup, self.plan, change = state
        self.worker = self._worker(self.setup)
        self.worker.set_world(self.m.members)
        self.snapshot_plan = self.plan  # what a failure before its first step rolls back to
        return Boundary(change.step, None, 0.0, 0.0, change)

    # ------------------------------------------------------------------ the boundary's decision
    def _finish_boundary(self, b: Boundary) -> int | str:
        spec, plan, record = self.spec, self.plan, b.record
        assert plan is not None and self.setup is not None
        box = None
        if self.leader:
            assert self.controller is not None
            assert self.last_tel is not None
            step, mean, p95, stage_times, peaks, ops = self.last_tel
            tel = Telemetry(
                step, time.perf_counter() - self.started, mean, p95, self.m.members, stage_times, peaks,
                ops if spec.calibrate else (),
            )  # fmt: skip
            if b.change is not None and b.change.draining:
                box = self._drain(b.change.draining)
            elif b.step < spec.steps:
                box = decide(self.controller, tel, plan, self.setup, spec.max_new_tokens_at(b.step))
            if (
                record is not None
                and self.controller.decisions
                and self.controller.decisions[-1].step == step
            ):
                d = self.controller.decisions[-1].to_json()
                record = record.with_decision({k: d[k] for k in ("verdict", "triggers", "reason")})
        box = broadcast(box)
        if record is not None:
            monitor_s = time.perf_counter() - b.t_monitor - b.member_s  # a join is not monitoring
            record = record.with_overheads(monitor_s, b.t_monitor - b.t_ckpt)
        moved, self.moved = self.moved, []
        if b.change is not None and b.change.reforms:
            moved.append({"kind": "membership", "seconds": b.member_s, "generation": b.change.generation,
                          "left": list(b.change.leaving), "joined": list(b.change.joining)})  # fmt: skip
        nxt, more = self._act(box, b.step, rebind=b.change is not None and b.change.reforms)
        moved += more
        if b.change is not None and b.change.draining and box is not None:  # the drained leave now
            gone = b.change.draining
            if self.m.gpu in gone:
                self.m.close()
                return "left"
            members = tuple(g for g in self.m.members if g not in gone)
            self.m.form(members, self.m.generation + 1)
            assert self.worker is not None and self.plan is not None
            self.worker.set_world(members)
            self.worker.bind(self.plan)
            moved.append({"kind": "membership", "seconds": 0.0, "generation": self.m.generation,
                          "left": list(gone), "joined": []})  # fmt: skip
        if self.leader:
            assert self.metrics is not None and record is not None and self.plan is not None
            self.metrics.write(record.with_transitions(moved), self.plan)
        return nxt

    def _act(self, box: Any, nxt: int, rebind: bool) -> tuple[int, list[dict[str, Any]]]:
        """Every member: run the controller's verdict (``rebind``: the world re-formed, so a
        kept plan needs new groups). Returns the next step and what moved."""
        worker, plan = self.worker, self.plan
        assert worker is not None and plan is not None
        moved: list[dict[str, Any]] = []
        if box is not None and box[0] in ("admit", "drain"):
            _, target, tr, reason = box
            seconds = reduce_max(worker.transition(tr))
            worker.bind(target)
            kinds = sorted({n.primitive.value for n in tr.dag.nodes})
            moved.append({
                "kind": "+".join(kinds) or "regroup", "seconds": seconds, "reason": reason,
                "bytes": tr.moved_bytes, "before": plan_summary(plan), "after": plan_summary(target),
            })  # fmt: skip
            self.plan = target
            if self.controller is not None and box[0] == "admit":
                self.controller.transition_done(seconds)
            elif self.controller is not None:
                self.controller.adopt(target)
        elif box is not None and box[0] == "restart":
            _, target, _, reason = box
            began = time.perf_counter()
            path = ckpt.latest(self.folder)
            if path is None:
                raise RuntimeError(f"step {nxt}: {reason}, and there is no checkpoint to restart from")
            resumed = ckpt.load(worker, target, path)
            worker.bind(target)
            worker.weight_sync(target)
            seconds = reduce_max(time.perf_counter() - began)
            moved.append({"kind": "restart", "seconds": seconds, "reason": reason, "from_step": resumed,
                          "before": plan_summary(plan), "after": plan_summary(target)})  # fmt: skip
            self.plan = target
            if self.controller is not None:
                self.controller.restarted(target)
            nxt = resumed + 1  # steps after the checkpoint run again, on the new plan
        elif rebind:
            worker.bind(plan)  # the world re-formed and the plan stays: new groups, same state
        return nxt, moved

    # ------------------------------------------------------------------ failures
    def _recover(self, step: int, lost: tuple[int, ...]) -> int:
        """Survivors formed a new generation and rolled back to the boundary before ``step``:
        the urgent replan from intact units (weight copies are rebuilt by a weight sync after
        it), or the restart from the latest checkpoint. Returns the step to run next."""
        worker, plan = self.worker, self.plan
        assert worker is not None and plan is not None and self.setup is not None
        t0 = time.perf_counter()
        receivers = frozenset(dst for _, dst in worker.workflow.weight_syncs)
        box = None
        if self.leader:
            assert self.controller is not None
            self.controller.adopt(plan)
            last: tuple[Any, ...] = self.last_tel or (step, 1.0, 1.0, {}, {})
            tel = Telemetry(
                step, time.perf_counter() - self.started, last[1], last[2], self.m.members, {}, {}
            )
            box = decide(self.controller, tel, plan, self.setup, self.spec.max_new_tokens_at(step), receivers)
        box = broadcast(box)
        nxt, moved = self._act(box, step, rebind=True)
        if box is None or box[0] == "admit":
            assert self.plan is not None
            worker.weight_sync(self.plan)  # the rollback dropped the weight copies
        self.moved = [{
            "kind": "recovered", "seconds": reduce_max(time.perf_counter() - t0), "lost": list(lost),
            "members": list(self.m.members), "generation": self.m.generation,
        }, *moved]  # fmt: skip
        return nxt

    # ------------------------------------------------------------------ the end
    def _finish(self) -> None:
        worker = self.worker
        assert worker is not None
        if self.leader:  # newcomers still waiting hear that there is nothing left to join
            for req in self.m.pending_joins():
                self.m.refuse(req, "the job has finished")
        if "actor.train" in worker.engines:
            worker.engines["actor.train"].save_hf(self.out / "hf" / "actor")
        if self.leader and self.metrics is not None:
            self.metrics.close()


def _free(taken: set[int]) -> int:
    g = 0
    while g in taken:
        g += 1
    return g
