"""Seeded transition cases and a fingerprint of everything a transition plan decides.

``tests/golden/transition_reference.json`` holds the cases (the two plans, spelled out, so a
change to the plan search does not change them) and the fingerprint the per-unit planner of
commit ``25fbcc4`` produced for each: a hash of every node, edge, commit-order entry, peak,
capacity, unit and scheduled start/finish, plus the makespan and counts in the clear. The test
(``test_transition_reference.py``) re-plans each case and asserts the same fingerprint.

Regenerate (only when the planner's meaning is meant to change): ``python -m tests.transition_cases``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from nereus.plan.layout import Candidate, Layout, Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import STAGE_ORDER, Recompute
from nereus.transition import LinkModel, NoSourceError, plan_transition
from nereus.transition.build import build_dag
from nereus.transition.dag import TransitionDag
from nereus.transition.schedule import Schedule, best_schedule
from tests.helpers import make_problem, random_plan

GOLDEN = Path(__file__).parent / "golden" / "transition_reference.json"
DRIFTS = {  # (pool fraction before, response before, pool fraction after, response after)
    "grow": (0.5, 2048, 1.0, 2048),
    "longer": (1.0, 2048, 1.0, 4096),
    "shrink": (1.0, 2048, 0.75, 2048),
}


def plan_doc(plan: Plan) -> dict[str, Any]:
    cands = [
        [c.model_stage, c.layout.tp, c.layout.pp, c.dp, list(c.gpus), c.micro_batch, c.recompute.value]
        for c in plan.candidates
    ]
    return {"pool": list(plan.pool), "candidates": cands}


def plan_of(doc: dict[str, Any], problem: PlanningProblem) -> Plan:
    cands = tuple(
        Candidate(name, Layout(tp, pp), dp, tuple(gpus), mb, Recompute(rc))
        for name, tp, pp, dp, gpus, mb, rc in doc["candidates"]
    )
    return Plan(problem.workflow, cands, tuple(doc["pool"]))


def problem_of(case: dict[str, Any]) -> PlanningProblem:
    p = case["problem"]
    return make_problem(p["model"], p["cluster"], p["gpus"], p["response"])


def fingerprint(dag: TransitionDag, sched: Schedule | None) -> dict[str, Any]:
    """Counts and makespan in the clear, and one hash of every value the plan decides."""
    parts = [
        repr(dag.nodes),
        repr(dag.edges),
        repr(dag.order),
        repr(sorted(dag.peak.items())),
        repr(sorted(dag.capacity.items())),
        repr((dag.feasible, dag.reason)),
        repr(sorted(dag.units.items())),
        repr(dataclasses.astuple(sched) if sched is not None else None),
    ]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return {
        "nodes": len(dag.nodes),
        "edges": len(dag.edges),
        "feasible": dag.feasible,
        "makespan": sched.makespan if sched is not None else None,
        "sha256": digest,
    }


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint of one case with today's planner."""
    problem = problem_of(case)
    current, target = plan_of(case["current"], problem), plan_of(case["target"], problem)
    try:
        tr = plan_transition(problem, current, target, frozenset(case.get("lost", ())))
    except NoSourceError as exc:
        return {"error": str(exc)}
    if "capacity" not in case:
        return fingerprint(tr.dag, tr.schedule)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in problem.workflow.model_stages}
    dag = build_dag(tr.moves, rank, LinkModel(problem.cluster, problem.efficiencies), case["capacity"])
    return fingerprint(dag, best_schedule(dag) if dag.feasible else None)


def _drift_case(
    model: str, cluster: str, gpus: int, before: tuple[float, int], after: tuple[float, int], lost: int = 0
) -> dict[str, Any] | None:
    """None when either pool has no plan."""
    from nereus.errors import InfeasibleError
    from nereus.plan.search import search

    (f1, r1), (f2, r2) = before, after
    try:
        current = search(make_problem(model, cluster, int(gpus * f1), r1)).plan
        p2 = dataclasses.replace(make_problem(model, cluster, int(gpus * f2), r2), anchor=current)
        target = search(p2).plan
    except InfeasibleError:
        return None
    case: dict[str, Any] = {
        "problem": {"model": model, "cluster": cluster, "gpus": int(gpus * f2), "response": r2},
        "current": plan_doc(current),
        "target": plan_doc(target),
    }
    if lost:  # GPUs of the current plan the target does not use
        spare = sorted(
            {g for c in current.candidates for g in c.gpus} - {g for c in target.candidates for g in c.gpus}
        )
        case["lost"] = spare[:lost]
    return case


def cases() -> list[dict[str, Any]]:
    """The benchmark's pairs at 32…1,024 GCDs, seeded random drifts, random tight-memory pairs."""
    out = []
    for gpus in (32, 64, 128, 256, 512, 1024):
        for drift, (f1, r1, f2, r2) in DRIFTS.items():
            case = _drift_case("llama-3.1-8b", "mi250x-slingshot", gpus, (f1, r1), (f2, r2))
            assert case is not None
            out.append({"name": f"mi250x {gpus} {drift}", **case})
    rng = random.Random(21)
    fractions, responses = (0.25, 0.5, 0.75, 1.0), (1024, 2048, 4096)
    k = 0
    while k < 24:
        cluster, most = rng.choice([("mi250x-slingshot", 1024), ("h200-ib", 64), ("a100-64gb-hdr100", 256)])
        gpus = rng.choice([g for g in (16, 32, 64, 128, 256, 512) if g <= most])
        before = (rng.choice(fractions), rng.choice(responses))
        after = (rng.choice(fractions), rng.choice(responses))
        case = _drift_case("llama-3.1-8b", cluster, gpus, before, after, lost=rng.choice([0, 0, 2]))
        if case is not None:
            out.append({"name": f"drift {k} {cluster} {gpus} {before}→{after}", **case})
            k += 1
    for k in range(40):
        gpus = rng.choice([8, 16, 32])
        problem = make_problem("tiny-llama", "a100-64gb-hdr100", gpus, 64)
        a, b = random_plan(rng, problem), random_plan(rng, problem)
        case = {
            "name": f"random pair {k} ({gpus} GPUs)",
            "problem": {"model": "tiny-llama", "cluster": "a100-64gb-hdr100", "gpus": gpus, "response": 64},
            "current": plan_doc(a),
            "target": plan_doc(b),
        }
        if k % 5 == 4:  # one model-stage's GPUs lost: restores from the trainer or from storage
            train = {g for c in a.candidates if c.model_stage.endswith(".train") for g in c.gpus}
            case["lost"] = sorted(set(rng.choice(a.candidates).gpus) - train)
        elif k % 2:  # a tight per-GPU capacity: promotions, resource edges, refusals
            tr = plan_transition(problem, a, b)
            need = max(tr.dag.peak.values(), default=1)
            case["capacity"] = int(need * rng.uniform(0.6, 1.2))
        out.append(case)
    return out


def main() -> None:
    doc = []
    for case in cases():
        case["expect"] = run_case(case)
        doc.append(case)
        print(case["name"], case["expect"], flush=True)
    GOLDEN.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
