"""The search against the brute force, the frontier's invariants, and the paper's observations."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.errors import InfeasibleError
from nereus.plan.candidates import candidate_table
from nereus.plan.cost import CostModel
from nereus.plan.exhaustive import all_plans, exhaustive, iter_plans, plan_is_feasible, plan_step_latency
from nereus.plan.frontier import frontier
from nereus.plan.overlap import step_latency
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.scip import available as scip_available
from nereus.plan.search import search
from nereus.plan.solvers import Solver, solve
from nereus.spec import (
    Algorithm,
    ClusterSpec,
    CollectiveLibrary,
    ExecutionMode,
    ModelFamily,
    ModelSpec,
    Role,
    Vendor,
    WorkloadSpec,
)
from nereus.spec.cluster import GIB
from nereus.spec.workload import Recompute, Stage
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


@st.composite
def small_problems(draw: st.DrawFn) -> PlanningProblem:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    model = ModelSpec(
        name="random",
        family=ModelFamily.LLAMA,
        hidden_size=heads * draw(st.sampled_from([8, 16])),
        num_hidden_layers=draw(st.integers(1, 6)),
        num_attention_heads=heads,
        num_key_value_heads=draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0])),
        intermediate_size=draw(st.integers(16, 256)),
        vocab_size=draw(st.integers(64, 2048)),
        tie_word_embeddings=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
    )
    algo = draw(st.sampled_from(list(Algorithm)))
    samples = draw(st.sampled_from([2, 4])) if algo is Algorithm.GRPO else 1
    prompts = draw(st.sampled_from([2, 4, 8, 16]))
    batches = [d for d in (1, 2, 4, 8, 16) if (prompts * samples) % d == 0]
    prompt_len = draw(st.integers(8, 64))
    global_batch = draw(st.sampled_from(batches))
    workload = WorkloadSpec(
        name="random",
        algorithm=algo,
        mode=draw(st.sampled_from(list(ExecutionMode))),
        prompts_per_step=prompts,
        samples_per_prompt=samples,
        prompt_len=prompt_len,
        max_prompt_len=64,
        global_batch=global_batch,
        micro_batch=draw(st.integers(1, min(4, global_batch))),
        inference_micro_batch=draw(st.integers(1, 8)),
        max_num_seqs=draw(st.integers(1, 16)),
        epochs=draw(st.integers(1, 2)),
        sequence_parallel=draw(st.booleans()),
        flash_attention=draw(st.booleans()),
        reward_model=draw(st.booleans()),
    )
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    gpus = draw(st.integers(2, 8))
    # memory from a fraction to a few times one trainer's state: binding in some cases, loose in others
    memory = draw(st.floats(0.3, 6.0)) * 16 * model.param_count() / GIB
    cluster = ClusterSpec(
        name="random",
        vendor=Vendor.NVIDIA,
        collective_library=CollectiveLibrary.NCCL,
        nodes=-(-gpus // gpn),
        gpus_per_node=gpn,
        gpu_model="random",
        gpu_memory_gib=memory,
        peak_bf16_tflops=draw(st.floats(0.001, 1000)),
        hbm_bandwidth_gbs=draw(st.floats(1, 5000)),
        intra_node_bandwidth_gbs=draw(st.floats(1, 500)),
        inter_node_bandwidth_gbs=draw(st.floats(0.1, 50)),
        intra_node_latency_us=draw(st.floats(0, 50)),
        inter_node_latency_us=draw(st.floats(0, 100)),
        runtime_reserved_gib=memory * 0.05,
    )
    response = draw(st.integers(4, 128))
    seq = SeqStats(prompt_len, response, response + draw(st.integers(0, 64)))
    space = draw(st.sampled_from([SearchSpace(), SearchSpace.urgent(), SearchSpace(max_tp=1)]))
    return PlanningProblem(workload, {r: model for r in Role}, cluster, tuple(range(gpus)), seq, space=space)


@settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems())
def test_search_equals_exhaustive_optimum(problem: PlanningProblem) -> None:
    ex = exhaustive(problem)
    try:
        found = search(problem)
    except InfeasibleError:
        assert ex.count == 0 and ex.best_step_latency_s is None
        return
    assert ex.best_step_latency_s is not None and ex.count > 0
    assert found.step_latency_s == pytest.approx(ex.best_step_latency_s, rel=1e-9)
    shapes = {e.model_stage: e.shape for e in found.estimates}
    assert plan_is_feasible(problem, shapes)
    assert plan_step_latency(problem, shapes) == pytest.approx(found.step_latency_s, rel=1e-12)
    latency = {e.model_stage: e.latency_s for e in found.estimates}
    assert step_latency(problem.workflow, problem.workload.mode, latency) == found.step_latency_s


def _tiny(algo: str, gpus: int, **kw: object) -> PlanningProblem:
    return make_problem("tiny-llama", "local-cpu", gpus, 64, algo, prompt=32, **kw)


def test_exhaustive_agrees_with_the_literal_brute_force() -> None:
    problem = _tiny(
        "grpo",
        3,
        prompts_per_step=2,
        samples_per_prompt=2,
        global_batch=2,
        micro_batch=2,
        reward_model=False,
    )
    literal = list(iter_plans(problem))
    ex = exhaustive(problem)
    assert ex.count == len(literal) > 0
    assert ex.best_step_latency_s == pytest.approx(min(lat for _, lat in literal), rel=1e-12)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_all_plans_lists_what_exhaustive_counts(mode: str) -> None:
    problem = _tiny("ppo", 5, prompts_per_step=8, global_batch=4, mode=mode)
    ex = exhaustive(problem)
    plans = list(all_plans(problem))
    assert len(plans) == ex.count > 0
    assert min(lat for _, lat in plans) == pytest.approx(ex.best_step_latency_s, rel=1e-12)
    assert all(plan_is_feasible(problem, shapes) for shapes, _ in plans[:: max(1, len(plans) // 50)])


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems())
def test_frontier_is_exactly_the_non_dominated_feasible_set(problem: PlanningProblem) -> None:
    cost = CostModel(problem)
    limit = problem.capacity_bytes - problem.reserved_bytes
    for ms in problem.workflow.model_stages:
        table = candidate_table(cost, ms)
        front = frontier(table, limit)
        pts = np.column_stack([front.gpus, front.latency, front.persistent, front.active])
        assert np.all(np.diff(front.latency) >= 0)
        for i, p in enumerate(pts):
            le = np.all(pts <= p, axis=1)
            lt = np.any(pts < p, axis=1)
            le[i] = False
            assert not np.any(le & lt), f"{ms.name}: {front.shapes[i]} is dominated"
        feasible = np.flatnonzero(table.active <= limit)
        all_pts = np.column_stack([table.gpus, table.latency, table.persistent, table.active])
        for j in feasible:  # everything dropped is matched or beaten by a frontier member
            assert np.any(np.all(pts <= all_pts[j], axis=1)), f"{ms.name}: {table.shapes[j]} lost"


def test_plan_places_tp_groups_inside_nodes() -> None:
    problem = make_problem(cluster="h200-ib", gpus=64, response=4096)
    result = search(problem)
    gpn = problem.cluster.gpus_per_node
    for c in result.plan.candidates:
        for group in c.tp_groups():
            assert len({g // gpn for g in group}) == 1, f"{c.model_stage}: TP group {group} spans nodes"
        if c.layout.size <= gpn:
            for r in range(c.dp):
                assert len({g // gpn for g in c.replica_gpus(r)}) == 1
    # the actor's model-stages start on the same GPUs, so its weight sync stays local
    assert result.plan.candidate("actor.gen").gpus[0] == result.plan.candidate("actor.train").gpus[0]


def _layouts(problem: PlanningProblem) -> dict[str, tuple[int, int]]:
    return {e.model_stage: (e.shape.layout.tp, e.shape.layout.pp) for e in search(problem).estimates}


@pytest.mark.parametrize("algo", ["ppo", "grpo", "remax"])
def test_choice_at_16_gpus_changes_between_2k_and_4k(algo: str) -> None:
    """Paper §3 / Fig. 4: as responses grow from 2K to 4K tokens the best plan at 16 GPUs changes."""
    short = search(make_problem(gpus=16, response=2048, algo=algo))
    long = search(make_problem(gpus=16, response=4096, algo=algo))
    before = {e.model_stage: (e.shape.layout, e.shape.dp) for e in short.estimates}
    after = {e.model_stage: (e.shape.layout, e.shape.dp) for e in long.estimates}
    assert before != after
    # and the short plan no longer fits at 4K: memory, not speed, forced the change
    long_problem = make_problem(gpus=16, response=4096, algo=algo)
    assert not plan_is_feasible(long_problem, {e.model_stage: e.shape for e in short.estimates})


def test_best_layout_differs_between_32_and_256_gpus() -> None:
    """Paper §3: the best TP/PP for Llama-3.1-8B differs between 32 and 256 GPUs."""
    assert _layouts(make_problem(gpus=32)) != _layouts(make_problem(gpus=256))


@pytest.mark.skipif(not scip_available(), reason="pyscipopt not installed")
@pytest.mark.parametrize(("gpus", "mode"), [(8, "sync"), (16, "sync"), (16, "async")])
def test_scip_solves_the_same_problem(gpus: int, mode: str) -> None:
    problem = make_problem(gpus=gpus, mode=mode)
    dp = solve(problem, Solver.DP)
    mip = solve(problem, Solver.SCIP)
    assert mip.step_latency_s == pytest.approx(dp.step_latency_s, rel=1e-6)


def test_exhaustive_solver_returns_a_placed_plan() -> None:
    problem = make_problem(gpus=8)
    result = solve(problem, Solver.EXHAUSTIVE)
    assert result.solver == "exhaustive"
    assert result.step_latency_s == pytest.approx(search(problem).step_latency_s, rel=1e-12)
    assert len(result.plan.candidates) == len(problem.workflow.model_stages)


def test_infeasible_names_the_binding_model_stage() -> None:
    problem = make_problem(model="llama-3.3-70b", cluster="a100-64gb-hdr100", gpus=4)
    with pytest.raises(InfeasibleError, match=r"actor.train needs ≥ [\d.]+ GiB per GPU at tp·pp ≤ 4"):
        search(problem)
    with pytest.raises(InfeasibleError):
        solve(problem, Solver.EXHAUSTIVE)


def test_urgent_space_can_rescue_a_plan() -> None:
    tight = make_problem(gpus=8, response=8192)
    with pytest.raises(InfeasibleError):
        search(tight)
    rescued = search(make_problem(gpus=8, response=8192, space=SearchSpace.urgent()))
    assert any(e.shape.recompute.value != "none" or e.shape.micro_batch < 4 for e in rescued.estimates)
    assert math.isfinite(rescued.step_latency_s)


@pytest.mark.parametrize("recompute", list(Recompute))
def test_the_workloads_recompute_is_what_its_trainers_are_planned_with(recompute: Recompute) -> None:
    """``recompute: full`` in a workload YAML was read and then ignored: every trainer was priced
    without recomputation (~25% too fast for an 8B GRPO trainer). The default space plans the
    workload's; the urgent space may still choose any."""
    problem = make_problem(gpus=16, response=1024, algo="grpo", recompute=recompute)
    plan = search(problem).plan
    trained = {
        c.recompute for c in plan.candidates if problem.workflow.get(c.model_stage).stage is Stage.TRAIN
    }
    assert trained == {recompute}


def test_flat_model_stages_are_planned_without_pipelining() -> None:
    """An engine without pipelining (vLLM) keeps its model-stage at pp = 1 in every plan the
    search considers, also in the urgent space, and the controller's replans keep the limit."""
    from nereus.control.controller import Controller
    from nereus.plan.candidates import layouts

    base = make_problem("llama-3.1-8b", gpus=32, response=2048)
    gen = base.workflow.get("actor.gen")
    assert any(lay.pp > 1 for lay in layouts(base, gen))  # the search would pipeline it
    for space in (
        SearchSpace(flat=("actor.gen",)),
        SearchSpace.urgent().keeping(SearchSpace(flat=("actor.gen",))),
    ):
        problem = make_problem("llama-3.1-8b", gpus=32, response=2048, space=space)
        assert all(lay.pp == 1 for lay in layouts(problem, gen))
        assert any(lay.pp > 1 for lay in layouts(problem, problem.workflow.get("actor.train")))
        assert search(problem).plan.candidate("actor.gen").layout.pp == 1
    flat = SearchSpace(flat=("actor.gen",))
    plan = search(make_problem("llama-3.1-8b", gpus=32, response=2048, space=flat)).plan
    ctl = Controller(base.workload, base.models, base.cluster, plan, space=flat)
    assert ctl.problem(base.pool, base.seq).space.flat == ("actor.gen",)
    assert ctl.problem(base.pool, base.seq, SearchSpace.urgent()).space.flat == ("actor.gen",)
