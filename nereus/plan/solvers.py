"""One entry point for the three solvers of the same problem: dp (the planner), exhaustive, scip."""

from __future__ import annotations

import time
from enum import StrEnum

from nereus.errors import InfeasibleError, NereusError
from nereus.plan.cost import CostModel
from nereus.plan.exhaustive import exhaustive
from nereus.plan.problem import PlanningProblem
from nereus.plan.scip import solve_scip
from nereus.plan.search import SearchResult, binding_constraint, build_tables, finish, search


class Solver(StrEnum):
    DP = "dp"  # frontier + exact program (search.py)
    EXHAUSTIVE = "exhaustive"  # every valid plan (exhaustive.py)
    SCIP = "scip"  # the MIP with SCIP (scip.py)


def solve(
    problem: PlanningProblem, solver: Solver = Solver.DP, time_limit_s: float | None = None
) -> SearchResult:
    """The fastest feasible plan by ``solver``. Raises ``InfeasibleError`` when none exists."""
    if solver is Solver.DP:
        return search(problem)
    started = time.perf_counter()
    if solver is Solver.EXHAUSTIVE:
        shapes = exhaustive(problem).best
    else:
        result = solve_scip(problem, time_limit_s)
        if result.shapes is None and result.status != "infeasible":
            raise NereusError(f"scip found no plan ({result.status})")
        shapes = result.shapes
    if shapes is None:
        raise InfeasibleError(binding_constraint(problem, build_tables(CostModel(problem))))
    return finish(problem, shapes, started, solver.value)
