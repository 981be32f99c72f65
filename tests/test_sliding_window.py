"""Sliding-window attention (Mistral; Qwen2/Qwen3 with ``use_sliding_window``): read from a
``config.json`` as transformers reads it, written back so transformers and vLLM apply the same
window, computed by the torch-native decoder as transformers computes it, refused by ``run`` where
vLLM cannot serve it, and priced (planner and simulator truth) with the window capping KV and
attention in generation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch

from nereus.backends import hf
from nereus.backends.model import DecoderStage
from nereus.errors import ConfigError
from nereus.plan.price import PriceQuery, price
from nereus.sim.truth import PARAMS, Lengths, Placement, run_stage
from nereus.sim.truth.decode import decode_step_seconds
from nereus.spec import load_cluster, load_model
from nereus.spec.model import ModelSpec, check_runnable
from nereus.spec.workload import Stage
from tests.engine_oracle import ATOL, SHAPE, hf_lm_logits, left_padded, reinit, transformers
from tests.test_truth import PPO

pytestmark = pytest.mark.pure

MISTRAL_7B_V01: dict[str, Any] = {  # mistralai/Mistral-7B-v0.1's config.json
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
}  # fmt: skip
QWEN2 = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 64,
}  # fmt: skip


def _read(tmp_path: Path, cfg: dict[str, Any]) -> ModelSpec:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return hf.read_config(d)


# ---------------------------------------------------------------------------- reading configs
@pytest.mark.parametrize(
    ("cfg", "window", "first"),
    [
        (MISTRAL_7B_V01, 4096, 0),
        ({**MISTRAL_7B_V01, "sliding_window": None}, 0, 0),  # Mistral 7B v0.2 on
        (
            {k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"},
            4096,
            0,
        ),  # transformers' default
        ({**MISTRAL_7B_V01, "sliding_window": 0}, 0, 0),  # vLLM: 0 disables it
        ({**MISTRAL_7B_V01, "sliding_window": 40000}, 40000, 0),  # past the context: kept, never binds
        (QWEN2, 0, 0),
        ({**QWEN2, "sliding_window": 8, "max_window_layers": 1}, 0, 0),  # use_sliding_window false
        ({**QWEN2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, 8, 1),
        ({**QWEN2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}, 8, 0),
        ({**QWEN2, "use_sliding_window": True, "sliding_window": 8}, 0, 0),  # default 28 ≥ 4 layers
        (
            {
                **QWEN2,
                "use_sliding_window": True,
                "sliding_window": 8,
                "max_window_layers": 2,
                "layer_types": ["full_attention"] * 3 + ["sliding_attention"],
            },
            8,
            3,
        ),
        ({**QWEN2, "layer_types": ["full_attention"] * 4}, 0, 0),
        ({**QWEN2, "model_type": "llama", "layer_types": ["full_attention"] * 4}, 0, 0),
    ],
)
def test_the_window_is_read_as_transformers_reads_it(
    tmp_path: Path, cfg: dict[str, Any], window: int, first: int
) -> None:
    spec = _read(tmp_path, cfg)
    assert (spec.sliding_window, spec.max_window_layers) == (window, first)
    assert spec.sliding_layers == (spec.num_hidden_layers - first if window else 0)


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        ({**MISTRAL_7B_V01, "sliding_window": "4096"}, "sliding_window"),
        ({**MISTRAL_7B_V01, "sliding_window": -1}, "sliding_window"),
        ({**MISTRAL_7B_V01, "sliding_window": True}, "sliding_window"),
        ({**QWEN2, "use_sliding_window": "yes"}, "use_sliding_window"),
        ({**QWEN2, "use_sliding_window": True, "max_window_layers": 1.5}, "max_window_layers"),
        (
            {
                **QWEN2,
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            "layer_types",
        ),
        ({**QWEN2, "use_sliding_window": True, "layer_types": ["full_attention"] * 3}, "layer_types"),
        ({**QWEN2, "use_sliding_window": True, "layer_types": ["local"] * 4}, "layer_types"),
        ({**QWEN2, "model_type": "llama", "layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({**MISTRAL_7B_V01, "layer_types": ["sliding_attention"] * 32}, "layer_types"),
        ({**MISTRAL_7B_V01, "layer_types": 5}, "layer_types"),  # not a list: one line, no traceback
        ({**QWEN2, "use_sliding_window": True, "sliding_window": 8, "layer_types": "full"}, "layer_types"),
    ],
)
def test_a_bad_window_is_one_line_naming_the_key(tmp_path: Path, cfg: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=f"key '{key}'") as err:
        _read(tmp_path, cfg)
    assert "\n" not in str(err.value)


def test_the_spec_validates_and_has_one_spelling_of_no_window() -> None:
    base = load_model("tiny-llama")
    with pytest.raises(ValueError, match="max_window_layers must be in"):
        dataclasses.replace(base, sliding_window=8, max_window_layers=base.num_hidden_layers + 1)
    with pytest.raises(ValueError, match="sliding_window must be in"):
        dataclasses.replace(base, sliding_window=-3)
    none = dataclasses.replace(base, sliding_window=8, max_window_layers=base.num_hidden_layers)
    assert none == base and none.sliding_window == 0  # no layer slides: the same model
    assert dataclasses.replace(base, sliding_window=0, max_window_layers=2) == base


def test_attended_and_causal_sum_against_a_brute_force_count() -> None:
    base = load_model("tiny-qwen2")  # 4 layers
    for window, first in ((0, 0), (5, 0), (5, 1), (5, 3), (64, 0)):
        spec = dataclasses.replace(base, sliding_window=window, max_window_layers=first)
        for length in (1, 4, 5, 6, 17):
            per_layer = [
                min(length, window) if window and i >= first else length
                for i in range(spec.num_hidden_layers)
            ]
            assert spec.attended(float(length)) == pytest.approx(np.mean(per_layer))
            pairs = sum(float(spec.attended(float(p))) for p in range(1, length + 1))
            assert spec.causal_sum(float(length)) == pytest.approx(pairs)
    arr = np.array([3.0, 9.0])
    spec = dataclasses.replace(base, sliding_window=4, max_window_layers=0)
    assert np.allclose(spec.attended(arr), [3.0, 4.0])


# ---------------------------------------------------------------------------- the engine and the files
def test_layers_that_slide_from_max_window_layers_match_transformers(tmp_path: Path) -> None:
    """Qwen2 with the window on layers 1-2 of 3 (a window of 5 over 24-token rows): transformers'
    logits, left padding included; Mistral's all-layer window is in the engine oracle's kinds."""
    cfg = transformers.Qwen2Config(
        **SHAPE, use_sliding_window=True, sliding_window=5, max_window_layers=1, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    theirs = transformers.Qwen2ForCausalLM(cfg)
    reinit(theirs, 3)
    theirs.eval().save_pretrained(tmp_path / "q", safe_serialization=True)
    spec = hf.read_config(tmp_path / "q")
    assert (spec.sliding_window, spec.max_window_layers) == (5, 1)
    ours = DecoderStage(spec, range(spec.num_hidden_layers), True, True)
    ours.load_state_dict(safetensors.torch.load_file(tmp_path / "q" / hf.SINGLE))
    batch = left_padded(3, 24, [0, 4, 11], spec.vocab_size, seed=7)
    with torch.no_grad():
        got = ours(batch.ids, batch.valid)
    want = hf_lm_logits(theirs, batch.ids, batch.valid)
    real = batch.valid.bool()
    torch.testing.assert_close(got[real], want[real], atol=ATOL, rtol=0)
    full = DecoderStage(dataclasses.replace(spec, sliding_window=0), range(3), True, True)
    full.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (full(batch.ids, batch.valid)[real] - want[real]).abs().max() > 1e-2  # the window matters


def test_written_configs_state_the_window_so_transformers_reads_the_same(tmp_path: Path) -> None:
    """A Mistral without a window is written ``sliding_window: null``: without the key,
    transformers (and vLLM after it) would apply a 4096-token window."""
    for window in (0, 4096, 16):
        spec = dataclasses.replace(
            ModelSpec.from_hf_config(_write(tmp_path, MISTRAL_7B_V01)), sliding_window=window
        )
        cfg = hf.hf_config(spec, torch.bfloat16)
        assert cfg["sliding_window"] == (window or None)
        assert transformers.MistralConfig(**cfg).sliding_window == (window or None)
        assert ModelSpec.from_hf_config(_write(tmp_path, cfg), name=spec.name) == spec
    qwen = dataclasses.replace(load_model("tiny-qwen2"), sliding_window=8, max_window_layers=1)
    cfg = hf.hf_config(qwen, torch.float32)
    assert cfg["use_sliding_window"] is True and cfg["max_window_layers"] == 1
    theirs = transformers.Qwen2Config(**cfg)
    assert theirs.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert ModelSpec.from_hf_config(_write(tmp_path, theirs.to_dict()), name=qwen.name) == qwen


def _write(tmp_path: Path, cfg: dict[str, Any]) -> Path:
    path = tmp_path / "w" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def test_run_takes_a_window_on_every_layer_and_refuses_one_on_some(tmp_path: Path) -> None:
    check_runnable(_read(tmp_path, MISTRAL_7B_V01))
    mixed = _read(
        tmp_path, {**QWEN2, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    )
    with pytest.raises(
        ConfigError, match=r"priced but not run \(vLLM serves a sliding window on every layer"
    ):
        check_runnable(mixed)


# ---------------------------------------------------------------------------- pricing
def _gen(model: ModelSpec, prompt: int, resp: int) -> Any:
    q = PriceQuery(Stage.GEN, 1, 1, 1, 64, prompt, resp, concurrency=16)
    return price(model, load_cluster("h200-ib"), q)


def test_the_planner_prices_generation_within_the_window(tmp_path: Path) -> None:
    windowed = _read(tmp_path, MISTRAL_7B_V01)
    full = dataclasses.replace(windowed, sliding_window=0)
    # within the window nothing changes
    assert _gen(windowed, 512, 2048).latency_s == _gen(full, 512, 2048).latency_s
    assert _gen(windowed, 512, 2048).peak_bytes == _gen(full, 512, 2048).peak_bytes
    # at 32k tokens a sequence holds what vLLM admits it for, the window and a prefill chunk
    # (4,095 + 8,192 tokens of 128 KiB), however long it grows; decode reads the window only
    long_w, long_f = _gen(windowed, 1024, 31744), _gen(full, 1024, 31744)
    assert long_w.peak_bytes == _gen(windowed, 1024, 15360).peak_bytes
    assert windowed.kv_bytes_per_token() == 128 << 10
    saved = 16 * (32768 - 4095 - 8192) * windowed.kv_bytes_per_token()
    assert long_f.peak_bytes - long_w.peak_bytes == pytest.approx(saved, rel=0.1)
    assert long_w.latency_s < long_f.latency_s
    assert long_w.by_term["decode"] < long_f.by_term["decode"]
    assert long_w.by_term["prefill"] == long_f.by_term["prefill"]  # a 1,024-token prompt: inside


def test_the_truth_prices_generation_within_the_window(tmp_path: Path) -> None:
    windowed = _read(tmp_path, MISTRAL_7B_V01)
    full = dataclasses.replace(windowed, sliding_window=0)
    a100 = load_cluster("a100-80gb-dgx")
    assert decode_step_seconds(windowed, a100, 64, 2048, PARAMS) == decode_step_seconds(
        full, a100, 64, 2048, PARAMS
    )
    assert decode_step_seconds(windowed, a100, 64, 16384, PARAMS) < decode_step_seconds(
        full, a100, 64, 16384, PARAMS
    )
    pl = Placement.of(1, 1, 1, (0,), 8, micro_batch=64)
    lengths = Lengths(6000, 6000, 8000)
    w = run_stage(windowed, PPO, a100, Stage.GEN, pl, 64, lengths, 40 * 2**30)
    f = run_stage(full, PPO, a100, Stage.GEN, pl, 64, lengths, 40 * 2**30)
    assert w.preempted < f.preempted and w.total < f.total
    assert w.seconds["attention"] < f.seconds["attention"]  # a 6,000-token prompt's prefill


def test_the_vllm_engine_is_given_what_it_admits_a_windowed_sequence_for() -> None:
    """Our vLLM engine's KV room: a sequence of the window and a prefill chunk, plus the block
    where the window starts mid-block; a full-attention model's is unchanged."""
    from nereus.backends.protocol import EngineOptions
    from nereus.backends.vllm import setup
    from nereus.plan.layout import Layout
    from nereus.spec.workload import Precision
    from nereus.state.buffers import StatePolicy
    from nereus.state.holder import RankState

    base = dataclasses.replace(load_model("tiny-llama"), family="mistral")
    policy = StatePolicy.of(Stage.GEN, Precision.FP32)
    options = EngineOptions(max_num_seqs=4)

    def room(model: ModelSpec, max_len: int) -> int:
        return setup.kv_cache_bytes(
            RankState.empty("a.gen", model, Layout(1, 1), 0, 0, policy), options, max_len
        )

    windowed = dataclasses.replace(base, sliding_window=16)
    per_token = 2 * base.num_hidden_layers * base.kv_size * 4
    assert room(base, 20000) == 4 * 20096 * per_token  # 20,000 in 128-token blocks
    assert room(windowed, 20000) == 4 * (8320 + 128) * per_token  # 15 + 8,192 = 8,207 tokens
    assert room(windowed, 1000) == room(base, 1000)  # shorter than what vLLM admits it for
    assert setup.max_batched_tokens(windowed) == setup.PREFILL_CHUNK_TOKENS
    assert setup.max_batched_tokens(base) is None
