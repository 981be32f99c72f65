"""The configs the slow benchmarks write validate (pure): ``e2e_async.py`` runs 4-worker jobs for
minutes, too long for the suite's smoke runs, and a workload it writes that the spec refuses
(``max_staleness`` in a sync workload) broke it unseen."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.spec import load_workload
from nereus.spec.workload import ExecutionMode
from tests.helpers import benchmark_module

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_async_benchmarks_workloads_load(tmp_path: Path, mode: str) -> None:
    path = tmp_path / f"{mode}.yaml"
    path.write_text(benchmark_module("e2e_async").workload_text(mode))
    workload = load_workload(str(path))
    assert workload.mode is ExecutionMode(mode)
    if mode == "async":
        assert workload.max_staleness == 1
