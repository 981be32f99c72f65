"""A replan's options are priced where their GPUs put them, as the running plan is.

The search prices each model-stage as if it had the pool to itself; on a fragmented pool (spot
instances of 2 GPUs on 4-GPU nodes) placement shares the pool, and a stage-mate can take the room
another was priced in, leaving its TP group across nodes. Admission compared the running plan,
priced where it runs, with targets priced where they would not: on a sine-shaped trace a move
priced at 32 s per step ran at 51 s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from nereus.control.options import Options
from nereus.plan.evaluate import placed_latency, price, shapes_of
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.search import search
from nereus.spec import Role, load_cluster, load_model, load_workload

pytestmark = pytest.mark.pure

# 2-GPU instances on 4-GPU nodes: whole nodes 0, 1 and 4, halves of 2, 3, 5 and 7
FRAGMENTED = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15, 16, 17, 20, 21, 30, 31)


def _problem(pool: tuple[int, ...]) -> PlanningProblem:
    model, workload = load_model("llama-3.1-8b"), load_workload("ppo")
    seq = SeqStats(workload.prompt_len, 502, 577)
    return PlanningProblem(workload, {r: model for r in Role}, load_cluster("a100-64gb-hdr100"), pool, seq)


def test_an_option_on_a_fragmented_pool_is_priced_where_it_is_placed() -> None:
    p = _problem(FRAGMENTED)
    found = search(p)
    where = price(replace(p, anchor=found.plan), shapes_of(found.plan)).step_latency_s
    assert where > 1.5 * found.step_latency_s  # a group placed across nodes its price did not cross
    assert placed_latency(p, found.plan, found.step_latency_s) == pytest.approx(where)
    options = Options(search, p.cluster, None, 120.0, 0.1)
    assert options.plan(p, "target").step_latency_s == pytest.approx(where)  # type: ignore[union-attr]


def test_whole_nodes_keep_the_search_price_and_the_fastest_placed_option_leads() -> None:
    whole = _problem(tuple(range(16)))
    found = search(whole)
    assert placed_latency(whole, found.plan, found.step_latency_s) == found.step_latency_s
    options = Options(search, whole.cluster, None, 120.0, 10.0)
    p = replace(_problem(FRAGMENTED), anchor=found.plan)
    ranked = options.around(p, found.plan)
    assert len(ranked) > 1
    assert ranked[0].step_latency_s == min(o.step_latency_s for o in ranked)
    for o in ranked:
        assert o.step_latency_s == pytest.approx(
            price(replace(p, anchor=o.plan), shapes_of(o.plan)).step_latency_s
        )
