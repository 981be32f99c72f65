"""Cost model: collective and compute formulas by hand, and the directions a planner relies on."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import numpy as np
import pytest

from nereus.errors import ConfigError
from nereus.plan.calibration import Efficiencies
from nereus.plan.cost import CostModel, collective, compute
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.memory import act_bytes
from nereus.plan.opclass import PRIOR_EFFICIENCY, Collective, Link, OpClass
from nereus.spec import load_cluster
from nereus.spec.workload import Precision
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def test_ring_collectives_by_hand() -> None:
    c = load_cluster("h200-ib")
    links = Links(c, Efficiencies())
    eta = PRIOR_EFFICIENCY[OpClass.ALLREDUCE_INTRA]
    got = collective(links, Collective.ALLREDUCE, 4, 4, 1e9)  # 4 GPUs inside a node
    assert float(got.total) == pytest.approx((2 * 3 / 4 * 1e9 / 450e9 + 6 * 2e-6) / eta)
    assert float(got.by_class[OpClass.ALLREDUCE_INTER]) == 0.0
    eta = PRIOR_EFFICIENCY[OpClass.ALLGATHER_INTER]
    got = collective(links, Collective.ALLGATHER, 64, 8, 8e8)  # 8 ranks spread over nodes
    assert float(got.by_class[OpClass.ALLGATHER_INTER]) == pytest.approx(
        (7 / 8 * 8e8 / 3.125e9 + 7 * 10e-6) / eta
    )
    assert float(collective(links, Collective.BROADCAST, 1, 1, 1e9).total) == 0.0
    assert links.link_for(8) is Link.INTRA and links.link_for(9) is Link.INTER


def test_compute_uses_class_efficiency() -> None:
    c = load_cluster("h200-ib")
    t = compute(c.peak_flops, Efficiencies(), 1e15, 2e14)
    assert float(t.by_class[OpClass.GEMM]) == pytest.approx(1e15 / (PRIOR_EFFICIENCY[OpClass.GEMM] * 989e12))
    assert float(t.by_class[OpClass.ATTENTION]) == pytest.approx(
        2e14 / (PRIOR_EFFICIENCY[OpClass.ATTENTION] * 989e12)
    )


def _latency(problem, name: str, layout: Layout, dp: int, micro: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    cost = CostModel(problem)
    terms, _ = cost.evaluate(problem.workflow.get(name), layout, np.array([dp]), np.array([micro]))
    return {k: float(np.ravel(v)[0]) for k, v in terms.terms.items()}


def test_more_replicas_finish_sooner() -> None:
    p = make_problem()
    one = sum(_latency(p, "ref.inf", Layout(1, 1), 1, 16).values())
    four = sum(_latency(p, "ref.inf", Layout(1, 1), 4, 16).values())
    assert four == pytest.approx(one / 4, rel=0.02)
    gen1 = sum(_latency(p, "actor.gen", Layout(2, 1), 1, 256).values())
    gen4 = sum(_latency(p, "actor.gen", Layout(2, 1), 4, 256).values())
    assert gen4 < gen1


def test_terms_present_where_they_belong() -> None:
    p = make_problem()
    train = _latency(p, "actor.train", Layout(2, 2), 2, 4)
    assert set(train) == {"compute", "tp_comm", "pp_comm", "bubble", "dp_sync", "optimizer"}
    assert all(v > 0 for v in train.values())
    single = _latency(p, "actor.train", Layout(1, 1), 1, 4)
    assert single["tp_comm"] == single["pp_comm"] == single["bubble"] == single["dp_sync"] == 0
    assert "weight_sync" in _latency(p, "actor.gen", Layout(1, 1), 1, 8)
    assert "weight_sync" in _latency(p, "critic.inf", Layout(1, 1), 1, 8)
    assert "weight_sync" not in _latency(p, "ref.inf", Layout(1, 1), 1, 8)


def test_pipeline_bubble_follows_1f1b() -> None:
    p = make_problem()
    t = _latency(p, "actor.train", Layout(1, 4), 1, 4)
    slots_per_update = 128 // 4  # micro-batches per replica per update
    # bubble = (pp − 1) slots, the rest are m slots: ratio (p − 1) / m (Narayanan et al. 2021)
    per_slot = (t["compute"] + t["tp_comm"] + t["pp_comm"]) / slots_per_update
    assert t["bubble"] == pytest.approx(3 * per_slot)


def test_doubling_efficiency_halves_bandwidth_terms() -> None:
    p = make_problem()
    fast = dataclasses.replace(
        p,
        efficiencies=Efficiencies(
            eta=MappingProxyType({k: min(1.0, 2 * v) for k, v in PRIOR_EFFICIENCY.items()})
        ),
    )
    base = _latency(p, "ref.inf", Layout(1, 1), 2, 16)
    quick = _latency(fast, "ref.inf", Layout(1, 1), 2, 16)
    assert quick["compute"] == pytest.approx(base["compute"] / 2)


def test_longer_responses_cost_more_time_and_memory() -> None:
    short, long = make_problem(response=1024), make_problem(response=4096)
    for name, lay, micro in (("actor.gen", Layout(2, 1), 64), ("actor.train", Layout(2, 2), 4)):
        ms = short.workflow.get(name)
        a_t, a_m = CostModel(short).evaluate(ms, lay, np.array([2]), np.array([micro]))
        b_t, b_m = CostModel(long).evaluate(ms, lay, np.array([2]), np.array([micro]))
        assert float(b_t.total[0]) > 2 * float(a_t.total[0])
        assert float(b_m.active[0]) > float(a_m.active[0])


def test_time_is_attributed_to_op_classes() -> None:
    p = make_problem(cluster="h200-ib", gpus=64)
    cost = CostModel(p)
    ms = p.workflow.get("actor.train")
    terms, _ = cost.evaluate(ms, Layout(8, 2), np.array([1, 2, 4]), np.array([4, 4, 4]))
    by_class = terms.by_class
    assert np.allclose(sum(by_class.values()), terms.total)
    # tp 8 stays in a node; a 16-GPU replica's pipeline crosses nodes; DP over replicas too
    assert np.all(by_class[OpClass.ALLREDUCE_INTRA] > 0) and np.all(by_class[OpClass.SENDRECV_INTER] > 0)
    assert by_class[OpClass.ALLREDUCE_INTER][0] == 0 and np.all(by_class[OpClass.ALLREDUCE_INTER][1:] > 0)
    assert np.all(by_class[OpClass.GEMM] > by_class[OpClass.ATTENTION])
    gen, _ = cost.evaluate(p.workflow.get("actor.gen"), Layout(1, 1), np.array([64]), np.array([8]))
    assert float(gen.by_class[OpClass.DECODE][0]) > 0  # decode is memory-bound at this batch


def test_fp32_is_priced_at_the_fp32_peak_with_four_byte_activations() -> None:
    """A workload of precision fp32 runs its matmuls at the cluster's FP32 rate (67 against 989
    TFLOP/s on H100), keeps 4-byte activations and moves 4-byte weights; bf16-mixed as before."""
    bf16 = make_problem(cluster="h100-ib", gpus=8)
    fp32 = make_problem(cluster="h100-ib", gpus=8, precision=Precision.FP32)
    name, layout = "actor.train", Layout(4, 1)
    a, b = _latency(bf16, name, layout, 2, 1), _latency(fp32, name, layout, 2, 1)
    assert b["compute"] == pytest.approx(a["compute"] * 989 / 67, rel=0.05)
    ms = bf16.workflow.get(name)
    mem_a = CostModel(bf16).evaluate(ms, layout, np.array([2]), np.array([1]))[1]
    mem_b = CostModel(fp32).evaluate(fp32.workflow.get(name), layout, np.array([2]), np.array([1]))[1]
    assert 1.5 * float(mem_a.activations[0]) < float(mem_b.activations[0]) < 2 * float(mem_a.activations[0])
    assert act_bytes(Precision.FP32) == 2 * act_bytes(Precision.BF16_MIXED)  # (the fp32 logits stay)


def test_fp32_on_a_cluster_without_its_peak_is_one_line() -> None:
    p = make_problem(cluster="h100-ib", gpus=8, precision=Precision.FP32)
    p = dataclasses.replace(p, cluster=dataclasses.replace(p.cluster, peak_fp32_tflops=None))
    with pytest.raises(ConfigError, match="precision fp32 needs peak_fp32_tflops"):
        CostModel(p)
