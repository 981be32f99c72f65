"""The plan whose trainers keep a copy on reserved GPUs: an option the planner's target is not.

The planner's search minimises step latency and knows nothing of revocations; placement then puts
one replica of every trainer on the reserved GPUs when one fits there (``nereus.plan.placement``),
and admission prices the restart a plan still risks (``nereus.control.risk``). So when the fastest
plan's trainer replicas are too large for the reserved GPUs — 8 reserved GPUs cannot hold a
16-GPU replica — nothing ever proposes the slightly slower plan that would keep a copy safe, and
the job restarts from its checkpoint whenever a revocation takes the last copy (issue 19).

``fitting_layouts`` shrinks the target's trainer layouts until one replica of each fits the
reserved GPUs of the pool together: the largest replica first, its pipeline halved before its
tensor parallelism (TP stays inside a node). The controller plans with those layouts held and
offers the result beside the target (``Options.around``); where its expected step time
(latency plus restart risk) beats the target's it goes first. A necessary condition only: whether
a replica lands on reserved GPUs is placement's to say, and the option's risk reads where it did.

Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from nereus.control.admission import Option
from nereus.plan.layout import Layout, Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.domains import FailureDomains
from nereus.spec.workload import Stage

Planner = Callable[[PlanningProblem, str], Option | None]  # a labelled search (``Options.plan``)


def fitting_layouts(plan: Plan, pool: Iterable[int], domains: FailureDomains) -> dict[str, Layout] | None:
    """``plan``'s trainer layouts shrunk until one replica of every trainer fits, together, in
    the reserved GPUs of ``pool``; None where they already fit (placement has what it needs) or
    where they cannot (fewer reserved GPUs than trainers)."""
    trainers = {c.model_stage: c.layout for c in plan.candidates if plan.stage_of(c) is Stage.TRAIN and c.dp}
    reserved = len(domains.reserved & frozenset(pool))
    if not trainers or reserved < len(trainers) or sum(x.size for x in trainers.values()) <= reserved:
        return None
    out = dict(trainers)
    while sum(x.size for x in out.values()) > reserved:
        name = max(sorted(out), key=lambda n: out[n].size)
        lay = out[name]
        out[name] = Layout(lay.tp, lay.pp // 2) if lay.pp > 1 else Layout(lay.tp // 2, lay.pp)
    return out


def reserved_option(
    problem: PlanningProblem, best: Option, domains: FailureDomains | None, plan: Planner
) -> Option | None:
    """Where ``best`` (the target) risks a restart: the best plan (``plan``, labelled "reserved")
    with the trainer layouts that let one replica of each sit on the reserved GPUs held, or None
    (no risk, nothing to shrink, nothing fits, or the same plan)."""
    if best.risk_s <= 0 or domains is None:
        return None
    holds = fitting_layouts(best.plan, problem.pool, domains)
    if holds is None:
        return None
    option = plan(problem.holding(holds), "reserved")  # a policy's own holds win
    return option if option is not None and option.plan.candidates != best.plan.candidates else None
