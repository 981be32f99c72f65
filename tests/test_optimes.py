"""Op-class timings: ideal seconds from the cluster's peaks, the DP all-reduce's link, efficiencies."""

from __future__ import annotations

import pytest

from nereus.plan.calibration import Efficiencies, Measurement
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.runtime.optimes import decode_s, efficiencies, gemm_s, train_times
from nereus.spec import load_cluster, load_model

pytestmark = pytest.mark.pure


def test_ideal_seconds_follow_the_formulas() -> None:
    cluster, model = load_cluster("h200-ib"), load_model("llama-3.1-8b")
    p = model.param_count()
    assert gemm_s(model, Layout(2, 1), 1000, 6.0, cluster.peak_flops) == pytest.approx(
        6 * p / 2 * 1000 / cluster.peak_flops
    )
    assert decode_s(model, Layout(1, 2), 10, 2, cluster) == pytest.approx(
        10 * p / 2 * 2 / (cluster.hbm_bandwidth_gbs * 1e9)
    )
    links = Links(cluster, Efficiencies.unit())
    assert links.ideal_ring_s(Collective.ALLREDUCE, 4, 8_000, Link.INTRA) == pytest.approx(
        1.5 * 8_000 / (cluster.intra_node_bandwidth_gbs * 1e9) + 6 * cluster.intra_node_latency_us * 1e-6
    )


def test_train_times_split_gemm_from_the_dp_allreduce_and_class_its_link() -> None:
    cluster, model = load_cluster("h200-ib"), load_model("tiny-llama")
    per_node = cluster.gpus_per_node
    inside = train_times(
        "actor.train", model, Layout(1, 1), 100, 2.0, 0.5, 4096, (0, 1), cluster, cluster.peak_flops
    )
    across = train_times(
        "actor.train", model, Layout(1, 1), 100, 2.0, 0.5, 4096, (0, per_node), cluster, cluster.peak_flops
    )
    alone = train_times(
        "actor.train", model, Layout(1, 1), 100, 2.0, 0.0, 0, (0,), cluster, cluster.peak_flops
    )
    assert [t.op_class for t in inside] == [OpClass.GEMM, OpClass.ALLREDUCE_INTRA]
    assert [t.op_class for t in across] == [OpClass.GEMM, OpClass.ALLREDUCE_INTER]
    assert [t.op_class for t in alone] == [OpClass.GEMM]
    assert inside[0].measured_s == pytest.approx(1.5) and inside[1].measured_s == pytest.approx(0.5)


def test_efficiency_is_ideal_over_measured_per_class() -> None:
    ms = (
        Measurement(OpClass.GEMM, 1.0, 2.0),
        Measurement(OpClass.GEMM, 1.0, 6.0),
        Measurement(OpClass.MEMORY, 1.0, 4.0),
    )
    assert efficiencies(ms) == {"gemm": pytest.approx(0.25), "memory": pytest.approx(0.25)}
