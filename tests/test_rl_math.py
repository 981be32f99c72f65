"""RL math: GAE against a slow reference, GRPO/ReMax advantages, reward placement, KL estimators,
and the policy/value losses (hand values, clipping, exact additivity over micro-batch splits)."""

from __future__ import annotations

import ast
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

import nereus
from nereus.rl.advantages import gae, grpo_advantages, last_valid, remax_advantages, token_rewards, whiten
from nereus.rl.losses import KLKind, PolicyLoss, ValueLoss, kl_penalty

pytestmark = pytest.mark.pure

B, P, N = 6, 3, 7  # rows, prompt columns, response columns
T = P + N


def response_mask(lengths: list[int], holes: bool = False) -> Tensor:
    """(B, T) float mask: 0 on the prompt, 1 on the first ``length`` response tokens."""
    m = torch.zeros(len(lengths), T)
    for b, n in enumerate(lengths):
        m[b, P : P + n] = 1
    if holes:
        m[0, P + 1] = 0  # a valid row with a gap (as a mask may have)
    return m


MASKS = {
    "full": response_mask([N] * B),
    "ragged": response_mask([N, 1, 3, N - 1, 2, 5]),
    "holes": response_mask([N, 1, 3, N - 1, 2, 5], holes=True),
}


def reference_gae(r: Tensor, v: Tensor, m: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """One row at a time over the list of valid indices (the definition, no vectorisation)."""
    adv, ret = torch.zeros_like(r, dtype=torch.float64), torch.zeros_like(r, dtype=torch.float64)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if m[b, t] > 0]
        running = 0.0
        for j in reversed(range(len(idx))):
            t = idx[j]
            next_v = float(v[b, idx[j + 1]]) if j + 1 < len(idx) else 0.0
            delta = float(r[b, t]) + gamma * next_v - float(v[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
            ret[b, t] = running + float(v[b, t])
    return adv, ret


def rand(seed: int, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ GAE
@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7)])
def test_gae_matches_reference_loop(name: str, gamma: float, lam: float) -> None:
    m = MASKS[name]
    r, v = rand(1, B, T), rand(2, B, T)
    adv, ret = gae(r, v, m, gamma, lam, whiten_advantages=False)
    want_adv, want_ret = reference_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(adv.double(), want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), want_ret, atol=1e-5, rtol=1e-5)


def test_gae_known_cases() -> None:
    m = torch.tensor([[0.0, 1, 1, 1, 0]])
    r = torch.tensor([[9.0, 0, 0, 1, 9]])  # rewards off the mask are ignored
    v = torch.tensor([[9.0, 0.5, 0.25, 0.5, 9]])  # so is the value past the last valid token
    adv, ret = gae(r, v, m, 1.0, 1.0, whiten_advantages=False)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1, 1, 1, 0]]))  # γ=λ=1: reward to go
    torch.testing.assert_close(adv, ret - v * m)
    adv, _ = gae(r, v, m, 0.5, 0.0, whiten_advantages=False)  # λ=0: the TD error
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5 * 0.25 - 0.5, 0.5 * 0.5 - 0.25, 1 - 0.5, 0]]))
    adv, ret = gae(r, v, m, 0.0, 1.0, whiten_advantages=False)  # γ=0: r − V, return r
    torch.testing.assert_close(adv, torch.tensor([[0.0, -0.5, -0.25, 0.5, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0, 0, 1, 0]]))


def test_gae_ignores_everything_off_the_mask() -> None:
    m = MASKS["holes"]
    r, v = rand(3, B, T), rand(4, B, T)
    garbage = torch.where(m.bool(), 0.0, 1e6)
    a1, r1 = gae(r, v, m, 0.99, 0.95)
    a2, r2 = gae(r + garbage, v - garbage, m, 0.99, 0.95)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)
    assert not a1[~m.bool()].any() and not r1[~m.bool()].any()


def test_whitened_advantages_have_zero_mean_unit_std_on_the_mask() -> None:
    m = MASKS["ragged"]
    adv, returns = gae(rand(5, B, T), rand(6, B, T), m, 0.99, 0.95, whiten_advantages=True)
    valid = adv[m.bool()]
    assert abs(float(valid.mean())) < 1e-5
    assert abs(float(valid.std()) - 1) < 1e-4
    assert not adv[~m.bool()].any()
    _, plain_returns = gae(rand(5, B, T), rand(6, B, T), m, 0.99, 0.95, whiten_advantages=False)
    torch.testing.assert_close(returns, plain_returns)  # returns come from the raw advantages
    x = rand(7, B, T) + 3
    kept = whiten(x, m, shift_mean=False)[m.bool()]
    assert abs(float(kept.mean()) - float(x[m.bool()].mean())) < 1e-4


# ------------------------------------------------------------------ rewards and baselines
def test_token_rewards_put_the_score_on_the_last_valid_token() -> None:
    m = MASKS["holes"]
    scores = torch.arange(1.0, B + 1)
    r = token_rewards(scores, m)
    last = last_valid(m)
    assert last.tolist() == [P + N - 1, P, P + 2, P + N - 2, P + 1, P + 4]
    assert torch.equal(r.nonzero()[:, 1], last)
    assert torch.equal(r[torch.arange(B), last], scores)
    kl = rand(8, B, T)
    r = token_rewards(scores, m, kl, kl_coef=0.1)
    want = -0.1 * kl * m
    want[torch.arange(B), last] += scores
    torch.testing.assert_close(r, want)


def test_token_rewards_refuse_an_empty_row() -> None:
    m = MASKS["full"].clone()
    m[2] = 0
    with pytest.raises(ValueError, match=r"rows \[2\] have no valid token"):
        token_rewards(torch.ones(B), m)


def test_grpo_groups_have_zero_mean_and_unit_std() -> None:
    g = 3
    m = MASKS["ragged"]
    scores = torch.tensor([0.0, 1.0, 0.1, 5.0, 5.0, 5.0])  # the second group cannot tell its rows apart
    adv = grpo_advantages(scores, g, m)
    per_row = adv.sum(1) / m.sum(1)
    assert torch.allclose(adv, per_row[:, None] * m)  # one value per response, on its valid tokens
    first = per_row[:g]
    assert abs(float(first.mean())) < 1e-6
    assert abs(float(first.std()) - 1) < 1e-5
    assert not per_row[g:].any()
    assert float(first[1]) > float(first[2]) > float(first[0])  # order of the scores is kept
    centred = grpo_advantages(scores, g, m, scale_by_std=False)
    torch.testing.assert_close(
        centred.sum(1) / m.sum(1), torch.tensor([-1.1 / 3, 1.9 / 3, -0.8 / 3, 0, 0, 0])
    )
    with pytest.raises(ValueError, match="must be at least 2 and divide"):
        grpo_advantages(scores, 4, m)


def test_remax_subtracts_the_greedy_reward() -> None:
    m = MASKS["ragged"]
    scores, greedy = rand(9, B), rand(10, B)
    torch.testing.assert_close(remax_advantages(scores, greedy, m), (scores - greedy)[:, None] * m)
    with pytest.raises(ValueError, match="baseline_scores must be"):
        remax_advantages(scores, greedy[:3], m)


# ------------------------------------------------------------------ KL estimators
def test_kl_estimators_on_hand_values_and_in_expectation() -> None:
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2)
    assert kl_penalty(logp, ref, KLKind.K1).item() == pytest.approx(d)
    assert kl_penalty(logp, ref, KLKind.K2).item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, KLKind.K3).item() == pytest.approx(0.5 - 1 + d)
    assert kl_penalty(ref, ref, KLKind.K3).item() == 0
    pi = torch.softmax(rand(11, 16).double(), -1)
    pr = torch.softmax(rand(12, 16).double(), -1)
    exact = float((pi * (pi.log() - pr.log())).sum())
    for kind in (KLKind.K1, KLKind.K3):  # unbiased: E_{x~π}[k(x)] = KL(π ‖ π_ref)
        assert float((pi * kl_penalty(pi.log(), pr.log(), kind)).sum()) == pytest.approx(exact)
    assert (kl_penalty(pi.log(), pr.log(), KLKind.K3) >= 0).all()
    with pytest.raises(ValueError, match="kl_kind must be one of k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


# ------------------------------------------------------------------ policy loss
def one_token(logp: float, old: float, adv: float) -> tuple[Tensor, dict[str, Tensor]]:
    scores = torch.tensor([[0.0, logp]], requires_grad=True)
    fields = {
        "old_logprobs": torch.tensor([[0.0, old]]),
        "advantages": torch.tensor([[0.0, adv]]),
        "mask": torch.tensor([[0.0, 1.0]]),
    }
    return scores, fields


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "has_grad"),
    [
        (1.0, 2.0, -2.0, True),
        (1.5, 1.0, -1.2, False),  # A > 0, ratio above 1 + ε: clipped, no gradient
        (0.5, 1.0, -0.5, True),  # A > 0, ratio below 1 − ε: the unclipped term still pulls up
        (0.5, -1.0, 0.8, False),  # A < 0, ratio below 1 − ε: clipped
        (1.5, -1.0, 1.5, True),  # A < 0, ratio above 1 + ε: the unclipped term still pushes down
    ],
)
def test_policy_loss_hand_values_and_clipping(ratio: float, adv: float, loss: float, has_grad: bool) -> None:
    scores, fields = one_token(math.log(ratio) - 1.0, -1.0, adv)
    fn = PolicyLoss(clip_eps=0.2, normaliser=4.0)
    out = fn(scores, fields)
    assert out.item() == pytest.approx(loss / 4)
    out.backward()
    assert scores.grad is not None
    g = float(scores.grad[0, 1])
    if has_grad:
        assert g == pytest.approx(-adv * ratio / 4)  # d(−A·ratio)/d log π; sign opposite to A
        assert (g < 0) == (adv > 0)
    else:
        assert g == 0
    assert fn.last_metrics().clip_fraction == (0.0 if has_grad else 0.25)
    assert fn.last_metrics().pg_loss == pytest.approx(loss / 4)


def test_dual_clip_bounds_a_negative_advantages_cost_and_log_ratios_stay_finite() -> None:
    """verl's clip_ratio_c: with A < 0 a ratio of e² costs at most −A·3 and gives no gradient; a
    log-ratio of ±100 (a stale batch, a diverged policy) gives a finite gradient, in the surrogate
    and in k3."""
    scores, fields = one_token(2.0 - 1.0, -1.0, -1.0)  # ratio e² ≈ 7.39, A = −1
    fn = PolicyLoss(clip_eps=0.2, normaliser=1.0)
    out = fn(scores, fields)
    assert out.item() == pytest.approx(3.0)
    out.backward()
    assert scores.grad is not None and float(scores.grad[0, 1]) == 0.0
    assert fn.last_metrics().clip_fraction == 1.0  # the dual clip took its gradient: counted
    scores, fields = one_token(2.0 - 1.0, -1.0, -1.0)
    undual = PolicyLoss(clip_eps=0.2, normaliser=1.0, dual_clip=None)(scores, fields)
    assert undual.item() == pytest.approx(math.exp(2.0))
    for far in (100.0, -100.0):
        scores, fields = one_token(far - 1.0, -1.0, 1.0)
        fields["ref_logprobs"] = fields["old_logprobs"]
        loss = PolicyLoss(clip_eps=0.2, normaliser=1.0, kl_coef=0.1)(scores, fields)
        loss.backward()
        assert scores.grad is not None and torch.isfinite(scores.grad).all() and torch.isfinite(loss)
    scores, fields = one_token(0.5, 0.0, 1.0)  # reference log-probs of ±inf on the padding
    fields["ref_logprobs"] = torch.tensor([[-math.inf, -1.0]])
    fields["old_logprobs"] = torch.tensor([[math.inf, -1.0]])
    loss = PolicyLoss(clip_eps=0.2, normaliser=1.0, kl_coef=0.1)(scores, fields)
    loss.backward()
    assert scores.grad is not None and torch.isfinite(loss) and torch.isfinite(scores.grad).all()
    with pytest.raises(ValueError, match="dual_clip must be above 1"):
        PolicyLoss(0.2, 1.0, dual_clip=1.0)


def batch(seed: int) -> tuple[Tensor, dict[str, Tensor]]:
    m = MASKS["holes"]
    scores = (rand(seed, B, T) * 0.3 - 2).requires_grad_(True)
    fields = {
        "old_logprobs": rand(seed + 1, B, T) * 0.3 - 2,
        "ref_logprobs": rand(seed + 2, B, T) * 0.3 - 2,
        "advantages": rand(seed + 3, B, T) * m,
        "old_values": rand(seed + 4, B, T),
        "returns": rand(seed + 5, B, T),
        "mask": m,
    }
    return scores, fields


def split_sum(
    fn: PolicyLoss | ValueLoss, scores: Tensor, fields: dict[str, Tensor], cuts: list[int]
) -> Tensor:
    total = scores.new_zeros(())
    for a, b in zip([0, *cuts], [*cuts, B], strict=True):
        total = total + fn(scores[a:b], {k: v[a:b] for k, v in fields.items()})
    return total


@pytest.mark.parametrize("cuts", [[3], [1, 2, 4], [1, 2, 3, 4, 5]])
def test_losses_add_up_exactly_over_row_splits(cuts: list[int]) -> None:
    scores, fields = batch(20)
    n = float(fields["mask"].sum())
    for whole_fn, part_fn in [
        (PolicyLoss(0.2, n, kl_coef=0.05, kl_kind=KLKind.K3), PolicyLoss(0.2, n, kl_coef=0.05)),
        (ValueLoss(0.5, n), ValueLoss(0.5, n)),
    ]:
        whole = whole_fn(scores, fields)
        (g_whole,) = torch.autograd.grad(whole, scores)
        parts = split_sum(part_fn, scores, fields, cuts)
        (g_parts,) = torch.autograd.grad(parts, scores)
        torch.testing.assert_close(parts, whole, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g_parts, g_whole, atol=1e-7, rtol=1e-6)
        want, got = dataclasses.asdict(whole_fn.metrics()), dataclasses.asdict(part_fn.metrics())
        assert got == pytest.approx(want, abs=1e-6)  # metric contributions add up like the loss
        assert any(want.values())


def test_policy_loss_kl_term_and_metrics() -> None:
    scores, fields = batch(30)
    n = float(fields["mask"].sum())
    plain, with_kl = PolicyLoss(0.2, n), PolicyLoss(0.2, n, kl_coef=0.1, kl_kind=KLKind.K1)
    diff = with_kl(scores, fields) - plain(scores, fields)
    want = 0.1 * ((scores.detach() - fields["ref_logprobs"]) * fields["mask"]).sum() / n
    torch.testing.assert_close(diff, want)
    assert with_kl.last_metrics().ref_kl == pytest.approx(float(want) / 0.1)
    assert plain.last_metrics().ref_kl == 0
    assert plain.last_metrics().approx_kl > 0
    assert 0 < plain.last_metrics().clip_fraction < 1
    plain.reset()
    assert plain.metrics().pg_loss == 0
    with pytest.raises(ValueError, match="missing ref_logprobs"):
        with_kl(scores, {k: v for k, v in fields.items() if k != "ref_logprobs"})


def test_losses_ignore_garbage_off_the_mask() -> None:
    scores, fields = batch(40)
    off = ~fields["mask"].bool()
    n = float(fields["mask"].sum())
    signs = torch.where(torch.arange(T) % 2 == 0, 1e4, -1e4)  # exp(±1e4) overflows: never to be taken
    for fn in (PolicyLoss(0.2, n, kl_coef=0.1), ValueLoss(0.2, n)):
        clean = fn(scores, fields)
        (g_clean,) = torch.autograd.grad(clean, scores)
        bad = torch.where(off, signs, scores.detach())
        bad.requires_grad_(True)
        dirty = fn(bad, fields)
        (g_dirty,) = torch.autograd.grad(dirty, bad)
        torch.testing.assert_close(dirty, clean)
        assert torch.isfinite(g_dirty).all()
        torch.testing.assert_close(g_dirty, g_clean)


# ------------------------------------------------------------------ value loss
@pytest.mark.parametrize(
    ("v", "ret", "clip", "loss", "grad", "clipped"),
    [
        (1.0, 1.0, 0.2, 0.5 * 0.64, 0.0, True),  # moved past the clip onto the return: clipped term wins
        (1.0, 0.0, 0.2, 0.5, 1.0, False),  # moved away from the return: the plain term, with gradient
        (0.1, 1.0, 0.2, 0.5 * 0.81, -0.9, False),  # inside the clip: plain
        (1.0, 1.0, None, 0.0, 0.0, False),  # no clip: plain squared error
    ],
)
def test_value_loss_clipping(
    v: float, ret: float, clip: float | None, loss: float, grad: float, clipped: bool
) -> None:
    scores = torch.tensor([[0.0, v]], requires_grad=True)
    fields = {"old_values": torch.tensor([[0.0, 0.0]]), "returns": torch.tensor([[0.0, ret]])}
    fields["mask"] = torch.tensor([[0.0, 1.0]])
    fn = ValueLoss(clip, normaliser=1.0)
    out = fn(scores, fields)
    assert out.item() == pytest.approx(loss)
    out.backward()
    assert scores.grad is not None
    assert float(scores.grad[0, 1]) == pytest.approx(grad)
    assert fn.last_metrics().clip_fraction == float(clipped)
    assert fn.last_metrics().vf_loss == pytest.approx(loss)


def test_loss_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="clip_eps"):
        PolicyLoss(1.5, 1.0)
    with pytest.raises(ValueError, match="normaliser"):
        PolicyLoss(0.2, 0.0)
    with pytest.raises(ValueError, match="kl_kind must be one of"):
        PolicyLoss(0.2, 1.0, kl_coef=0.1, kl_kind="kl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip must be positive"):
        ValueLoss(-1.0, 1.0)
    scores, fields = batch(50)
    with pytest.raises(ValueError, match="missing returns"):
        ValueLoss(None, 1.0)(scores, {"old_values": fields["old_values"], "mask": fields["mask"]})
    with pytest.raises(ValueError, match="field 'mask'"):
        PolicyLoss(0.2, 1.0)(scores, {**fields, "mask": fields["mask"][:, :3]})


# ------------------------------------------------------------------ purity
def test_rl_package_is_pure() -> None:
    root = Path(nereus.__file__).parent / "rl"
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [
                n for n in names if n.split(".")[:2] == ["torch", "distributed"] or n == "subprocess"
            ], f
    code = "import sys, nereus.rl.tokenizer, nereus.rl.tasks; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "False", out.stderr


def test_the_reward_model_scores_the_head_at_the_last_token_itself() -> None:
    """A reward model's score is its head at the response's last token (verl, Hugging Face
    sequence classifiers), not at the token before: the worker's scores are aligned with the
    tokens (entry i is the head at i − 1), so the rollouts go one padding column wider."""
    from types import SimpleNamespace

    from nereus.backends.logprobs import token_values
    from nereus.rl.tasks import TaskRecord
    from nereus.rl.tokenizer import CharTokenizer
    from nereus.runtime.job import sequence_rewards
    from nereus.runtime.rollout import Rollouts

    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [5, 6, 7, 8, 9, 10]])  # responses from column 3
    valid = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]])  # last tokens: columns 4 and 5
    r = Rollouts(ids, valid, mask, (0, 1), 3)

    def infer(plan: object, name: str, rr: Rollouts) -> Tensor:
        head = torch.arange(rr.ids.shape[1], dtype=torch.float32).expand(rr.rows, -1)  # head at p: p
        return token_values(head)

    worker = SimpleNamespace(
        workflow=SimpleNamespace(model_stages=[SimpleNamespace(name="reward.inf")]), infer=infer
    )
    setup = SimpleNamespace(spec=SimpleNamespace(verifier="none", reward_coef=1.0), tokenizer=CharTokenizer())
    records = [TaskRecord("p", "a", "0"), TaskRecord("p", "a", "1")]
    scores, rm, verifier = sequence_rewards(worker, None, setup, r, records)  # type: ignore[arg-type]
    assert rm is not None and rm.tolist() == [4.0, 5.0]
    # accuracy reads the verifier's scores alone: a reward model scoring above 1 is not "correct"
    assert verifier.tolist() == [0.0, 0.0] and scores.tolist() == [4.0, 5.0]


def test_k3_is_clamped_and_approx_kl_is_schulmans_k3_of_the_ratio() -> None:
    # π_ref/π = e⁵: e⁵ − 5 − 1 ≈ 142 unclamped; verl's bound is 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([5.0]), KLKind.K3).item() == 10.0
    old = torch.tensor([[-1.0, -2.0]])
    fields = {"old_logprobs": old, "advantages": torch.zeros(1, 2), "mask": torch.tensor([[1.0, 0.0]])}
    loss = PolicyLoss(0.2, 1.0)
    loss(old + math.log(1.5), fields)  # ratio 1.5 on the one masked-in token
    assert loss.last_metrics().approx_kl == pytest.approx(0.5 - math.log(1.5))
