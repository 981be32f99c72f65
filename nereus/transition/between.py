"""From two plans to a transition: the moves of every model-stage, the global DAG, L_tran.

``plan_transition(problem, current, target, lost)`` is what admission calls before anything
moves: it builds each model-stage's ``StageMove`` (intact units of the current plan, units of
the target), the global DAG under the problem's per-GPU memory (capacity after headroom, minus
the runtime reserve), and schedules it (the better of two list-scheduling priorities);
``l_tran_s`` is the schedule's makespan. ``with_staging`` counts the zero-copy staging in the
ledger and, where the default batches do not fit a GPU, picks smaller ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import STAGE_ORDER
from nereus.state.buffers import StatePolicy
from nereus.state.sources import STORAGE, state_source
from nereus.transition.build import _Locals
from nereus.transition.choose import SLACK, plan_dag
from nereus.transition.classplan import ClassPlan, plan_classes
from nereus.transition.dag import TransitionDag
from nereus.transition.links import link_model
from nereus.transition.move import StageMove
from nereus.transition.schedule import Schedule
from nereus.transition.wire import STAGING_BUDGET, WirePlan, staging_bytes

# Staging batch sizes ``with_staging`` tries, largest first: where the default's staging does not
# fit a GPU beside its state, smaller batches (more of them, the same bytes) may. A chunk larger
# than the budget still has a batch of its own, so below some size nothing more is saved.
STAGING_BUDGETS = tuple(STAGING_BUDGET >> k for k in range(5))  # 256 MiB down to 16 MiB
ROOMY = "per-unit (room for staging)"  # the path of a DAG ``fit_staging`` planned again


@dataclass(frozen=True, slots=True)
class Transition:
    """The per-unit DAG a transition runs and its schedule; ``path``: how it was planned
    ("per-unit", or "class" when a class plan was laid onto it, see ``classplan.py``);
    ``staging_budget``: the staging bytes per peer a batch of its zero-copy rounds may hold, which
    every rank's ``Executor`` uses (``with_staging`` sets it where the default does not fit)."""

    dag: TransitionDag
    schedule: Schedule | None  # None when the DAG is infeasible
    moves: tuple[StageMove, ...]
    path: str = "per-unit"
    staging_budget: int = STAGING_BUDGET

    def __post_init__(self) -> None:
        if isinstance(self.staging_budget, bool) or self.staging_budget <= 0:
            raise ValueError(f"staging_budget must be a positive byte count, got {self.staging_budget!r}")

    @property
    def feasible(self) -> bool:
        return self.dag.feasible

    @property
    def l_tran_s(self) -> float:
        return self.schedule.makespan if self.schedule else float("inf")

    @property
    def moved_bytes(self) -> int:
        return sum(n.bytes for n in self.dag.nodes)

    @property
    def peak_max(self) -> int:
        """The largest per-GPU state + staging bytes any execution holds."""
        return max(self.dag.peak.values(), default=0)

    def gpu_done(self) -> dict[int, float]:
        """When each GPU is done: its last node's finish."""
        done: dict[int, float] = {}
        if self.schedule is not None:
            for node, end in zip(self.dag.nodes, self.schedule.finish, strict=True):
                for g in node.gpus:
                    done[g] = max(done.get(g, 0.0), end)
        return done

    @property
    def changed(self) -> tuple[str, ...]:
        """Model-stages whose units change."""
        return tuple(m.name for m in self.moves if not m.unchanged)

    @property
    def resharded(self) -> tuple[str, ...]:
        """Model-stages whose (tp, pp) changes."""
        return tuple(m.name for m in self.moves if m.current_layout != m.target_layout)


class Priced:
    """What admission prices: a class plan (``classplan.py``) whose per-unit ``transition`` is
    built on first use, when the transition runs, or an exact per-unit ``Transition``. Not a
    frozen value for that reason; nothing but ``transition`` changes it, once."""

    __slots__ = ("_expand", "_transition", "classes")

    def __init__(
        self,
        transition: Transition | None,
        classes: ClassPlan | None = None,
        expand: Callable[[], Transition] | None = None,
    ) -> None:
        if transition is None and (classes is None or expand is None):
            raise ValueError("a priced transition needs its DAG, or a class plan and a way to expand it")
        self._transition, self.classes, self._expand = transition, classes, expand

    @property
    def transition(self) -> Transition:
        """The per-unit DAG and schedule (built from the class plan on first use)."""
        if self._transition is None:
            assert self._expand is not None
            self._transition = self._expand()
        return self._transition

    @property
    def expanded(self) -> bool:
        return self._transition is not None

    @property
    def checked(self) -> bool:
        """A class plan whose per-unit DAG has had its staging counted (``with_staging``)."""
        return self.classes is not None and self._expand is None

    @property
    def path(self) -> str:
        """What was priced: "class" or "per-unit"."""
        return "class" if self.classes is not None else "per-unit"

    @property
    def _plan(self) -> ClassPlan | None:
        return self.classes if self._transition is None else None

    @property
    def feasible(self) -> bool:
        return True if self._plan is not None else self.transition.feasible

    @property
    def l_tran_s(self) -> float:
        """The priced makespan (the class plan's: its expansion runs exactly this long)."""
        return self.classes.makespan if self.classes is not None else self.transition.l_tran_s

    @property
    def moved_bytes(self) -> int:
        plan = self._plan
        return plan.moved_bytes if plan is not None else self.transition.moved_bytes

    @property
    def peak_max(self) -> int:
        plan = self._plan
        return plan.peak_max if plan is not None else self.transition.peak_max

    def gpu_done(self) -> dict[int, float]:
        """When each GPU is done (a class plan: when the last class on it ends, an upper bound)."""
        plan = self._plan
        return plan.gpu_done() if plan is not None else self.transition.gpu_done()

    @property
    def changed(self) -> tuple[str, ...]:
        plan = self._plan
        return plan.derived.changed if plan is not None else self.transition.changed

    @property
    def resharded(self) -> tuple[str, ...]:
        plan = self._plan
        return plan.derived.resharded if plan is not None else self.transition.resharded


class NoSourceError(ValueError):
    """A model-stage has no intact unit and nothing to restore it from (checkpoint and restart)."""


def stage_moves(
    problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset()
) -> tuple[StageMove, ...]:
    """Every model-stage's move, in workflow order."""
    moves = []
    for ms in target.workflow.model_stages:
        old, new = current.candidate(ms.name), target.candidate(ms.name)
        # the replicas' GPU lists straight from the candidates: ``intact_units`` and ``replicas``
        # would build EMUs that ``StageMove.between`` builds again under their DAG names
        intact = [gpus for gpus in map(old.replica_gpus, range(old.dp)) if not lost or lost.isdisjoint(gpus)]
        restore_from = ""
        restore_gpus: tuple[int, ...] = ()
        if not intact:
            src = state_source(current, ms.name, lost)
            if src is None:
                trainer = current.workflow.sync_source(ms.name)
                also = f" and neither has its weight-sync source {trainer}" if trainer else ""
                raise NoSourceError(f"{ms.name} has no intact replica{also} (checkpoint and restart)")
            if isinstance(src, str):
                restore_from = STORAGE
            else:
                restore_from = src.model_stage
                restore_gpus = tuple(g for g in src.gpus if g not in lost)
        moves.append(
            StageMove.between(
                ms.name,
                problem.model_of(ms),
                StatePolicy.of(ms.stage, problem.workload.precision),
                old.layout,
                intact,
                new.layout,
                [new.replica_gpus(r) for r in range(new.dp)],
                restore_from,
                restore_gpus,
            )
        )
    return tuple(moves)


def ledger_capacity(problem: PlanningProblem) -> int:
    """Per-GPU bytes state and staging may use during a transition."""
    return int(problem.capacity_bytes - problem.reserved_bytes)


def with_staging(tr: Transition, capacity: int, budgets: Sequence[int] = STAGING_BUDGETS) -> Transition:
    """``tr`` with its staging counted in the ledger: each GPU's peak is its state's (the DAG's
    bound) plus the bytes its zero-copy staging pool grows to (``wire.staging_bytes``; the pool is
    kept until the transition ends, so it is added whole). A GPU over its capacity (the DAG's,
    else ``capacity``: per-GPU bytes for state and staging, ``ledger_capacity``) rules out a batch
    size; the first of ``budgets`` (largest first) under which every GPU fits is the transition's
    ``staging_budget``, and where none fits the transition is infeasible and the reason names the
    GPU (at the smallest batches)."""
    dag = tr.dag
    if not dag.feasible:
        return tr
    if not budgets or any(b <= 0 for b in budgets):
        raise ValueError(f"staging budgets must be positive byte counts, got {list(budgets)}")
    wire = WirePlan(dag, tr.moves)  # what moves, for every budget
    for budget in budgets:
        staging = staging_bytes(dag, tr.moves, budget, wire)
        if not staging:
            return tr  # nothing stages, in batches of any size
        peak = {g: b + staging.get(g, 0) for g, b in dag.peak.items()}
        peak.update({g: b for g, b in staging.items() if g not in peak})
        cap = {g: dag.capacity.get(g, capacity) for g in peak}
        over = sorted((g for g in peak if peak[g] > cap[g]), key=lambda g: (cap[g] - peak[g], g))
        if not over:
            return replace(tr, dag=replace(dag, peak=peak), staging_budget=budget)
    g = over[0]
    reason = (
        f"GPU {g} needs {peak[g]} bytes for state and staging ({staging.get(g, 0)} of them staging, in "
        f"batches of at most {budget >> 20} MiB a peer), {peak[g] - cap[g]} more than the {cap[g]} it has"
    )
    return replace(tr, dag=replace(dag, peak=peak, feasible=False, reason=reason), staging_budget=budget)


def fit_staging(problem: PlanningProblem, tr: Transition) -> Transition:
    """``with_staging`` on the problem's ledger capacity; where no batch size fits, the DAG is
    planned again under each GPU's capacity less what it stages in the smallest batches — more
    serial, so its state peaks lower and leave room for the staging — and counted again against
    the real capacity. The first feasible of the two, else the first's refusal."""
    capacity = ledger_capacity(problem)
    out = with_staging(tr, capacity)
    if out.feasible or not tr.feasible:
        return out
    staging = staging_bytes(tr.dag, tr.moves, STAGING_BUDGETS[-1])
    caps = {g: tr.dag.capacity.get(g, capacity) for g in set(tr.dag.capacity) | set(staging)}
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in problem.workflow.model_stages}
    links = link_model(problem.cluster, problem.efficiencies)
    dag, schedule = plan_dag(tr.moves, rank, links, {g: c - staging.get(g, 0) for g, c in caps.items()})
    if not dag.feasible:
        return out
    roomy = Transition(replace(dag, capacity=caps), schedule, tr.moves, ROOMY)
    again = with_staging(roomy, capacity)
    return again if again.feasible else out


def plan_transition(
    problem: PlanningProblem,
    current: Plan,
    target: Plan,
    lost: frozenset[int] = frozenset(),
    skip: frozenset[str] = frozenset(),
    grouped: bool | None = False,
    direct: bool = True,
) -> Transition:
    """The global DAG from ``current`` to ``target`` and its schedule (raises NoSourceError).
    ``skip``: model-stages left out (weight copies a weight sync rebuilds afterwards);
    ``grouped``: None plans on replica classes where that applies (``classplan.py``, laid onto
    the per-unit DAG) and else groups per-unit nodes where that applies (``group.py``); True
    groups wherever memory allows; False (the default, what the goldens pin) is the exact
    per-unit greedy; ``direct``: whether it also plans re-layouts straight from one replica
    (``choose.plan_dag``; the class and group plans do not). Admission prices with
    ``price_transition`` instead, which leaves the per-unit DAG of a class plan unbuilt until
    the transition runs."""
    if grouped is None:
        priced = _classes(problem, current, target, lost, skip)
        if priced is not None:
            return priced.transition
    moves = tuple(m for m in stage_moves(problem, current, target, lost) if m.name not in skip)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    links = link_model(problem.cluster, problem.efficiencies)
    dag, schedule = plan_dag(moves, rank, links, ledger_capacity(problem), grouped, direct)
    return Transition(dag, schedule, moves)


def price_transition(
    problem: PlanningProblem,
    current: Plan,
    target: Plan,
    lost: frozenset[int] = frozenset(),
    skip: frozenset[str] = frozenset(),
) -> Priced:
    """What admission needs to decide: the class plan where it applies (no per-unit node is made
    until ``Priced.transition`` is read), else the exact per-unit plan (raises NoSourceError).
    A class plan more than ``SLACK`` above its lower bound is priced per unit too and the shorter
    kept, so what is priced is within ``SLACK`` of the bound or no longer than the per-unit plan."""
    priced = _classes(problem, current, target, lost, skip)
    return priced if priced is not None else Priced(plan_transition(problem, current, target, lost, skip))


def _classes(
    problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int], skip: frozenset[str]
) -> Priced | None:
    if lost:
        return None  # intact replicas only: the per-unit planner's business
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    links = link_model(problem.cluster, problem.efficiencies)
    plan = plan_classes(problem, current, target, links, ledger_capacity(problem), rank, skip)
    if plan is None:
        return None
    if plan.makespan > (1.0 + SLACK) * plan.floor:
        # members of a class start together: where that leaves the plan this far above the bound
        # of either variant's per-unit DAG, the per-unit greedy may find shorter (within SLACK of
        # it, no plan can be much)
        exact = plan_transition(problem, current, target, lost, skip)
        if exact.feasible and exact.l_tran_s < plan.makespan - 1e-12:
            return Priced(exact)
    return Priced(None, plan, lambda: _expand(problem, current, target, skip, plan))


def _expand(
    problem: PlanningProblem, current: Plan, target: Plan, skip: frozenset[str], plan: ClassPlan
) -> Transition:
    """The per-unit DAG with the class schedule laid onto it; the exact per-unit plan (and why)
    where its groups are not the classes."""
    from nereus.transition.class_ledger import expand_ledgered
    from nereus.transition.group import expand_onto

    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    links = link_model(problem.cluster, problem.efficiencies)
    moves = tuple(m for m in stage_moves(problem, current, target) if m.name not in skip)
    loc = _Locals(moves, links, ledger_capacity(problem), direct=plan.direct)
    if plan.ledger is None:
        out = expand_onto(
            loc.nodes, loc.edges, loc.units, loc.init, loc.cap, plan.signatures(), plan.schedule
        )
    else:
        sigs = plan.signatures()
        out = expand_ledgered(
            loc.nodes, loc.edges, loc.units, loc.cap, sigs, plan.schedule, plan.derived, plan.ledger
        )
    if out is not None:
        return Transition(out[0], out[1], moves, "class")
    dag, schedule = plan_dag(moves, rank, links, ledger_capacity(problem))
    return Transition(dag, schedule, moves, "per-unit (the groups are not the classes)")
