"""Where a replan looks: the options it weighs, each priced with what it risks.

A replan does not only ask the planner for S*, the fastest plan. Its ``Options`` are S* and, beside
it, plans a little slower whose transitions are cheaper or safer:

* ``reserved``: the trainers' layouts shrunk until a copy of each fits the reserved GPUs
  (``nereus.control.reserved``), first where its expected step time beats S*'s;
* ``floor``: the best plan on the reserved GPUs alone, where S* risks losing work — nothing on
  it is ever revoked, which pays while the pool is unsettled (right after it changed); first
  likewise where its expected step beats the first option's;
* ``hold-layouts``: the running layouts with only DP and GPUs changed, and
  ``relayout:<stage>``: one stage re-laid-out, the others' layouts kept — those two only within
  ``fallback_tolerance`` of S*'s latency.

Every option is priced where its GPUs put it (``nereus.plan.evaluate.placed_latency``), as the
running plan is: the search prices each model-stage as if it had the pool to itself, and on a
fragmented pool placement can leave a TP group across nodes that price never crossed (a move
priced at 32 s per step ran at 51 s). Where that leaves S* slower than another option, the
tolerance is measured from the fastest, and the option expected fastest (its risk included)
leads.

Every option carries its expected seconds lost per step (``nereus.control.risk``): the work of
steps that lose a GPU, and the restart when a trainer loses its last replica. ``since_s`` (the
seconds since the pool last changed, where the controller knows it) sets how unsettled the pool
is.

Pure: the planner is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from nereus.control.admission import Option
from nereus.control.fallback import held_layouts
from nereus.control.reserved import reserved_option
from nereus.control.risk import last_copy_loss, lost_work, restart_seconds
from nereus.errors import InfeasibleError
from nereus.plan.evaluate import placed_latency, price, shapes_of
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
    since_s: float | None = None  # seconds since the pool last changed (None: unknown, mean rate)
    offer_floor: bool = True  # offer the reserved floor (a policy whose DP follows the pool does not)

    def __post_init__(self) -> None:
        if not (self.tolerance >= 0 and self.relaunch_s >= 0):
            raise ValueError(f"tolerance and relaunch_s must be ≥ 0, got {self.tolerance}, {self.relaunch_s}")
        if self.since_s is not None and not self.since_s >= 0:
            raise ValueError(f"since_s must be ≥ 0 or None, got {self.since_s}")

    def at(self, since_s: float | None) -> Options:
        """These options priced ``since_s`` seconds after the pool last changed."""
        return self if since_s == self.since_s else replace(self, since_s=since_s)

    def around(self, problem: PlanningProblem, running: Plan, label: str = "target") -> list[Option]:
        """S*, then the slightly slower plans whose transitions from ``running`` are cheaper:
        S* (or the reserved option where it is expected faster) first, the rest by latency. Each
        is priced where its GPUs put it (``plan.evaluate.placed_latency``); where that leaves S*
        slower than another option (a fragmented pool), the tolerance is measured from the
        fastest and the option expected fastest (its risk included) leads."""
        best = self.plan(problem, label)
        if best is None:
            return []
        options = [best]
        for safe in (reserved_option(problem, best, self.domains, self.plan), self.floor(problem, best)):
            if safe is not None:  # kept safe: first where it is expected faster
                options = [safe, *options] if safe.expected_s < options[0].expected_s else [*options, safe]
        current = {c.model_stage: c.layout for c in running.candidates}
        holds: list[tuple[str, dict[str, Layout]]] = [("hold-layouts", dict(current))]
        for stage in running.workflow.stages:
            keep = {n: lay for n, lay in current.items() if running.workflow.get(n).stage is not stage}
            holds.append((f"relayout:{stage.value}", keep))
        held: list[Option] = []
        for name, layouts in holds:
            option = self.plan(problem.holding(layouts), name)  # a policy's own holds win
            seen = (o.plan.candidates for o in options + held)
            if option is not None and all(option.plan.candidates != c for c in seen):
                held.append(option)
        # within the tolerance of the fastest: S* but where placement leaves it slower than a plan
        # the search ranked behind it (a fragmented pool)
        fastest = min(o.step_latency_s for o in (best, *held))
        options += [o for o in held if o.step_latency_s <= fastest * (1.0 + self.tolerance)]
        ranked = [options[0], *sorted(options[1:], key=lambda o: o.step_latency_s)]
        if ranked[0] is best and fastest < best.step_latency_s:
            lead = min(ranked, key=lambda o: o.expected_s)  # as the safe options are put first
            ranked.remove(lead)
            ranked.insert(0, lead)
        return ranked

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
        latency = placed_latency(problem, result.plan, result.step_latency_s)  # what it runs at
        return Option(label, result.plan, latency, self.risk(result.plan, latency, problem))

    def floor(self, problem: PlanningProblem, best: Option) -> Option | None:
        """The best plan on the pool's reserved GPUs alone (labelled "floor") where ``best``
        risks losing work and the pool has both kinds; None otherwise or if nothing fits."""
        if not self.offer_floor or self.domains is None or best.risk_s <= 0:
            return None
        reserved = tuple(g for g in problem.pool if g in self.domains.reserved)
        if not reserved or len(reserved) == len(problem.pool):
            return None
        return self.plan(replace(problem, pool=reserved), "floor")

    def risk(self, plan: Plan, step_s: float, problem: PlanningProblem) -> float:
        """Expected seconds lost per step: the work of a step that loses a GPU, and a restart
        when a trainer loses every replica (``nereus.control.risk``)."""
        if self.domains is None or not self.domains.at_risk:
            return 0.0
        lost = lost_work(plan, self.domains, step_s, self.since_s)
        p = last_copy_loss(plan, self.domains, step_s, self.since_s)
        return lost + (p * self.restart_seconds(plan, problem) if p > 0 else 0.0)

    def restart_seconds(self, plan: Plan, problem: PlanningProblem) -> float:
        """What restarting ``plan`` from its checkpoint costs: relaunch and state read."""
        state = price(problem, shapes_of(plan)).checkpoint
        return restart_seconds(plan, state, self.cluster, self.relaunch_s)
