"""The engine on one rank against transformers (the oracle): logits and log-probs equal
transformers' for Llama 3, Qwen3 and Qwen2; checkpoints round-trip through ``load_hf``/``save_hf``;
bad checkpoints raise ``ConfigError`` without touching the state.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import Tensor

from nereus.backends import hf
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.model import DecoderStage, inv_frequencies
from nereus.backends.protocol import TokenBatch
from nereus.backends.torch_native import TorchNativeEngine
from nereus.errors import ConfigError
from nereus.spec import load_model
from nereus.spec.model import Head, ModelSpec, RopeScaling
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState
from tests.engine_oracle import (
    ATOL,
    KINDS,
    LAYOUT,
    LLAMA3_ROPE,
    SHAPE,
    buffer_copies,
    hf_lm_logits,
    hf_positions,
    left_padded,
    next_token_logprobs,
    one_rank_engine,
    safetensor_keys,
    scored_mask,
    transformers,
)

pytestmark = pytest.mark.pure


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
    batch = left_padded(3, 28, [0, 5, 13], spec.vocab_size, seed=1)  # positions up to 27 > 16
    with torch.no_grad():
        got = ours(batch.ids, batch.valid)
    want = hf_lm_logits(theirs, batch.ids, batch.valid)
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
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
    batch = left_padded(3, 28, [0, 5, 13], spec.vocab_size, seed=2)
    got = eng.forward(batch)
    want = next_token_logprobs(hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids)
    assert got.shape == batch.ids.shape and got.dtype == torch.float32
    assert torch.equal(got[:, 0], torch.zeros(3))
    scored = scored_mask(batch.valid)
    assert want[scored].abs().max() > 1.0
    torch.testing.assert_close(got[scored], want[scored], atol=ATOL, rtol=0)
    # temperature and micro-batches
    hot = eng.forward(batch, micro_batches=3, temperature=0.7)
    want_hot = next_token_logprobs(hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids, 0.7)
    torch.testing.assert_close(hot[scored], want_hot[scored], atol=ATOL, rtol=0)


def test_left_padding_does_not_change_a_row(checkpoints: dict) -> None:
    """A row's log-probs do not depend on how much padding precedes it or on the pad ids."""
    d, _ = checkpoints["llama"]
    eng = one_rank_engine(hf.read_config(d), Stage.INF, checkpoint=d)
    batch = left_padded(1, 20, [0], 128, seed=3)
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
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
    out = tmp_path / "ours"
    eng.save_hf(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours"]  # no temporary left behind
    # the same tensor names as transformers' own checkpoint (tied: no lm_head.weight), bitwise
    assert safetensor_keys(out) == safetensor_keys(d)
    assert ("lm_head.weight" in safetensor_keys(out)) is (kind != "qwen3")
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
    batch = left_padded(2, 24, [0, 6], spec.vocab_size, seed=4)
    want = hf_lm_logits(theirs, batch.ids, batch.valid)
    got = hf_lm_logits(back, batch.ids, batch.valid)
    assert torch.equal(got, want)


def test_value_head_from_lm_checkpoint_round_trips(checkpoints: dict, tmp_path: Path) -> None:
    d, _ = checkpoints["llama"]
    spec = hf.read_config(d).with_head(Head.VALUE)
    eng = one_rank_engine(spec, Stage.TRAIN, checkpoint=d)  # score.weight missing: zeros
    score = eng.state.view(BufferKind.PARAM, "score.weight")
    assert score.shape == (1, spec.hidden_size) and not score.any()
    batch = left_padded(2, 20, [0, 4], spec.vocab_size, seed=5)
    assert not eng.forward(batch).any()
    w = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        score.copy_(w)
    out = tmp_path / "critic"
    eng.save_hf(out)
    assert safetensor_keys(out) == (safetensor_keys(d) - {"lm_head.weight"}) | {"score.weight"}
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
            input_ids=batch.ids, attention_mask=batch.valid, position_ids=hf_positions(batch.valid)
        ).last_hidden_state
        values = critic.score(hidden).squeeze(-1)
    got = eng.forward(batch)
    scored = scored_mask(batch.valid)
    want = torch.nn.functional.pad(values[:, :-1], (1, 0))
    assert want[scored].abs().max() > 0.1
    torch.testing.assert_close(got[scored], want[scored], atol=ATOL, rtol=0)
    # and our own reader takes the value checkpoint back, score included
    again = one_rank_engine(spec, Stage.INF, checkpoint=out)
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
    batch = left_padded(2, 16, [0, 5], spec.vocab_size, seed=8)
    want = next_token_logprobs(hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids)
    scored = scored_mask(batch.valid)
    torch.testing.assert_close(eng.forward(batch)[scored], want[scored], atol=ATOL, rtol=0)


def test_sharded_checkpoint_round_trips(
    checkpoints: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, theirs = checkpoints["qwen2"]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
    monkeypatch.setattr(hf, "SHARD_BYTES", 40_000)
    out = tmp_path / "sharded"
    eng.save_hf(out)
    index = json.loads((out / hf.INDEX).read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and not (out / hf.SINGLE).exists()
    assert set(index["weight_map"]) == safetensor_keys(d)
    total = sum(t.numel() * t.element_size() for t in safetensors.torch.load_file(d / hf.SINGLE).values())
    assert index["metadata"]["total_size"] == total
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    batch = left_padded(2, 12, [0, 3], spec.vocab_size, seed=9)
    assert torch.equal(
        hf_lm_logits(back.eval(), batch.ids, batch.valid), hf_lm_logits(theirs, batch.ids, batch.valid)
    )
    again = one_rank_engine(spec, Stage.INF, checkpoint=out)  # our reader: the index path
    assert torch.equal(again.state.buffers[BufferKind.PARAM], eng.state.buffers[BufferKind.PARAM])


# ---------------------------------------------------------------------------- 7. bad input
@pytest.fixture
def llama_copy(checkpoints: dict, tmp_path: Path) -> Path:
    d, _ = checkpoints["llama"]
    out = tmp_path / "ckpt"
    shutil.copytree(d, out)
    return out


def _scrambled_engine(spec: ModelSpec) -> TorchNativeEngine:
    """A training engine whose every buffer holds distinctive values."""
    eng = one_rank_engine(spec)
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
    before = buffer_copies(eng)
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
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
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
