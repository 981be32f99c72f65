"""From two plans to a transition: the moves of every model-stage, the global DAG, L_tran.

``plan_transition(problem, current, target, lost)`` is what admission calls before anything
moves: it builds each model-stage's ``StageMove`` (intact units of the current plan, units of
the target), the global DAG under the problem's per-GPU memory (capacity after headroom, minus
the runtime reserve), and schedules it (the better of two list-scheduling priorities);
``l_tran_s`` is the schedule's makespan.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import STAGE_ORDER
from nereus.state.buffers import StatePolicy
from nereus.state.sources import STORAGE, state_source
from nereus.transition.build import plan_dag
from nereus.transition.dag import TransitionDag
from nereus.transition.links import LinkModel
from nereus.transition.move import StageMove
from nereus.transition.schedule import Schedule


@dataclass(frozen=True, slots=True)
class Transition:
    dag: TransitionDag
    schedule: Schedule | None  # None when the DAG is infeasible
    moves: tuple[StageMove, ...]

    @property
    def feasible(self) -> bool:
        return self.dag.feasible

    @property
    def l_tran_s(self) -> float:
        return self.schedule.makespan if self.schedule else float("inf")

    @property
    def moved_bytes(self) -> int:
        return sum(n.bytes for n in self.dag.nodes)


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


def plan_transition(
    problem: PlanningProblem,
    current: Plan,
    target: Plan,
    lost: frozenset[int] = frozenset(),
    skip: frozenset[str] = frozenset(),
    grouped: bool | None = False,
) -> Transition:
    """The global DAG from ``current`` to ``target`` and its schedule (raises NoSourceError).
    ``skip``: model-stages left out (weight copies a weight sync rebuilds afterwards);
    ``grouped``: plan identical units as groups (None: where it applies, see ``plan_dag``;
    off by default: it saves little end to end so far, see ``group.py``)."""
    moves = tuple(m for m in stage_moves(problem, current, target, lost) if m.name not in skip)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    links = LinkModel(problem.cluster, problem.efficiencies)
    dag, schedule = plan_dag(moves, rank, links, ledger_capacity(problem), grouped)
    return Transition(dag, schedule, moves)
