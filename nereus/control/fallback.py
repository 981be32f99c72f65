"""The in-place alternative to a checkpoint restart (issue 19).

An opportunistic replan considers a restart (``admission.restart_instead``) when none of its
options can move in place. Those options are the planner's target and plans at most
``fallback_tolerance`` slower, so the running layouts with only DP and GPUs changed — what the
static policy does when its pool grows: Extends onto the new GPUs, Destroys of the surplus — are
left out whenever they are slower than that. A restart costs minutes (relaunch, checkpoint read)
where such a move costs seconds. So before a restart the controller prices that plan too, at any
latency, and weighs the two by Eq. 2: the restart onto the best option goes ahead only when its
seconds plus H steps of that plan cost no more than the move in place plus H steps of the held
plan; otherwise the held plan is admitted, under the policy's own rule against the running plan
(which a held plan at least as slow as the restart's target passes whenever the restart did).

Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nereus.control.admission import Decision, Option, Rule
from nereus.control.transition_cost import TransitionEstimate
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem

Planner = Callable[[PlanningProblem, str], Option | None]  # a labelled search (``Options.plan``)
LABEL = "hold-layouts"


def held_layouts(plan: Plan, problems: Iterable[PlanningProblem], planner: Planner) -> Option | None:
    """The fastest plan (by expected step time) that keeps every layout of ``plan`` and changes
    only DP and GPUs, over ``problems`` (the replan's, and the wider space's where the running
    plan came from it); None where none fits or the only one is ``plan`` itself."""
    layouts = {c.model_stage: c.layout for c in plan.candidates}
    best: Option | None = None
    for problem in problems:
        option = planner(problem.holding(layouts), LABEL)  # a policy's own holds win
        if option is None or option.plan.candidates == plan.candidates:
            continue
        if best is None or option.expected_s < best.expected_s:
            best = option
    return best


def in_place_instead(
    rule: Rule, restart: Decision, held: Option, est: TransitionEstimate, expected_s: float, horizon: float
) -> str | None:
    """Why ``held``, moved to in place along ``est``, is admitted instead of ``restart`` (a
    restart decision), or None: it costs less over the ``horizon`` (L_tran + H·L, each L with the
    restart it risks) and pays back under ``rule`` against the running plan's ``expected_s``."""
    if not est.feasible or restart.l_tran_s is None or restart.target_latency_s is None:
        return None
    restart_cost = restart.l_tran_s + horizon * (restart.target_latency_s + restart.target_risk_s)
    move_cost = est.seconds + horizon * held.expected_s
    if move_cost >= restart_cost:
        return None
    ok, why = rule.pays_back(expected_s - held.expected_s, est.seconds, horizon)
    if not ok:
        return None
    return (
        f"{held.label}: in place instead of a restart onto {restart.target_label} "
        f"({move_cost:.4g} s against {restart_cost:.4g} s over H = {horizon:.3g} steps); {why}"
    )
