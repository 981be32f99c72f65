"""A step row's response metrics: the share of responses cut at the length limit (verl's
response_length/clip_ratio), and no accuracy where no verifier runs (``verifier: none``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import truncated
from nereus.runtime.metrics import MetricsWriter, StepRecord
from nereus.runtime.rollout import assemble

pytestmark = pytest.mark.pure
EOS, PAD = 2, 0


def test_a_response_without_a_stop_token_was_cut() -> None:
    prompt = torch.tensor([[7, 8], [7, 8], [7, 8], [7, 8]])
    tokens = torch.tensor([[5, EOS, PAD], [5, 6, 9], [EOS, PAD, PAD], [6, 6, PAD]])
    valid = (tokens != PAD).long()
    r = assemble(prompt, torch.ones_like(prompt), [(0, tokens, valid, None)], [0, 1, 2, 3], PAD)
    assert truncated(r, [EOS]) == pytest.approx(0.5)  # rows 1 (at the limit) and 3 (no stop token)
    assert truncated(r, [EOS, 9]) == pytest.approx(0.25)  # a second stop id ends row 1
    empty = assemble(prompt[:1], torch.ones(1, 2), [(0, tokens[:1] * 0, valid[:1] * 0, None)], [0], PAD)
    assert truncated(empty, [EOS]) == 1.0  # nothing generated is no stop either


def test_a_step_without_a_verifier_has_no_accuracy(tmp_path: Path) -> None:
    spec_file = tmp_path / "exp.yaml"
    spec_file.write_text("name: x\nworkload: grpo-tiny\nmodel: tiny-llama\n")
    shown = io.StringIO()
    writer = MetricsWriter(tmp_path / "out", ExperimentSpec.load(spec_file), Console(file=shown, width=300))
    metrics = {"reward": 0.5, "kl": 0.0, "actor_loss": 1.0, "truncated": 0.25}
    row = StepRecord.of(0, metrics, 1.0, 4.0, _plan(), 0.0, {})
    assert row.accuracy is None and row.truncated == 0.25
    writer.write(row, None)  # type: ignore[arg-type]
    writer.tb.close()
    written = json.loads((tmp_path / "out" / "metrics.jsonl").read_text())
    assert written["accuracy"] is None and written["truncated"] == 0.25
    assert "acc    - │" in shown.getvalue()
    acc = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    assert "accuracy" not in acc.Tags()["scalars"] and acc.Scalars("truncated")[0].value == 0.25


def _plan():  # type: ignore[no-untyped-def]
    from tests.test_rollout_probs_diff import _plan as plan

    return plan()
