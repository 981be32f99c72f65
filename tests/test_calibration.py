"""Calibration: robust per-class efficiencies, memory factors, JSON persistence keyed by cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.plan.calibration import CalibrationStore, Efficiencies, Measurement
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass
from nereus.spec import Stage

pytestmark = pytest.mark.pure


def test_priors_until_measured() -> None:
    store = CalibrationStore("h200-ib")
    assert store.efficiencies().eta == PRIOR_EFFICIENCY
    assert store.efficiency(OpClass.GEMM) == PRIOR_EFFICIENCY[OpClass.GEMM]


def test_fit_recovers_efficiency_and_ignores_outliers() -> None:
    store = CalibrationStore("h200-ib")
    ideal = [0.1, 0.2, 0.4, 0.8, 1.6, 0.3]
    for t in ideal:  # one step each
        store.update([Measurement(OpClass.GEMM, t, t / 0.72)])
    assert store.efficiency(OpClass.GEMM) == pytest.approx(0.72)
    store.update([Measurement(OpClass.GEMM, 0.5, 50.0)])  # one straggler step
    assert store.efficiency(OpClass.GEMM) == pytest.approx(0.72)
    # other classes untouched
    assert store.efficiency(OpClass.ALLREDUCE_INTER) == PRIOR_EFFICIENCY[OpClass.ALLREDUCE_INTER]


def test_window_forgets_old_samples() -> None:
    store = CalibrationStore("x", window=4)
    for _ in range(4):
        store.update([Measurement(OpClass.MEMORY, 1.0, 2.0)])
    for _ in range(4):
        store.update([Measurement(OpClass.MEMORY, 1.0, 1.25)])
    assert store.efficiency(OpClass.MEMORY) == pytest.approx(0.8)
    assert store.sample_count(OpClass.MEMORY) == 4


def test_efficiency_clipped_to_unit_interval() -> None:
    store = CalibrationStore("x")
    store.update([Measurement(OpClass.GEMM, 2.0, 1.0)])  # faster than peak: mis-specified peak
    assert store.efficiency(OpClass.GEMM) == 1.0


def test_values_far_past_their_bounds_are_named() -> None:
    store = CalibrationStore("x")
    store.update([Measurement(OpClass.GEMM, 1.05, 1.0)])  # 5% past: noise, used as 1 in silence
    assert store.clipped() == []
    store.update([Measurement(OpClass.ATTENTION, 1e-6, 1.0)])
    for _ in range(3):
        store.update_memory(Stage.TRAIN, 1.0, 10.0)
    assert store.clipped() == [
        "attention efficiency 1e-06 is outside [0.01, 1]; using 0.01",
        "train memory ratio 10 is outside [0.5, 4]; using 4",
    ]


def test_memory_correction_is_conservative() -> None:
    store = CalibrationStore("x")
    for ratio in (1.10, 1.12, 1.08, 1.11, 1.09):
        store.update_memory(Stage.TRAIN, 100.0, 100.0 * ratio)
    factor = store.memory_factor(Stage.TRAIN)
    assert 1.10 <= factor <= 1.16  # median plus a robust spread, not the mean
    assert store.memory_factor(Stage.GEN) == 1.0
    assert store.efficiencies().memory(Stage.TRAIN) == factor


def test_the_fit_is_kept_until_a_sample_or_an_out_of_memory_changes_it() -> None:
    """``efficiencies()`` is fitted once per change of the store: the same object until an
    update, a memory sample or an out-of-memory floor, then what a fresh store fits."""
    store = CalibrationStore("x")
    store.update(
        Measurement(OpClass.GEMM, t, t / 0.7, size=s) for t, s in ((0.1, 1e9), (0.2, 4e9), (0.4, 1.6e10))
    )
    first = store.efficiencies()
    assert store.efficiencies() is first
    changes = [
        lambda: store.update([Measurement(OpClass.GEMM, 0.3, 0.5, size=2e9)]),
        lambda: store.update_memory(Stage.TRAIN, 100.0, 120.0),
        lambda: store.raise_memory_floor(Stage.GEN),
    ]
    for change in changes:
        before = store.efficiencies()
        change()
        after = store.efficiencies()
        assert after is not before and after != before
        assert after == store._fit()  # what the samples now fit to


def test_save_load_roundtrip_and_clusters_kept_apart(tmp_path: Path) -> None:
    path = tmp_path / "cal" / "calibration.json"
    a = CalibrationStore("h200-ib")
    a.update([Measurement(OpClass.GEMM, 1.0, 1.5)])
    a.update_memory(Stage.INF, 10.0, 12.0)
    a.save(path)
    b = CalibrationStore("mi250x-slingshot")
    b.update([Measurement(OpClass.GEMM, 1.0, 4.0)])
    b.save(path)
    assert sorted(json.loads(path.read_text())["clusters"]) == ["h200-ib", "mi250x-slingshot"]
    again = CalibrationStore.load(path, "h200-ib")
    assert again.efficiency(OpClass.GEMM) == pytest.approx(1 / 1.5)
    assert again.memory_factor(Stage.INF) == pytest.approx(1.2)
    assert CalibrationStore.load(path, "mi250x-slingshot").efficiency(OpClass.GEMM) == 0.25
    assert CalibrationStore.load(path, "unknown").efficiencies().eta == PRIOR_EFFICIENCY
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temp files left


def test_malformed_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        CalibrationStore.load(path, "x")
    path.write_text(json.dumps({"format": 99, "clusters": {}}))
    with pytest.raises(ConfigError, match="key 'format'"):
        CalibrationStore.load(path, "x")
    path.write_text(json.dumps({"format": 1, "clusters": {"x": {"window": 8, "samples": {"gemm": [[1]]}}}}))
    with pytest.raises(ConfigError, match="malformed calibration"):
        CalibrationStore.load(path, "x")


def test_values_are_validated() -> None:
    with pytest.raises(ValueError):
        Measurement(OpClass.GEMM, 0.0, 1.0)
    with pytest.raises(ValueError, match="efficiency of gemm"):
        Efficiencies(eta={**PRIOR_EFFICIENCY, OpClass.GEMM: 1.5})


def test_what_a_store_saves_it_loads_at_the_planners_sizes_and_full_windows(tmp_path: Path) -> None:
    """Sized samples carry the planner's own sizes (70B inference: 1.6e13 FLOPs), and two
    clusters' full windows make a file over 1 MiB: both were refused on load."""
    path = tmp_path / "cal.json"
    for cluster in ("a100-80gb-dgx", "h200-ib", "h100-ib"):
        store = CalibrationStore(cluster, window=512)
        for k in range(512):
            size = 1.6e13 * (1 + k % 7)
            store.update(Measurement(op, 1.0 + k % 3, 2.0 + k % 3, size=size) for op in OpClass)
        store.save(path)
    assert path.stat().st_size > 1 << 20
    back = CalibrationStore.load(path, "h200-ib", strict=True)
    assert back.sample_count(OpClass.GEMM) == 512 and back.curve(OpClass.GEMM) is not None


def test_sized_samples_past_their_bounds_are_warned_about() -> None:
    """A GEMM cannot beat the GPU's peak: sized samples at η 50 (or 1e-6) moved the plan 3.7×
    with no warning, where the class-wide η warned."""
    store = CalibrationStore("h200-ib")
    store.update(Measurement(OpClass.GEMM, 1.0, 1.0 / 50, size=s) for s in (1e6, 1e8, 1e10, 1e12))
    (line,) = [w for w in store.clipped() if "sized" in w]
    assert line.startswith("gemm sized samples' efficiencies 50–50 pass [0.01, 1]")
    ok = CalibrationStore("h200-ib")  # a collective's curve may pass its ring ideal
    ok.update(Measurement(OpClass.ALLREDUCE_INTER, 1.0, 1.0 / 3, size=s) for s in (1e6, 1e8, 1e10, 1e12))
    assert [w for w in ok.clipped() if "sized" in w] == []
