"""A replan run beside the next step (``nereus.runtime.deferred``, issue 21: monitoring under 2%).

- Deferred on a helper thread — with the next boundary's memory check ahead queued behind it, as
  the leader does — the controller's decisions equal those it makes on the boundary, on random
  length drifts, pool changes, memory peaks and out-of-memory errors, whatever the policy.
- Only replans whose triggers cannot be urgent are deferred, and only where a later boundary
  can still apply them.
- Something urgent at the next boundary drops a deferred decision: the controller keeps the
  running plan (a move it admitted is not made) and decides afresh, urgently.
- The step that ran beside a deferred move is folded into calibration and the length growth.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from nereus.control.admission import Decision, Verdict
from nereus.control.controller import Controller, State, policy_config
from nereus.control.telemetry import Telemetry
from nereus.control.triggers import Trigger, TriggerKind
from nereus.plan.calibration import Measurement
from nereus.plan.layout import Plan
from nereus.plan.opclass import OpClass
from nereus.plan.search import search
from nereus.runtime.deferred import Deferral, Taken, deferrable
from nereus.spec.workload import Stage
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def _follow(ctl: Controller, d: Decision | None) -> None:
    """The runtime's answer to ``d``."""
    if d is None:
        return
    if d.verdict is Verdict.ADMIT:
        ctl.transition_done(1.0)
    elif d.verdict is Verdict.RESTART and d.target is not None:
        ctl.restarted(d.target)


def _comparable(d: Decision | None) -> Decision | None:
    """``d`` without what was priced of its transition (the DAG object, compared by identity)."""
    if d is None or d.transition is None:
        return d
    return replace(d, transition=replace(d.transition, priced=None))


@pytest.mark.parametrize(("policy", "seed"), [("nereus", 0), ("nereus", 1), ("always", 2), ("oracle", 3)])
def test_a_deferred_decision_equals_the_one_on_the_boundary(policy: str, seed: int) -> None:
    problem = make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=16, response=2048)
    plan: Plan = search(make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=8, response=2048)).plan
    config = policy_config(policy)
    now = Controller(problem.workload, problem.models, problem.cluster, plan, config)
    later = Controller(problem.workload, problem.models, problem.cluster, plan, config)
    helper = ThreadPoolExecutor(1)
    deferral = Deferral(later, helper.submit)
    rng = random.Random(seed)
    length, pool = 2048.0, plan.pool
    verdicts: set[str] = set()
    deferred = 0
    for step in range(30):
        if rng.random() < 0.35:
            length = max(64.0, length * rng.choice((0.5, 0.8, 1.5, 2.0)))
        if rng.random() < 0.15:  # the pool grows to 16 or shrinks to the running plan's GPUs
            pool = tuple(range(16)) if len(pool) < 16 else now.plan.pool
        kind = rng.random()
        peaks = {"actor.train": rng.uniform(1e9, 6e10)} if kind < 0.1 else {}
        oom = 0.1 <= kind < 0.14
        t = Telemetry(
            step, 10.0 * step, length, length * 1.3, pool, peak_memory=peaks, oom=oom,
            oom_stage="actor.train" if oom else "",
        )  # fmt: skip
        expected = now.observe(t)
        fired = later.triggers(t)
        got: Decision | None = None
        if fired:
            assert deferrable(fired, step + 1, 100) == (expected is not None and not expected.urgent)
            deferral.start(t, fired)
            deferral.launch()  # once the boundary is over
            nxt = length * rng.uniform(0.8, 1.2)  # the next boundary's early work, queued behind it
            helper.submit(later.prepare, nxt, nxt * 1.3).result()
            now.prepare(nxt, nxt * 1.3)
            taken = deferral.take()
            assert not deferral.pending and taken.seconds >= 0 and not taken.dropped
            got = taken.decision
            deferred += 1
        assert _comparable(got) == _comparable(expected), f"step {step}"
        verdicts |= {got.verdict.value} if got is not None else set()
        _follow(now, expected)
        _follow(later, got)
        assert later.plan == now.plan and later.state == now.state
    helper.shutdown()
    assert deferred >= 5 and "admit" in verdicts, (deferred, verdicts)


def _trigger(kind: TriggerKind) -> Trigger:
    return Trigger(kind, "x", 1.0, 0.0, 1.0)


def test_only_replans_that_cannot_be_urgent_are_deferred() -> None:
    calm = [_trigger(TriggerKind.DRIFT), _trigger(TriggerKind.PERIODIC), _trigger(TriggerKind.POOL)]
    assert deferrable(calm, 3, 10)
    assert not deferrable([], 3, 10)
    for urgent in (TriggerKind.GPU_LOSS, TriggerKind.MEMORY, TriggerKind.OOM):
        assert not deferrable([*calm, _trigger(urgent)], 3, 10), urgent
    assert deferrable(calm, 8, 10) and not deferrable(calm, 9, 10)  # no boundary left to apply it


def test_an_urgent_condition_drops_the_deferred_decision() -> None:
    problem = make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=16, response=2048)
    plan = search(make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=8, response=2048)).plan
    ctl = Controller(problem.workload, problem.models, problem.cluster, plan, policy_config("always"))
    helper = ThreadPoolExecutor(1)
    deferral = Deferral(ctl, helper.submit)
    assert deferral.drop() is None  # nothing under way: nothing to drop
    assert ctl.observe(Telemetry(0, 0.0, 2048.0, 2400.0, plan.pool)) is None
    grown = Telemetry(1, 10.0, 2048.0, 2400.0, tuple(range(16)))  # 8 more GPUs: worth moving
    fired = ctl.triggers(grown)
    assert [f.kind for f in fired] == [TriggerKind.POOL] and deferrable(fired, 2, 10)
    deferral.start(grown, fired)
    with pytest.raises(RuntimeError, match="already under way"):
        deferral.start(grown, fired)
    dropped = deferral.drop()  # the next boundary: a GPU of the running plan is lost
    assert dropped is not None and dropped.dropped and dropped.decision.verdict is Verdict.ADMIT
    assert not deferral.pending
    assert ctl.plan is plan and ctl.state is State.STEADY and ctl.pending is None
    assert ctl.decisions[-1] is dropped.decision  # the replan it was is logged
    lost = tuple(g for g in range(16) if g != plan.pool[0])
    fresh = ctl.observe(Telemetry(2, 20.0, 2048.0, 2400.0, lost))
    assert fresh is not None and fresh.urgent and fresh.step == 2
    assert any(f.kind is TriggerKind.GPU_LOSS for f in fresh.triggers)
    if fresh.target is not None:
        assert plan.pool[0] not in {g for c in fresh.target.candidates for g in c.gpus}
    with pytest.raises(RuntimeError, match="no deferred decision"):
        deferral.take()
    helper.shutdown()


def test_a_taken_decision_has_non_negative_seconds() -> None:
    problem = make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=8, response=2048)
    plan = search(problem).plan
    d = Decision(0, 0.0, (), False, Verdict.KEEP, "", 1.0)
    assert Taken(d, 0.0).keeps and not Taken(d, 0.0).dropped
    with pytest.raises(ValueError, match="seconds"):
        Taken(d, -1.0)
    assert plan.pool == problem.pool


def test_the_step_beside_a_deferred_move_is_folded_in() -> None:
    """A deferred move applied one boundary later: the step that ran meanwhile (on the plan the
    move leaves) still reaches calibration and the length growth, as observing it would."""
    problem = make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=16, response=2048)
    plan = search(make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=8, response=2048)).plan
    moved = Controller(problem.workload, problem.models, problem.cluster, plan, policy_config("always"))
    watched = Controller(problem.workload, problem.models, problem.cluster, plan, policy_config("always"))
    helper = ThreadPoolExecutor(1)
    deferral = Deferral(moved, helper.submit)
    warm_up = (Measurement(OpClass.GEMM, 1.0, 2.0),)  # the first step's timings: left out
    calm = Telemetry(0, 0.0, 2048.0, 2400.0, plan.pool, measurements=warm_up)
    assert moved.observe(calm) is None and watched.observe(calm) is None
    grown = Telemetry(1, 10.0, 2048.0, 2400.0, tuple(range(16)))  # 8 more GPUs: worth moving
    deferral.start(grown, moved.triggers(grown))
    watched.triggers(grown)
    deferral.launch()
    slow = (Measurement(OpClass.GEMM, 1.0, 4.0), Measurement(OpClass.GEMM, 2.0, 8.0))
    meanwhile = Telemetry(2, 20.0, 3072.0, 3500.0, grown.pool, measurements=slow,
                          peak_memory={"actor.train": 5e10})  # fmt: skip
    taken = deferral.take()
    assert taken.decision.verdict is Verdict.ADMIT and moved.state is State.TRANSITIONING
    before = moved.calibration.efficiency(OpClass.GEMM)
    moved.fold(meanwhile)
    watched.triggers(meanwhile)
    assert moved.calibration.efficiency(OpClass.GEMM) < before
    assert moved.calibration.efficiency(OpClass.GEMM) == watched.calibration.efficiency(OpClass.GEMM)
    assert moved.calibration.memory_factor(Stage.TRAIN) == watched.calibration.memory_factor(Stage.TRAIN)
    assert moved.lengths.last == watched.lengths.last == 3072.0
    assert moved.lengths.growth == watched.lengths.growth > 1.0
    assert moved.state is State.TRANSITIONING  # nothing else: no triggers, the move still pending
    with pytest.raises(ValueError, match="out-of-memory"):
        moved.fold(replace(meanwhile, oom=True))
    helper.shutdown()
