"""Training on one rank: ``train_step``'s flat AdamW equals ``torch.optim.AdamW``, micro-batches add
up to the same step, and bf16 mixed precision keeps fp32 master weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from itertools import pairwise

import pytest
import safetensors.torch
import torch
from torch import Tensor

from nereus.backends import hf
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.logprobs import token_logprobs
from nereus.backends.model import DecoderStage
from nereus.backends.optim import AdamWConfig
from nereus.backends.protocol import TokenBatch
from nereus.backends.torch_native import TorchNativeEngine
from nereus.backends.torch_native.training import accumulate_into
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.holder import RankState
from tests.engine_oracle import LAYOUT, left_padded, one_rank_engine, scored_mask

pytestmark = pytest.mark.pure


# ---------------------------------------------------------------------------- 6. training
def _train_batch(spec: ModelSpec) -> tuple[TokenBatch, Callable[[Tensor, Mapping[str, Tensor]], Tensor]]:
    batch = left_padded(4, 16, [0, 2, 5, 9], spec.vocab_size, seed=17)
    mask = scored_mask(batch.valid).float()
    n = float(mask.sum())

    def loss_fn(scores: Tensor, fields: Mapping[str, Tensor]) -> Tensor:
        return -(scores * fields["mask"]).sum() / n

    return TokenBatch(batch.ids, batch.valid, {"mask": mask}), loss_fn


def test_train_step_reduces_the_loss(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, optim=AdamWConfig(lr=3e-3), checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    before = float(loss_fn(eng.forward(batch), batch.fields))
    losses = []
    for _ in range(6):
        stats = eng.train_step(batch, loss_fn)
        losses.append(stats.loss)
        assert stats.tokens == int(batch.valid.sum()) and stats.grad_norm > 0
    after = float(loss_fn(eng.forward(batch), batch.fields))
    assert losses[0] == pytest.approx(before, rel=1e-5)
    assert all(b < a for a, b in pairwise(losses))
    assert after < 0.8 * before
    assert eng.state.state.updates == 6


def test_train_step_scores_at_the_sampling_temperature(checkpoints: dict) -> None:
    """The trained log-probs are the sampling policy's: at temperature 0.7 the first step's loss is
    the loss of ``forward`` at 0.7, not at 1 (verl divides the logits by the rollout temperature)."""
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, optim=AdamWConfig(lr=3e-3), checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    hot = float(loss_fn(eng.forward(batch, temperature=0.7), batch.fields))
    assert hot != pytest.approx(float(loss_fn(eng.forward(batch), batch.fields)), rel=1e-3)
    assert eng.train_step(batch, loss_fn, temperature=0.7).loss == pytest.approx(hot, rel=1e-5)


def test_a_non_finite_gradient_skips_the_update(checkpoints: dict) -> None:
    """One NaN score makes the loss and the gradient norm NaN: the update is skipped (as verl
    does), the weights and the optimizer's count stay, and the next finite batch trains as usual."""
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, optim=AdamWConfig(lr=3e-3), checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    before = eng.forward(batch)

    def poisoned(scores: Tensor, fields: Mapping[str, Tensor]) -> Tensor:
        return loss_fn(scores, fields) * torch.tensor(float("nan"))

    stats = eng.train_step(batch, poisoned)
    assert math.isnan(stats.grad_norm) and math.isnan(stats.loss)
    assert eng.state.state.updates == 0 and eng.state.state.version == 0
    assert torch.equal(eng.forward(batch), before)
    assert math.isfinite(eng.train_step(batch, loss_fn).grad_norm) and eng.state.state.updates == 1
    assert not torch.equal(eng.forward(batch), before)


def test_train_step_needs_optimizer_state(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    with pytest.raises(RuntimeError, match="does not train"):
        eng.train_step(batch, loss_fn)


@pytest.mark.parametrize(("kind", "clip"), [("llama", 0.0), ("qwen3", 0.0), ("qwen2", 0.5)])
def test_flat_adamw_matches_torch_adamw(kind: str, clip: float, checkpoints: dict) -> None:
    d, _ = checkpoints[kind]
    spec = hf.read_config(d)
    cfg = AdamWConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, max_grad_norm=clip)
    eng = one_rank_engine(spec, optim=cfg, checkpoint=d)
    # the reference: the same module as a plain nn.Module, trained by torch.optim.AdamW
    ref = DecoderStage(spec, range(spec.num_hidden_layers), True, True)
    missing, unexpected = ref.load_state_dict(safetensors.torch.load_file(d / hf.SINGLE), strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if spec.tie_word_embeddings else [])
    if spec.tie_word_embeddings:
        assert ref.lm_head is not None and ref.model.embed_tokens is not None
        ref.lm_head.weight = ref.model.embed_tokens.weight
    params = list(ref.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    assert no_decay  # norms (and Qwen2's biases) exist and skip weight decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False,
    )  # fmt: skip
    batch, loss_fn = _train_batch(spec)
    for step in range(3):
        stats = eng.train_step(batch, loss_fn)
        opt.zero_grad()
        loss = loss_fn(token_logprobs(ref(batch.ids, batch.valid), batch.ids), batch.fields)
        loss.backward()
        # torch.nn.utils.clip_grad_norm_'s rule, the norm in fp64 (fp32 rounding of the norm
        # would move near-zero gradients, which Adam then amplifies)
        norm = torch.stack([p.grad.double().square().sum() for p in params]).sum().sqrt()
        if clip:
            for p in params:
                p.grad.mul_(min(1.0, clip / (float(norm) + 1e-6)))
        opt.step()
        assert stats.loss == pytest.approx(float(loss.detach()), rel=1e-5), step
        assert stats.grad_norm == pytest.approx(float(norm), rel=1e-4), step
        if clip:
            assert stats.grad_norm > clip  # clipping engaged
    state = eng.full_state()
    assert state is not None
    want = ref.state_dict()
    assert set(state) == set(want) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    for name, t in state.items():
        torch.testing.assert_close(t, want[name].detach(), atol=1e-6, rtol=0, msg=name)
    moved = max(
        float((t - safetensors.torch.load_file(d / hf.SINGLE)[n]).abs().max()) for n, t in state.items()
    )
    assert moved > 1e-2  # the parameters did change
    assert eng.state.state.updates == 3


def test_micro_batches_accumulate_to_the_same_step(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen2"]
    spec = hf.read_config(d)
    cfg = AdamWConfig(lr=1e-2, max_grad_norm=0.0)
    one, two = one_rank_engine(spec, optim=cfg, checkpoint=d), one_rank_engine(spec, optim=cfg, checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    a, b = one.train_step(batch, loss_fn), two.train_step(batch, loss_fn, micro_batches=2)
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    # summation order differs: where a gradient is near Adam's eps its update (up to lr = 1e-2)
    # moves by ~1e-6, and by 1.4e-5 for one element in 1e5 seen on some machines
    torch.testing.assert_close(
        two.state.buffers[BufferKind.PARAM], one.state.buffers[BufferKind.PARAM], atol=5e-5, rtol=0
    )
    moved = (
        one.state.buffers[BufferKind.PARAM]
        - one_rank_engine(spec, checkpoint=d).state.buffers[BufferKind.PARAM]
    )
    assert moved.abs().max() > 5e-3


# ------------------------------------------------------------------ bf16 mixed precision (CPU)
def test_bf16_mixed_precision_keeps_fp32_master_weights(checkpoints: dict) -> None:
    """bf16 parameters and activations, fp32 master weights and moments: the update lands in the
    master copy and the parameters are its bf16 rounding; log-probs stay near fp32's."""
    directory, _ = checkpoints["llama"]
    model = hf.read_config(directory)
    fp32 = one_rank_engine(model, checkpoint=directory)
    groups = Groups.build(Grid.single(LAYOUT), model, 0)
    rs = RankState.empty("actor", model, LAYOUT, 0, 0, StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED))
    bf16 = TorchNativeEngine(rs, groups, AdamWConfig(lr=1e-3))
    bf16.load_hf(directory)
    assert rs.buffers[BufferKind.PARAM].dtype == torch.bfloat16
    assert rs.buffers[BufferKind.MASTER].dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.vocab_size, (4, 12), generator=g)
    batch = TokenBatch(ids, torch.ones_like(ids), {"mask": torch.ones(4, 12)})
    assert (bf16.forward(batch) - fp32.forward(batch)).abs().max().item() < 0.25
    before = rs.buffers[BufferKind.MASTER].clone()
    stats = bf16.train_step(batch, lambda s, f: -(s * f["mask"]).sum() / 48, micro_batches=2)
    master = rs.buffers[BufferKind.MASTER]
    assert stats.grad_norm > 0 and not torch.equal(master, before)
    assert torch.equal(rs.buffers[BufferKind.PARAM], master.to(torch.bfloat16))
    hot = bf16.train_step(batch, lambda s, f: -(s * f["mask"]).sum() / 48, micro_batches=2, temperature=0.7)
    assert hot.grad_norm > 0 and math.isfinite(hot.loss)  # the bf16 logits' fp32 copy divided in place


def test_bf16_micro_batches_accumulate_in_fp32(checkpoints: dict) -> None:
    """Each micro-batch's bf16 gradient is added into the fp32 flat gradient as autograd makes it
    (Megatron's main_grad): the accumulated gradient is the fp32 sum of the micro-batches' own,
    exactly, not their sum rounded to bf16 at every micro-batch."""
    directory, _ = checkpoints["llama"]
    model = hf.read_config(directory)
    groups = Groups.build(Grid.single(LAYOUT), model, 0)
    rs = RankState.empty("actor", model, LAYOUT, 0, 0, StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED))
    eng = TorchNativeEngine(rs, groups, AdamWConfig(lr=1e-3))
    eng.load_hf(directory)
    b = eng.bound
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.vocab_size, (4, 12), generator=g)
    batch = TokenBatch(ids, torch.ones_like(ids), {"mask": torch.ones(4, 12)})

    def backward(mb: TokenBatch) -> None:
        (-(b.score(b.stage(mb.ids, mb.valid), mb.ids) * mb.fields["mask"]).sum()).backward()

    numel = rs.layout_of().numel
    total = torch.zeros(numel)
    hooks = accumulate_into(b, total)
    for mb in batch.split(4):
        backward(mb)
    for h in hooks:
        h.remove()
    want = torch.zeros(numel)
    for mb in batch.split(4):
        one = torch.zeros(numel)
        hooks = accumulate_into(b, one)
        backward(mb)
        for h in hooks:
            h.remove()
        want += one
    assert torch.equal(total, want) and total.abs().max() > 0
    assert all(p.grad is None for p in b.params.values())  # the flat gradient holds them
