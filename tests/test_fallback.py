"""Before a checkpoint restart, the running layouts with only DP and GPUs changed are weighed too
(``nereus.control.fallback``, issue 19): Eq. 2 between the restart and that move in place."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.control.admission import Decision, Option, Profit, Rule, Verdict
from nereus.control.controller import Controller
from nereus.control.fallback import LABEL, held_layouts, in_place_instead
from nereus.control.options import Options
from nereus.control.policy import ControllerConfig
from nereus.control.telemetry import Telemetry
from nereus.control.transition_cost import TransitionEstimate
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import search
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

PAYBACK = Rule(Profit.PAYBACK, 0.5)


@pytest.fixture(scope="module")
def plans() -> tuple[PlanningProblem, Plan, Plan]:
    """The 8B PPO problem on 32 GPUs, its best plan, and the best plan on 16 of them."""
    wide = make_problem(gpus=32, response=1024)
    narrow = make_problem(gpus=16, response=1024)
    return wide, search(wide).plan, search(narrow).plan


def _restart(plan: Plan, seconds: float = 192.0, latency: float = 120.0, risk: float = 0.0) -> Decision:
    return dataclasses.replace(
        Decision(29, 0.0, (), False, Verdict.RESTART, "", 426.0),
        target=plan, target_label="reserved", target_latency_s=latency, l_tran_s=seconds, target_risk_s=risk,
    )  # fmt: skip


def _moved(seconds: float, feasible: bool = True) -> TransitionEstimate:
    return TransitionEstimate(seconds if feasible else 0.0, 0.0, feasible, "" if feasible else "no room")


Plans = tuple[PlanningProblem, Plan, Plan]


def test_the_move_in_place_goes_when_it_costs_less_over_the_horizon(plans: Plans) -> None:
    _, best, _ = plans
    restart = _restart(best)  # 192 s + 14 × 120 s = 1,872 s
    assert in_place_instead(PAYBACK, restart, Option(LABEL, best, 125.0), _moved(30.0), 426.0, 14.0)
    why = in_place_instead(PAYBACK, restart, Option(LABEL, best, 130.0), _moved(30.0), 426.0, 14.0)
    assert why is not None and "1850 s against 1872 s" in why and "payback" in why  # 30 + 14 × 130
    assert in_place_instead(PAYBACK, restart, Option(LABEL, best, 135.0), _moved(30.0), 426.0, 14.0) is None
    refused = _moved(0.0, False)
    assert in_place_instead(PAYBACK, restart, Option(LABEL, best, 125.0), refused, 426.0, 14.0) is None
    # the restart's target risks restarts of its own: counted in its cost
    risky = _restart(best, risk=10.0)  # 192 + 14 × 130 = 2,012 s
    assert in_place_instead(PAYBACK, risky, Option(LABEL, best, 135.0), _moved(30.0), 426.0, 14.0)
    # ... and so are the held plan's
    exposed = Option(LABEL, best, 125.0, 10.0)
    assert in_place_instead(PAYBACK, restart, exposed, _moved(30.0), 426.0, 14.0) is None


def test_the_move_in_place_still_has_to_pay_back(plans: Plans) -> None:
    _, best, _ = plans
    restart = _restart(best, seconds=400.0, latency=90.0)  # 400 + 2 × 90 = 580 s
    held = Option(LABEL, best, 100.0)  # 150 + 2 × 100 = 350 s: cheaper than the restart
    assert in_place_instead(PAYBACK, restart, held, _moved(150.0), 110.0, 2.0) is None  # payback 15 > γ·H = 1
    assert in_place_instead(PAYBACK, restart, held, _moved(150.0), 90.0, 2.0) is None  # no gain at all
    assert in_place_instead(Rule(Profit.ANY_GAIN), restart, held, _moved(150.0), 110.0, 2.0) is not None


def test_the_held_plan_keeps_every_layout_and_follows_the_pool(plans: Plans) -> None:
    wide, _, running = plans

    def planner(p: PlanningProblem, label: str) -> Option | None:
        result = search(p)
        return Option(label, result.plan, result.step_latency_s)

    held = held_layouts(running, [wide], planner)
    assert held is not None and held.label == LABEL
    assert all(held.plan.candidate(c.model_stage).layout == c.layout for c in running.candidates)
    assert sum(c.num_gpus for c in held.plan.candidates) > sum(c.num_gpus for c in running.candidates)
    narrow = make_problem(gpus=16, response=1024)
    assert held_layouts(running, [narrow], planner) is None  # on its own pool: the running plan itself


class _OnlyDpMoves:
    """A transition estimator under which only moves that keep every layout fit in memory."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.asked = seconds, 0

    def estimate(self, problem, current, target, lost=frozenset(), skip=frozenset(), sunk=False):  # type: ignore[no-untyped-def]
        self.asked += 1
        same = all(target.candidate(c.model_stage).layout == c.layout for c in current.candidates)
        return _moved(self.seconds, same)

    def observe(self, estimate: TransitionEstimate, measured_s: float) -> None:
        pass

    def seed(self, fixed: object) -> None:
        pass

    def built(self, plan: object) -> None:
        pass


def _grow(ctl: Controller, running: Plan, wide: PlanningProblem, quiet: int = 40) -> Decision | None:
    """``quiet`` steps on the running plan's pool since it last changed (a pool horizon of that
    many steps), then the pool grows."""
    ctl.monitor.pool_horizon.crossed(0)
    for step in range(quiet):
        assert ctl.observe(Telemetry(step, 100.0 * step, 1024.0, 1024.0, running.pool)) is None
    return ctl.observe(Telemetry(quiet, 100.0 * quiet, 1024.0, 1024.0, wide.pool))


def test_a_growing_pool_moves_in_place_where_every_option_was_refused(plans: Plans) -> None:
    """16 → 32 GPUs: the planner's target re-lays out the trainers and cannot move (the
    estimator refuses any new layout), and the held layouts are outside the 0% fallback
    tolerance. A restart would pay back; the DP-only move costs less over the horizon and goes."""
    wide, best, running = plans
    assert any(best.candidate(c.model_stage).layout != c.layout for c in running.candidates)  # refused
    config = ControllerConfig(fallback_tolerance=0.0)
    ctl = Controller(wide.workload, wide.models, wide.cluster, running, config, estimator=_OnlyDpMoves(20.0))
    decision = _grow(ctl, running, wide)
    assert decision is not None and not decision.urgent
    assert decision.verdict is Verdict.ADMIT and decision.target_label == LABEL, decision.reason
    assert "instead of a restart" in decision.reason and decision.l_tran_s == 20.0
    assert decision.target is not None
    assert all(decision.target.candidate(c.model_stage).layout == c.layout for c in running.candidates)
    # a move in place that costs more than the restart over the horizon: the restart goes
    slow = Controller(wide.workload, wide.models, wide.cluster, running, config, estimator=_OnlyDpMoves(1e6))
    decision = _grow(slow, running, wide)
    assert decision is not None and decision.verdict is Verdict.RESTART, decision.reason


@pytest.mark.parametrize(("tolerance", "relaunch"), [(-0.1, 120.0), (0.1, -1.0), (float("nan"), 120.0)])
def test_an_option_search_refuses_a_negative_tolerance_or_relaunch(tolerance: float, relaunch: float) -> None:
    problem = make_problem(gpus=8)
    with pytest.raises(ValueError, match="tolerance and relaunch_s"):
        Options(search, problem.cluster, None, relaunch, tolerance)


def test_the_option_search_offers_the_held_layouts_beside_the_target(
    plans: tuple[PlanningProblem, Plan, Plan],
) -> None:
    """``Options.around`` from a running plan: S* first, then options within the tolerance."""
    problem, _, running = plans  # the 16-GPU plan, now on 32 GPUs
    options = Options(search, problem.cluster, None, 120.0, 10.0).around(problem, running)
    held = {c.model_stage: c.layout for c in running.candidates}
    expected = Options(search, problem.cluster, None, 120.0, 10.0).plan(problem.holding(held), LABEL)
    assert expected is not None and expected.plan != options[0].plan
    assert [o for o in options if o.label == LABEL] == [expected]
    latencies = [o.step_latency_s for o in options[1:]]
    assert latencies == sorted(latencies)
    assert all(o.step_latency_s <= options[0].step_latency_s * 11.0 for o in options)
    assert len({o.plan.candidates for o in options}) == len(options)
