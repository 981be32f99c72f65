"""The torch-native engine on one rank against Hugging Face transformers (the oracle).

fp32 on CPU, tiny random models (Llama 3 with llama3 RoPE scaling, Qwen3 with tied embeddings and
q/k norms, Qwen2 with q/k/v bias): logits and log-probs equal transformers', checkpoints round-trip
through ``load_hf``/``save_hf``, decoding with a KV cache equals recomputation, sampling depends
only on (seed, sample id, step), ``train_step``'s FlatAdamW equals ``torch.optim.AdamW``, and bad
checkpoints raise ``ConfigError`` without touching the state.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Mapping
from itertools import pairwise
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import Tensor

from nereus.backends import hf
from nereus.backends.grid import Grid
from nereus.backends.logprobs import token_logprobs
from nereus.backends.model import DecoderStage, inv_frequencies
from nereus.backends.optim import AdamWConfig
from nereus.backends.parallel import Groups
from nereus.backends.protocol import TokenBatch
from nereus.backends.sampling import SamplingParams, sample, uniforms
from nereus.backends.torch_native import TorchNativeEngine
from nereus.errors import ConfigError
from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.model import Head, ModelSpec, RopeScaling
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState

transformers = pytest.importorskip("transformers")  # the oracle (extra nereus[dev])

ATOL = 1e-5  # on logits / log-probs of magnitude ~1-10, fp32
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
}
KINDS = ("llama", "qwen3", "qwen2")
LAYOUT = Layout(1, 1)


# ---------------------------------------------------------------------------- builders
def _hf_model(kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny transformers model with O(1) random weights (not the tiny default init)."""
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SHAPE, rope_scaling=dict(LLAMA3_ROPE), rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_theta=1e6)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    _reinit(model, seed)
    return model.eval()


def _reinit(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def _hf_lm_logits(model: transformers.PreTrainedModel, ids: Tensor, valid: Tensor) -> Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=valid, position_ids=_positions(valid))
    logits: Tensor = out.logits
    return logits


def _positions(valid: Tensor) -> Tensor:
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def _next_token_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """(B, T): entry i = log p(ids[i] | ids[:i]) from ``logits`` at i − 1; entry 0 is 0."""
    lp = torch.log_softmax(logits[:, :-1].double() / temperature, -1)
    lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)).float()


def _scored(valid: Tensor) -> Tensor:
    """Where a next-token log-prob is meaningful: the token and the one before it are real."""
    out = torch.zeros_like(valid, dtype=torch.bool)
    out[:, 1:] = valid[:, 1:].bool() & valid[:, :-1].bool()
    return out


def _left_padded(rows: int, length: int, pads: list[int], vocab: int, seed: int) -> TokenBatch:
    """Random ids with ``pads[b]`` left-padding slots in row b (pad slots hold garbage ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    valid = torch.ones(rows, length, dtype=torch.long)
    for b, p in enumerate(pads):
        valid[b, :p] = 0
    return TokenBatch(ids, valid)


def _engine(
    model: ModelSpec,
    stage: Stage = Stage.TRAIN,
    optim: AdamWConfig | None = None,
    checkpoint: Path | None = None,
) -> TorchNativeEngine:
    groups = Groups.build(Grid.single(LAYOUT), model, 0)
    rs = RankState.empty("actor", model, LAYOUT, 0, 0, StatePolicy.of(stage, Precision.FP32))
    eng = TorchNativeEngine(rs, groups, optim)
    if checkpoint is not None:
        eng.load_hf(checkpoint)
    return eng


def _buffers(eng: TorchNativeEngine) -> dict[BufferKind, Tensor]:
    return {k: b.clone() for k, b in eng.state.buffers.items()}


def _keys(directory: Path) -> set[str]:
    with safe_open(str(directory / hf.SINGLE), "pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """kind -> (directory written by save_pretrained, the transformers model)."""
    root = tmp_path_factory.mktemp("hf")
    out: dict[str, tuple[Path, object]] = {}
    for i, kind in enumerate(KINDS):
        model = _hf_model(kind, seed=10 * i)
        d = root / kind
        model.save_pretrained(d, safe_serialization=True)
        out[kind] = (d, model)
    return out


# ---------------------------------------------------------------------------- 1. oracle
def test_llama3_inverse_frequencies_match_transformers() -> None:
    """Every band of Llama 3's scaling (high-frequency kept, smoothed, scaled by 1/factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for old, theta in ((16, 10000.0), (32, 10000.0), (64, 500000.0)):
        rope = {**LLAMA3_ROPE, "original_max_position_embeddings": old}
        cfg = transformers.LlamaConfig(**SHAPE, rope_scaling=rope, rope_theta=theta)
        theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        spec = ModelSpec(
            name="t", family="llama", **SHAPE, rope_theta=theta,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, old),
        )  # fmt: skip
        ours = inv_frequencies(spec)
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
        unscaled = inv_frequencies(dataclasses.replace(spec, rope_scaling=None))
        assert not torch.allclose(ours, unscaled)  # the scaling changes something


@pytest.mark.parametrize("kind", KINDS)
def test_decoder_stage_matches_transformers_logits(kind: str, checkpoints: dict) -> None:
    """The bare module with transformers' state dict: the same logits at every real position."""
    d, theirs = checkpoints[kind]
    spec = hf.read_config(d)
    ours = DecoderStage(spec, range(spec.num_hidden_layers), True, True)
    missing, unexpected = ours.load_state_dict(safetensors.torch.load_file(d / hf.SINGLE), strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if spec.tie_word_embeddings else [])
    if spec.tie_word_embeddings:
        assert ours.lm_head is not None and ours.model.embed_tokens is not None
        ours.lm_head.weight = ours.model.embed_tokens.weight
    batch = _left_padded(3, 28, [0, 5, 13], spec.vocab_size, seed=1)  # positions up to 27 > 16
    with torch.no_grad():
        got = ours(batch.ids, batch.valid)
    want = _hf_lm_logits(theirs, batch.ids, batch.valid)
    real = batch.valid.bool()
    assert want[real].abs().max() > 1.0  # not trivially small
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_forward_matches_transformers_logprobs(kind: str, checkpoints: dict) -> None:
    """save_pretrained -> read_config -> load_hf -> forward: the next-token log-probs of transformers."""
    d, theirs = checkpoints[kind]
    spec = hf.read_config(d)
    assert spec.family.value == kind
    assert spec.tie_word_embeddings is (kind == "qwen3")
    assert spec.qk_norm is (kind == "qwen3")
    assert spec.attention_bias is (kind == "qwen2")
    assert (spec.rope_scaling is not None) is (kind == "llama")
    eng = _engine(spec, Stage.INF, checkpoint=d)
    batch = _left_padded(3, 28, [0, 5, 13], spec.vocab_size, seed=2)
    got = eng.forward(batch)
    want = _next_token_logprobs(_hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids)
    assert got.shape == batch.ids.shape and got.dtype == torch.float32
    assert torch.equal(got[:, 0], torch.zeros(3))
    scored = _scored(batch.valid)
    assert want[scored].abs().max() > 1.0
    torch.testing.assert_close(got[scored], want[scored], atol=ATOL, rtol=0)
    # temperature and micro-batches
    hot = eng.forward(batch, micro_batches=3, temperature=0.7)
    want_hot = _next_token_logprobs(_hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids, 0.7)
    torch.testing.assert_close(hot[scored], want_hot[scored], atol=ATOL, rtol=0)


def test_left_padding_does_not_change_a_row(checkpoints: dict) -> None:
    """A row's log-probs do not depend on how much padding precedes it or on the pad ids."""
    d, _ = checkpoints["llama"]
    eng = _engine(hf.read_config(d), Stage.INF, checkpoint=d)
    batch = _left_padded(1, 20, [0], 128, seed=3)
    alone = eng.forward(batch)
    padded_ids = torch.cat(
        [torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(31)), batch.ids], 1
    )
    padded_valid = torch.cat([torch.zeros(1, 9, dtype=torch.long), batch.valid], 1)
    padded = eng.forward(TokenBatch(padded_ids, padded_valid))
    torch.testing.assert_close(padded[:, 10:], alone[:, 1:], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------- 2. round trip
@pytest.mark.parametrize("kind", KINDS)
def test_save_hf_round_trips_through_transformers(kind: str, checkpoints: dict, tmp_path: Path) -> None:
    d, theirs = checkpoints[kind]
    spec = hf.read_config(d)
    eng = _engine(spec, Stage.INF, checkpoint=d)
    out = tmp_path / "ours"
    eng.save_hf(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours"]  # no temporary left behind
    # the same tensor names as transformers' own checkpoint (tied: no lm_head.weight), bitwise
    assert _keys(out) == _keys(d)
    assert ("lm_head.weight" in _keys(out)) is (kind != "qwen3")
    mine, original = safetensors.torch.load_file(out / hf.SINGLE), safetensors.torch.load_file(d / hf.SINGLE)
    assert all(torch.equal(mine[k], original[k]) for k in original)
    # config round trip
    assert dataclasses.replace(hf.read_config(out), name=spec.name) == spec
    # transformers loads it, with nothing missing, and computes the same logits
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(back) is type(theirs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert back.config.tie_word_embeddings is spec.tie_word_embeddings
    back.eval()
    batch = _left_padded(2, 24, [0, 6], spec.vocab_size, seed=4)
    want = _hf_lm_logits(theirs, batch.ids, batch.valid)
    got = _hf_lm_logits(back, batch.ids, batch.valid)
    assert torch.equal(got, want)


def test_value_head_from_lm_checkpoint_round_trips(checkpoints: dict, tmp_path: Path) -> None:
    d, _ = checkpoints["llama"]
    spec = hf.read_config(d).with_head(Head.VALUE)
    eng = _engine(spec, Stage.TRAIN, checkpoint=d)  # score.weight missing: zeros
    score = eng.state.view(BufferKind.PARAM, "score.weight")
    assert score.shape == (1, spec.hidden_size) and not score.any()
    batch = _left_padded(2, 20, [0, 4], spec.vocab_size, seed=5)
    assert not eng.forward(batch).any()
    w = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        score.copy_(w)
    out = tmp_path / "critic"
    eng.save_hf(out)
    assert _keys(out) == (_keys(d) - {"lm_head.weight"}) | {"score.weight"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    critic, info = transformers.LlamaForSequenceClassification.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert critic.config.num_labels == 1
    assert torch.equal(critic.score.weight.detach(), w)
    assert dataclasses.replace(hf.read_config(out), name=spec.name) == spec.with_head(Head.LM)
    # values at every position: transformers' score on its final hidden states, shifted by one
    critic.eval()
    with torch.no_grad():
        hidden = critic.model(
            input_ids=batch.ids, attention_mask=batch.valid, position_ids=_positions(batch.valid)
        ).last_hidden_state
        values = critic.score(hidden).squeeze(-1)
    got = eng.forward(batch)
    scored = _scored(batch.valid)
    want = torch.nn.functional.pad(values[:, :-1], (1, 0))
    assert want[scored].abs().max() > 0.1
    torch.testing.assert_close(got[scored], want[scored], atol=ATOL, rtol=0)
    # and our own reader takes the value checkpoint back, score included
    again = _engine(spec, Stage.INF, checkpoint=out)
    assert torch.equal(again.state.view(BufferKind.PARAM, "score.weight"), w)


def test_spec_to_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    """A model that starts from our YAML spec (tiny-qwen3) and random buffers: transformers reads
    the checkpoint and computes our log-probs."""
    spec = load_model("tiny-qwen3")
    g = torch.Generator().manual_seed(7)
    fulls = {
        s.source: torch.randn(s.full_shape, generator=g) * 0.2
        + (1.0 if s.name.endswith("norm.weight") else 0.0)
        for s in shards(spec, LAYOUT, 0, 0)
    }

    def full(kind: BufferKind, name: str) -> Tensor:
        return fulls[name] if kind is BufferKind.PARAM else torch.zeros_like(fulls[name])

    policy = StatePolicy.of(Stage.INF, Precision.FP32)
    rs = RankState.from_full("actor", spec, LAYOUT, 0, 0, policy, full)
    eng = TorchNativeEngine(rs, Groups.build(Grid.single(LAYOUT), spec, 0))
    eng.save_hf(tmp_path / "m")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert theirs.config.rms_norm_eps == spec.rms_norm_eps
    assert theirs.config.rope_parameters["rope_theta"] == spec.rope_theta
    theirs.eval()
    batch = _left_padded(2, 16, [0, 5], spec.vocab_size, seed=8)
    want = _next_token_logprobs(_hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids)
    scored = _scored(batch.valid)
    torch.testing.assert_close(eng.forward(batch)[scored], want[scored], atol=ATOL, rtol=0)


def test_sharded_checkpoint_round_trips(
    checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, theirs = checkpoints["qwen2"]
    spec = hf.read_config(d)
    eng = _engine(spec, Stage.INF, checkpoint=d)
    monkeypatch.setattr(hf, "SHARD_BYTES", 40_000)
    out = tmp_path / "sharded"
    eng.save_hf(out)
    index = json.loads((out / hf.INDEX).read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and not (out / hf.SINGLE).exists()
    assert set(index["weight_map"]) == _keys(d)
    total = sum(t.numel() * t.element_size() for t in safetensors.torch.load_file(d / hf.SINGLE).values())
    assert index["metadata"]["total_size"] == total
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = _left_padded(2, 12, [0, 3], spec.vocab_size, seed=9)
    assert torch.equal(
        _hf_lm_logits(back.eval(), batch.ids, batch.valid), _hf_lm_logits(theirs, batch.ids, batch.valid)
    )
    again = _engine(spec, Stage.INF, checkpoint=out)  # our reader: the index path
    assert torch.equal(again.state.buffers[BufferKind.PARAM], eng.state.buffers[BufferKind.PARAM])


# ---------------------------------------------------------------------------- 3. KV cache
def _prompts(spec: ModelSpec, seed: int = 11) -> TokenBatch:
    return _left_padded(3, 12, [0, 3, 7], spec.vocab_size, seed)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_logprobs_equal_recomputation(kind: str, checkpoints: dict) -> None:
    d, _ = checkpoints[kind]
    spec = hf.read_config(d)
    eng = _engine(spec, Stage.INF, checkpoint=d)
    prompts = _prompts(spec)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=5)
    gen = eng.generate(prompts, [0, 1, 2], params)
    assert gen.tokens.shape == gen.valid.shape == gen.logprobs.shape == (3, 8)
    assert gen.valid.all()  # no stop tokens
    seqs = gen.sequences()
    assert torch.equal(seqs.ids[:, :12], prompts.ids)
    plen = prompts.ids.shape[1]
    rescored = eng.forward(seqs, temperature=0.9)[:, plen:]
    live = gen.valid.bool()
    torch.testing.assert_close(rescored[live], gen.logprobs[live], atol=ATOL, rtol=0)
    assert (gen.logprobs < 0).all()  # real log-probs, not a placeholder
    # each token is `sample` of the recomputed logits with that step's draw
    with torch.no_grad():
        logits = eng.stage(seqs.ids, seqs.valid)
    for step in range(8):
        tok, _ = sample(logits[:, plen - 1 + step], params, [0, 1, 2], step)
        assert torch.equal(tok, gen.tokens[:, step]), step
    # and the cached decode agrees with transformers (positions 12 … 19 pass the RoPE scaling edge)
    _, theirs = checkpoints[kind]
    want = _next_token_logprobs(_hf_lm_logits(theirs, seqs.ids, seqs.valid), seqs.ids, 0.9)[:, plen:]
    torch.testing.assert_close(gen.logprobs[live], want[live], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_are_the_argmax_of_recomputation(kind: str, checkpoints: dict) -> None:
    d, _ = checkpoints[kind]
    spec = hf.read_config(d)
    eng = _engine(spec, Stage.INF, checkpoint=d)
    prompts = _prompts(spec, seed=12)
    gen = eng.generate(prompts, [7, 8, 9], SamplingParams(max_new_tokens=8, greedy=True, temperature=0.0))
    seqs = gen.sequences()
    plen = prompts.ids.shape[1]
    with torch.no_grad():
        logits = eng.stage(seqs.ids, seqs.valid)
    want = logits[:, plen - 1 : -1].argmax(-1)
    assert torch.equal(gen.tokens, want)
    assert len(set(gen.tokens.flatten().tolist())) > 3  # not a constant
    lp = eng.forward(seqs)[:, plen:]  # greedy log-probs are at temperature 1
    torch.testing.assert_close(gen.logprobs, lp, atol=ATOL, rtol=0)
    # the same greedy tokens from a different seed (no randomness involved)
    again = eng.generate(prompts, [0, 0, 0], SamplingParams(max_new_tokens=8, greedy=True, seed=99))
    assert torch.equal(again.tokens, gen.tokens)


# ---------------------------------------------------------------------------- 4. semantics
@pytest.fixture(scope="module")
def llama_engine(checkpoints: dict) -> TorchNativeEngine:
    d, _ = checkpoints["llama"]
    return _engine(hf.read_config(d), Stage.INF, checkpoint=d)


def test_generation_is_seeded(llama_engine: TorchNativeEngine) -> None:
    eng = llama_engine
    prompts = _prompts(eng.model)
    p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    a = eng.generate(prompts, [0, 1, 2], p)
    b = eng.generate(prompts, [0, 1, 2], p)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    c = eng.generate(prompts, [0, 1, 2], dataclasses.replace(p, seed=6))
    assert not torch.equal(a.tokens, c.tokens)
    for r in range(3):  # every row changes, not just one
        assert not torch.equal(a.tokens[r], c.tokens[r])
    d = eng.generate(prompts, [3, 4, 5], p)  # sample ids key the draws too
    assert not torch.equal(a.tokens, d.tokens)


def test_row_does_not_depend_on_its_batch(llama_engine: TorchNativeEngine) -> None:
    """A sample's tokens depend on its prompt, seed and sample id only: not on the other rows,
    on its position in the batch, or on how much padding the batch gives it."""
    eng = llama_engine
    prompts = _prompts(eng.model, seed=13)
    p = SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.95, seed=21)
    ids = [40, 41, 42]
    batch = eng.generate(prompts, ids, p)
    for r in range(3):
        real = prompts.valid[r].bool()
        alone = TokenBatch(prompts.ids[r : r + 1, real], prompts.valid[r : r + 1, real])
        single = eng.generate(alone, [ids[r]], p)
        assert torch.equal(single.tokens[0], batch.tokens[r]), r
        torch.testing.assert_close(single.logprobs[0], batch.logprobs[r], atol=ATOL, rtol=0)
    # reversed batch order: the same tokens per sample
    rev = eng.generate(TokenBatch(prompts.ids.flip(0), prompts.valid.flip(0)), ids[::-1], p)
    assert torch.equal(rev.tokens.flip(0), batch.tokens)


def test_stop_tokens_end_a_row(llama_engine: TorchNativeEngine) -> None:
    eng = llama_engine
    prompts = _prompts(eng.model, seed=14)
    p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, pad_token_id=127)
    free = eng.generate(prompts, [0, 1, 2], p)
    stop = int(free.tokens[0, 2])  # row 0 stops at step 2 at the latest
    stopped = eng.generate(prompts, [0, 1, 2], dataclasses.replace(p, stop_token_ids=(stop,)))
    n = stopped.tokens.shape[1]
    assert n <= 8
    ended_somewhere = False
    for r in range(3):
        row = free.tokens[r].tolist()
        end = row.index(stop) + 1 if stop in row else 8  # the stop token itself is kept
        ended_somewhere |= end < n
        assert stopped.valid[r, :end].all() and not stopped.valid[r, end:].any()
        assert torch.equal(stopped.tokens[r, :end], free.tokens[r, :end])
        assert (stopped.tokens[r, end:] == 127).all()
        assert (stopped.logprobs[r, end:] == 0).all()
        torch.testing.assert_close(stopped.logprobs[r, :end], free.logprobs[r, :end], atol=ATOL, rtol=0)
    assert ended_somewhere
    # every row stopping ends the loop early: all tokens are stop tokens
    many = dataclasses.replace(p, stop_token_ids=tuple(range(128)))
    short = eng.generate(prompts, [0, 1, 2], many)
    assert short.tokens.shape == (3, 1) and short.valid.all()


def test_max_new_tokens_and_max_positions(llama_engine: TorchNativeEngine) -> None:
    eng = llama_engine
    prompts = _prompts(eng.model)
    assert eng.model.max_position_embeddings == 64
    for n in (1, 3):
        gen = eng.generate(prompts, [0, 1, 2], SamplingParams(max_new_tokens=n, seed=1))
        assert gen.tokens.shape == (3, n)
    full = eng.generate(prompts, [0, 1, 2], SamplingParams(max_new_tokens=64 - 12, seed=1))
    assert full.tokens.shape == (3, 52) and full.valid.all()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.generate(prompts, [0, 1, 2], SamplingParams(max_new_tokens=64 - 11))
    with pytest.raises(ValueError, match="sample ids"):
        eng.generate(prompts, [0, 1], SamplingParams(max_new_tokens=2))


def test_value_head_cannot_generate(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen3"]
    eng = _engine(hf.read_config(d).with_head(Head.VALUE), Stage.INF, checkpoint=d)
    with pytest.raises(RuntimeError, match="value head"):
        eng.generate(_prompts(eng.model), [0, 1, 2], SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------------------- 5. sampling
def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_tiny_top_p_and_greedy_take_the_argmax() -> None:
    z = _logits(64, 50, seed=1)
    ids = list(range(64))
    for step in range(4):
        tok, lp = sample(z, SamplingParams(max_new_tokens=1, top_p=1e-9, temperature=2.0), ids, step)
        assert torch.equal(tok, z.argmax(-1))
        want = torch.log_softmax(z.double() / 2.0, -1).gather(-1, tok[:, None]).squeeze(-1).float()
        torch.testing.assert_close(lp, want, atol=1e-6, rtol=0)
    tok, lp = sample(z, SamplingParams(max_new_tokens=1, greedy=True, temperature=0.0), ids, 0)
    assert torch.equal(tok, z.argmax(-1))
    want = torch.log_softmax(z.double(), -1).max(-1).values.float()
    torch.testing.assert_close(lp, want, atol=1e-6, rtol=0)


def test_sample_frequencies_follow_the_tempered_and_truncated_distribution() -> None:
    n = 20000
    ids = list(range(n))
    z = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))[None].repeat(n, 1)
    tok, _ = sample(z, SamplingParams(max_new_tokens=1, temperature=1.0, seed=3), ids, 0)
    freq = torch.bincount(tok, minlength=6).double() / n
    torch.testing.assert_close(freq, torch.softmax(z[0].double(), -1), atol=0.015, rtol=0)
    # temperature 0.5 squares and renormalises the probabilities
    tok, _ = sample(z, SamplingParams(max_new_tokens=1, temperature=0.5, seed=3), ids, 1)
    freq = torch.bincount(tok, minlength=6).double() / n
    torch.testing.assert_close(freq, torch.softmax(z[0].double() / 0.5, -1), atol=0.015, rtol=0)
    # top_p 0.7 keeps the tokens with less than 0.7 ahead of them: 0.4, 0.25, 0.15
    tok, lp = sample(z, SamplingParams(max_new_tokens=1, top_p=0.7, seed=3), ids, 2)
    freq = torch.bincount(tok, minlength=6).double() / n
    want = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0], dtype=torch.float64) / 0.8
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
    # the log-prob is the full (untruncated) distribution's
    torch.testing.assert_close(lp, z[0].gather(-1, tok).float(), atol=1e-6, rtol=0)


def test_uniforms_are_deterministic_and_in_range() -> None:
    ids = list(range(5000))
    a = uniforms(7, ids, 3)
    assert a.dtype == torch.float64 and a.shape == (5000,)
    assert torch.equal(a, uniforms(7, ids, 3))
    assert ((a >= 0) & (a < 1)).all()
    assert abs(float(a.mean()) - 0.5) < 0.02 and abs(float(a.var()) - 1 / 12) < 0.005
    assert len(set(a.tolist())) == 5000
    for other in (uniforms(8, ids, 3), uniforms(7, ids, 4), uniforms(7, [i + 1 for i in ids], 3)):
        assert (a != other).float().mean() > 0.99
    # a sample's number does not depend on the others
    assert torch.equal(uniforms(7, [123], 3), uniforms(7, ids, 3)[123:124])
    assert torch.equal(uniforms(7, [2**70 + 5], 0), uniforms(7, [2**70 + 5], 0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "pad_token_id": -1}, "pad_token_id"),
        ({"max_new_tokens": 4, "stop_token_ids": (3, -2)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_needs_no_temperature() -> None:
    assert SamplingParams(max_new_tokens=1, greedy=True, temperature=0.0).greedy


# ---------------------------------------------------------------------------- 6. training
def _train_batch(spec: ModelSpec) -> tuple[TokenBatch, Callable[[Tensor, Mapping[str, Tensor]], Tensor]]:
    batch = _left_padded(4, 16, [0, 2, 5, 9], spec.vocab_size, seed=17)
    mask = _scored(batch.valid).float()
    n = float(mask.sum())

    def loss_fn(scores: Tensor, fields: Mapping[str, Tensor]) -> Tensor:
        return -(scores * fields["mask"]).sum() / n

    return TokenBatch(batch.ids, batch.valid, {"mask": mask}), loss_fn


def test_train_step_reduces_the_loss(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = _engine(spec, optim=AdamWConfig(lr=3e-3), checkpoint=d)
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


def test_train_step_needs_optimizer_state(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = _engine(spec, Stage.INF, checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    with pytest.raises(RuntimeError, match="does not train"):
        eng.train_step(batch, loss_fn)


@pytest.mark.parametrize(("kind", "clip"), [("llama", 0.0), ("qwen3", 0.0), ("qwen2", 0.5)])
def test_flat_adamw_matches_torch_adamw(kind: str, clip: float, checkpoints: dict) -> None:
    d, _ = checkpoints[kind]
    spec = hf.read_config(d)
    cfg = AdamWConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, max_grad_norm=clip)
    eng = _engine(spec, optim=cfg, checkpoint=d)
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
    one, two = _engine(spec, optim=cfg, checkpoint=d), _engine(spec, optim=cfg, checkpoint=d)
    batch, loss_fn = _train_batch(spec)
    a, b = one.train_step(batch, loss_fn), two.train_step(batch, loss_fn, micro_batches=2)
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    # summation order differs: gradients near Adam's eps move by ~1e-6
    torch.testing.assert_close(
        two.state.buffers[BufferKind.PARAM], one.state.buffers[BufferKind.PARAM], atol=1e-5, rtol=0
    )
    moved = one.state.buffers[BufferKind.PARAM] - _engine(spec, checkpoint=d).state.buffers[BufferKind.PARAM]
    assert moved.abs().max() > 5e-3


# ---------------------------------------------------------------------------- 7. bad input
@pytest.fixture
def llama_copy(checkpoints: dict, tmp_path: Path) -> Path:
    d, _ = checkpoints["llama"]
    out = tmp_path / "ckpt"
    shutil.copytree(d, out)
    return out


def _scrambled_engine(spec: ModelSpec) -> TorchNativeEngine:
    """A training engine whose every buffer holds distinctive values."""
    eng = _engine(spec)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for buf in eng.state.buffers.values():
            buf.copy_(torch.randn(buf.shape, generator=g))
    return eng


def _rewrite(directory: Path, edit: Callable[[dict[str, Tensor]], None]) -> None:
    tensors = safetensors.torch.load_file(directory / hf.SINGLE)
    edit(tensors)
    safetensors.torch.save_file(tensors, str(directory / hf.SINGLE), metadata={"format": "pt"})


def _expect_failure(eng: TorchNativeEngine, directory: Path, match: str) -> None:
    before = _buffers(eng)
    with pytest.raises(ConfigError, match=match):
        eng.load_hf(directory)
    for kind, buf in eng.state.buffers.items():
        assert torch.equal(buf, before[kind]), kind


def test_load_hf_without_config(llama_copy: Path) -> None:
    spec = hf.read_config(llama_copy)
    (llama_copy / "config.json").unlink()
    _expect_failure(_scrambled_engine(spec), llama_copy, "no config.json")


def test_load_hf_without_weights(llama_copy: Path) -> None:
    spec = hf.read_config(llama_copy)
    (llama_copy / hf.SINGLE).unlink()
    _expect_failure(_scrambled_engine(spec), llama_copy, "model.safetensors")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b"\x00garbage!" * 64, id="garbage"),
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
    ],
)
def test_load_hf_corrupt_safetensors(llama_copy: Path, damage: Callable[[bytes], bytes]) -> None:
    spec = hf.read_config(llama_copy)
    path = llama_copy / hf.SINGLE
    path.write_bytes(damage(path.read_bytes()))
    _expect_failure(_scrambled_engine(spec), llama_copy, "model.safetensors")


def test_load_hf_vocab_mismatch(llama_copy: Path) -> None:
    spec = hf.read_config(llama_copy)
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["vocab_size"] = 256
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    _expect_failure(_scrambled_engine(spec), llama_copy, "vocab_size")


def test_load_hf_other_family(checkpoints: dict) -> None:
    """A Qwen3 checkpoint (q/k norms) is not a Llama of the same shape."""
    d, _ = checkpoints["qwen3"]
    spec = dataclasses.replace(hf.read_config(d), family="llama", qk_norm=False, tie_word_embeddings=False)
    _expect_failure(_scrambled_engine(spec), d, "qk_norm")


def test_load_hf_tied_model_from_untied_checkpoint(checkpoints: dict) -> None:
    """An untied checkpoint's lm_head.weight must not be silently dropped by a tied model."""
    d, _ = checkpoints["llama"]
    spec = dataclasses.replace(hf.read_config(d), tie_word_embeddings=True)
    _expect_failure(_scrambled_engine(spec), d, "tie_word_embeddings")


def test_load_hf_missing_or_misshapen_tensor(llama_copy: Path) -> None:
    """The bad tensor comes last in state-dict order: everything before it was read already."""
    spec = hf.read_config(llama_copy)
    eng = _scrambled_engine(spec)
    _rewrite(llama_copy, lambda t: t.pop("lm_head.weight"))
    _expect_failure(eng, llama_copy, "'lm_head.weight' is missing")
    _rewrite(llama_copy, lambda t: t.update({"lm_head.weight": torch.zeros(spec.vocab_size, 8)}))
    _expect_failure(eng, llama_copy, "lm_head.weight.*shape")


def test_load_hf_resets_optimizer_state(checkpoints: dict) -> None:
    d, _ = checkpoints["llama"]
    eng = _scrambled_engine(hf.read_config(d))
    eng.load_hf(d)
    assert not eng.state.buffers[BufferKind.EXP_AVG].any()
    assert not eng.state.buffers[BufferKind.EXP_AVG_SQ].any()
    want = safetensors.torch.load_file(d / hf.SINGLE)
    for name, view in eng.state.views():
        assert torch.equal(view, want[name]), name


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_save_failure_leaves_no_partial_directory(
    checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, _ = checkpoints["qwen3"]
    spec = hf.read_config(d)
    eng = _engine(spec, Stage.INF, checkpoint=d)
    existing = tmp_path / "existing"
    eng.save_hf(existing)
    snapshot = _tree(existing)
    real_save = hf.save_file

    def failing(tensors: dict[str, Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
        real_save(dict(list(tensors.items())[:2]), path, metadata=metadata)  # half-written first
        raise OSError("No space left on device")

    monkeypatch.setattr(hf, "save_file", failing)
    with pytest.raises(OSError, match="No space"):
        eng.save_hf(tmp_path / "fresh")
    with pytest.raises(OSError, match="No space"):
        eng.save_hf(existing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert _tree(existing) == snapshot
    # a later successful save replaces the checkpoint and leaves nothing else behind
    monkeypatch.setattr(hf, "save_file", real_save)
    with torch.no_grad():
        eng.state.view(BufferKind.PARAM, "model.norm.weight").fill_(2.0)
    eng.save_hf(existing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert torch.equal(
        safetensors.torch.load_file(existing / hf.SINGLE)["model.norm.weight"],
        torch.full((spec.hidden_size,), 2.0),
    )


# ------------------------------------------------------------------ bf16 mixed precision (CPU)
def test_bf16_mixed_precision_keeps_fp32_master_weights(checkpoints: dict) -> None:
    """bf16 parameters and activations, fp32 master weights and moments: the update lands in the
    master copy and the parameters are its bf16 rounding; log-probs stay near fp32's."""
    directory, _ = checkpoints["llama"]
    model = hf.read_config(directory)
    fp32 = _engine(model, checkpoint=directory)
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
