"""Admission: every branch of Eq. 2, fallbacks, urgency — and the controller around it."""

from __future__ import annotations

import pytest

from nereus.control.action import Keep, Move, Restart, TransitionRecord
from nereus.control.admission import Decision, Option, Profit, Rule, Verdict, admit
from nereus.control.controller import Controller, ControllerConfig, State, policy_config
from nereus.control.telemetry import Telemetry
from nereus.control.transition_cost import DagEstimator, FixedCosts, TransitionEstimate
from nereus.control.triggers import POOL, TriggerKind
from nereus.errors import ConfigError, InfeasibleError
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.search import SearchResult, search
from nereus.spec.workload import Stage
from nereus.state.sources import intact_replicas, state_source
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def est(seconds: float, feasible: bool = True) -> TransitionEstimate:
    return TransitionEstimate(seconds, 0.0, feasible, "" if feasible else "too big")


@pytest.fixture(scope="module")
def plan() -> Plan:
    return search(make_problem(gpus=16)).plan


def opt(plan: Plan, latency: float, label: str = "target") -> Option:
    return Option(label, plan, latency)


def test_payback_boundary_is_inclusive(plan: Plan) -> None:
    rule = Rule(Profit.PAYBACK, gamma=0.5)
    # ΔL = 10 s; γ·H = 0.5 · 4 = 2 steps; L_tran = 20 s pays back in exactly 2 steps → admitted
    i, why = admit(rule, 100.0, [opt(plan, 90.0)], [est(20.0)], horizon=4.0, urgent=False)
    assert i == 0 and "payback 2 ≤ γ·H = 2" in why
    i, why = admit(rule, 100.0, [opt(plan, 90.0)], [est(20.0001)], horizon=4.0, urgent=False)
    assert i is None and "payback" in why and "> γ·H = 2" in why


def test_unprofitable_infeasible_and_fallback(plan: Plan) -> None:
    rule = Rule(Profit.PAYBACK, gamma=0.5)
    i, why = admit(rule, 100.0, [opt(plan, 101.0)], [est(1.0)], 10.0, False)
    assert i is None and "no gain" in why
    # S* is faster but its transition does not fit; a slightly slower fallback with a cheap one does
    options = [opt(plan, 80.0), opt(plan, 85.0, "hold-layouts")]
    i, why = admit(rule, 100.0, options, [est(1.0, feasible=False), est(5.0)], 10.0, False)
    assert i == 1 and why.startswith("hold-layouts")
    # S* pays back too slowly; the cheaper fallback pays back
    i, _ = admit(rule, 100.0, options, [est(500.0), est(5.0)], 2.0, False)
    assert i == 1


def test_urgent_waives_profitability_not_feasibility(plan: Plan) -> None:
    rule = Rule(Profit.PAYBACK, gamma=0.5)
    i, why = admit(rule, 100.0, [opt(plan, 120.0)], [est(1e6)], 1.0, urgent=True)
    assert i == 0 and "urgent" in why
    i, why = admit(rule, None, [opt(plan, 120.0)], [est(1.0, feasible=False)], 1.0, urgent=True)
    assert i is None and "infeasible" in why


def test_an_urgent_move_costs_least_over_the_pools_horizon(plan: Plan) -> None:
    """Urgent: of the feasible options, the least L_tran + H · L — a faster plan is worth a dearer
    move when its gain repays the extra seconds within H steps, and not otherwise."""
    rule = Rule(0.5)
    options = [opt(plan, 100.0, "target"), opt(plan, 105.0, "hold-layouts"), opt(plan, 90.0, "relayout:gen")]
    estimates = [est(300.0), est(10.0), est(1.0, feasible=False)]
    i, why = admit(rule, None, options, estimates, horizon=10.0, urgent=True)
    assert i == 1 and "hold-layouts: urgent" in why and "H = 10" in why  # 10 + 1050 < 300 + 1000
    i, _ = admit(rule, None, options, estimates, horizon=100.0, urgent=True)
    assert i == 0  # 300 + 10,000 < 10 + 10,500
    i, _ = admit(rule, 95.0, options, estimates, horizon=58.0, urgent=True)  # tie: the earlier option
    assert i == 0
    i, why = admit(rule, None, options, [est(1.0, feasible=False)] * 3, horizon=10.0, urgent=True)
    assert i is None and why.count("transition infeasible") == 3


def test_gamma_zero_admits_only_urgent(plan: Plan) -> None:
    rule = Rule(Profit.PAYBACK, gamma=0.0)
    assert admit(rule, 100.0, [opt(plan, 10.0)], [est(0.001)], 100.0, False)[0] is None
    assert admit(rule, 100.0, [opt(plan, 10.0)], [est(0.001)], 100.0, True)[0] == 0


def test_baseline_rules(plan: Plan) -> None:
    assert admit(Rule(Profit.ANY_GAIN), 100.0, [opt(plan, 99.9)], [est(1e5)], 0.1, False)[0] == 0
    assert admit(Rule(Profit.SWITCH), 100.0, [opt(plan, 150.0)], [est(1.0)], 0.1, False)[0] == 0
    with pytest.raises(ValueError):
        Rule(gamma=1.5)
    with pytest.raises(ConfigError, match="unknown policy 'greedy'"):
        policy_config("greedy")
    for bad in (
        "periodic:x",
        "periodic:0",
        "periodic: 2",
        "periodic:1_0",
        "periodic:\u0663",
        "periodic:" + "9" * 30,
    ):
        with pytest.raises(ConfigError, match=r"periodic:K needs a whole number K in \[1, 10,000,000\]"):
            policy_config(bad)
    assert policy_config("periodic:3").period == 3


# ---------------------------------------------------------------- controller
def _controller(plan: Plan, config: ControllerConfig | None = None, planner=search) -> Controller:  # type: ignore[no-untyped-def]
    p = make_problem(gpus=16)
    return Controller(p.workload, p.models, p.cluster, plan, config, planner=planner)


def t(step: int, length: float, pool: tuple[int, ...], **kw: object) -> Telemetry:
    return Telemetry(step, 100.0 * step, length, length, pool, **kw)  # type: ignore[arg-type]


def test_controller_steady_until_a_trigger() -> None:
    # a plan with some memory margin: the 2K plan fills its GPUs, so growth alone would fire MEMORY
    ctl = _controller(search(make_problem(gpus=16, response=2304)).plan)
    pool = tuple(range(16))
    assert ctl.observe(t(0, 2048, pool)) is None
    assert ctl.observe(t(1, 2100, pool)) is None and ctl.state is State.STEADY
    assert ctl.decisions == []


def test_controller_replans_on_growth_and_resets_references(plan: Plan) -> None:
    calls: list[PlanningProblem] = []

    def planner(problem: PlanningProblem) -> SearchResult:
        calls.append(problem)
        return search(problem)

    ctl = _controller(plan, planner=planner)
    pool = tuple(range(16))
    ctl.observe(t(0, 2048, pool))
    d = ctl.observe(t(1, 4096, pool))  # +100%: drift, and the 2K plan no longer fits at 4K
    assert d is not None and calls
    assert any(tr.kind in (TriggerKind.DRIFT, TriggerKind.MEMORY) for tr in d.triggers)
    assert d.verdict in (Verdict.ADMIT, Verdict.RESTART)
    if d.verdict is Verdict.ADMIT:
        assert ctl.state is State.TRANSITIONING and d.target is not None
        with pytest.raises(RuntimeError):
            ctl.observe(t(2, 4096, pool))
        ctl.transition_done(d.l_tran_s or 1.0)
        assert ctl.plan is d.target and ctl.state is State.STEADY
    n = len(ctl.decisions)
    assert ctl.observe(t(3, 4100, pool)) is None  # the reference moved to 4096
    assert len(ctl.decisions) == n


def test_gpu_loss_is_urgent_and_sole_trainer_loss_restarts(plan: Plan) -> None:
    trainer = plan.candidate("actor.train")
    assert trainer.dp == 1  # 16 A100s at 2K: one actor-training replica (tp4·pp2)
    ctl = _controller(plan)
    pool = tuple(range(16))
    ctl.observe(t(0, 2048, pool))
    d = ctl.observe(t(1, 2048, tuple(g for g in pool if g not in set(trainer.gpus))))
    assert d is not None and d.urgent and d.current_latency_s is None
    assert d.verdict is Verdict.RESTART and "no intact replica" in d.reason
    assert ctl.state is State.RESTART_REQUIRED and d.target is not None
    ctl.restarted(d.target)
    assert ctl.state is State.STEADY


def test_state_sources_follow_rl_semantics(plan: Plan) -> None:
    everything = frozenset(g for c in plan.candidates for g in c.gpus)
    assert state_source(plan, "actor.train", everything) is None  # optimizer state is gone
    assert state_source(plan, "ref.inf", everything) == "storage"  # frozen: reload from disk
    gen, trainer = plan.candidate("actor.gen"), plan.candidate("actor.train")
    lost = frozenset(gen.gpus) - frozenset(trainer.gpus)  # generation loses what training does not hold
    assert lost and intact_replicas(trainer, lost) == 1
    expected = gen if intact_replicas(gen, lost) else trainer  # else: re-sync from the trainer
    assert state_source(plan, "actor.gen", lost) is expected


def test_periodic_and_static_policies(plan: Plan) -> None:
    ctl = _controller(plan, policy_config("periodic:3"))
    pool = tuple(range(16))
    kinds = []
    for i in range(6):
        d = ctl.observe(t(i, 2048, pool))
        if d is not None:
            kinds.append((i, [tr.kind for tr in d.triggers]))
            if d.verdict is Verdict.ADMIT:
                ctl.transition_done(1.0)
    assert [i for i, _ in kinds] == [2, 5] and all(TriggerKind.PERIODIC in k for _, k in kinds)
    static = _controller(plan, policy_config("static"))
    static.observe(t(0, 2048, pool))
    d = static.observe(t(1, 2048, tuple(range(32))))  # pool doubles: DP follows, TP/PP do not
    assert d is not None and d.verdict is Verdict.ADMIT and d.target is not None
    assert {c.model_stage: c.layout for c in d.target.candidates} == {
        c.model_stage: c.layout for c in plan.candidates
    }


def test_estimator_learns_fixed_costs_from_measured_transitions() -> None:
    e = DagEstimator()
    moved_only = TransitionEstimate(2.0, 0.0, True, features=(2.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    with_rebuild = TransitionEstimate(2.0, 0.0, True, features=(2.0, 1.0, 0.0, 1.0, 8.0, 0.0))
    assert float(e.weights @ with_rebuild.features) == pytest.approx(2.0)  # prior: bandwidth only
    for _ in range(6):  # engines rebuilt for a new layout take ~30 s beyond moving bytes
        e.observe(with_rebuild, 2.0 + 30.0 + 2.0)
        e.observe(moved_only, 2.0)
    assert float(e.weights @ with_rebuild.features) == pytest.approx(34.0, rel=0.1)
    assert float(e.weights @ moved_only.features) == pytest.approx(2.0, rel=0.1)
    assert (e.weights >= 0).all()


def test_dag_estimator_prices_the_transition_dag(plan: Plan) -> None:
    import dataclasses

    from nereus.transition import plan_transition

    problem = make_problem(gpus=32)
    target = search(dataclasses.replace(problem, anchor=plan)).plan
    e = DagEstimator()
    estimate = e.estimate(problem, plan, target)
    tr = plan_transition(problem, plan, target)
    assert estimate.feasible and tr.feasible
    assert estimate.features[0] == pytest.approx(tr.l_tran_s) and estimate.seconds == pytest.approx(
        tr.l_tran_s
    )
    assert estimate.moved_bytes == tr.moved_bytes > 0
    assert estimate.peak_bytes == pytest.approx(max(tr.dag.peak.values()) + problem.reserved_bytes)
    assert set(estimate.changed) == {m.name for m in tr.moves if not m.unchanged}
    assert max(estimate.per_gpu_seconds.values()) == pytest.approx(tr.l_tran_s)
    # nothing moves: free and feasible
    same = e.estimate(problem, plan, plan)
    assert same.feasible and same.seconds == 0.0 and same.changed == ()
    # every trainer replica lost: no source of optimizer state
    trainer = plan.candidate("actor.train")
    lost = frozenset(trainer.gpus)
    keep = tuple(g for g in problem.pool if g not in lost)
    shrunk = dataclasses.replace(problem, pool=keep, anchor=plan)
    gone = e.estimate(shrunk, plan, search(shrunk).plan, lost)
    assert not gone.feasible and "no intact replica" in gone.reason


def test_rebuilds_a_reformed_world_pays_anyway_are_not_charged(plan: Plan) -> None:
    """A worker joined: the world re-forms and every engine is rebuilt whatever the decision, so a
    transition there costs its DAG alone, and its measured moving seconds (not the rebuilds) are
    what the fit learns from."""
    import dataclasses

    problem = make_problem(gpus=32)
    target = search(dataclasses.replace(problem, anchor=plan)).plan
    e = DagEstimator()
    e.seed(FixedCosts(20.0, 5.0, 1.0, 0.01))  # rebuilding engines is what transitions cost here
    full, sunk = e.estimate(problem, plan, target), e.estimate(problem, plan, target, sunk=True)
    assert any(full.features[1:]) and full.seconds > sunk.seconds
    assert sunk.sunk and sunk.features == (full.features[0], 0.0, 0.0, 0.0, 0.0, 0.0)
    assert sunk.seconds == pytest.approx(full.features[0])

    c = _controller(plan, policy_config("nereus"))
    c.estimator = e
    c.observe(t(0, 2048, tuple(range(16))))
    d = c.observe(dataclasses.replace(t(1, 2048, tuple(range(32))), reformed=True))
    assert d is not None and d.transition is not None and d.transition.sunk
    assert d.to_json()["sunk_rebuilds"] is True
    assert d.verdict is Verdict.ADMIT, d.reason  # the 16 new GPUs pay back the moving seconds
    before = e.weights.copy()
    c.moved(d.action, 30.0, moving_s=float(d.transition.features[0]))  # 30 s, mostly rebuilds
    assert e.weights[0] == pytest.approx(before[0], rel=0.05)  # the DAG's weight kept its scale


def test_an_admitted_decision_moves_along_the_transition_it_priced(plan: Plan) -> None:
    """Admission returns the transition it priced: the action carries that very DAG."""
    static = _controller(plan, policy_config("static"))
    static.observe(t(0, 2048, tuple(range(16))))
    d = static.observe(t(1, 2048, tuple(range(32))))
    assert d is not None and d.transition is not None
    action = d.action
    assert isinstance(action, Move) and not action.drain
    assert action.target is d.target and action.transition is d.transition.transition
    assert action.kind == "+".join(sorted({n.primitive.value for n in action.transition.dag.nodes}))
    static.moved(action, 1.0)
    assert static.plan is d.target and static.state is State.STEADY
    record = TransitionRecord.move(action, 1.5, plan).to_json()
    assert list(record) == ["kind", "seconds", "reason", "bytes", "before", "after"]
    assert record["bytes"] == action.transition.moved_bytes and record["seconds"] == 1.5


def test_restart_and_keep_actions(plan: Plan) -> None:
    trainer = plan.candidate("actor.train")
    ctl = _controller(plan)
    ctl.observe(t(0, 2048, tuple(range(16))))
    d = ctl.observe(t(1, 2048, tuple(g for g in range(16) if g not in set(trainer.gpus))))
    assert d is not None and isinstance(d.action, Restart) and d.action.plan is d.target
    decision = Decision(0, 0.0, (), False, Verdict.KEEP, "the current plan is the planner's target", 1.0)
    assert decision.action == Keep("the current plan is the planner's target")
    with pytest.raises(ValueError, match="without a priced transition"):
        _ = Decision(0, 0.0, (), False, Verdict.ADMIT, "", 1.0, target=plan).action


def test_a_drain_moves_off_the_leaving_gpus_or_keeps_with_the_reason(plan: Plan) -> None:
    ctl = _controller(plan, planner=search)
    ctl.observe(t(0, 2048, tuple(range(16))))
    action = ctl.drain(tuple(range(12)), SeqStats.fixed(256, 2048), "shrink: GPUs [12..15] leave")
    assert isinstance(action, Move) and action.drain and action.reason.startswith("shrink")
    assert not {g for c in action.target.candidates for g in c.gpus} & {12, 13, 14, 15}
    ctl.moved(action, 2.0)
    assert ctl.plan is action.target and ctl.state is State.STEADY
    refused = ctl.drain((0,), SeqStats.fixed(256, 2048))  # an 8B PPO job does not fit on one GPU
    assert isinstance(refused, Keep) and "does not fit" in refused.reason


def test_out_of_memory_never_keeps_the_plan_and_raises_the_stage_correction(plan: Plan) -> None:
    ctl = _controller(plan)
    pool = tuple(range(16))
    ctl.observe(t(0, 2048, pool))
    before = ctl.calibration.memory_factor(Stage.TRAIN)
    # the smallest correction that predicts the OOM: the trainers' peak up to physical memory
    problem = ctl.problem(plan.pool, SeqStats.fixed(256, 2048))
    bound = price(problem, shapes_of(plan)).bound
    peak = max(b for n, b in bound.items() if plan.workflow.get(n).stage is Stage.TRAIN)
    physical = problem.cluster.gpu_memory_bytes - problem.reserved_bytes
    step = min(1.25, max(1.02, physical / peak))
    ctl.monitor.pool_horizon.crossed(0)  # the pool last changed at step 0: its H at step 6 is 6
    d = ctl.observe(t(6, 2048, pool, oom=True, oom_stage="actor.train"))
    assert d is not None and d.urgent and d.current_latency_s is None
    assert d.horizon_steps == ctl.monitor.horizon_now(POOL, 6) == 6.0  # urgent options: the pool's H, not 1
    assert any(tr.kind is TriggerKind.OOM for tr in d.triggers)
    assert d.verdict in (Verdict.ADMIT, Verdict.RESTART)  # never "keep": that plan ran out
    if d.verdict is Verdict.ADMIT:
        assert d.target is not None and d.target.candidates != plan.candidates
    assert ctl.calibration.memory_factor(Stage.TRAIN) == pytest.approx(before * step)
    assert ctl.calibration.memory_factor(Stage.GEN) == 1.0  # only the stage that ran out


def test_nowhere_to_go_keeps_a_plan_that_holds_its_gpus_and_restarts_one_that_does_not(plan: Plan) -> None:
    """Nothing fits the pool (the planner finds no plan at all): a plan only predicted over its
    memory budget, on GPUs it still holds, carries on (a restart would reload it as it is), while
    a plan that lost GPUs or ran out of memory restarts wherever the pool allows (no target)."""

    def nothing_fits(problem: PlanningProblem) -> SearchResult:
        raise InfeasibleError("nothing fits")

    pool = tuple(range(16))
    ctl = _controller(plan, planner=nothing_fits)
    ctl.observe(t(0, 2048, pool))
    d = ctl.observe(t(1, 4096, pool))  # the 2K plan is predicted over capacity at 4K
    assert d is not None and d.urgent and any(tr.kind is TriggerKind.MEMORY for tr in d.triggers)
    assert d.verdict is Verdict.KEEP and d.target is None, d.reason
    assert "the running plan holds its GPUs and carries on" in d.reason
    assert isinstance(d.action, Keep) and ctl.state is State.STEADY and ctl.plan is plan

    trainer = plan.candidate("actor.train")
    lost = _controller(plan, planner=nothing_fits)
    lost.observe(t(0, 2048, pool))
    d = lost.observe(t(1, 2048, tuple(g for g in pool if g not in set(trainer.gpus))))
    assert d is not None and d.verdict is Verdict.RESTART and d.target is None
    assert d.action == Restart(None, d.reason) and lost.state is State.RESTART_REQUIRED

    oom = _controller(plan, planner=nothing_fits)
    oom.observe(t(0, 2048, pool))
    d = oom.observe(t(1, 2048, pool, oom=True, oom_stage="actor.train"))
    assert d is not None and d.verdict is Verdict.RESTART and d.target is None


def test_the_step_after_a_move_measures_the_new_plan_without_a_drift(plan: Plan) -> None:
    """A move onto a grown pool, and the first measured step on the new plan (after its warm-up
    step) sees its op classes at half the efficiency the left plan did (other shapes): that is
    the new reference, not a drift that would replan at once with H = 1."""
    from nereus.plan.calibration import Measurement
    from nereus.plan.opclass import OpClass

    def ms(eff: float) -> tuple[Measurement, ...]:
        return (Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / eff),)

    ctl = _controller(plan)
    ctl.observe(t(0, 2048, tuple(range(16)), measurements=ms(0.6)))
    d = ctl.observe(t(1, 2048, tuple(range(32)), measurements=ms(0.6)))
    assert d is not None and d.verdict is Verdict.ADMIT, d and d.reason
    ctl.transition_done(5.0)
    assert ctl.observe(t(2, 2048, tuple(range(32)), measurements=ms(0.3))) is None  # warm-up: left out
    assert ctl.observe(t(3, 2048, tuple(range(32)), measurements=ms(0.3))) is None  # the new reference
    later = ctl.observe(t(4, 2048, tuple(range(32)), measurements=ms(0.6)))  # now it drifts
    assert later is not None and [f.signal for f in later.triggers] == ["efficiency.allreduce.inter"]
