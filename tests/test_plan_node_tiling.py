"""Nodes whose GPU count is not a power of two (Summit's 6, Aurora's 12): placement keeps every
TP group that fits in a node inside one, a TP group or replica that does not divide the node is
priced between nodes unless its model-stage is placed alone on the pool, and no searched plan is
priced on faster links than the ones it is placed on.

The defect these pin: 8B PPO on 48 GPUs of 12 per node planned actor.train at tp8·dp4 with its
fourth TP group on GPUs 32-35 and 44-47 (two nodes) while pricing it inside one node (18.9 s;
70.6 s where it ran), because each model-stage is priced as if it had the pool alone and
critic.train's 16 GPUs (a node and a third) had taken the room."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus.errors import InfeasibleError
from nereus.plan.bestfit import FreeGpus, alone_on_pool, group_spans, occupancy, placed_spans
from nereus.plan.candidates import Shape, estimate
from nereus.plan.cost import CostModel
from nereus.plan.exhaustive import exhaustive
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.price import PriceQuery, price
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import SearchResult, search
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import ExecutionMode, Stage
from tests.helpers import make_problem
from tests.test_search import small_problems

pytestmark = pytest.mark.pure

AR_INTRA = OpClass.of(Collective.ALLREDUCE, Link.INTRA).value
AR_INTER = OpClass.of(Collective.ALLREDUCE, Link.INTER).value


def _on_nodes_of(problem: PlanningProblem, gpn: int, gpus: int) -> PlanningProblem:
    cluster = dataclasses.replace(problem.cluster, gpus_per_node=gpn, nodes=-(-gpus // gpn))
    return dataclasses.replace(problem, cluster=cluster, pool=tuple(range(gpus)))


def _problem(
    gpn: int, gpus: int, model: str = "llama-3.1-8b", algo: str = "ppo", mode: str = "sync"
) -> PlanningProblem:
    p = make_problem(model=model, cluster="a100-80gb-dgx", gpus=8, algo=algo)
    p = dataclasses.replace(p, workload=dataclasses.replace(p.workload, mode=ExecutionMode(mode)))
    p = dataclasses.replace(
        p, cluster=dataclasses.replace(p.cluster, gpus_per_node=gpn, nodes=-(-gpus // gpn))
    )
    return dataclasses.replace(p, pool=tuple(range(gpus)))


def _where_placed(problem: PlanningProblem, result: SearchResult) -> dict[str, float]:
    """Each model-stage's latency re-priced where its placement put it (the plan as anchor)."""
    again = CostModel(dataclasses.replace(problem, anchor=result.plan))
    return {
        c.model_stage: estimate(
            again, problem.workflow.get(c.model_stage), Shape(c.layout, c.dp, c.micro_batch, c.recompute)
        ).latency_s
        for c in result.plan.candidates
    }


def _tp_groups_inside_nodes(result: SearchResult, gpn: int) -> None:
    for c in result.plan.candidates:
        if gpn % c.layout.tp == 0:  # a TP group that divides the node never straddles one
            for group in c.tp_groups():
                assert len({g // gpn for g in group}) == 1, (c.model_stage, group)


def test_the_testers_plan_on_nodes_of_twelve_is_priced_where_it_is_placed() -> None:
    problem = _problem(12, 48)
    result = search(problem)
    _tp_groups_inside_nodes(result, 12)
    where = _where_placed(problem, result)
    for e in result.estimates:  # never priced faster than it runs where placed
        assert where[e.model_stage] <= e.latency_s * (1 + 1e-9), (
            e.model_stage,
            e.shape,
            where[e.model_stage],
        )


@pytest.mark.parametrize(
    ("gpn", "gpus", "model", "algo", "mode"),
    [(12, 48, "qwen3-14b", "grpo", "async"), (12, 96, "llama-3.1-8b", "ppo", "sync"),
     (12, 60, "llama-3.1-8b", "ppo", "async"), (6, 36, "llama-3.1-8b", "ppo", "sync"),
     (6, 48, "qwen3-14b", "grpo", "sync"), (6, 24, "qwen3-14b", "ppo", "async"),
     (12, 24, "llama-3.1-8b", "grpo", "async"), (12, 18, "qwen3-14b", "ppo", "sync")],
)  # fmt: skip
def test_searched_plans_on_nodes_of_six_and_twelve_are_never_priced_below_their_placement(
    gpn: int, gpus: int, model: str, algo: str, mode: str
) -> None:
    """Re-priced where placed, no model-stage is slower than the search said (most of these
    were, by up to 3.7×, before; the last two are part-used nodes: what async generation leaves,
    18 GPUs on nodes of 12); a model-stage placed alone, or whose groups divide the node, costs
    exactly what the search said."""
    problem = _problem(gpn, gpus, model, algo, mode)
    result = search(problem)
    _tp_groups_inside_nodes(result, gpn)
    where = _where_placed(problem, result)
    wf, m = problem.workflow, problem.workload.mode
    for e, c in zip(result.estimates, result.plan.candidates, strict=True):
        assert where[e.model_stage] <= e.latency_s * (1 + 1e-9), (
            e.model_stage,
            e.shape,
            where[e.model_stage],
        )
        alone = len(wf.by_stage(wf.get(c.model_stage).stage)) == 1 and (
            m is ExecutionMode.SYNC or wf.get(c.model_stage).stage is Stage.GEN
        )
        if alone or (gpn % c.layout.tp == 0 and gpn % c.layout.size == 0):
            assert where[e.model_stage] == pytest.approx(e.latency_s, rel=1e-9), e.model_stage


def test_take_keeps_each_tp_group_inside_a_node_that_can_hold_it() -> None:
    # a tp8·pp2 replica on whole nodes of 12: 8 + 8, not a whole node and 4 (a TP-8 group over two)
    assert FreeGpus(range(48), 12).take(16, tp=8) == (*range(8), *range(12, 20))
    # two part-used nodes of 12 with 10 free each: 8 + 8, not 10 + 6
    gpus = FreeGpus([g for n in range(2) for g in range(n * 12, n * 12 + 10)], 12).take(16, tp=8)
    assert gpus == (*range(8), *range(12, 20))
    # no node holds the second TP group: it straddles, from the replica's own node first
    free = FreeGpus((*range(10), 12, 13, 14, 15, 24, 25, 26, 27), 12)
    gpus = free.take(16, tp=8)
    assert gpus[:8] == tuple(range(8)) and {8, 9} < set(gpus[8:])
    # what async generation may leave on nodes of 12 (6 free on each of two): 4 + 4, not 6 + 2
    gpus = FreeGpus((*range(6, 12), *range(18, 24)), 12).take(8, tp=4)
    assert gpus == (6, 7, 8, 9, 18, 19, 20, 21)
    # on whole nodes every node's free GPUs stay a multiple of a TP degree that divides the node:
    # after a node and a third went to a larger replica, the TP-4 groups of four tp4·pp2
    # replicas each stay inside a node (the tester's plan had GPUs 32-35 and 44-47)
    free = FreeGpus(range(48), 12)
    free.take(16, tp=4)
    for _ in range(4):
        replica = free.take(8, tp=4)
        assert all(len({g // 12 for g in replica[i : i + 4]}) == 1 for i in (0, 4)), replica
    # nodes of a power of two: unchanged, TP groups and all (6 + 2 on two nodes with 6 free)
    gpus = FreeGpus([g for n in range(2) for g in range(n * 8, n * 8 + 6)], 8).take(8, tp=4)
    assert gpus == (0, 1, 2, 3, 4, 5, 8, 9)


def test_a_group_that_does_not_divide_the_node_is_priced_between_nodes_unless_alone() -> None:
    whole = (12, 12, 12, 12)

    def spans(tp: float, size: float, dp: float, alone: bool) -> tuple[float, float, float]:
        t, r, d = group_spans(whole, 12, np.array([tp]), np.array([size]), np.array([dp]), alone=alone)
        return float(t[0]), float(r[0]), float(d[0])

    assert spans(8, 8, 4, alone=True) == (8, 8, 48)  # best fit alone: one replica per node
    assert spans(8, 8, 4, alone=False)[:2] == (24, 24)  # stage-mates may take the room: two nodes
    assert spans(4, 8, 4, alone=False)[:2] == (4, 24)  # its TP-4 groups never straddle
    assert spans(4, 4, 3, alone=False) == (4, 4, 12)  # groups that divide the node: as laid out
    # a pool of one node (nereus run on one Aurora node): nothing can straddle, priced inside
    t1, r1, _ = group_spans((12,), 12, np.array([8.0]), np.array([8.0]), np.array([1.0]), alone=False)
    assert (float(t1[0]), float(r1[0])) == (8, 8)
    # nodes of a power of two: nothing changes (no group both fits and fails to divide one)
    t, r, d = group_spans((8, 8, 4), 8, np.array([4.0]), np.array([8.0]), np.array([2.0]), alone=False)
    assert (float(t[0]), float(r[0]), float(d[0])) == (4, 8, 16)


def test_price_prices_one_layout_on_its_own_gpus() -> None:
    """``nereus price`` places the layout alone on the first tp·pp·dp GPUs: on nodes of 12, one
    TP-8 group stays inside node 0, while four leave the fourth across two nodes (as Megatron's
    contiguous ranks leave the second)."""
    cluster = dataclasses.replace(load_cluster("a100-80gb-dgx"), gpus_per_node=12)
    model = load_model("llama-3.1-8b")

    def classes(dp: int) -> set[str]:
        q = PriceQuery(Stage.TRAIN, 8, 1, dp, 512, 256, 2048, global_batch=128, micro_batch=4)
        return {
            op for op, s in price(model, cluster, q).by_class.items() if op.startswith("allreduce") and s > 0
        }

    assert classes(1) == {AR_INTRA}
    assert AR_INTER in classes(4)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    small_problems(), st.sampled_from([(3, 6), (3, 9), (3, 12), (6, 6), (6, 12), (12, 12), (6, 8), (12, 8)])
)
def test_search_equals_exhaustive_on_nodes_that_are_not_a_power_of_two(
    problem: PlanningProblem, nodes: tuple[int, int]
) -> None:
    """Prices stay a function of one candidate, so the program stays exact; and on whole nodes no
    searched model-stage's TP group or replica is placed on a slower link than it is priced on."""
    gpn, gpus = nodes
    problem = _on_nodes_of(problem, gpn, gpus)
    ex = exhaustive(problem)
    try:
        found = search(problem)
    except InfeasibleError:
        assert ex.count == 0
        return
    assert ex.best_step_latency_s is not None
    assert found.step_latency_s == pytest.approx(ex.best_step_latency_s, rel=1e-9)
    if len(problem.pool) % gpn:
        return  # part-used nodes: best fit's approximations (tests/test_plan_pool_links.py)
    wf, profile = problem.workflow, occupancy(problem.pool, gpn)
    for c in found.plan.candidates:
        tp_span, rep_span, _ = placed_spans(c, gpn)
        alone = alone_on_pool(wf, problem.workload.mode, wf.get(c.model_stage))
        one = np.array([float(c.layout.tp)]), np.array([float(c.layout.size)]), np.array([float(c.dp)])
        priced = group_spans(profile, gpn, *one, alone=alone)
        assert priced[0][0] > gpn or tp_span <= gpn, c
        assert priced[1][0] > gpn or rep_span <= gpn, c
