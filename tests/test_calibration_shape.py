"""Calibration by shape: η per op class as a curve of the size of the work (and a collective's
ranks per node), learned from sized measurements, priced per candidate at its own shape."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from nereus.errors import ConfigError
from nereus.plan.calibration import CalibrationStore, Efficiencies, Measurement
from nereus.plan.candidates import candidate_table
from nereus.plan.cost import CostModel, collective
from nereus.plan.evaluate import ideal_shapes, price, unsized
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.opclass import PRIOR_EFFICIENCY, Collective, Link, OpClass
from nereus.plan.search import search
from nereus.plan.shapefit import ShapeCurve, fit_curve
from nereus.runtime.optimes import OpTime
from nereus.sim.observe import pair
from nereus.spec import load_cluster
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def hill(size: float) -> float:
    """A saturating efficiency (not the fit's piecewise-linear form): 0.8·s/(s + 1e9)."""
    return 0.8 * size / (size + 1e9)


def sized(op: OpClass, sizes: list[float], eta=hill, group: float = 0.0) -> list[Measurement]:  # type: ignore[no-untyped-def]
    return [Measurement(op, 1.0, 1.0 / eta(s), s, group) for s in sizes]


def test_curve_follows_a_saturating_efficiency_and_holds_its_ends() -> None:
    sizes = [10 ** (7 + 0.25 * k) for k in range(17)]  # 1e7 … 1e11
    store = CalibrationStore("x")
    store.update(sized(OpClass.GEMM, sizes))
    eff = store.efficiencies()
    assert OpClass.GEMM in eff.curves
    for s in (3e7, 1e9, 5e10):
        assert float(eff.at(OpClass.GEMM, s)) == pytest.approx(hill(s), rel=0.08)
    # outside the measured sizes the curve holds its end values
    assert float(eff.at(OpClass.GEMM, 1e13)) == pytest.approx(float(eff.at(OpClass.GEMM, 1e11)))
    assert float(eff.at(OpClass.GEMM, 1e3)) == pytest.approx(float(eff.at(OpClass.GEMM, 1e7)))
    # a row of unknown size takes the class-wide η, which is Σ ideal / Σ measured as before
    assert float(eff.at(OpClass.GEMM, 0.0)) == eff[OpClass.GEMM] == store.efficiency(OpClass.GEMM)


def test_curve_rejects_a_straggler() -> None:
    sizes = [10 ** (7 + 0.25 * k) for k in range(17)]
    clean = fit_curve([(1.0, 1.0 / hill(s), s, 0.0) for s in sizes], 0.5)
    noisy = fit_curve([(1.0, 1.0 / hill(s), s, 0.0) for s in sizes] + [(1.0, 100.0, 1e9, 0.0)], 0.5)
    assert clean is not None and noisy is not None
    assert float(noisy.eta(1e9)) == pytest.approx(float(clean.eta(1e9)), rel=0.02)


def test_no_curve_from_too_few_or_one_size() -> None:
    assert fit_curve([(1.0, 2.0, 1e9, 0.0)] * 3, 0.5) is None
    assert fit_curve([(1.0, 2.0, 1e9, 0.0)] * 10, 0.5) is None  # one size: the class-wide η says it all
    store = CalibrationStore("x")
    store.update([Measurement(OpClass.GEMM, 1.0, 2.0)] * 10)  # sizes unknown (the runtime's timers)
    assert store.efficiencies().curves == {}


def test_each_group_bucket_has_its_own_curve() -> None:
    """A hierarchical all-reduce moves 1/g of the bytes over each NIC: against the planner's flat
    ring the achieved η grows like g, beyond 1 (a curve allows it; the class-wide η does not)."""
    ms = [
        Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / (0.4 * g * hill(s) / 0.8), s, g)
        for g in (1.0, 2.0, 4.0, 8.0)
        for s in (1e7, 1e8, 1e9, 1e10)
    ]
    store = CalibrationStore("x")
    store.update(ms)
    eff = store.efficiencies()
    assert eff.curves[OpClass.ALLREDUCE_INTER].groups == (0, 1, 2, 3)
    at8 = float(eff.at(OpClass.ALLREDUCE_INTER, 1e10, 8.0))
    at1 = float(eff.at(OpClass.ALLREDUCE_INTER, 1e10, 1.0))
    assert at8 / at1 == pytest.approx(8.0, rel=0.05)
    assert at8 > 1.0 and eff[OpClass.ALLREDUCE_INTER] <= 1.0
    # a bucket never measured takes the pooled curve; a mixed sample's group rounds to its bucket
    pooled = float(eff.curves[OpClass.ALLREDUCE_INTER].eta(1e10))
    assert float(eff.at(OpClass.ALLREDUCE_INTER, 1e10, 64.0)) == pytest.approx(pooled)
    assert float(eff.at(OpClass.ALLREDUCE_INTER, 1e10, 7.0)) == pytest.approx(at8)


def test_groups_that_vary_with_size_do_not_extrapolate() -> None:
    """Pipeline stages and bytes per pass vary together (deeper pipelines, fewer bytes per stage):
    a row at a combination never measured stays within what its bucket measured."""
    ms = [Measurement(OpClass.MEMORY, 1.0, 1.0 / 0.5, s, 1.0) for s in (1e10, 2e10, 4e10, 8e10)]
    ms += [Measurement(OpClass.MEMORY, 1.0, 1.0 / 0.1, s, 4.0) for s in (1e9, 2e9, 4e9, 8e9)]
    store = CalibrationStore("x")
    store.update(ms)
    eff = store.efficiencies()
    assert float(eff.at(OpClass.MEMORY, 1e8, 1.0)) == pytest.approx(0.5, rel=0.02)  # held at its end
    assert float(eff.at(OpClass.MEMORY, 1e12, 4.0)) == pytest.approx(0.1, rel=0.02)


def test_no_curves_prices_exactly_as_before() -> None:
    """Without sized samples every row's price is bit for bit the class-wide one; tracking shapes
    changes no price either."""
    problem = make_problem(gpus=16)
    store = CalibrationStore(problem.cluster.name)
    store.update([Measurement(OpClass.GEMM, 1.0, 1.4), Measurement(OpClass.ALLREDUCE_INTRA, 1.0, 2.5)])
    plain = Efficiencies(eta=store.efficiencies().eta)
    with_store = dataclasses.replace(problem, efficiencies=store.efficiencies())
    with_plain = dataclasses.replace(problem, efficiencies=plain)
    for m in problem.workflow.model_stages:
        a = candidate_table(CostModel(with_store), m)
        b = candidate_table(CostModel(with_plain), m)
        c = candidate_table(CostModel(with_plain, track=True), m)
        assert np.array_equal(a.latency, b.latency) and np.array_equal(b.latency, c.latency)


def test_curve_prices_each_row_at_its_own_size() -> None:
    """A GEMM curve that punishes small kernels makes high TP (smaller per-GPU GEMMs) dearer
    relative to TP 1 than the class-wide η says."""
    problem = make_problem(gpus=16)
    ms = problem.workflow.get("actor.train")
    store = CalibrationStore(problem.cluster.name)
    store.update(sized(OpClass.GEMM, [10 ** (9 + 0.25 * k) for k in range(17)], lambda s: hill(s / 1e3)))
    eff = store.efficiencies()
    flat = dataclasses.replace(problem, efficiencies=Efficiencies(eta=eff.eta))
    shaped = dataclasses.replace(problem, efficiencies=eff)

    def gemm(p, tp: int) -> float:  # type: ignore[no-untyped-def]
        terms, _ = CostModel(p).evaluate(ms, Layout(tp, 1), np.array([16 // tp]), np.array([1]))
        return float(terms.parts["compute"].by_class[OpClass.GEMM][0])

    assert gemm(shaped, 8) / gemm(shaped, 1) > 1.3 * gemm(flat, 8) / gemm(flat, 1)


def test_collective_reads_eta_by_bytes_and_group() -> None:
    c = load_cluster("a100-64gb-hdr100")
    curve = ShapeCurve((math.log(1e6), math.log(1e9)), (math.log(0.1), math.log(0.8)))
    eff = Efficiencies(curves={OpClass.ALLREDUCE_INTRA: curve})
    links = Links(c, eff)
    small = float(collective(links, Collective.ALLREDUCE, 4, 4, 1e6).total)
    big = float(collective(links, Collective.ALLREDUCE, 4, 4, 1e9).total)
    hops = 6 * c.intra_node_latency_us * 1e-6
    bw = c.intra_node_bandwidth_gbs * 1e9
    assert small == pytest.approx((1.5 * 1e6 / bw + hops) / 0.1)  # η divides latency too
    assert big == pytest.approx((1.5 * 1e9 / bw + hops) / 0.8)
    # the inter class has no curve: its prior, as before
    inter = float(collective(links, Collective.ALLREDUCE, 64, 8, 1e9).total)
    flat = float(collective(Links(c, Efficiencies()), Collective.ALLREDUCE, 64, 8, 1e9).total)
    assert inter == flat


def test_ideal_shapes_match_price_and_carry_the_gemm_size() -> None:
    problem = make_problem(gpus=16)
    plan = search(problem).plan
    from nereus.plan.evaluate import shapes_of

    shapes = shapes_of(plan)
    unit = dataclasses.replace(problem, efficiencies=Efficiencies.unit())
    ideal = price(unit, shapes)
    sized_ = ideal_shapes(problem, shapes)
    m = problem.model_of(problem.workflow.get("actor.train"))
    s = shapes["actor.train"]
    layer = 2.0 * (m.hidden_size * (2 * m.q_size + 2 * m.kv_size) + m.mlp_params())
    tokens = s.micro_batch * problem.seq.mean_len
    assert sized_["actor.train"][OpClass.GEMM].size == pytest.approx(layer * tokens / s.layout.tp)
    for name, classes in sized_.items():
        assert {op: c.ideal_s for op, c in classes.items()} == pytest.approx(
            {op: t for op, t in ideal.by_class[name].items() if t > 0}
        )
        for op, c in classes.items():
            stage = problem.workflow.get(name).stage
            assert (c.size > 0) is (op not in unsized(stage))
            grouped = op.value.startswith(("allreduce", "allgather", "memory", "decode"))
            assert (c.group >= 1.0) if grouped else c.group == 0.0


def test_pair_carries_shapes_and_unknown_falls_back() -> None:
    problem = make_problem(gpus=16)
    from nereus.plan.evaluate import shapes_of

    shapes = shapes_of(search(problem).plan)
    sized_ = ideal_shapes(problem, shapes)["actor.train"]
    ideal = {op: c.ideal_s for op, c in sized_.items()}
    truth = {op.value: 1.3 * t for op, t in ideal.items()}
    with_shape = pair(ideal, truth, sized_)
    assert all(m.size == sized_[m.op_class].size for m in with_shape)
    without = pair(ideal, truth)
    assert all(m.size == 0.0 and m.group == 0.0 for m in without)
    # the runtime's op timings carry no shape: the store keeps their class-wide η only
    runtime = OpTime("actor.train", OpClass.GEMM, 1.0, 1.25).measurement()
    assert runtime is not None and runtime.size == 0.0
    store = CalibrationStore("x")
    store.update([runtime] * 8)
    assert store.efficiency(OpClass.GEMM) == pytest.approx(0.8) and not store.efficiencies().curves


def test_persistence_format_2_roundtrip_and_format_1_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    store = CalibrationStore("a100")
    store.update(sized(OpClass.GEMM, [10 ** (7 + 0.5 * k) for k in range(9)]))
    store.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == 2 and len(doc["clusters"]["a100"]["shaped"]["gemm"]) == 9
    again = CalibrationStore.load(path, "a100")
    assert again.efficiencies().curves == store.efficiencies().curves
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(
            {
                "format": 1,
                "clusters": {"a100": {"window": 8, "samples": {"gemm": [[1.0, 2.0]]}, "memory": {}}},
            }
        )
    )
    loaded = CalibrationStore.load(old, "a100")
    assert loaded.efficiency(OpClass.GEMM) == 0.5 and not loaded.efficiencies().curves
    loaded.save(old)  # merged into a format-1 file: it becomes format 2
    assert json.loads(old.read_text())["format"] == 2
    old.write_text(json.dumps({"format": 3, "clusters": {}}))
    with pytest.raises(ConfigError, match="key 'format': expected 1 or 2"):
        CalibrationStore.load(old, "a100")
    bad = {"window": 8, "samples": {}, "memory": {}, "shaped": {"gemm": [[1.0, 2.0, -5.0, 0.0]]}}
    old.write_text(json.dumps({"format": 2, "clusters": {"a100": bad}}))
    with pytest.raises(ConfigError, match=r"shaped\.gemm"):
        CalibrationStore.load(old, "a100")


def test_values_are_validated() -> None:
    with pytest.raises(ValueError, match="size and group"):
        Measurement(OpClass.GEMM, 1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="knots must increase"):
        ShapeCurve((1.0, 1.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="at least two knots"):
        ShapeCurve((1.0,), (0.0,))
    assert PRIOR_EFFICIENCY[OpClass.GEMM] == Efficiencies().at(OpClass.GEMM, 1e9)


def test_memory_bound_reads_eta_by_bytes_and_pipeline_stages() -> None:
    from nereus.plan.cost import memory_bound

    c = load_cluster("a100-64gb-hdr100")
    four = ((math.log(1e8), math.log(1e10)), (math.log(0.05), math.log(0.2)))
    curve = ShapeCurve((math.log(1e8), math.log(1e10)), (math.log(0.2), math.log(0.8)), (2,), (four,))
    links = Links(c, Efficiencies(curves={OpClass.MEMORY: curve}))
    hbm = c.hbm_bandwidth_gbs * 1e9
    assert float(memory_bound(links, 1e10).total) == pytest.approx(1e10 / (0.8 * hbm))
    assert float(memory_bound(links, 1e8).total) == pytest.approx(1e8 / (0.2 * hbm))
    # a decode step cycling through 4 pipeline stages reads its bucket's curve
    assert float(memory_bound(links, 1e10, stages=4.0).total) == pytest.approx(4e10 / (0.8 * hbm))
    plain = Links(c, Efficiencies())
    assert float(memory_bound(plain, 1e10).total) == 1e10 / plain.copy_rate


@pytest.mark.parametrize("sized", [False, True])
def test_a_latency_bound_collective_prices_back_as_measured(sized: bool) -> None:
    """A measured collective's η is its whole ideal (bandwidth and the ring's hop latency) over what
    it took, so the planner divides the whole ideal by η: calibrated on small all-reduces whose
    latency is most of their ideal, it prices them at what they took (it priced them about 2× too
    fast when η divided only the bandwidth term)."""
    c = load_cluster("a100-64gb-hdr100")
    unit = Links(c, Efficiencies.unit())
    sizes = (2e5, 1e6, 5e6) if sized else (1e6,)
    took = {b: 3.0 * unit.ideal_ring_s(Collective.ALLREDUCE, 4, b, Link.INTRA) for b in sizes}
    hops = 6 * c.intra_node_latency_us * 1e-6
    assert hops > 0.5 * unit.ideal_ring_s(Collective.ALLREDUCE, 4, 1e6, Link.INTRA)  # latency-bound
    store = CalibrationStore(c.name)
    for _ in range(40):
        store.update(
            [
                Measurement(
                    OpClass.ALLREDUCE_INTRA,
                    unit.ideal_ring_s(Collective.ALLREDUCE, 4, b, Link.INTRA),
                    t,
                    b if sized else 0.0,
                    4.0 if sized else 0.0,
                )
                for b, t in took.items()
            ]
        )
    links = Links(c, store.efficiencies())
    for b, t in took.items():
        got = float(collective(links, Collective.ALLREDUCE, 4, 4, b).total)
        assert got == pytest.approx(t, rel=0.05)
