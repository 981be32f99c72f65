"""The controller: when to adapt and to what (paper §1–2), as a small explicit state machine.

    STEADY ──trigger──▶ REPLANNING ──admit──▶ TRANSITIONING ──transition_done──▶ STEADY
       │                     └──keep──▶ STEADY
       └──urgent trigger──▶ URGENT ──admit──▶ TRANSITIONING
                               └──nothing fits in place──▶ RESTART_REQUIRED ──restarted──▶ STEADY

``observe`` is called once per step boundary with that step's telemetry (the clock is the
telemetry's ``time_s``); it folds the measurements into calibration, fires triggers, and when any
fires, replans and admits or rejects a transition. Every replan yields a ``Decision`` record.
The runtime (or the simulator) executes an admitted transition at the safe boundary and reports
``transition_done``, or restarts from a checkpoint and reports ``restarted``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from enum import StrEnum
from functools import partial

from nereus.control.action import Action, Keep, Move
from nereus.control.admission import (
    Decision,
    Option,
    Verdict,
    admit_staged,
    decided,
    restart_instead,
)
from nereus.control.deferral import Deferral
from nereus.control.fallback import in_place_instead
from nereus.control.guard import MemoryGuard
from nereus.control.lengths import LengthForecast
from nereus.control.memory_fit import fold_peaks, oom_steps
from nereus.control.options import Options, Planner
from nereus.control.policy import POLICIES, ControllerConfig, policy_config
from nereus.control.revocations import RevocationHistory
from nereus.control.settling import PoolAge
from nereus.control.telemetry import Telemetry
from nereus.control.transition_cost import (
    DagEstimator,
    FixedCosts,
    TransitionEstimate,
    TransitionEstimator,
    staged,
)
from nereus.control.triggers import GROWTH, POOL, Trigger, TriggerKind, TriggerMonitor, horizon
from nereus.control.warmup import WarmUp
from nereus.control.widened import is_widened, led_by_wider
from nereus.errors import InfeasibleError
from nereus.plan.cache import PlanCache
from nereus.plan.calibration import OOM_STEP, CalibrationStore
from nereus.plan.layout import Plan
from nereus.plan.problem import DEFAULT_HEADROOM, PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.spec.cluster import ClusterSpec
from nereus.spec.domains import FailureDomains
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Role, Stage, WorkloadSpec

# the named policies live in policy.py; they are imported from here too
__all__ = ["POLICIES", "Controller", "ControllerConfig", "Planner", "State", "policy_config"]


class State(StrEnum):
    STEADY = "steady"
    REPLANNING = "replanning"
    TRANSITIONING = "transitioning"
    URGENT = "urgent"
    RESTART_REQUIRED = "restart-required"


class Controller:
    """Decides, step by step, whether the job should change its plan."""

    def __init__(
        self,
        workload: WorkloadSpec,
        models: Mapping[Role, ModelSpec],
        cluster: ClusterSpec,
        plan: Plan,
        config: ControllerConfig | None = None,
        calibration: CalibrationStore | None = None,
        planner: Planner = search,
        estimator: TransitionEstimator | None = None,
        headroom: float = DEFAULT_HEADROOM,
        space: SearchSpace | None = None,
        domains: FailureDomains | None = None,
        warm_up: bool = True,
    ) -> None:
        self.workload = workload
        # reserved and revocable GPUs (None: the cluster's YAML marks none revocable)
        self.domains = domains if domains is not None else cluster.failure_domains()
        self.space = space or SearchSpace()  # the job's engine limits every replan keeps
        self.models = dict(models)
        self.cluster = cluster
        self.plan = plan
        self.config = config or ControllerConfig()
        self.calibration = calibration or CalibrationStore(cluster.name)
        self.plan_cache = PlanCache()  # what replans of this job reuse (issue 21)
        self.planner = partial(search, cache=self.plan_cache) if planner is search else planner
        self.estimator = estimator or DagEstimator()
        self.estimator.built(plan)  # the job starts by building this plan's engines
        self.options = Options(
            self.planner, cluster, self.domains, self.config.restart_s, self.config.fallback_tolerance,
            offer_floor=not self.config.hold_layouts,  # static's DP follows the pool
        )  # fmt: skip
        self.pool_age = PoolAge(self.domains)  # how settled the pool is (``nereus.control.settling``)
        # a cluster YAML's revocable nodes: the rate and its age factors learned from the pool
        # the job sees (a trace's domains come with their history already)
        self.history = RevocationHistory(self.domains) if domains is None and self.domains else None
        # the headroom the running plan is held to, and its memory checks ahead (``guard.py``)
        self.memory = MemoryGuard(headroom)
        self.state = State.STEADY
        self.decisions: list[Decision] = []
        self.pending: Decision | None = None
        self.monitor = TriggerMonitor(
            self.config.delta_len, self.config.delta_eff, self.config.ema_weight, pool=plan.pool
        )
        self.first_layouts = {c.model_stage: c.layout for c in plan.candidates}
        self.lengths = LengthForecast(workload.prompt_len, workload.max_response_len)
        self.deferral = Deferral()  # a rejected, profitable-someday target (``nereus.control.deferral``)
        # steps on fresh engines: their timings are left out (``warm_up``: the job's first step
        # after a rebuild is slower; the simulator's truth models none, so it keeps them)
        self.warmup = WarmUp(warm_up)

    @property
    def headroom(self) -> float:
        """The share of each GPU's memory the job's plans keep free for model error."""
        return self.memory.headroom

    # ------------------------------------------------------------------ inputs
    def problem(
        self, pool: Sequence[int], seq: SeqStats, space: SearchSpace | None = None
    ) -> PlanningProblem:
        base = (space or self.space).keeping(self.space)
        if self.config.hold_layouts:
            base = base.holding(self.first_layouts)
        return PlanningProblem(
            self.workload, self.models, self.cluster, tuple(sorted(pool)), seq,
            self.calibration.efficiencies(), base, self.headroom, anchor=self.plan, domains=self.domains,
        )  # fmt: skip

    def _seq(self, t: Telemetry, ahead: float = 1.0) -> SeqStats:
        """The lengths ``ahead`` steps after the step ``t`` (``LengthForecast``)."""
        return self.lengths.ahead(t.seq_len_mean, t.seq_len_p95, ahead)

    def _calibrate(self, t: Telemetry) -> None:
        """Fold measured op-class times and memory peaks into calibration (paper §2.5)."""
        if t.measurements or t.peak_memory or t.oom:  # the calibration changes
            self.memory.forget()
        self.calibration.update(t.measurements)
        if t.peak_memory:
            now = self.problem(self.plan.pool, self._seq(t, ahead=0.0))
            fold_peaks(self.calibration, now, self.plan, t.peak_memory)

    # ------------------------------------------------------------------ the state machine
    def observe(self, t: Telemetry, rebuilt: frozenset[str] = frozenset()) -> Decision | None:
        """Telemetry of the step that just ended; a Decision if a replan happened. ``rebuilt``:
        model-stages whose state a weight sync rebuilds after the transition (a rolled-back step
        dropped the weight copies), left out of the transitions it prices. In parts:
        ``triggers``, then ``decide`` (``replan``, ``commit``)."""
        fired = self.triggers(t)
        return self.decide(t, fired, rebuilt) if fired else None

    def decide(self, t: Telemetry, fired: list[Trigger], rebuilt: frozenset[str] = frozenset()) -> Decision:
        """The replan on ``fired`` (``triggers(t)``), committed."""
        self.state = State.URGENT if any(f.urgent for f in fired) else State.REPLANNING
        return self.commit(t, self.replan(t, fired, rebuilt))

    def triggers(self, t: Telemetry) -> list[Trigger]:
        """``t`` folded in (calibration, the length growth, the trigger references' crossings) and
        the triggers it fires, after which a replan is due (``replan`` then ``commit``)."""
        if self.state in (State.TRANSITIONING, State.RESTART_REQUIRED):
            raise RuntimeError(f"observe() while {self.state.value}: report the transition or restart first")
        t = self.warmup.strip(t)
        self._fold(t)
        if t.oom:  # the model under-predicted that stage's memory: correct it before replanning
            stages = {self.plan.workflow.get(t.oom_stage).stage} if t.oom_stage else set(Stage)
            steps = oom_steps(self.problem(self.plan.pool, self._seq(t, ahead=0.0)), self.plan)
            for stage in stages:
                self.calibration.raise_memory_floor(stage, steps.get(stage, OOM_STEP))
        plan_gpus = frozenset(g for c in self.plan.candidates for g in c.gpus)
        seq = self._seq(t)
        past = not t.lost_of(plan_gpus) and self._over_capacity_ahead(seq)
        tolerated = self.memory.tolerates(self.plan)
        violation = past and (tolerated or self.plan_headroom == 0.0 or self._over_capacity_ahead(seq, 0.0))
        fired = self.monitor.observe(t, plan_gpus, violation, past and not violation)
        settled = self.pool_age.trigger(t, plan_gpus, self.monitor.horizon_now(GROWTH, t.step))
        fired += [settled] if settled is not None and not fired else []
        if self.config.period and (t.step + 1) % self.config.period == 0:
            fired.append(Trigger(TriggerKind.PERIODIC, "timer", t.step, t.step, float(self.config.period)))
        # memory is every policy's business: past capacity (urgent) or past the headroom
        kept = self.config.replan_on | {TriggerKind.MARGIN}
        fired = [f for f in fired if f.urgent or f.kind in kept]
        if not fired:
            fired = self.deferral.trigger(self.monitor, t.step, self.config.rule.gamma)
        return fired

    def fold(self, t: Telemetry) -> None:
        """``t`` folded into calibration and the length growth, and nothing else: the telemetry
        of a step that ran on the plan the controller is leaving, after a decision deferred from
        the boundary before it admitted a move or a restart (``nereus.runtime.deferred``). Its
        triggers are not evaluated: the move answers the drift, and the next step's telemetry sets
        out from the references the decision reset."""
        if t.oom:
            raise ValueError("an out-of-memory step is observed (triggers), never only folded in")
        self._fold(self.warmup.strip(t))

    def _fold(self, t: Telemetry) -> None:
        """What every step's telemetry changes: the length growth, calibration and the pool's
        age (the options are priced at it)."""
        self.lengths.observe(t.seq_len_mean)
        if self.history is not None:
            self.history.observe(t)
            self.pool_age.domains = learned = self.history.domains()
            self.options = replace(self.options, domains=learned)
        self.options = self.options.at(self.pool_age.observe(t))
        self._calibrate(t)

    def commit(self, t: Telemetry, decision: Decision) -> Decision:
        """``decision`` (``replan`` on ``t``) taken: new trigger references, a rejected target
        remembered, the decision logged, and the state it leads to."""
        self.monitor.reset(t)
        self.pool_age.priced(t.time_s)
        self.deferral.after(decision, self.config.rule)
        self.decisions.append(decision)
        if decision.over_headroom:
            # the plan carries on, checked ahead against ``tolerated_headroom`` (past it, urgent;
            # an out-of-memory step restarts it). Until it changes, replans price it there too and
            # search the others at the headroom
            self.memory.kept_past(self.plan, decision.urgent)
        if decision.verdict is Verdict.ADMIT:
            self.state, self.pending = State.TRANSITIONING, decision
        elif decision.verdict is Verdict.RESTART:
            self.state, self.pending = State.RESTART_REQUIRED, decision
        else:
            self.state, self.pending = State.STEADY, None
        return decision

    def prepare(self, seq_len_mean: float, seq_len_p95: float) -> None:
        """Before the step's telemetry is complete (the leader gathers the other ranks' reports
        meanwhile): price the running plan ahead at the lengths the next ``observe`` will see, so
        that its memory check is a kept answer. Decides nothing; a calibration change in that
        telemetry discards the answer (``_calibrate``), and ``observe`` prices again."""
        seq = self.lengths.at(seq_len_mean, seq_len_p95, self.lengths.grown(seq_len_mean))
        tolerated = self.memory.tolerates(self.plan)
        if self._over_capacity_ahead(seq) and self.plan_headroom > 0.0 and not tolerated:
            self._over_capacity_ahead(seq, 0.0)

    @property
    def plan_headroom(self) -> float:
        """The headroom the running plan is held to (``MemoryGuard.held``)."""
        return self.memory.held(self.plan)

    @property
    def tolerated_headroom(self) -> float:
        """What a plan run past the headroom still keeps free (``MemoryGuard.tolerated_headroom``)."""
        return self.memory.tolerated_headroom

    def _over_capacity_ahead(self, seq: SeqStats, headroom: float | None = None) -> bool:
        """Whether the running plan is predicted over capacity at the next step's lengths ``seq``
        within ``headroom`` (by default ``plan_headroom``), a quiet step answered from kept checks."""
        held = self.plan_headroom if headroom is None else headroom

        def at(lengths: SeqStats) -> PlanningProblem:
            return replace(self.problem(self.plan.pool, lengths), headroom=held)

        return self.memory.over_capacity(self.plan, seq, held, at)

    def transition_done(self, measured_s: float, moving_s: float | None = None) -> None:
        """The admitted transition finished in ``measured_s`` (``moving_s`` of it moving state,
        the rest rebuilding and regrouping); its target is now the plan. A transition priced with
        sunk rebuilds (the world re-formed) refines L_tran from its moving seconds alone."""
        if self.state is not State.TRANSITIONING or self.pending is None or self.pending.target is None:
            raise RuntimeError("transition_done() without an admitted transition")
        est = self.pending.transition
        if est is not None:
            sunk = est.sunk and moving_s is not None
            self.estimator.observe(est, moving_s if sunk and moving_s is not None else measured_s)
        self.plan = self.pending.target
        self.estimator.built(self.plan)
        self.monitor.rebase()
        self.state, self.pending = State.STEADY, None
        self.warmup.rebuilt()

    def started(self, fixed: FixedCosts) -> None:
        """The job built its engines and groups in these seconds at start-up: until transitions
        measure them, a move's rebuilds and regroups are priced at what they took then."""
        self.estimator.seed(fixed)

    def moved(self, action: Move, measured_s: float, moving_s: float | None = None) -> None:
        """The job ran ``action`` in ``measured_s`` (``moving_s`` of it moving state): an admitted
        transition (its measured time refines L_tran), or a drain the launcher asked for (adopted
        as it is)."""
        if action.drain:
            self.adopt(action.target)
        else:
            self.transition_done(measured_s, moving_s)

    def drain(self, pool: Sequence[int], seq: SeqStats, reason: str = "") -> Action:
        """A move off the GPUs outside ``pool`` while they still hold their state (a shrink the
        launcher asked for): the best plan on ``pool`` and the transition to it, or Keep with the
        reason nothing fits there."""
        if self.history is not None:
            self.history.draining(pool)
        problem = self.problem(pool, seq)
        try:
            target = self.planner(problem).plan
        except InfeasibleError as exc:
            return Keep(f"the job does not fit on GPUs {list(problem.pool)} ({exc})")
        est = staged(problem, self.estimator.estimate(problem, self.plan, target))
        if est.transition is None or not est.feasible:
            return Keep(f"no transition onto GPUs {list(problem.pool)}: {est.reason}")
        return Move(target, est.transition, reason, drain=True)

    def adopt(self, plan: Plan, rebuilt: bool = True) -> None:
        """The job runs ``plan`` again: a step that failed part-way (a transition included) was
        rolled back to its boundary (``rebuilt``: engines were built again, so the next step
        warms up; not for a decision dropped before it acted)."""
        if rebuilt and plan.candidates != self.plan.candidates:
            self.monitor.rebase()
        self.plan = plan
        self.state, self.pending = State.STEADY, None
        if rebuilt:
            self.estimator.built(plan)
            self.warmup.rebuilt()

    def restarted(self, plan: Plan, headroom: float | None = None) -> None:
        """The job restarted from a checkpoint on ``plan`` (a static policy adopts its layouts);
        ``headroom``: what it was chosen with, where less than the job's (0: the calibrated model
        within the GPUs' memory, before waiting for more GPUs) — its memory is then checked ahead
        at that headroom."""
        if plan.candidates != self.plan.candidates:  # (a plan carried on as it is keeps them)
            self.monitor.rebase()
        self.plan = plan
        self.estimator.built(plan)
        self.memory.restarted(plan, headroom)
        self.first_layouts = {c.model_stage: c.layout for c in plan.candidates}
        self.state, self.pending = State.STEADY, None
        self.warmup.rebuilt()

    # ------------------------------------------------------------------ replanning
    def replan(self, t: Telemetry, fired: list[Trigger], rebuilt: frozenset[str] = frozenset()) -> Decision:
        """The decision on ``fired`` (``triggers(t)``), which changes nothing but the plan cache:
        it may run on another thread while the next step runs, as long as nothing else touches
        the controller meanwhile; ``commit`` makes it the controller's."""
        urgent = any(f.urgent for f in fired)
        seq = self._seq(t)
        problem = self.problem(t.pool, seq)
        lost = t.lost_of(frozenset(g for c in self.plan.candidates for g in c.gpus))
        oom = any(f.kind is TriggerKind.OOM for f in fired)
        # the running plan's latency where the job may keep it (None: it must move; a plan that
        # ran out of memory is not one to keep) and whether it is past its headroom (a move away
        # must pay back)
        current, margin = (None, False) if lost or oom else self.memory.running(self.plan, problem)
        urgent = urgent or current is None
        risk = 0.0 if current is None else self.options.risk(self.plan, current, problem)
        expected = None if current is None else current + risk  # with the restart it risks
        # an urgent move's target runs until the pool next changes: its options are weighed over that
        h = self.monitor.horizon_now(POOL, t.step) if urgent else horizon([f for f in fired if not f.urgent])
        d = self.options.domains
        base = Decision(
            t.step, t.time_s, tuple(fired), urgent, Verdict.KEEP, "", current, horizon_steps=h,
            current_risk_s=risk, revocation_rate=None if d is None else d.revocations_per_hour,
            over_headroom=margin,
        )  # fmt: skip
        options = self._options(problem)
        # the wider space too (``nereus.control.widened``), and past the headroom: what fits it may
        # need smaller micro-batches or recomputation
        if not options or urgent or margin or is_widened(self.plan, self.workload):
            wider = self._options(self.problem(t.pool, seq, SearchSpace.urgent()), "widened")
            options = led_by_wider(options, wider)
        if options and options[0].plan.candidates == self.plan.candidates and not oom and not lost:
            return replace(base, reason="the current plan is the planner's target")
        if not lost:  # GPUs that died and are back: the same plan again is a move (onto them)
            options = [o for o in options if o.plan.candidates != self.plan.candidates]
        estimates = [
            self.estimator.estimate(problem, self.plan, o.plan, lost, rebuilt, t.reformed) for o in options
        ]
        index, reason = admit_staged(self.config.rule, problem, expected, options, estimates, h, urgent)
        alone = margin and all(f.kind is TriggerKind.MARGIN for f in fired)
        if alone and index is not None and expected is not None and options[index].expected_s >= expected:
            # past the headroom alone, a plan the job may keep: whatever the rule, only a faster
            # one is worth a move (``switch`` would take any that fits the headroom)
            slower = options[index]
            index, reason = None, f"{slower.label}: no gain (ΔL {expected - slower.expected_s:+.3g} s)"
        if index is None and urgent:  # also try smaller micro-batches and recomputation
            widened = [
                o
                for o in self._options(self.problem(t.pool, seq, SearchSpace.urgent()), "urgent")
                if not (oom and o.plan.candidates == self.plan.candidates)
            ]
            more = [
                self.estimator.estimate(problem, self.plan, o.plan, lost, rebuilt, t.reformed)
                for o in widened
            ]
            index, why = admit_staged(self.config.rule, problem, expected, widened, more, h, True)
            if index is None:
                best = next(iter(options or widened), None)
                if best is None and not lost and not oom:  # a restart could only reload it as it is
                    return replace(
                        base,
                        reason=f"nothing else fits the {len(problem.pool)} GPUs ({reason}; {why}): "
                        "the running plan holds its GPUs and carries on",
                        over_headroom=current is None or margin,  # over the headroom it is held to
                    )
                return replace(
                    base,
                    verdict=Verdict.RESTART,
                    reason=f"nothing transitions in place: {reason}; {why}",
                    target=best.plan if best else None,
                    target_label=best.label if best else "",
                    target_latency_s=best.step_latency_s if best else None,
                )
            options, estimates, reason = widened, more, why
        if index is None and expected is not None and options and not any(e.feasible for e in estimates):
            best, why_not = options[0], estimates[0].reason  # nothing moves in place
            seconds = self.options.restart_seconds(best.plan, problem)
            restart = restart_instead(self.config.rule, base, best, why_not, expected, seconds, h)
            if restart is not None:
                held = self._held_instead(problem, restart, expected, h, lost, rebuilt, t.reformed)
                if held is None:
                    return restart
                options, estimates, reason = [held[0]], [held[1]], held[2]
                index = 0
        return decided(base, options, estimates, index, reason, expected)

    def _held_instead(
        self, problem: PlanningProblem, restart: Decision, expected: float, h: float,
        lost: frozenset[int], rebuilt: frozenset[str], reformed: bool,
    ) -> tuple[Option, TransitionEstimate, str] | None:  # fmt: skip
        """Before ``restart``: the running layouts with only DP and GPUs changed, at any latency
        (``nereus.control.fallback``), with the move there and why it goes instead, or None."""
        spaces = [problem]
        if is_widened(self.plan, self.workload):
            spaces.append(self.problem(problem.pool, problem.seq, SearchSpace.urgent()))
        held = self.options.held(self.plan, spaces)
        if held is None:
            return None
        est = staged(problem, self.estimator.estimate(problem, self.plan, held.plan, lost, rebuilt, reformed))
        why = in_place_instead(self.config.rule, restart, held, est, expected, h)
        return None if why is None else (held, est, why)

    def _options(self, problem: PlanningProblem, label: str = "target") -> list[Option]:
        """The replan's options from the running plan (``nereus.control.options``)."""
        return self.options.around(problem, self.plan, label)
