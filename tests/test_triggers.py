"""Triggers: thresholds with reference reset, horizons updated only at crossings, pool events."""

from __future__ import annotations

import itertools

import pytest

from nereus.control.telemetry import Telemetry
from nereus.control.triggers import GROWTH, POOL, Horizon, Threshold, TriggerKind, TriggerMonitor, horizon
from nereus.plan.calibration import Measurement
from nereus.plan.opclass import OpClass

pytestmark = pytest.mark.pure


def tel(step: int, length: float = 1000.0, pool: tuple[int, ...] = (0, 1, 2, 3), **kw: object) -> Telemetry:
    return Telemetry(step, float(step), length, length * 1.1, pool, **kw)  # type: ignore[arg-type]


def test_threshold_fires_beyond_delta_and_reference_resets() -> None:
    th = Threshold("seq_len", 0.30, 0.5)
    assert th.observe(0, 1000) is None  # first value becomes the reference
    assert th.observe(1, 1299) is None  # +29.9%
    fired = th.observe(2, 1301)
    assert fired is not None and fired.reference == 1000 and fired.value == 1301
    th.reset(1301)  # after the replan, even if rejected
    assert th.observe(3, 1350) is None  # a persistent deviation does not re-fire


def test_steady_growth_crosses_repeatedly_and_horizon_is_an_ema_of_intervals() -> None:
    th = Threshold("seq_len", 0.30, 0.5)
    length, crossings = 1000.0, []
    th.observe(0, length)
    for step in range(1, 40):
        length *= 1.1  # +10% per step: crosses every 3 steps once the reference resets
        t = th.observe(step, length)
        if t is not None:
            crossings.append((step, t.horizon_steps))
            th.reset(length)
    steps = [s for s, _ in crossings]
    assert len(steps) > 5 and all(b - a == 3 for a, b in itertools.pairwise(steps))
    assert crossings[0][1] == 1.0  # before the first interval: 1 step
    assert crossings[1][1] == 3.0 and crossings[-1][1] == pytest.approx(3.0)


def test_horizon_updates_only_at_crossings() -> None:
    h = Horizon(0.5)
    assert h.steps == 1.0
    h.crossed(10)
    assert h.steps == 1.0  # one crossing: no interval yet
    h.crossed(14)
    assert h.steps == 4.0
    h.crossed(16)
    assert h.steps == pytest.approx(0.5 * 2 + 0.5 * 4)


def test_pool_events_and_urgency() -> None:
    mon = TriggerMonitor()
    plan_gpus = frozenset({0, 1})
    assert mon.observe(tel(0), plan_gpus, False) == []
    grow = mon.observe(tel(1, pool=(0, 1, 2, 3, 4, 5)), plan_gpus, False)
    assert [t.kind for t in grow] == [TriggerKind.POOL] and not grow[0].urgent
    loss = mon.observe(tel(3, pool=(1, 2, 3)), plan_gpus, False)
    assert loss[0].kind is TriggerKind.GPU_LOSS and loss[0].urgent
    assert loss[0].horizon_steps == 2.0  # pool changed at steps 1 and 3
    memory = mon.observe(tel(4, pool=(1, 2, 3)), frozenset({1, 2}), True)
    assert [t.kind for t in memory] == [TriggerKind.MEMORY] and memory[0].urgent
    oom = mon.observe(tel(5, pool=(1, 2, 3), oom=True), frozenset({1, 2}), True)
    assert [t.kind for t in oom] == [TriggerKind.OOM]


def test_efficiency_drift_per_op_class() -> None:
    mon = TriggerMonitor(delta_eff=0.25)

    def step(i: int, eff: float) -> list[TriggerKind]:
        ms = (Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / eff),)
        return [t.kind for t in mon.observe(tel(i, measurements=ms), frozenset({0}), False)]

    assert step(0, 0.6) == []
    assert step(1, 0.5) == []  # −17%
    assert step(2, 0.4) == [TriggerKind.DRIFT]  # −33%: congestion


def test_smallest_horizon_wins() -> None:
    mon = TriggerMonitor()
    assert horizon([]) == 1.0
    th = Threshold("seq_len", 0.3, 0.5)
    th.observe(0, 1.0)
    a = th.observe(1, 2.0)
    assert a is not None
    grow = mon.observe(tel(0), frozenset(), False) + mon.observe(tel(7, pool=(0,)), frozenset(), False)
    assert horizon([a, *grow]) == min(a.horizon_steps, grow[0].horizon_steps)


def test_a_pool_grown_before_the_first_telemetry_fires() -> None:
    """Workers that joined during start-up: the first telemetry already shows them. Against the
    pool the plan was made for, that is a change (the job grows onto them); without it, none."""
    grown = (0, 1, 2, 3)
    mon = TriggerMonitor(pool=(0, 1))
    assert [t.kind for t in mon.observe(tel(0, pool=grown), frozenset({0, 1}), False)] == [TriggerKind.POOL]
    assert TriggerMonitor().observe(tel(0, pool=grown), frozenset({0, 1}), False) == []
    same = TriggerMonitor(pool=grown)
    assert same.observe(tel(0, pool=grown), frozenset({0, 1}), False) == []


def test_exactly_delta_does_not_fire_and_a_zero_reference_is_replaced() -> None:
    th = Threshold("seq_len", 0.30, 0.5)
    th.observe(0, 1000)
    assert th.observe(1, 1300) is None  # exactly +30%: within δ
    zero = Threshold("efficiency.gemm", 0.25, 0.5)
    assert zero.observe(0, 0.0) is None and zero.observe(1, 5.0) is None  # 0 is no reference to divide by
    assert zero.reference == 5.0


def test_a_horizon_is_at_least_the_steps_since_the_last_crossing() -> None:
    h = Horizon(0.5)
    h.crossed(2)
    h.crossed(10)  # one interval: 8 steps
    assert h.steps == 8.0 and h.effective(12) == 8.0
    assert h.effective(30) == 20.0  # stable for 20 steps: not expected to change within 8
    h.crossed(10)  # the same step again is no interval
    assert h.steps == 8.0


def test_a_plan_on_gpus_outside_an_unchanged_pool_is_a_gpu_loss() -> None:
    mon = TriggerMonitor(pool=(0, 1))
    [fired] = mon.observe(tel(0, pool=(0, 1)), frozenset({0, 1, 2}), False)
    assert fired.kind is TriggerKind.GPU_LOSS


def test_gpus_that_died_during_the_step_are_a_gpu_loss_even_when_the_pool_holds_them_again() -> None:
    """An instance revoked mid-step and replaced by its end: the pool looks the same, but the
    workers there died (``Telemetry.lost``), so the plan has lost GPUs and the pool changed twice."""
    mon = TriggerMonitor(pool=(0, 1, 2, 3))
    plan = frozenset({0, 1, 2, 3})
    assert mon.observe(tel(0), plan, False) == []
    [fired] = mon.observe(tel(1, lost=(2, 3)), plan, False)
    assert fired.kind is TriggerKind.GPU_LOSS
    assert mon.observe(tel(2), plan, False) == []
    [fired] = mon.observe(tel(4, lost=(3,)), frozenset({0, 1}) | {3}, False)
    assert fired.kind is TriggerKind.GPU_LOSS and mon.pool_horizon.steps == 3.0  # crossed at 1 and 4
    # GPUs outside the plan that died: the pool changed, the plan runs on
    [fired] = mon.observe(tel(5, lost=(2, 3)), frozenset({0, 1}), False)
    assert fired.kind is TriggerKind.POOL
    with pytest.raises(ValueError, match="lost GPU ids repeat"):
        tel(6, lost=(1, 1))


def test_reset_takes_the_replans_efficiency_as_the_new_reference() -> None:
    mon = TriggerMonitor(pool=(0, 1, 2, 3))
    plan = frozenset({0, 1, 2, 3})

    def measured(step: int, eff: float) -> Telemetry:
        return tel(step, measurements=(Measurement(OpClass.GEMM, 1.0, 1.0 / eff),))

    assert mon.observe(measured(0, 0.5), plan, False) == []
    [drift] = mon.observe(measured(1, 0.3), plan, False)
    assert drift.signal == "efficiency.gemm"
    mon.reset(measured(1, 0.3))
    assert mon.observe(measured(2, 0.3), plan, False) == []  # the new reference: no drift


def test_a_pool_that_only_grows_carries_the_horizon_until_it_next_loses_gpus() -> None:
    """A growth's gain lasts until the added GPUs go, not until the pool next grows again: its
    trigger is the ``pool.growth`` signal, whose horizon counts the steps between losses (and no
    fewer than the steps since the last loss, or since the first step seen); a loss is the
    ``pool`` signal, with the paper's horizon between any two changes."""
    mon = TriggerMonitor()
    plan = frozenset({0, 1})
    assert mon.observe(tel(3, pool=(0, 1, 2, 3)), plan, False) == []  # the first step seen
    grown = [
        f for f in mon.observe(tel(7, pool=(0, 1, 2, 3, 4, 5)), plan, False) if f.kind is TriggerKind.POOL
    ]
    assert [(f.signal, f.horizon_steps) for f in grown] == [(GROWTH, 4.0)]  # no loss in 4 steps
    grown = mon.observe(tel(8, pool=tuple(range(8))), plan, False)
    assert [(f.signal, f.horizon_steps) for f in grown] == [(GROWTH, 5.0)]
    assert mon.horizon_now(POOL, 8) == 1.0  # the pool changes every step or so
    lost = mon.observe(tel(10, pool=(0, 1, 2, 3, 4, 5)), plan, False)
    assert [(f.kind, f.signal) for f in lost] == [(TriggerKind.POOL, POOL)]  # a loss, not the plan's
    assert lost[0].horizon_steps == pytest.approx(0.5 * 2 + 0.5 * 1)
    regrown = mon.observe(tel(11, pool=tuple(range(8))), plan, False)
    assert [(f.signal, f.horizon_steps) for f in regrown] == [(GROWTH, 7.0)]  # first loss 7 steps in
    assert mon.horizon_now(GROWTH, 30) == 20.0  # and it has held for 20 steps since
    revoked = mon.observe(tel(12, pool=tuple(range(8)), lost=(6,)), plan, False)  # back within the step
    assert [(f.kind, f.signal) for f in revoked] == [(TriggerKind.POOL, POOL)]
    assert mon.horizon_now(GROWTH, 12) == pytest.approx(0.5 * 2 + 0.5 * 7)


def test_a_plan_past_its_headroom_within_the_memory_fires_a_replan_that_is_not_urgent() -> None:
    """The running plan predicted past the headroom but within the GPUs' memory: a ``MARGIN``
    trigger (a move away must pay back), whose H is the pool's (until it next changes, and no
    less than it has now been stable); a violation of the memory itself stays urgent and wins."""
    mon = TriggerMonitor()
    plan_gpus = frozenset({0, 1})
    mon.observe(tel(0), plan_gpus, False)
    mon.observe(tel(2, pool=(0, 1, 2)), plan_gpus, False)  # the pool last changed at step 2
    margin = mon.observe(tel(7, pool=(0, 1, 2)), plan_gpus, False, into_margin=True)
    assert [t.kind for t in margin] == [TriggerKind.MARGIN] and not margin[0].urgent
    assert margin[0].horizon_steps == 5.0 == mon.horizon_now(POOL, 7)
    both = mon.observe(tel(8, pool=(0, 1, 2)), plan_gpus, True, into_margin=True)
    assert [t.kind for t in both] == [TriggerKind.MEMORY]
    assert margin[0].describe() == "memory: next step predicted past the headroom, within capacity"


def test_on_a_pool_that_never_changed_the_margins_h_is_the_steps_since_the_first_observed() -> None:
    """A fixed allocation: the pool has held since the first step observed, so a plan past its
    headroom there has H = the steps since then (it was 1 however long the pool had held, and a
    move refused on it never repaid in time); the first pool crossing still has H = 1 (paper)."""
    mon = TriggerMonitor()
    plan_gpus = frozenset({0, 1})
    mon.observe(tel(3), plan_gpus, False)  # the first step observed (a resumed job, say)
    for i in range(4, 12):
        assert mon.observe(tel(i), plan_gpus, False) == []
    margin = mon.observe(tel(12), plan_gpus, False, into_margin=True)
    assert [t.kind for t in margin] == [TriggerKind.MARGIN]
    assert margin[0].horizon_steps == 9.0 == mon.horizon_now(POOL, 12)
    first = mon.observe(tel(13, pool=(0, 1, 2)), plan_gpus, False)  # GPU 3 leaves
    assert [(t.kind, t.signal, t.horizon_steps) for t in first] == [(TriggerKind.POOL, POOL, 1.0)]
    assert mon.pool_horizon.steps == 1.0  # no interval between crossings seen yet
    assert mon.horizon_now(POOL, 15) == 2.0  # stable since the crossing at step 13


def test_the_margin_sets_h_only_where_no_signal_fired_with_it() -> None:
    """H is the smallest H_x among the signals that fired; a plan past its headroom is no signal
    that changes, so a pool growth's H (say) is not cut to the margin's."""
    mon = TriggerMonitor()
    plan_gpus = frozenset({0, 1})
    mon.observe(tel(0), plan_gpus, False)
    fired = mon.observe(tel(6, pool=(0, 1, 2, 3, 4)), plan_gpus, False, into_margin=True)
    kinds = {t.kind: t for t in fired}
    assert set(kinds) == {TriggerKind.POOL, TriggerKind.MARGIN}
    growth = kinds[TriggerKind.POOL]
    assert growth.signal == GROWTH and growth.horizon_steps == 6.0
    assert kinds[TriggerKind.MARGIN].horizon_steps == 1.0  # the pool just changed: H 1
    assert horizon(fired) == 6.0 and horizon([kinds[TriggerKind.MARGIN]]) == 1.0


def test_after_the_plan_changes_its_first_efficiency_is_the_new_reference() -> None:
    """A move measures each op class on other shapes: the first efficiency on the new plan is
    its reference, not a drift from the left plan's (which crossed with H = 1 and cut the next
    decision's H to 1); a later change from it is a drift, its interval counted from no crossing."""
    mon = TriggerMonitor(delta_eff=0.25)

    def step(i: int, eff: float) -> list[float]:
        ms = (Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / eff),)
        return [t.horizon_steps for t in mon.observe(tel(i, measurements=ms), frozenset({0}), False)]

    assert step(0, 0.6) == []
    mon.rebase()  # the controller's plan changed
    assert step(1, 0.3) == []  # −50%, on the new plan's shapes: its reference
    assert step(2, 0.32) == []
    assert step(5, 0.6) == [1.0]  # +100% from 0.3: a drift, the first crossing (H = 1)
    fresh = TriggerMonitor(delta_eff=0.25)
    fresh.observe(
        tel(0, measurements=(Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / 0.6),)), frozenset({0}), False
    )
    moved = fresh.observe(
        tel(1, measurements=(Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / 0.3),)), frozenset({0}), False
    )
    assert [t.kind for t in moved] == [TriggerKind.DRIFT]  # without the rebase, the plan change is a drift


def test_a_move_refused_past_the_headroom_alone_waits_on_the_pools_horizon() -> None:
    """A refused move on a ``MARGIN`` replan alone waits as a deferred target on the pool's H
    (the margin's own); beside another signal, on that signal's (``horizon`` leaves it out)."""
    from nereus.control.admission import Decision, Profit, Rule, Verdict
    from nereus.control.deferral import Deferral

    mon, plan_gpus, rule = TriggerMonitor(), frozenset({0, 1}), Rule(Profit.PAYBACK, 0.5)
    mon.observe(tel(0), plan_gpus, False)
    mon.observe(tel(2, pool=(0, 1, 2)), plan_gpus, False)  # the pool changed at step 2
    margin = mon.observe(tel(3, pool=(0, 1, 2)), plan_gpus, False, into_margin=True)
    deferral = Deferral()
    deferral.after(Decision(3, 3.0, tuple(margin), False, Verdict.KEEP, "", 100.0, payback_steps=2.0), rule)
    assert deferral.pending == ((POOL,), 2.0)
    assert deferral.trigger(mon, 4, 0.5) == []  # H 2: γ·H = 1 < 2
    assert [t.kind for t in deferral.trigger(mon, 6, 0.5)] == [TriggerKind.DEFERRED]  # H 4: γ·H = 2
    both = mon.observe(tel(7, pool=(0, 1, 2, 3)), plan_gpus, False, into_margin=True)
    deferral.after(Decision(7, 7.0, tuple(both), False, Verdict.KEEP, "", 100.0, payback_steps=2.0), rule)
    assert deferral.pending == ((GROWTH,), 2.0)
