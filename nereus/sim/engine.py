"""Replay a run step by step: supply from a trace, lengths from a curve, truth from ``nereus.sim.truth``.

At every step boundary the controller sees the previous step's telemetry with the pool of *now*,
may admit a transition (its true duration is charged) or ask for a restart (a checkpoint reload
is charged); then the step runs on the controller's plan. Its time comes from the true
per-model-stage times by the truth's step model (``truth.asynchrony``): synchronous, the sum of
each stage's slowest model-stage; asynchronous, a pipeline in which generation runs up to
``Scenario.max_staleness`` batches ahead and each step ends with a weight sync, its state carried
from step to step (at a move or restart the rollouts generated ahead are kept or dropped as
``Scenario.in_flight`` says; a crash drops them). It runs out of memory when any GPU's true peak
(its model-stage's true footprint plus the idle state of other stages on that GPU) exceeds the
GPU's memory, in which case the step is lost and the job restarts from its checkpoint. Wall time
includes transitions, restarts and time spent waiting for GPUs, as in the paper's step latency.

The truth (``nereus.sim.truth``) is written apart from the planner, with its own functional forms
fitted to published measurements; the planner learns it only through telemetry: per model-stage,
the truth's seconds per op class paired with the planner's ideal seconds of the class
(``nereus.sim.observe``). Peaks are the truth's own, and the out-of-memory check adds the truth's
idle-resident bytes of co-located model-stages of other stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace

from nereus.control.action import Keep, Move, RecordKind, Restart, TransitionRecord
from nereus.control.admission import Decision
from nereus.control.controller import Controller, policy_config
from nereus.control.telemetry import Telemetry
from nereus.control.transition_cost import FixedCosts
from nereus.errors import InfeasibleError
from nereus.plan.calibration import Efficiencies, Measurement
from nereus.plan.evaluate import ideal_shapes, price, shapes_of
from nereus.plan.layout import Layout, Plan
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.sim.moving import engine_of, true_moving_seconds
from nereus.sim.observe import (
    holds_step_sync,
    merged,
    out_of_memory,
    pair,
    quiet_truth,
    steady_step,
    step_sync,
    with_step_sync,
)
from nereus.sim.records import Scenario, SimulationError, StepRecord, Summary
from nereus.sim.seeding import Seeding
from nereus.sim.truth import PARAMS, Hardware, StageResult
from nereus.sim.truth.asynchrony import AsyncStep, Pipeline, sync_step
from nereus.spec.workload import ExecutionMode, Stage

__all__ = ["STATIC_BEST", "Scenario", "SimulationError", "StepRecord", "Summary", "simulate"]


def _describe(plan: Plan) -> dict[str, str]:
    return {c.model_stage: f"{c.layout}·dp{c.dp}" for c in plan.candidates}


class _Run:
    """One policy's replay."""

    def __init__(
        self, scenario: Scenario, policy: str, gamma: float, hold: Mapping[str, Layout] | None = None
    ) -> None:
        self.s = scenario
        self.hw = Hardware(scenario.seed, scenario.noise, scenario.episodes, PARAMS)
        # every policy knows the reserved floor and the trace's revocation rate, and what a restart costs
        self.config = replace(policy_config(policy, gamma), restart_s=scenario.restart_s)
        self.domains = scenario.supply.domains()
        self.free = policy == "oracle"  # its moves and restarts cost nothing: a bound, not a policy
        self.hold = dict(hold or {})  # static-best: the layouts a static run starts with
        self.t = 0.0
        self.holding_from = 0.0  # since when the running plan's GPUs hold its state (this step's)
        self.controller: Controller | None = None
        self.layouts_seen: list[dict[str, Layout]] = []  # every plan's layouts, in order
        self.seeding = Seeding(scenario, self.hw, probe=self.free)  # ``nereus.sim.seeding``
        async_mode = scenario.workload.mode is ExecutionMode.ASYNC
        self.pipeline = Pipeline(scenario.max_staleness) if async_mode else None

    def pool(self) -> tuple[int, ...]:
        return self.s.supply.pool_at(self.t)

    def _problem(self, pool: tuple[int, ...], seq: SeqStats) -> PlanningProblem:
        """The controller's view of the job (the first plan, before it exists: priors; the
        oracle's: calibrated from its probe of the truth, see ``nereus.sim.seeding``)."""
        if self.controller is not None:
            return self.controller.problem(pool, seq)
        problem = PlanningProblem(
            self.s.workload, self.s.models, self.s.cluster, pool, seq, space=self.s.space,
            domains=self.domains,
        )  # fmt: skip
        self.seeding.sweep(pool)
        return replace(problem, efficiencies=self.seeding.store(problem).efficiencies())

    def _quiet(self, plan: Plan, seq: SeqStats) -> dict[str, StageResult]:
        return quiet_truth(self.s.workload, self.s.models, self.s.cluster, plan, seq)

    def restart_cost(self, plan: Plan, seq: SeqStats) -> float:
        """Relaunch plus reading every model-stage's state from the checkpoint."""
        cost = price(self._problem(plan.pool, seq), shapes_of(plan))
        state = sum(cost.checkpoint[c.model_stage] * c.num_gpus for c in plan.candidates)
        nodes = max(1, len({g // self.s.cluster.gpus_per_node for c in plan.candidates for g in c.gpus}))
        return self.s.restart_s + state / (self.s.storage_gbs * 1e9 * nodes)

    def wait_for_plan(self, seq: SeqStats, relax: bool = True) -> tuple[Plan, float, float]:
        """The best plan once the pool allows one; the time spent waiting for it; the headroom it
        was found with. ``relax``: a restart that did not run out of memory may drop the headroom
        before it waits."""
        waited, largest = 0.0, 0
        while True:
            pool = self.pool()
            largest = max(largest, len(pool))
            if pool:
                problem = self._problem(pool, seq)
                # a restart may pick new layouts, and recompute or shrink micro-batches if it must
                held = [problem.space.holding(self.hold), SearchSpace.urgent().holding(self.hold)]
                first = held if self.hold and self.controller is None else []
                tried = (*first, problem.space, SearchSpace(), SearchSpace.urgent())
                spaces = [(s, problem.headroom) for s in tried]
                if self.controller is not None and relax:
                    # before waiting minutes for GPUs: the calibrated model's peaks (corrected by
                    # what the job measured) within the GPUs' memory less the runtime reserve and
                    # the share of the headroom a plan run past it keeps (``tolerated_headroom``),
                    # not the whole headroom kept for a model that has not measured anything yet
                    # (an OOM raises the floor as any does)
                    spaces.append((SearchSpace.urgent(), self.controller.tolerated_headroom))
                for space, headroom in spaces:
                    try:
                        kept = replace(problem, space=space.keeping(self.s.space), headroom=headroom)
                        return search(kept).plan, waited, headroom
                    except InfeasibleError:
                        pass
            nxt = self.s.supply.next_change_after(self.t)
            if nxt is None:
                flat = "; generation at pp 1, as vLLM runs it" if self.s.space.flat else ""
                most = (
                    f"at most {largest} GPUs, then {len(pool)} where it settles"
                    if largest > len(pool)
                    else (f"{len(pool)} GPUs, where it settles")
                )
                raise SimulationError(
                    f"no plan fits the pool the trace gives from here ({most}; "
                    f"responses of {seq.response_len:.0f} tokens{flat})"
                )
            waited += nxt - self.t
            self.t = nxt

    def wait_for_gpus(self) -> float:
        """Simulated seconds until the pool holds a GPU again (the clock moves there)."""
        waited = 0.0
        while not self.pool():
            nxt = self.s.supply.next_change_after(self.t)
            if nxt is None:
                counts = self.s.supply.trace.counts
                empty = len(counts) - next((i for i, c in enumerate(reversed(counts)) if c > 0), len(counts))
                raise SimulationError(
                    f"the trace holds no GPU from tick {empty} to its end ({len(counts)} ticks); give "
                    "the pool a floor (--min-gpus) or end the run sooner (--steps, --speedup)"
                )
            waited += nxt - self.t
            self.t = nxt
        return waited

    def step(self, k: int, prev: Telemetry | None) -> tuple[StepRecord, Telemetry]:
        seq = self.s.lengths(k)
        start = self.t
        stalled_s, startup_s = self._boot(seq) if self.controller is None else (0.0, 0.0)
        ctl = self.controller
        assert ctl is not None
        if not self.pool():  # every GPU is gone: the job stalls until some come back
            stalled_s += self.wait_for_gpus()
        pool = self.pool()  # what the boundary sees; changes after it surface at the next one
        self.holding_from = self.t  # the plan's GPUs hold its state from here (a move's, a step's)
        decision = ctl.observe(replace(prev, pool=pool, time_s=self.t)) if prev is not None else None
        before = ctl.plan
        moved: list[TransitionRecord] = []
        if decision is not None:
            pool, moved, waited = self._act(decision, prev, pool, seq, k)
            stalled_s += waited
        tp_pp = (
            decision is not None
            and isinstance(decision.action, Move)
            and bool(decision.transition and decision.transition.resharded)
        )
        dropped = self._flush(self.s.in_flight == "drain") if moved else 0
        plan = ctl.plan
        layouts = {c.model_stage: c.layout for c in plan.candidates}
        if not self.layouts_seen or self.layouts_seen[-1] != layouts:
            self.layouts_seen.append(layouts)
        quiet = self._quiet(plan, seq)  # the truth's, on a quiet machine
        quiet_sync = self._step_sync(plan)  # async: the step's weight sync
        sync = self.hw.run(quiet_sync, k) if quiet_sync else {}
        times, own, measurements, peaks = self._measure(plan, pool, seq, k, quiet, sync)
        step_s, pipelined = self._step_time(plan, times, own, sync)
        predicted = price(ctl.problem(pool, seq), shapes_of(plan))  # the model's view of this step
        quiet_stage = self._quiet_stages(plan, quiet, quiet_sync)
        moved_from = None
        if decision is not None and isinstance(decision.action, Move):
            left = self._quiet_stages(before, self._quiet(before, seq), self._step_sync(before))
            moved_from = steady_step(before, left)
        oom = out_of_memory(self.s.cluster, plan, peaks, {n: r.resident_bytes for n, r in quiet.items()})
        restart_s = 0.0
        if oom and not self.free:  # the step is lost: the job crashes and restarts from its checkpoint
            restart_s = self.restart_cost(plan, seq)
            self.t += restart_s
        self.t += step_s
        plan_gpus = {g for c in plan.candidates for g in c.gpus}
        # GPUs revoked while the step ran, whether or not the pool holds them again by its end
        # (a replacement instance starts empty): the step is lost, and so is their state
        revoked = tuple(sorted(plan_gpus - self.s.supply.held_through(self.holding_from, self.t)))
        preempted = bool(revoked)
        if oom or preempted:  # the job crashed: what generation ran ahead is gone
            dropped += self._flush(keep=False)
        record = StepRecord(
            k, start, len(pool), seq.response_len, seq.response_p95, _describe(plan), step_s,
            transition_s=sum(r.seconds for r in moved if r.kind is RecordKind.MOVE),
            restart_s=restart_s + sum(r.seconds for r in moved if r.kind is RecordKind.RESTART),
            stalled_s=stalled_s, oom=oom, tp_pp_change=tp_pp,
            decision=decision.to_json() if decision is not None else None, preempted=preempted,
            transitions=tuple(moved), pipeline=pipelined, dropped_rollouts=dropped,
            predicted_s=predicted.step_latency_s, quiet_s=steady_step(plan, quiet_stage),
            stage_predicted_s=dict(predicted.latency), stage_quiet_s=quiet_stage, moved_from_s=moved_from,
            startup_s=startup_s,
        )  # fmt: skip
        telemetry = Telemetry(
            k, self.t, seq.response_len, seq.response_p95, pool, times, peaks, tuple(measurements), oom,
            lost=revoked,
        )  # fmt: skip
        return record, telemetry

    def _boot(self, seq: SeqStats) -> tuple[float, float]:
        """The job's start: its first plan once the pool allows one (the job's headroom) and the
        controller on it. Returns the seconds stalled for GPUs and spent probing (``seeding``)."""
        plan, stalled_s, _ = self.wait_for_plan(seq)
        startup_s = 0.0 if self.free else self.seeding.sweep_s
        self.t += startup_s
        self.controller = Controller(
            self.s.workload, self.s.models, self.s.cluster, plan, self.config, self.seeding.store(),
            space=self.s.space, domains=self.domains,
            warm_up=False,  # the truth's first step after a rebuild is no slower (``warmup``)
        )  # fmt: skip
        self._started(plan)
        return stalled_s, startup_s

    def _act(
        self, decision: Decision, prev: Telemetry | None, pool: tuple[int, ...], seq: SeqStats, k: int
    ) -> tuple[tuple[int, ...], list[TransitionRecord], float]:
        """Run the boundary's decision: a move (its true seconds charged) or a restart (the
        checkpoint reload, and any wait for GPUs). Returns the pool the step runs on, what moved,
        and the seconds spent waiting for GPUs."""
        assert self.controller is not None
        ctl, before = self.controller, self.controller.plan
        match decision.action:
            case Move() as move:
                seconds = 0.0 if self.free else self._transition_truth(decision, move)
                self.t += seconds
                ctl.moved(move, seconds)
                return pool, [TransitionRecord.move(move, seconds, before)], 0.0
            case Restart(plan=target, reason=reason):
                # the running plan crashed (out of memory) or its state died with its GPUs: no
                # plan to carry on with
                oom = prev is not None and prev.oom
                failed = oom or (prev is not None and bool(prev.lost))
                pool, restarted, waited = self._restart(target, reason, pool, seq, k - 1, failed, oom)
                return pool, [restarted] if restarted is not None else [], waited
            case Keep():
                return pool, [], 0.0
        raise AssertionError(f"unknown action {decision.action!r}")

    def _step_sync(self, plan: Plan) -> dict[str, float]:
        return step_sync(self.s.models, self.s.cluster, plan)

    def _quiet_stages(
        self, plan: Plan, quiet: Mapping[str, StageResult], sync: Mapping[str, float]
    ) -> dict[str, float]:
        """Each model-stage's quiet seconds, the async weight sync (``sync``, quiet) on those that
        hold it, as the planner prices them: their ``steady_step`` is the truth's step without
        noise or waits."""
        seconds = {n: sum(r.seconds.values()) for n, r in quiet.items()}
        return with_step_sync(plan, seconds, sum(sync.values()))

    def _measure(
        self, plan: Plan, pool: tuple[int, ...], seq: SeqStats, k: int,
        quiet: Mapping[str, StageResult], sync: Mapping[str, float],
    ) -> tuple[dict[str, float], dict[str, float], list[Measurement], dict[str, float]]:  # fmt: skip
        """Step ``k`` of ``plan`` as its workers would time it: per model-stage, the truth's
        quiet seconds with episodes and noise (``times``, the async generator's with the weight
        sync; ``own`` without), the calibration measurements against the planner's ideal seconds
        per op class, and the true memory peaks."""
        assert self.controller is not None
        problem = replace(self.controller.problem(pool, seq), efficiencies=Efficiencies.unit())
        ideal = price(problem, shapes_of(plan))  # the planner's seconds per op class at peak
        sized = ideal_shapes(problem, shapes_of(plan))  # and the shape of each class's work
        times, own, measurements, peaks = {}, {}, [], {}
        for c in plan.candidates:
            measured = self.hw.run(quiet[c.model_stage].seconds, k)  # episodes and noise on top
            own[c.model_stage] = sum(measured.values())
            if holds_step_sync(plan, c.model_stage):  # async: generator's and trainers' telemetry
                measured = merged(measured, sync)  # has the step's weight sync
            times[c.model_stage] = sum(measured.values())
            roofline = plan.stage_of(c) is Stage.GEN
            measurements.extend(pair(ideal.by_class[c.model_stage], measured, sized[c.model_stage], roofline))
            peaks[c.model_stage] = self.hw.peak(quiet[c.model_stage].peak_bytes)
        return times, own, measurements, peaks

    def _step_time(
        self, plan: Plan, times: Mapping[str, float], own: Mapping[str, float], sync: Mapping[str, float]
    ) -> tuple[float, AsyncStep | None]:
        """The step's seconds by the truth's step model: synchronous, each stage's slowest in
        turn; asynchronous, the pipeline's next step (and its record)."""
        wf = plan.workflow
        if self.pipeline is None:
            return sync_step([times[m.name] for m in wf.by_stage(s)] for s in wf.stages), None
        gen_s = sync_step([[own[m.name] for m in wf.by_stage(Stage.GEN)]])
        trainer_s = sync_step([own[m.name] for m in wf.by_stage(s)] for s in wf.stages if s is not Stage.GEN)
        pipelined = self.pipeline.step(gen_s, trainer_s, sum(sync.values()))
        return pipelined.step_s, pipelined

    def _started(self, plan: Plan) -> None:
        """The job built its first plan's engines and groups; the controller is told how long
        that took (the truth's rebuild and regroup costs, measured), as a job on a cluster
        would tell it."""
        assert self.controller is not None
        stages = [plan.stage_of(c) for c in plan.candidates]
        build_s, group_s = self.hw.startup(
            [engine_of(plan, c.model_stage, self.s.models) for c in plan.candidates]
        )
        degrees = [(c.layout.tp, c.layout.pp, c.dp) for c in plan.candidates]
        self.controller.started(FixedCosts.of(stages, build_s, group_s, degrees))

    def _flush(self, keep: bool) -> int:
        """Async, at a transition, a restart or a crash: keep or drop the rollouts generated
        ahead. Returns the rollouts dropped."""
        if self.pipeline is None:
            return 0
        (gen,) = self.s.workload.workflow().by_stage(Stage.GEN)
        return self.pipeline.flush(keep) * self.s.workload.sequences(gen)

    def _transition_truth(self, decision: Decision, move: Move) -> float:
        """The true seconds of an admitted move: its DAG walked by the truth (``sim.moving``, not
        the planner's estimate), its engine rebuilds and regroups."""
        est = decision.transition
        resharded = set(est.resharded) if est else set()
        changed = set(est.changed) if est else set()
        rebuilt = [engine_of(move.target, n, self.s.models) for n in sorted(resharded)]
        regrouped = [engine_of(move.target, n, self.s.models) for n in sorted(changed - resharded)]
        moving = true_moving_seconds(move.transition, self.s.cluster, PARAMS)
        return self.hw.transition(moving, rebuilt, regrouped)

    def _restart(
        self,
        target: Plan | None,
        reason: str,
        pool: tuple[int, ...],
        seq: SeqStats,
        checkpoint: int,
        failed: bool = False,
        oom: bool = False,
    ) -> tuple[tuple[int, ...], TransitionRecord | None, float]:
        """Reload the checkpoint onto ``target`` (None: the best plan once the pool allows one).
        ``failed``: the running plan just ran out of memory (``oom``) or lost its state with GPUs
        revoked in its step, so it is no plan to carry on with — the job reloads onto the best
        plan the GPUs allow (after an OOM, not by dropping the headroom: the plan that crashed
        may fit that rule) or waits for GPUs. Returns the pool, what moved, and the seconds spent
        waiting for GPUs."""
        assert self.controller is not None
        ctl, waited, headroom = self.controller, 0.0, None
        running = frozenset(g for c in ctl.plan.candidates for g in c.gpus)
        if target is None and running <= set(pool) and not failed:
            ctl.restarted(ctl.plan, ctl.plan_headroom)  # nothing better fits: carry on as it is (no restart)
            return pool, None, 0.0
        if target is None:
            target, waited, headroom = self.wait_for_plan(seq, relax=not oom)
            pool = target.pool
            self.holding_from = self.t  # the reload onto the target's GPUs starts here
        seconds = 0.0 if self.free else self.restart_cost(target, seq)
        self.t += seconds
        record = TransitionRecord.restart(seconds, reason, checkpoint, ctl.plan, target)
        for c in target.candidates:  # the relaunch built its engines: their layouts are compiled
            self.hw.compiled.mark(engine_of(target, c.model_stage, self.s.models))
        ctl.restarted(target, headroom)
        return pool, record, waited


STATIC_BEST = "static-best"


def simulate(scenario: Scenario, policy: str, gamma: float = 0.5) -> Summary:
    """Replay ``scenario`` under ``policy``; the per-step records are in ``Summary.records``.

    Two reference policies. ``oracle`` adopts the planner's best plan every step, with moves and
    restarts free (lost steps still count); its calibration starts from a probe of the quiet truth
    on its first plan (``nereus.sim.seeding``) and then learns from telemetry like any policy.
    ``static-best`` is the static policy (TP/PP held, DP
    follows the pool) started on the layouts that turn out best in hindsight: the static policy's
    own first layouts and each distinct set of layouts the oracle used are tried (a set the job
    cannot hold through the trace, one whose steps keep failing, is dropped), and the fastest run
    is reported."""
    if policy == STATIC_BEST:
        oracle = _Run(scenario, "oracle", gamma)
        _replay(oracle, scenario, "oracle")
        tries = [_replay(_Run(scenario, "static", gamma), scenario, "static")]
        for hold in oracle.layouts_seen:
            # layouts the job cannot hold (say, out of memory on a smaller pool) are no candidate
            with contextlib.suppress(SimulationError):
                tries.append(_replay(_Run(scenario, "static", gamma, hold), scenario, "static"))
        return replace(min(tries, key=lambda s: s.total_s), policy=STATIC_BEST)
    return _replay(_Run(scenario, policy, gamma), scenario, policy)


def _replay(run: _Run, scenario: Scenario, policy: str) -> Summary:
    records: list[StepRecord] = []
    prev: Telemetry | None = None
    k = 0
    while k < scenario.steps:
        record, prev = run.step(k, prev)
        records.append(record)
        if not record.lost:
            k += 1
        elif len(records) > 4 * scenario.steps + 100:
            raise SimulationError(f"step {k} keeps failing under policy {policy!r}")
    total = sum(r.wall_s for r in records)
    assert run.controller is not None
    decisions = run.controller.decisions
    return Summary(
        policy,
        total / scenario.steps,
        total,
        sum(1 for r in records if any(t.kind is RecordKind.MOVE for t in r.transitions)),
        sum(1 for r in records if r.tp_pp_change),
        sum(1 for r in records if r.oom),
        sum(1 for r in records if r.preempted),
        # the restarts that ran, as the step records show them (a restart verdict the job
        # carried on from, its plan as it was, is a replan, not a restart)
        sum(1 for r in records if any(t.kind is RecordKind.RESTART for t in r.transitions)),
        sum(r.stalled_s for r in records),
        len(decisions),
        tuple(records),
        sum(r.dropped_rollouts for r in records),
    )
