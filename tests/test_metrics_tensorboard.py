"""A step that runs again (after ``--resume`` or a recovery from a checkpoint) has one row in
``metrics.jsonl`` and one point in TensorBoard: the events of the steps run again are purged."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.metrics import MetricsWriter, StepRecord, drop_rows_after, read_rows

pytestmark = pytest.mark.pure


def _record(step: int, reward: float) -> StepRecord:
    return StepRecord(step, reward, 0.0, 0.0, 0.0, None, None, 1.0, 0.0, 4.0, 2, {}, {})


def _points(folder: Path) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, round(e.value, 3)) for e in acc.Scalars("reward")]


def test_a_step_run_again_has_one_point(tmp_path: Path) -> None:
    spec_file = tmp_path / "exp.yaml"
    spec_file.write_text("name: x\nworkload: grpo-tiny\nmodel: tiny-llama\n")
    spec = ExperimentSpec.load(spec_file)
    quiet = Console(file=io.StringIO())
    first = MetricsWriter(tmp_path / "out", spec, quiet)
    for step in range(4):
        first.write(_record(step, 0.1 * step), None)  # type: ignore[arg-type]
    first.tb.close()
    first.file.close()
    drop_rows_after(tmp_path / "out" / "metrics.jsonl", 1)  # --resume from step 1's checkpoint (loop.py)
    again = MetricsWriter(tmp_path / "out", spec, quiet)
    for step in (2, 3, 4):
        again.write(_record(step, 0.5 + step), None)  # type: ignore[arg-type]
    again.write(_record(3, 9.0), None)  # type: ignore[arg-type]  # a recovery in the run: step 3 again
    again.tb.close()
    assert [s for s, _ in read_rows(tmp_path / "out" / "metrics.jsonl")] == [0, 1, 2, 3]
    assert _points(tmp_path / "out" / "tensorboard") == [(0, 0.0), (1, 0.1), (2, 2.5), (3, 9.0)]


def test_the_engines_probability_difference_is_a_tensorboard_scalar(tmp_path: Path) -> None:
    spec_file = tmp_path / "exp.yaml"
    spec_file.write_text("name: x\nworkload: grpo-tiny\nmodel: tiny-llama\n")
    writer = MetricsWriter(tmp_path / "out", ExperimentSpec.load(spec_file), Console(file=io.StringIO()))
    diff = {"max": 0.25, "mean": 0.05, "std": 0.01}
    writer.write(replace(_record(0, 0.0), rollout_probs_diff=diff), None)  # type: ignore[arg-type]
    writer.write(_record(1, 0.0), None)  # type: ignore[arg-type]  # a step not measured: no point
    writer.tb.close()
    acc = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    got = {k: [(e.step, round(e.value, 3)) for e in acc.Scalars(f"rollout/probs_diff_{k}")] for k in diff}
    assert got == {"max": [(0, 0.25)], "mean": [(0, 0.05)], "std": [(0, 0.01)]}
