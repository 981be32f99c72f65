"""The work a step loses with a revoked GPU, by how settled the pool is (issue 19): the rate's
dependence on the time since the pool last changed (``FailureDomains.age_factors``, estimated from
a trace's history), a step's lost work L·p/(1 − p), the reserved "floor" option, and the
``settled`` trigger that re-plans once idle GPUs have become safe enough to use."""

from __future__ import annotations

import math

import pytest

from nereus.control.admission import Verdict
from nereus.control.controller import Controller
from nereus.control.policy import policy_config
from nereus.control.risk import MAX_LOSS_P, lost_work
from nereus.control.settling import PoolAge
from nereus.control.telemetry import Telemetry
from nereus.control.triggers import TriggerKind
from nereus.plan.search import search
from nereus.sim import GpuSupply, SpotTrace
from nereus.spec.domains import FailureDomains
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

UNSETTLED = ((0.0, 40.0), (500.0, 0.02))  # 40× the mean rate for 500 s after a change, then calm


def test_exposure_integrates_the_rate_over_the_pools_age() -> None:
    flat = FailureDomains(frozenset(), 2, 2.0)
    assert flat.exposure_hours(360.0, 1e6) == pytest.approx(0.1)  # no factors: the mean rate
    aged = FailureDomains(frozenset(), 2, 2.0, age_factors=((0.0, 4.0), (100.0, 0.5)))
    assert aged.exposure_hours(100.0, 50.0) == pytest.approx((50 * 4.0 + 50 * 0.5) / 3600)
    assert aged.exposure_hours(100.0, None) == pytest.approx(100 / 3600)  # age unknown: the mean
    assert aged.exposure_hours(100.0, 500.0) == pytest.approx(50 / 3600)
    assert aged.exposure_hours(0.0, 0.0) == 0.0
    for bad in (((10.0, 1.0),), ((0.0, 1.0), (0.0, 2.0)), ((0.0, -1.0),), ((0.0, math.nan),)):
        with pytest.raises(ValueError, match="age_factors"):
            FailureDomains(frozenset(), 2, 2.0, age_factors=bad)


def test_any_lost_probability_counts_every_revocable_instance_a_step_touches() -> None:
    d = FailureDomains(frozenset(range(4)), 2, 3.0)  # instances 0, 1 reserved
    assert d.any_lost_probability(range(4), 3600.0) == 0.0
    assert d.any_lost_probability([4, 5], 1200.0) == pytest.approx(1 - math.exp(-1.0))
    assert d.any_lost_probability([0, 4, 6], 1200.0) == pytest.approx(1 - math.exp(-2.0))
    # correlated: each event takes a quarter of 4 held instances (one); a step on 2 of them is hit
    # by half the events
    burst = FailureDomains(frozenset(range(4)), 2, 0.0, 2.0, (0.25,))
    assert burst.any_lost_probability([4, 6], 1800.0, held=4) == pytest.approx(1 - math.exp(-0.5))
    assert burst.any_lost_probability([4, 6, 8, 10], 1800.0, held=4) == pytest.approx(1 - math.exp(-1.0))
    early = FailureDomains(frozenset(range(4)), 2, 0.0, 2.0, (0.25,), UNSETTLED)
    assert early.any_lost_probability([4, 6], 100.0, 4, 0.0) > burst.any_lost_probability([4, 6], 100.0, 4)
    assert early.any_lost_probability([4, 6], 100.0, 4, 900.0) < burst.any_lost_probability([4, 6], 100.0, 4)


def test_lost_work_is_the_retries_of_a_step() -> None:
    problem = make_problem(gpus=32, response=1024)
    plan = search(problem).plan
    everything = FailureDomains(frozenset(), 4, 2.0)
    p = everything.any_lost_probability([g for c in plan.candidates for g in c.gpus], 100.0, 8)
    assert lost_work(plan, everything, 100.0) == pytest.approx(100.0 * p / (1 - p))
    assert lost_work(plan, FailureDomains(frozenset(range(32)), 4, 2.0), 100.0) == 0.0
    storm = FailureDomains(frozenset(), 4, 1e5)  # every step lost: capped, not infinite
    assert lost_work(plan, storm, 100.0) == pytest.approx(100.0 * MAX_LOSS_P / (1 - MAX_LOSS_P))


def _trace(counts: list[int], gap: float = 60.0) -> SpotTrace:
    return SpotTrace("synthetic", gap, tuple(counts))


def test_age_factors_come_from_the_traces_history() -> None:
    """Capacity that arrives and is gone two ticks later, then long calm: the rate right after
    a change is above the mean, after a long calm below it — in simulated seconds."""
    cycle = [2, 4, 4, 2] + [2] * 60  # a rise, a drop two ticks later, then an hour of calm
    supply = GpuSupply(_trace(cycle * 6), 2, 8, 2, 0, 2.0)  # 2 GPUs per instance, 1 reserved
    factors = supply.age_factors()
    assert [a for a, _ in factors] == [0.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0]
    by_age = dict(factors)
    assert by_age[30.0] > 1.0 > by_age[960.0]
    assert supply.domains().age_factors == factors
    assert GpuSupply(_trace([1, 2, 3, 3]), 2, 8, 2).age_factors() == ()  # no drop: nothing to learn


def _tel(step: int, time_s: float, pool: tuple[int, ...]) -> Telemetry:
    return Telemetry(step, time_s, 1024.0, 1024.0, pool)


def test_pool_age_fires_settled_only_with_idle_gpus_in_a_calmer_bin() -> None:
    domains = FailureDomains(frozenset(range(8)), 4, 2.0, age_factors=UNSETTLED)
    age = PoolAge(domains)
    small, big = tuple(range(16)), tuple(range(32))
    assert age.observe(_tel(0, 0.0, small)) == 0.0
    assert age.observe(_tel(1, 100.0, big)) == 0.0  # a new pool: its age starts again
    age.priced(100.0)
    idle = frozenset(small)
    assert age.trigger(_tel(2, 400.0, big), idle, 2.0) is None  # still in the first bin
    assert age.observe(_tel(3, 700.0, big)) == 600.0
    fired = age.trigger(_tel(3, 700.0, big), idle, 2.0)
    assert fired is not None and fired.kind is TriggerKind.SETTLED and not fired.urgent
    assert age.trigger(_tel(3, 700.0, big), frozenset(big), 2.0) is None  # nothing idle
    age.priced(700.0)
    assert age.trigger(_tel(4, 800.0, big), idle, 2.0) is None  # priced in that bin already
    # the same pool at both ends of a step whose GPUs were revoked and replaced: its age starts again
    assert age.observe(Telemetry(5, 900.0, 1024.0, 1200.0, big, lost=(20, 21))) == 0.0
    assert age.observe(_tel(6, 950.0, big)) == 50.0
    flat = FailureDomains(frozenset(range(8)), 4, 2.0)  # no age factors: nothing settles
    assert PoolAge(flat).trigger(_tel(3, 700.0, big), idle, 2.0) is None
    assert PoolAge(None).trigger(_tel(3, 700.0, big), idle, 2.0) is None


def test_a_controller_waits_for_new_capacity_to_settle_then_grows_onto_it() -> None:
    """The pool doubles onto revocable instances that, by the history, are likely gone within
    a step: the replan keeps off them; once the pool has been calm past the unsettled span, the
    settled trigger re-plans and the job grows onto them."""
    problem = make_problem(gpus=16, response=1024)
    plan = search(problem).plan
    domains = FailureDomains(frozenset(range(16)), 4, 2.0, age_factors=UNSETTLED)
    ctl = Controller(problem.workload, problem.models, problem.cluster, plan, domains=domains)
    small, big = tuple(range(16)), tuple(range(32))
    assert ctl.observe(_tel(0, 0.0, small)) is None
    d = ctl.observe(_tel(1, 100.0, big))
    assert d is not None and d.verdict is Verdict.KEEP
    assert d.target is None and ctl.plan is plan  # 16 GPUs idle: the new ones are too unsettled
    assert ctl.observe(_tel(2, 300.0, big)) is None
    d = ctl.observe(_tel(3, 700.0, big))
    assert d is not None and [t.kind for t in d.triggers] == [TriggerKind.SETTLED]
    assert d.verdict is Verdict.ADMIT and d.target is not None
    assert {g for c in d.target.candidates for g in c.gpus} - set(small)  # onto the new GPUs


def test_static_never_falls_back_to_the_floor() -> None:
    problem = make_problem(gpus=32, response=1024)
    domains = FailureDomains(frozenset(range(24, 32)), 4, 50.0)
    plan = search(problem).plan
    for policy, floor in (("nereus", True), ("static", False)):
        ctl = Controller(
            problem.workload, problem.models, problem.cluster, plan, policy_config(policy), domains=domains
        )
        labels = {o.label for o in ctl._options(ctl.problem(problem.pool, problem.seq))}
        assert ("floor" in labels) is floor
