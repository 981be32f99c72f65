"""Where a replan looks: the options it weighs, each priced with the restart it risks.

A replan does not only ask the planner for S*, the fastest plan. Its ``Options`` are S* and, beside
it, plans a little slower whose transitions are cheaper or safer:

* ``reserved``: the trainers' layouts shrunk until a copy of each fits the reserved GPUs
  (``nereus.control.reserved``), first where its expected step time beats S*'s;
* ``hold-layouts``: the running layouts with only DP and GPUs changed;
* ``relayout:<stage>``: one stage re-laid-out, the others' layouts kept;

those last two only within ``fallback_tolerance`` of S*'s latency. Every option carries its
expected restart seconds per step (``nereus.control.risk``): the probability that a trainer loses
its last replica within a step, times the restart's seconds.

Pure: the planner is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nereus.control.admission import Option
from nereus.control.fallback import held_layouts
from nereus.control.reserved import reserved_option
from nereus.control.risk import last_copy_loss, restart_seconds
from nereus.errors import InfeasibleError
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Layout, Plan
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import SearchResult
from nereus.spec.cluster import ClusterSpec
from nereus.spec.domains import FailureDomains

Planner = Callable[[PlanningProblem], SearchResult]


@dataclass(frozen=True, slots=True)
class Options:
    """The option search of one job: its planner, failure domains and restart price."""

    planner: Planner
    cluster: ClusterSpec
    domains: FailureDomains | None  # None: no GPU is revocable, no plan risks a restart
    relaunch_s: float  # a restart's relaunch seconds (reading the checkpoint comes on top)
    tolerance: float  # how much slower than S* a cheaper-to-reach option may be

    def __post_init__(self) -> None:
        if not (self.tolerance >= 0 and self.relaunch_s >= 0):
            raise ValueError(f"tolerance and relaunch_s must be ≥ 0, got {self.tolerance}, {self.relaunch_s}")

    def around(self, problem: PlanningProblem, running: Plan, label: str = "target") -> list[Option]:
        """S*, then the slightly slower plans whose transitions from ``running`` are cheaper:
        S* (or the reserved option where it is expected faster) first, the rest by latency."""
        best = self.plan(problem, label)
        if best is None:
            return []
        options = [best]
        safe = reserved_option(problem, best, self.domains, self.plan)
        if safe is not None:  # a copy of every trainer kept safe: first where it is expected faster
            options = [safe, best] if safe.expected_s < best.expected_s else [best, safe]
        current = {c.model_stage: c.layout for c in running.candidates}
        holds: list[tuple[str, dict[str, Layout]]] = [("hold-layouts", dict(current))]
        for stage in running.workflow.stages:
            keep = {n: lay for n, lay in current.items() if running.workflow.get(n).stage is not stage}
            holds.append((f"relayout:{stage.value}", keep))
        limit = best.step_latency_s * (1.0 + self.tolerance)
        for name, layouts in holds:
            option = self.plan(problem.holding(layouts), name)  # a policy's own holds win
            fresh = option is not None and all(option.plan.candidates != o.plan.candidates for o in options)
            if fresh and option is not None and option.step_latency_s <= limit:
                options.append(option)
        return [options[0], *sorted(options[1:], key=lambda o: o.step_latency_s)]

    def held(self, running: Plan, problems: list[PlanningProblem]) -> Option | None:
        """``running``'s layouts with only DP and GPUs changed, at any latency, over
        ``problems`` (``nereus.control.fallback``)."""
        return held_layouts(running, problems, self.plan)

    def plan(self, problem: PlanningProblem, label: str) -> Option | None:
        """The planner's plan for ``problem`` as an option labelled ``label``; None if none fits."""
        try:
            result = self.planner(problem)
        except InfeasibleError:
            return None
        latency = result.step_latency_s
        return Option(label, result.plan, latency, self.risk(result.plan, latency, problem))

    def risk(self, plan: Plan, step_s: float, problem: PlanningProblem) -> float:
        """Expected restart seconds per step: a trainer losing every replica within a step."""
        if self.domains is None or not self.domains.at_risk:
            return 0.0
        p = last_copy_loss(plan, self.domains, step_s)
        return p * self.restart_seconds(plan, problem) if p > 0 else 0.0

    def restart_seconds(self, plan: Plan, problem: PlanningProblem) -> float:
        """What restarting ``plan`` from its checkpoint costs: relaunch and state read."""
        state = price(problem, shapes_of(plan)).checkpoint
        return restart_seconds(plan, state, self.cluster, self.relaunch_s)
