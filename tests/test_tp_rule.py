"""The tensor-parallel rule one place keeps (``ModelSpec.tp_conflict``): tp divides the attention
heads, and tp and the KV heads divide one another. Checked against the geometry oracle of
``tests/test_geometry.py`` for every head count up to 64, and on models with awkward head counts:
every layout the planner enumerates or picks is one the state geometry (and so the runtime, vLLM,
Megatron) can shard."""

from __future__ import annotations

import itertools

import pytest

from nereus.plan.candidates import layouts
from nereus.plan.layout import Layout
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.spec import ModelFamily, ModelSpec, Role, load_cluster, load_workload
from nereus.state.geometry import check_layout
from tests.test_geometry import admits

pytestmark = pytest.mark.pure


def awkward(heads: int, kv: int, layers: int = 12, hidden_per_head: int = 128) -> ModelSpec:
    """A model whose head counts are not powers of two (or KV heads that tp cannot split)."""
    return ModelSpec(
        name=f"awkward-{heads}-{kv}", family=ModelFamily.LLAMA, hidden_size=heads * hidden_per_head,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        intermediate_size=4 * heads * hidden_per_head, vocab_size=32000,
    )  # fmt: skip


AWKWARD = [(48, 6, 60), (6, 3, 12), (40, 8, 40), (28, 4, 28), (14, 2, 24), (12, 12, 12), (20, 5, 8)]


def test_tp_options_are_what_check_layout_admits() -> None:
    for heads in range(1, 65):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            m = awkward(heads, kv, hidden_per_head=2)
            for tp in (1, 2, 4, 8, 16, 32, 64, 128):
                assert (not m.tp_conflict(tp)) == admits(m, Layout(tp, 1)), (heads, kv, tp)
            assert m.tp_options() == tuple(t for t in (1, 2, 4, 8, 16, 32, 64) if admits(m, Layout(t, 1)))
    assert awkward(48, 6).tp_options() == (1, 2) and awkward(6, 3).tp_options() == (1,)
    assert awkward(40, 8).tp_options(64) == (1, 2, 4, 8) and awkward(12, 12).tp_options() == (1, 2, 4)
    assert awkward(48, 6).tp_refusal(4, 8) == (
        "tp 4 and the 6 KV heads must divide one another "
        "(awkward-48-6: 48 attention heads, 6 KV heads; allowed tp: 1, 2)"
    )
    assert awkward(48, 6).tp_refusal(2) == ""


@pytest.mark.parametrize(("heads", "kv", "layers"), AWKWARD)
def test_the_planner_emits_only_layouts_check_layout_admits(heads: int, kv: int, layers: int) -> None:
    """Every candidate layout (node-sized and widened tp, several pools), and every plan the search
    picks, is one the state geometry (and so the runtime, vLLM, Megatron) can shard."""
    m = awkward(heads, kv, layers)
    cluster, workload = load_cluster("h100-ib"), load_workload("ppo")
    for gpus, max_tp in itertools.product((1, 2, 8, 24, 64, 128), (0, 64)):
        problem = PlanningProblem(
            workload, dict.fromkeys(Role, m), cluster, tuple(range(gpus)), SeqStats.fixed(256, 1024),
            space=SearchSpace(max_tp=max_tp),
        )  # fmt: skip
        for ms in problem.workflow.model_stages:
            found = layouts(problem, ms)
            assert found, (gpus, ms.name)  # tp1·pp1 always
            for lay in found:
                check_layout(problem.model_of(ms), lay)
        if gpus in (64, 128) and max_tp == 0:
            for c in search(problem).plan.candidates:
                check_layout(m, c.layout)
