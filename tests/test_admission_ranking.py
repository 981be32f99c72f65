"""The ranking benchmark (benchmarks/admission_ranking.py): its rank statistic, and one case run
end to end on the quiet truth — calibration by shape predicts the step times it ranks."""

from __future__ import annotations

import pytest

from tests.helpers import benchmark_module

pytestmark = pytest.mark.pure


RANK = benchmark_module("admission_ranking")


def test_spearman() -> None:
    assert RANK.spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]) == pytest.approx(1.0)
    assert RANK.spearman([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert RANK.spearman([1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(0.5)


def test_shape_calibration_predicts_the_truth_it_ranks() -> None:
    """MI250X, 128 GCDs: with every held layout's quiet truth as telemetry, η by shape predicts
    the step times within 10% and ranks them as the truth does; one η per op class does not
    predict them as well (the classes' efficiencies differ with shape)."""
    row = RANK.case("mi250x-256", 128, 1500.0)
    shape, flat = row["all/shape"], row["all/flat"]
    assert row["holds"] >= 8
    assert shape["step_mape"] < 0.10 and shape["step_mape"] < flat["step_mape"]
    assert shape["spearman"] >= 0.9 and shape["regret"] <= 0.01
    assert "allreduce.intra" in shape["curves"] and flat["curves"] == []
