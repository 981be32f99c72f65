"""Async weight sync in the planner: generation runs on GPUs of its own, so the trainer's new
weights cross the pool to reach it, and the sync ends the step after both sides."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.plan.cost import SYNC_WAIT
from nereus.plan.opclass import OpClass
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import SearchResult, search
from nereus.sim.observe import step_sync
from nereus.spec.workload import ExecutionMode, Stage
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def _problem(gpus: int, algo: str = "grpo", mode: ExecutionMode = ExecutionMode.ASYNC) -> PlanningProblem:
    p = make_problem(cluster="h200-ib", gpus=gpus, algo=algo, response=2048)
    return dataclasses.replace(p, workload=dataclasses.replace(p.workload, mode=mode))


def _terms(result: SearchResult, name: str) -> dict[str, float]:
    (e,) = [e for e in result.estimates if e.model_stage == name]
    return {k: float(v.total) for k, v in e.latency.parts.items()}


def _classes(result: SearchResult, name: str, term: str) -> set[OpClass]:
    (e,) = [e for e in result.estimates if e.model_stage == name]
    return {op for op, t in e.latency.parts[term].by_class.items() if float(t) > 0}


@pytest.mark.parametrize(("algo", "gpus"), [("grpo", 16), ("ppo", 24), ("grpo", 12)])
def test_across_nodes_the_sync_ends_the_step_after_both_sides(algo: str, gpus: int) -> None:
    """Generation receives the actor's weights between nodes, every trainer waits the same
    sync, so the step is max(generation, inference + training) + sync. It used to be priced as
    a copy inside generation's replica (0.03 s for 8B on H200s, where the truth's broadcast
    across the two nodes takes 3.8 s) and on generation's side only."""
    problem = _problem(gpus, algo)
    result = search(problem)
    wf = result.plan.workflow
    (gen,) = wf.by_stage(Stage.GEN)
    sync = _terms(result, gen.name)["weight_sync"]
    assert _classes(result, gen.name, "weight_sync") == {OpClass.BROADCAST_INTER}
    trainers = [m.name for m in wf.by_stage(Stage.TRAIN)]
    for name in trainers:
        assert _terms(result, name)[SYNC_WAIT] == pytest.approx(sync, rel=1e-12), name
    own = {e.model_stage: e.latency_s for e in result.estimates}
    gen_own = own[gen.name] - sync
    rest = max(own[m.name] for m in wf.by_stage(Stage.INF)) + max(own[n] - sync for n in trainers)
    assert result.step_latency_s == pytest.approx(max(gen_own, rest) + sync, rel=1e-9)
    # the same bytes the truth moves, on the link it moves them over: within a factor of 3 of
    # its seconds before calibration (each side has its own efficiencies)
    truth = sum(step_sync(problem.models, problem.cluster, result.plan).values())
    assert truth / 3 < sync < truth * 3, (sync, truth)


def test_inside_one_node_the_sync_stays_on_nvlink() -> None:
    result = search(_problem(8))
    (gen,) = result.plan.workflow.by_stage(Stage.GEN)
    assert _classes(result, gen.name, "weight_sync") == {OpClass.BROADCAST_INTRA}
    assert _classes(result, "actor.train", SYNC_WAIT) == {OpClass.BROADCAST_INTRA}
    assert _terms(result, gen.name)["weight_sync"] < 0.1


def test_sync_mode_keeps_each_receivers_own_sync_and_no_wait() -> None:
    """Colocated (sync mode): a receiver gets its weights inside its replica; trainers wait on
    nothing, since each stage follows the last."""
    result = search(_problem(16, mode=ExecutionMode.SYNC))
    for e in result.estimates:
        assert SYNC_WAIT not in e.latency.parts, e.model_stage
    (gen,) = result.plan.workflow.by_stage(Stage.GEN)
    assert _terms(result, gen.name)["weight_sync"] < 0.1


def test_the_truths_sync_is_the_actors_whole_weights() -> None:
    problem = _problem(16)
    plan = search(problem).plan
    assert set(step_sync(problem.models, problem.cluster, plan)) == {"broadcast.inter"}
    sync_plan = search(_problem(16, mode=ExecutionMode.SYNC)).plan
    assert step_sync(problem.models, problem.cluster, sync_plan) == {}
