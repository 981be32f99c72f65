"""What only the job's leader does (the worker on GPU 0, which hosts the store and the controller).

At every step boundary it decides the pool change — scripted losses, newcomers whose signed join
requests it accepts (a ``grow`` job, or a scripted gain it starts itself in local mode), nodes
to drain for shrink requests — and the action: the controller's decision on the step's telemetry
(a restart resolved to the plan it reloads onto), or a drain's move off the leaving GPUs. It
writes each step's metrics. Every other worker learns the outcome by broadcast. Edge module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from nereus.control.action import Action, Keep, Restart, TransitionRecord
from nereus.control.controller import Controller, policy_config
from nereus.control.telemetry import Telemetry
from nereus.plan.layout import Plan
from nereus.plan.problem import SeqStats
from nereus.runtime.job import JobSetup, restart_plan
from nereus.runtime.membership import JoinRequest, Membership
from nereus.runtime.metrics import MetricsWriter, StepRecord
from nereus.runtime.pool import Change, drain_gpus, read_shrink_requests
from nereus.spec import load_cluster

JOIN_WAIT_S = 120.0  # a scripted local gain: how long the leader waits for the new process


class Leader:
    """The controller, the metrics and the pool on GPU 0."""

    def __init__(
        self, m: Membership, setup: JobSetup, plan: Plan, out: Path, control: Path | None = None,
        spawn_local: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        spec = setup.spec
        self.m, self.setup, self.spec = m, setup, spec
        self.control = control  # shrink requests (``shrink-*.json``) from nereus-launch
        self.spawn_local = spawn_local  # local mode: start a scripted newcomer
        self.cluster = load_cluster(spec.cluster)
        self.controller = Controller(
            setup.workload, setup.models, self.cluster, plan, policy_config(spec.policy)
        )
        self.metrics = MetricsWriter(out, spec)
        self.started = time.perf_counter()  # the controller's clock

    # ------------------------------------------------------------------ the action
    def decide(self, tel: Telemetry, max_new: int, rebuilt: frozenset[str] = frozenset()) -> Action:
        """The controller's action on ``tel``; a restart goes to the plan ``restart_plan`` picks."""
        decision = self.controller.observe(tel, rebuilt)
        if decision is None:
            return Keep()
        action = decision.action
        if isinstance(action, Restart):
            problem = self.controller.problem(
                tel.pool, SeqStats.fixed(self.setup.workload.prompt_len, max_new)
            )
            return replace(action, plan=restart_plan(self.setup, problem, max_new))
        return action

    def drain(self, tel: Telemetry, gpus: tuple[int, ...]) -> Action:
        """The move off ``gpus`` while they still hold their state (a shrink)."""
        pool = tuple(g for g in self.m.members if g not in gpus)
        seq = SeqStats.fixed(self.setup.workload.prompt_len, tel.seq_len_mean)
        action = self.controller.drain(pool, seq, f"shrink: GPUs {list(gpus)} leave")
        if isinstance(action, Keep):
            self.m.log(f"shrink refused: {action.reason}")
        return action

    def recover(self, plan: Plan, last: Telemetry | None, step: int, rebuilt: frozenset[str]) -> Action:
        """After a failed step rolled back to ``plan``: the urgent replan on the survivors."""
        self.controller.adopt(plan)
        mean, p95 = (last.seq_len_mean, last.seq_len_p95) if last is not None else (1.0, 1.0)
        tel = Telemetry(step, self.clock(), mean, p95, self.m.members)
        return self.decide(tel, self.spec.max_new_tokens_at(step), rebuilt)

    def clock(self) -> float:
        """Seconds since the leader started: the telemetry's time."""
        return time.perf_counter() - self.started

    # ------------------------------------------------------------------ the pool
    def pool_change(self, nxt: int) -> Change | None:
        """Who is in the generation from step ``nxt``: scripted losses, accepted newcomers (each
        answered with its GPU id and the generation), nodes drained for shrink requests."""
        leaving = tuple(g for g in self.spec.lost_at(nxt) if g in self.m.members)
        accepted = self._joins(nxt)
        nodes = read_shrink_requests(self.control, self.m.log)
        draining, why = drain_gpus(nodes, self.m.members, self.m.hosts() if nodes else {}, self.m.gpu)
        if why:
            self.m.log(why)
        draining = tuple(g for g in draining if g not in leaving)
        if not (leaving or accepted or draining):
            return None
        joining = tuple(g for g, _ in accepted)
        members = tuple(sorted((set(self.m.members) - set(leaving)) | set(joining)))
        generation = self.m.generation + (1 if leaving or joining else 0)
        change = Change(nxt, members, generation, leaving, joining, draining)
        for gpu, req in accepted:
            self.m.answer(req, gpu, change.generation, members)
        return change

    def _joins(self, nxt: int) -> list[tuple[int, JoinRequest]]:
        """Newcomers to admit now (scripted local gains are started and awaited)."""
        expected = [g for g in self.spec.gained_at(nxt) if g not in self.m.members]
        if expected and self.spawn_local is not None:
            for g in expected:
                self.spawn_local(g)
        accepted: list[tuple[int, JoinRequest]] = []
        deadline = time.monotonic() + JOIN_WAIT_S
        taken = set(self.m.members)
        limit = self.cluster.total_gpus
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
                return accepted
            if time.monotonic() > deadline:
                self.m.log(f"scripted newcomers {missing} did not ask to join in {JOIN_WAIT_S:.0f} s")
                return accepted
            time.sleep(0.05)

    # ------------------------------------------------------------------ metrics
    def with_decision(self, record: StepRecord, step: int) -> StepRecord:
        """``record`` with the controller's replan at its boundary, if there was one."""
        decisions = self.controller.decisions
        if not decisions or decisions[-1].step != step:
            return record
        d = decisions[-1].to_json()
        return record.with_decision({k: d[k] for k in ("verdict", "triggers", "reason")})

    def write(self, record: StepRecord, moved: list[TransitionRecord], plan: Plan) -> None:
        self.metrics.write(record.with_transitions([t.to_json() for t in moved]), plan)

    def finish(self) -> None:
        """Newcomers still waiting hear that there is nothing left to join; metrics close."""
        for req in self.m.pending_joins():
            self.m.refuse(req, "the job has finished")
        self.metrics.close()


def _free(taken: set[int]) -> int:
    g = 0
    while g in taken:
        g += 1
    return g
