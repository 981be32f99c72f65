"""A model-stage that loads a trainer's weights at the step boundary (``Workflow.sync_source``) is
placed on that trainer's nodes first, so the weight sync the cost model prices inside the
receiver's replica (``CommTerms._weight_sync``) stays inside those nodes.

The defect this pins: 8B PPO on 128 H100s placed actor.inf on GPUs 0-31 and actor.train on
64-127 (critic.inf on 95-125, critic.train on 0-63): every actor.inf replica loaded the new
weights from other nodes, priced as a copy inside its own GPU. Placement visited the stages in
workflow order and never looked at where the trainer was.

The preference acts among equally free nodes only (best fit first, which the cost model's replay
of placement prices), so on a pool that async generation has fragmented a receiver may still go
to a fuller node than its trainer's."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.plan.bestfit import FreeGpus
from nereus.plan.layout import Plan
from nereus.plan.search import search
from nereus.spec.workload import ExecutionMode
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def _nodes(gpus: tuple[int, ...], gpn: int) -> set[int]:
    return {g // gpn for g in gpus}


def _on_source_nodes(plan: Plan, gpn: int) -> dict[str, tuple[int, int]]:
    """Per weight-sync receiver: its GPUs on its trainer's nodes, and the most it could have
    there (its GPU count, or every GPU of those nodes in the pool)."""
    out = {}
    for c in plan.candidates:
        src = plan.workflow.sync_source(c.model_stage)
        apart = plan.mode is ExecutionMode.ASYNC and c.model_stage == "actor.gen"  # priced between nodes
        if src is None or c.dp == 0 or apart:
            continue
        nodes = _nodes(plan.candidate(src).gpus, gpn)
        room = sum(1 for g in plan.pool if g // gpn in nodes)
        out[c.model_stage] = (sum(1 for g in c.gpus if g // gpn in nodes), min(len(c.gpus), room))
    return out


@pytest.mark.parametrize(
    ("algo", "cluster", "gpus", "mode"),
    [
        ("ppo", "h100-ib", 128, "sync"),
        ("ppo", "h100-ib", 32, "sync"),
        ("grpo", "h100-ib", 64, "sync"),
        ("remax", "a100-80gb-dgx", 32, "sync"),
        ("ppo", "mi250x-slingshot", 256, "sync"),
    ],
)
def test_weight_sync_receivers_sit_on_their_trainers_nodes(
    algo: str, cluster: str, gpus: int, mode: str
) -> None:
    p = make_problem(cluster=cluster, gpus=gpus, algo=algo)
    p = dataclasses.replace(p, workload=dataclasses.replace(p.workload, mode=ExecutionMode(mode)))
    plan = search(p).plan
    assert plan.mode is ExecutionMode(mode)
    got = _on_source_nodes(plan, p.cluster.gpus_per_node)
    assert got, "no weight-sync receiver"
    for name, (on, most) in got.items():
        assert on == most, (name, on, most, plan.candidate(name).gpus)


def test_a_preferred_node_is_taken_first_only_among_equally_free_ones() -> None:
    """Best fit first (the fullest node that still fits: what the cost model's replay of
    placement assumes), and among nodes as free as each other the preferred one."""
    free = FreeGpus(range(32), 8)  # four whole nodes
    assert free.take(2, prefer=frozenset({2})) == (16, 17)  # all equally free: node 2
    assert free.take(4, prefer=frozenset({3})) == (18, 19, 20, 21)  # node 2 is fuller: best fit wins
    assert free.take(8, prefer=frozenset({3})) == tuple(range(24, 32))  # whole nodes: node 3
    assert free.take(16, prefer=frozenset({1})) == tuple(range(0, 16))  # whole nodes 0, 1 (1 first)
    assert free.take(2) == (22, 23)
