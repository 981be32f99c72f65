"""Decode is its own op class (issue 19): generation's HBM reads calibrate from generation only,
the trainers' memory-bound passes (optimizer step) keep ``OpClass.MEMORY``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from nereus.plan.calibration import CalibrationStore, Efficiencies, Measurement
from nereus.plan.cost import CostModel, memory_bound
from nereus.plan.evaluate import ideal_shapes, price, shapes_of
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass
from nereus.plan.search import search
from nereus.sim.observe import pair
from nereus.spec import load_cluster
from tests.helpers import benchmark_module, make_problem

pytestmark = pytest.mark.pure

# the A100 async window's trainer samples (issue 19): tiny optimizer passes measured 25× slower
TRAINER_SIZES = [math.exp(23.6 + 0.2 * k) for k in range(7)]  # e^23.6 … e^24.8 bytes
DECODE_SIZES = [math.exp(22.6 + 0.4 * k) for k in range(7)]  # e^22.6 … e^25.0 bytes


def trainer_and_decode_store() -> CalibrationStore:
    store = CalibrationStore("a100")
    store.update(Measurement(OpClass.MEMORY, 0.05, 0.05 / 0.04, s, 1.0) for s in TRAINER_SIZES)
    store.update(Measurement(OpClass.DECODE, 200.0, 200.0 / 0.55, s, 1.0) for s in DECODE_SIZES)
    return store


def test_decode_and_optimizer_no_longer_share_a_curve() -> None:
    eff = trainer_and_decode_store().efficiencies()
    assert {OpClass.MEMORY, OpClass.DECODE} <= set(eff.curves)
    big = math.exp(24.8)
    assert float(eff.at(OpClass.MEMORY, big, 1.0)) == pytest.approx(0.04, rel=0.02)
    assert float(eff.at(OpClass.DECODE, big, 1.0)) == pytest.approx(0.55, rel=0.02)
    # the cost model prices generation's decode at decode's η and the optimizer at memory's
    c = load_cluster("a100-64gb-hdr100")
    links = Links(c, eff)
    hbm = c.hbm_bandwidth_gbs * 1e9
    decode = memory_bound(links, big, op=OpClass.DECODE)
    assert set(decode.by_class) == {OpClass.DECODE}
    assert float(decode.total) == pytest.approx(big / (0.55 * hbm), rel=0.02)
    assert float(memory_bound(links, big).total) == pytest.approx(big / (0.04 * hbm), rel=0.02)


def test_generation_prices_decode_and_trainers_the_optimizer_as_memory() -> None:
    p = make_problem(cluster="h200-ib", gpus=64)
    cost = CostModel(p)
    gen, _ = cost.evaluate(p.workflow.get("actor.gen"), Layout(1, 1), np.array([64]), np.array([8]))
    assert float(gen.by_class[OpClass.DECODE][0]) > 0 and OpClass.MEMORY not in gen.by_class
    train, _ = cost.evaluate(p.workflow.get("actor.train"), Layout(8, 2), np.array([1]), np.array([4]))
    assert float(train.by_class[OpClass.MEMORY][0]) > 0 and OpClass.DECODE not in train.by_class
    # unshaped, decode reads its own class-wide η (prior 0.5), not memory's
    slow = dict(PRIOR_EFFICIENCY) | {OpClass.MEMORY: 0.05}
    slowed = CostModel(dataclasses.replace(p, efficiencies=Efficiencies(eta=slow)))
    gen2, _ = slowed.evaluate(p.workflow.get("actor.gen"), Layout(1, 1), np.array([64]), np.array([8]))
    assert float(gen2.by_class[OpClass.DECODE][0]) == pytest.approx(float(gen.by_class[OpClass.DECODE][0]))


def test_pair_puts_generation_memory_under_decode() -> None:
    problem = make_problem(gpus=16)
    shapes = shapes_of(search(problem).plan)
    sized_ = ideal_shapes(problem, shapes)
    gen = sized_["actor.gen"]
    assert OpClass.DECODE in gen and gen[OpClass.DECODE].size > 0 and gen[OpClass.DECODE].group >= 1.0
    ideal = {op: c.ideal_s for op, c in gen.items()}
    # the truth names its decode reads "memory": on generation they join the roofline in decode
    truth = {"memory": 2.0 * ideal[OpClass.DECODE], "gemm": 1.5 * ideal[OpClass.GEMM]}
    got = {m.op_class: m for m in pair(ideal, truth, gen, roofline=True)}
    assert OpClass.MEMORY not in got and got[OpClass.DECODE].measured_s == pytest.approx(sum(truth.values()))
    train = sized_["actor.train"]
    tideal = {op: c.ideal_s for op, c in train.items()}
    tgot = {m.op_class for m in pair(tideal, {"memory": 1.0, "gemm": 2.0}, train)}
    assert OpClass.MEMORY in tgot and OpClass.DECODE not in tgot


def test_calibration_file_roundtrip_with_decode(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    store = trainer_and_decode_store()
    store.update([Measurement(OpClass.DECODE, 1.0, 2.0)])
    store.save(path)
    doc = json.loads(path.read_text())["clusters"]["a100"]
    assert len(doc["shaped"]["decode"]) == len(DECODE_SIZES) and len(doc["shaped"]["memory"]) == len(
        TRAINER_SIZES
    )
    again = CalibrationStore.load(path, "a100")
    assert again.efficiencies().curves == store.efficiencies().curves
    assert again.efficiency(OpClass.DECODE) == store.efficiency(OpClass.DECODE)
    # a file written before the class existed (memory samples only) loads: decode at its prior
    old = tmp_path / "old.json"
    entry = {"window": 8, "samples": {"memory": [[1.0, 4.0]]}, "memory": {}}
    old.write_text(json.dumps({"format": 2, "clusters": {"a100": entry}}))
    loaded = CalibrationStore.load(old, "a100")
    assert loaded.efficiency(OpClass.MEMORY) == 0.25
    assert loaded.efficiencies()[OpClass.DECODE] == PRIOR_EFFICIENCY[OpClass.DECODE]


def test_a100_async_window_no_longer_keeps_the_slow_generation_plan() -> None:
    """The window that dominated the A100 async admission run (us-west-2a, offset 1600): after the
    revocation to 8 GPUs nereus kept actor.gen tp2·pp1·dp1 mb16 because its calibration priced
    static's mb128 generation at 18× its truth (η of decode read off the optimizer's curve). Now
    nereus's calibration prices static's generation like static's own does, and nereus runs a
    large micro-batch there too."""
    adm = benchmark_module("admission")
    from nereus.sim.engine import _Run

    trace = next(t for t in adm.TRACES if "us-west-2a" in str(t))
    runs: dict[str, _Run] = {}
    until = 40  # nereus: the first step from 20 on where the revocation has left 8 GPUs
    for policy in ("nereus", "static"):
        run = _Run(adm.scenario("a100-8-32-async", Path(trace), 1600, 40, seed=1600), policy, 0.5)
        prev, k = None, 0
        while k < until and not (policy == "nereus" and k >= 20 and len(run.pool()) == 8):
            rec, prev = run.step(k, prev)
            k += 0 if rec.lost else 1
        until = k
        runs[policy] = run
    nereus, static = runs["nereus"], runs["static"]
    assert len(nereus.pool()) == 8 and until < 40
    seq = nereus.s.lengths(until)
    gen = {who: shapes_of(r.controller.plan)["actor.gen"] for who, r in runs.items()}
    assert gen["nereus"].micro_batch > 16
    static_plan = shapes_of(static.controller.plan)
    by_nereus = price(nereus.controller.problem(nereus.pool(), seq), static_plan).latency["actor.gen"]
    by_static = price(static.controller.problem(nereus.pool(), seq), static_plan).latency["actor.gen"]
    assert by_nereus == pytest.approx(by_static, rel=0.25)
