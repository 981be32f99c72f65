"""The plan search as a mixed-integer program, solved by SCIP (optional extra ``nereus[scip]``).

Same problem as ``search.py`` (paper Eq. 1 with our co-residency rule), written as a MIP over
every individually feasible candidate — the baseline the paper compares its planner with:

    z[M,c] ∈ {0,1},  Σ_c z[M,c] = 1                                  one candidate per model-stage
    Σ_{M∈s} Σ_c gpus_c z[M,c] ≤ P                                     per stage (sync)
    T_s ≥ Σ_c L_c z[M,c],  X_s ≥ Σ_c resident_c z[M,c]               for M ∈ s
    Σ_c active_c z[M,c] + Σ_{s'≠s} X_{s'} ≤ capacity − reserve        for M ∈ s
    minimise Σ_s T_s            (async: T ≥ T_gen, T ≥ T_inf + T_train; generation GPUs apart)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nereus.errors import ConfigError
from nereus.plan.candidates import CandidateTable, Shape
from nereus.plan.cost import CostModel
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import build_tables
from nereus.spec.cluster import GIB
from nereus.spec.workload import ExecutionMode, Stage


def available() -> bool:
    try:
        import pyscipopt  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class ScipResult:
    shapes: dict[str, Shape] | None  # None: infeasible (or no solution within the time limit)
    objective_s: float | None
    status: str
    seconds: float


def solve_scip(
    problem: PlanningProblem,
    time_limit_s: float | None = None,
    tables: dict[str, CandidateTable] | None = None,
) -> ScipResult:
    """Solve the plan MIP with SCIP; raises ``ConfigError`` if pyscipopt is not installed.

    ``tables`` (every model-stage's priced candidates) are built when not given.
    """
    try:
        from pyscipopt import Model, quicksum
    except ImportError:
        raise ConfigError("solver 'scip' needs pyscipopt: pip install 'nereus[scip]'") from None
    started = time.perf_counter()
    tables = tables or build_tables(CostModel(problem))
    limit = (problem.capacity_bytes - problem.reserved_bytes) / GIB
    wf = problem.workflow
    mode = problem.workload.mode
    P = problem.gpus
    m = Model("nereus-plan")
    m.hideOutput()
    if time_limit_s is not None:
        m.setParam("limits/time", time_limit_s)
    z: dict[str, dict[int, Any]] = {}
    for ms in wf.model_stages:
        t = tables[ms.name]
        keep = [i for i in range(len(t)) if t.active[i] / GIB <= limit]
        z[ms.name] = {i: m.addVar(vtype="B", name=f"z[{ms.name},{i}]") for i in keep}
        m.addCons(quicksum(z[ms.name].values()) == 1)

    def total(name: str, values: Any) -> Any:
        return quicksum(values[i] * var for i, var in z[name].items())

    stages = wf.stages
    T = {s: m.addVar(lb=0.0, name=f"T[{s.value}]") for s in stages}
    shared = [s for s in stages if mode is ExecutionMode.SYNC or s is not Stage.GEN]
    X = {s: m.addVar(lb=0.0, name=f"X[{s.value}]") for s in shared}
    for s in stages:
        for ms in wf.by_stage(s):
            t = tables[ms.name]
            m.addCons(T[s] >= total(ms.name, t.latency))
            if s in X:
                m.addCons(X[s] >= total(ms.name, t.persistent / GIB))
    gen_gpus = (
        0
        if mode is ExecutionMode.SYNC
        else quicksum(total(ms.name, tables[ms.name].gpus) for ms in wf.by_stage(Stage.GEN))
    )
    for s in shared:
        m.addCons(gen_gpus + quicksum(total(ms.name, tables[ms.name].gpus) for ms in wf.by_stage(s)) <= P)
        others = quicksum(X[o] for o in shared if o is not s)
        for ms in wf.by_stage(s):
            m.addCons(total(ms.name, tables[ms.name].active / GIB) + others <= limit)
    if mode is ExecutionMode.SYNC:
        m.setObjective(quicksum(T.values()), "minimize")
    else:
        step = m.addVar(lb=0.0, name="step")
        m.addCons(step >= T[Stage.GEN])
        m.addCons(step >= quicksum(T[s] for s in shared))
        m.setObjective(step, "minimize")
    m.optimize()
    status = str(m.getStatus())
    if m.getNSols() == 0:
        return ScipResult(None, None, status, time.perf_counter() - started)
    sol = m.getBestSol()
    assert sol is not None
    shapes = {}
    for ms in wf.model_stages:
        chosen = max(z[ms.name], key=lambda i: sol[z[ms.name][i]])
        shapes[ms.name] = tables[ms.name].shape(chosen)
    return ScipResult(shapes, float(m.getObjVal()), status, time.perf_counter() - started)
