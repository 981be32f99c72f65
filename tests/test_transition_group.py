"""Grouped planning (``nereus.transition.group``): valid expanded schedules close to the per-unit
greedy's, the per-unit DAG the executor needs, and the exact per-unit path where it does not apply.

The pairs are the stored plans of ``tests/golden/transition_reference.json`` at 256 GPUs and more
(the benchmark's drifts and the seeded random drifts, with and without lost GPUs) and a few
fresh seeded drifts; no plan search runs here except those few.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from nereus.spec.workload import STAGE_ORDER
from nereus.transition import LinkModel, plan_transition
from nereus.transition.between import ledger_capacity
from nereus.transition.build import initial_bytes
from nereus.transition.choose import plan_dag
from nereus.transition.dag import EdgeKind
from nereus.transition.group import Groups, room_for_everything
from nereus.transition.rcpsp import verify
from tests.transition_cases import GOLDEN, _drift_case, plan_of, problem_of

pytestmark = pytest.mark.pure

GAP = 0.05  # grouped makespan / per-unit greedy makespan − 1
TICK_S = 1e-6  # the verifier's integer ticks


def _large() -> list[dict[str, Any]]:
    cases = json.loads(GOLDEN.read_text())
    return [
        c for c in cases if "capacity" not in c and "error" not in c["expect"] and c["problem"]["gpus"] >= 256
    ]


def _fresh() -> list[dict[str, Any]]:
    """Seeded random drifts at 256 and 512 GCDs, not among the golden cases."""
    rng = random.Random(2121)
    out: list[dict[str, Any]] = []
    while len(out) < 3:
        gpus = rng.choice([256, 512])
        before = (rng.choice((0.5, 0.75, 1.0)), rng.choice((1024, 2048, 4096)))
        after = (rng.choice((0.5, 0.75, 1.0)), rng.choice((1024, 2048, 4096)))
        case = _drift_case("llama-3.1-8b", "mi250x-slingshot", gpus, before, after, lost=rng.choice([0, 2]))
        if case is not None:
            out.append({"name": f"fresh {gpus} {before}→{after}", **case})
    return out


LARGE = _large()


def _check(case: dict[str, Any]) -> None:
    problem = problem_of(case)
    current, target = plan_of(case["current"], problem), plan_of(case["target"], problem)
    lost = frozenset(case.get("lost", ()))
    exact = plan_transition(problem, current, target, lost, grouped=False, direct=False)  # as groups plan
    tr = plan_transition(problem, current, target, lost, grouped=True, direct=False)
    assert exact.schedule is not None and tr.schedule is not None
    if not tr.schedule.priority.startswith("grouped"):
        # memory too tight for the no-wait ledger: the exact per-unit plan, unchanged
        assert room_for_everything(exact.dag.nodes, initial_bytes(exact.moves), exact.dag.capacity) is None
        assert tr.dag == exact.dag and tr.schedule == exact.schedule
        return
    dag, sched = tr.dag, tr.schedule
    # the per-unit DAG the executor runs: the same nodes, edges and units, no resource edge needed
    assert exact.dag.resource_edges == 0
    assert dag.nodes == exact.dag.nodes and dag.edges == exact.dag.edges and dag.units == exact.dag.units
    assert sorted(dag.order) == list(range(len(dag.nodes)))
    pos = {n: k for k, n in enumerate(dag.order)}
    assert all(pos[e.src] < pos[e.dst] for e in dag.edges)  # a topological order
    # peak bounds every execution: what the per-unit ledger guarantees, never less
    assert all(dag.peak[g] >= exact.dag.peak[g] for g in exact.dag.peak)
    assert all(dag.peak[g] <= dag.capacity[g] for g in dag.peak)
    # the expanded schedule: precedence over every edge, ports, per-GPU memory
    starts = [round(s / TICK_S) for s in sched.start]
    durations = [round(f / TICK_S) - s for f, s in zip(sched.finish, starts, strict=True)]
    assert all(d >= 0 for d in durations)
    assert not verify(dag, initial_bytes(tr.moves), durations, starts, edges=None)
    assert all(
        f - s == pytest.approx(n.est_s) for s, f, n in zip(sched.start, sched.finish, dag.nodes, strict=True)
    )
    assert sched.makespan == max(sched.finish)
    assert sched.makespan <= (1 + GAP) * exact.l_tran_s + 1e-9, (sched.makespan, exact.l_tran_s)
    assert set(sched.critical_path) <= set(range(len(dag.nodes)))


@pytest.mark.parametrize("case", LARGE, ids=[c["name"] for c in LARGE])
def test_grouped_schedule_is_valid_and_close_to_the_per_unit_greedy(case: dict[str, Any]) -> None:
    _check(case)


def test_fresh_seeded_drifts_at_scale() -> None:
    for case in _fresh():
        _check(case)


def test_the_benchmark_pairs_at_1024_are_planned_grouped() -> None:
    """Where it applies (many identical units, memory for every acquisition) ``grouped=None`` groups:
    on replica classes (``classplan.py``), expanded onto the per-unit DAG when it is read."""
    big = [c for c in LARGE if c["name"].startswith("mi250x 1024")]
    assert len(big) == 3
    for case in big:
        problem = problem_of(case)
        cur, tgt = plan_of(case["current"], problem), plan_of(case["target"], problem)
        tr = plan_transition(problem, cur, tgt, grouped=None)
        assert tr.schedule is not None and tr.schedule.priority.startswith(("grouped", "class"))
        groups = Groups(list(tr.dag.nodes), list(tr.dag.edges))
        assert len(groups.members) * 20 < len(tr.dag.nodes)


def test_memory_pressure_falls_back_to_the_exact_per_unit_plan() -> None:
    case = next(c for c in LARGE if c["name"] == "mi250x 512 grow")
    problem = problem_of(case)
    tr = plan_transition(problem, plan_of(case["current"], problem), plan_of(case["target"], problem))
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in problem.workflow.model_stages}
    links = LinkModel(problem.cluster, problem.efficiencies)
    acquired: dict[int, int] = dict(initial_bytes(tr.moves))
    for n in tr.dag.nodes:
        for g, b in n.acquire:
            acquired[g] = acquired.get(g, 0) + b
    tight = max(acquired.values()) - 1  # one GPU short of room for every acquisition at once
    assert tight < ledger_capacity(problem)
    dag, sched = plan_dag(tr.moves, rank, links, tight, grouped=True)
    exact = plan_dag(tr.moves, rank, links, tight, grouped=False)
    assert (dag, sched) == exact
    assert sched is None or not sched.priority.startswith("grouped")


def test_small_transitions_keep_the_per_unit_planner() -> None:
    cases = [c for c in json.loads(GOLDEN.read_text()) if c["name"].startswith("mi250x 32 ")]
    for case in cases:
        problem = problem_of(case)
        cur, tgt = plan_of(case["current"], problem), plan_of(case["target"], problem)
        tr = plan_transition(problem, cur, tgt, grouped=None)
        assert tr.schedule is not None and not tr.schedule.priority.startswith("grouped")
        assert tr.dag.resource_edges == sum(e.kind is EdgeKind.RESOURCE for e in tr.dag.edges)
