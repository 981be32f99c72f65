"""The generation engine's probabilities against the trainer side's (verl's rollout_probs_diff):
carried from the replicas' parts into the rollouts, measured per batch, kept with a batch held
ahead, and written with the step's row."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.search import search
from nereus.runtime.metrics import StepRecord
from nereus.runtime.pending import pack, unpack
from nereus.runtime.rollout import Batch, assemble, probs_diff
from nereus.spec import Role, load_cluster, load_model, load_workload

PAD = 0
Part = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _parts(with_logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor, list[Part]]:
    prompt = torch.tensor([[0, 5], [6, 7], [8, 9]])
    prompt_valid = torch.tensor([[0, 1], [1, 1], [1, 1]])
    # two replicas: rows 0-1 (2 tokens, row 1 stopped after one) and row 2 (3 tokens)
    a_lp = torch.log(torch.tensor([[0.5, 0.25], [0.8, 0.9]]))
    b_lp = torch.log(torch.tensor([[0.1, 0.2, 0.3]])) if with_logprobs else None
    a: Part = (0, torch.tensor([[3, 4], [2, 0]]), torch.tensor([[1, 1], [1, 0]]), a_lp)
    b: Part = (2, torch.tensor([[1, 1, 1]]), torch.tensor([[1, 1, 1]]), b_lp)
    return prompt, prompt_valid, [a, b]


@pytest.mark.pure
def test_the_engines_log_probs_are_placed_on_the_response_tokens() -> None:
    prompt, valid, parts = _parts()
    r = assemble(prompt, valid, parts, [0, 1, 2], PAD)
    assert r.sampled is not None and tuple(r.sampled.shape) == tuple(r.ids.shape) == (3, 5)
    assert torch.equal(r.sampled[:, :2], torch.zeros(3, 2))  # the prompt carries none
    assert torch.equal(r.sampled == 0, r.mask == 0)  # past a stop (0.9 of row 1) and padding: 0
    assert r.sampled[1, 2].exp().item() == pytest.approx(0.8)
    assert r.sampled[2, 4].exp().item() == pytest.approx(0.3)


@pytest.mark.pure
def test_rollouts_from_a_part_without_log_probs_carry_none_and_measure_nothing() -> None:
    prompt, valid, parts = _parts(with_logprobs=False)
    r = assemble(prompt, valid, parts, [0, 1, 2], PAD)
    assert r.sampled is None and probs_diff(r, torch.zeros(r.ids.shape)) == {}


@pytest.mark.pure
def test_the_difference_is_over_the_response_tokens_only() -> None:
    prompt, valid, parts = _parts()
    r = assemble(prompt, valid, parts, [0, 1, 2], PAD)
    trainer = torch.full(r.ids.shape, -100.0)  # the prompt and padding: far off, and never read
    trainer[r.mask.bool()] = torch.log(torch.tensor([0.5, 0.5, 0.8, 0.1, 0.2, 0.4]))
    got = probs_diff(r, trainer)
    diffs = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.0, 0.1], dtype=torch.float64)
    assert got["rollout_probs_diff_max"] == pytest.approx(0.25)
    assert got["rollout_probs_diff_mean"] == pytest.approx(float(diffs.mean()))
    assert got["rollout_probs_diff_std"] == pytest.approx(float(diffs.std()))
    assert probs_diff(r, r.sampled.clone()) == {  # type: ignore[union-attr]
        "rollout_probs_diff_max": 0.0, "rollout_probs_diff_mean": 0.0, "rollout_probs_diff_std": 0.0,
    }  # fmt: skip
    assert probs_diff(r, torch.zeros(3, 4)) == {}  # not aligned with the rollouts: not measured


@pytest.mark.pure
def test_a_batch_held_ahead_keeps_its_difference_and_bad_values_are_refused() -> None:
    prompt, valid, parts = _parts()
    r = assemble(prompt, valid, parts, [0, 1, 2], PAD)
    zero = torch.zeros(r.ids.shape)
    diff = probs_diff(r, zero)
    got = unpack(pack({4: Batch(4, 3, r, zero, None, diff), 5: Batch(5, 4, r, zero)}))
    assert got[4].probs_diff == diff and got[5].probs_diff == {}
    for bad, why in [
        ({"rollout_probs_diff_min": 0.1}, "'probs_diff' must map some of"),
        ({"rollout_probs_diff_max": -0.1}, "must be a number in \\[0, 1\\]"),
        ({"rollout_probs_diff_max": 1.5}, "must be a number in \\[0, 1\\]"),
        ({"rollout_probs_diff_max": "0.1"}, "must be a number in \\[0, 1\\]"),
    ]:
        with pytest.raises(ValueError, match=why):
            unpack(pack({4: Batch(4, 3, r, zero, None, bad)}))  # type: ignore[arg-type]


@pytest.mark.pure
def test_the_steps_row_carries_the_difference_where_it_was_measured() -> None:
    metrics = {"reward": 0.5, "accuracy": 0.0, "kl": 0.0, "actor_loss": 1.0}
    measured = {**metrics, "rollout_probs_diff_max": 0.25, "rollout_probs_diff_mean": 0.05}
    plan = _plan()
    assert StepRecord.of(1, measured, 1.0, 4.0, plan, 0.0, {}).rollout_probs_diff == {
        "max": 0.25,
        "mean": 0.05,
    }
    assert StepRecord.of(1, metrics, 1.0, 4.0, plan, 0.0, {}).rollout_probs_diff is None


def _plan() -> Plan:
    model = load_model("tiny-llama")
    models = {r: model for r in Role}
    p = PlanningProblem(
        load_workload("grpo-tiny"), models, load_cluster("local-cpu"), (0, 1), SeqStats(4, 8, 8)
    )
    return search(p).plan


@pytest.mark.pure
def test_non_finite_log_probs_are_left_out_and_a_held_batch_still_packs() -> None:
    prompt, valid, parts = _parts()
    r = assemble(prompt, valid, parts, [0, 1, 2], PAD)
    trainer = torch.zeros(r.ids.shape)
    trainer[1, 2] = float("nan")  # a token of a skipped (non-finite) update's scoring
    got = probs_diff(r, trainer)
    assert got["rollout_probs_diff_max"] == pytest.approx(0.9)  # |0.1 − 1|: the NaN token is not counted
    assert probs_diff(r, torch.full(r.ids.shape, float("nan"))) == {}
    above = r.sampled.clone()  # type: ignore[union-attr]
    above[r.mask.bool()] = 1e-6  # a log-prob rounded just above 0: p > 1
    diff = probs_diff(replace(r, sampled=above), torch.full(r.ids.shape, -50.0))
    assert 0.99 < diff["rollout_probs_diff_max"] <= 1.0
    unpack(pack({4: Batch(4, 3, r, trainer, None, diff)}))  # what pack writes, unpack reads
