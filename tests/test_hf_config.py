"""A Hugging Face ``config.json`` read as transformers reads it (``nereus.spec.hf_config``): its
defaults for missing keys, and a one-line refusal of keys that change the function in a way the
model does not describe (so no engine loads such a checkpoint and computes something else);
checkpoint tensors that are not bf16/fp16/fp32 weights are refused by the reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from nereus.backends import hf
from nereus.errors import ConfigError
from nereus.spec.model import ModelSpec, check_runnable
from tests.engine_oracle import transformers

pytestmark = pytest.mark.pure

TINYLLAMA: dict[str, Any] = {  # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
}  # fmt: skip
CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def _read(tmp_path: Path, cfg: dict[str, Any]) -> ModelSpec:
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(cfg))
    return ModelSpec.from_hf_config(path)


def _transformers_params(cfg: dict[str, Any]) -> int:
    config_cls, model_cls = CLASSES[cfg["model_type"]]
    with torch.device("meta"):
        model = model_cls(config_cls(**{k: v for k, v in cfg.items() if k != "model_type"}))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_act": "relu2"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            "quantization_config",
        ),
        ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
        ({"num_local_experts": 8, "num_experts_per_tok": 2}, "num_local_experts"),
        ({"model_type": "qwen2", "num_experts": 60}, "num_experts"),
        ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ],
)
def test_keys_that_change_the_function_unmodelled_are_refused(
    tmp_path: Path, change: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError, match=f"key '{key}'") as err:
        _read(tmp_path, {**TINYLLAMA, **change})
    assert "\n" not in str(err.value)


def test_a_multimodal_wrapper_names_its_text_config(tmp_path: Path) -> None:
    wrapper = {
        "model_type": "qwen2",
        "text_config": {k: v for k, v in TINYLLAMA.items() if k != "model_type"},
    }
    with pytest.raises(ConfigError, match="key 'text_config': a multimodal model's nested language model"):
        _read(tmp_path, wrapper)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"hidden_act": "swish", "mlp_bias": False, "attention_bias": False},
        {"model_type": "mistral", "attention_bias": True, "sliding_window": None},  # transformers ignores it
        {"model_type": "qwen2", "attention_bias": False},  # transformers' Qwen2 has q/k/v biases anyway
        {"model_type": "qwen3", "head_dim": 64},
        {"model_type": "qwen3"},  # no head_dim: Qwen3's is 128, not hidden/heads (was priced at 16)
    ],
)
def test_parameters_are_what_transformers_builds(tmp_path: Path, change: dict[str, Any]) -> None:
    cfg = {**TINYLLAMA, **change}
    assert _read(tmp_path, cfg).param_count() == _transformers_params(cfg)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_missing_keys_take_transformers_defaults(tmp_path: Path, family: str) -> None:
    cfg = {k: v for k, v in TINYLLAMA.items() if k not in ("rms_norm_eps", "max_position_embeddings")}
    cfg["model_type"] = family
    spec = _read(tmp_path, cfg)
    theirs = CLASSES[family][0]()
    assert spec.rms_norm_eps == theirs.rms_norm_eps == 1e-6
    assert spec.max_position_embeddings == theirs.max_position_embeddings
    built = CLASSES[family][0](**cfg)  # Qwen2's config has no head_dim: its attention takes hidden/heads
    assert spec.head_dim == (
        getattr(built, "head_dim", None) or cfg["hidden_size"] // cfg["num_attention_heads"]
    )


def test_run_refuses_a_yaml_llama_with_attention_bias() -> None:
    """The engines' q/k/v biases are Qwen2's; exported as a llama, transformers would add an
    o_proj bias the checkpoint does not have."""
    import dataclasses

    from nereus.spec import load_model

    spec = dataclasses.replace(load_model("tiny-llama"), attention_bias=True)
    with pytest.raises(ConfigError, match="set family qwen2"):
        check_runnable(spec)
    check_runnable(load_model("tiny-qwen2"))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.int32, torch.bool, torch.float64])
def test_the_reader_refuses_weights_that_are_not_floating_point(tmp_path: Path, dtype: torch.dtype) -> None:
    save_file({"model.norm.weight": torch.ones(4).to(dtype)}, tmp_path / hf.SINGLE)
    reader = hf.SafetensorsReader(tmp_path)
    with pytest.raises(ConfigError, match=r"tensor 'model.norm.weight' is .*; expected bf16, fp16 or fp32"):
        reader.get("model.norm.weight", (4,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_reader_takes_floating_point_weights(tmp_path: Path, dtype: torch.dtype) -> None:
    save_file({"model.norm.weight": torch.ones(4).to(dtype)}, tmp_path / hf.SINGLE)
    assert hf.SafetensorsReader(tmp_path).get("model.norm.weight", (4,)).dtype == dtype


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_reader_refuses_weights_that_are_not_finite(tmp_path: Path, bad: float) -> None:
    w = torch.ones(4)
    w[2] = bad
    save_file({"model.norm.weight": w}, tmp_path / hf.SINGLE)
    with pytest.raises(ConfigError, match=r"tensor 'model.norm.weight' holds NaN or Infinity$"):
        hf.SafetensorsReader(tmp_path).get("model.norm.weight", (4,))


def test_the_header_check_reads_dtype_and_shape_without_the_data(tmp_path: Path) -> None:
    save_file(
        {"a": torch.ones(4, 2), "b": torch.ones(3).to(torch.int32), "c": torch.ones(2, dtype=torch.bfloat16)},
        tmp_path / hf.SINGLE,
    )
    reader = hf.SafetensorsReader(tmp_path)
    reader.check_header("a", (4, 2))
    reader.check_header("c", (2,))
    with pytest.raises(ConfigError, match=r"tensor 'a' has shape \(4, 2\), the model needs \(2, 4\)$"):
        reader.check_header("a", (2, 4))
    with pytest.raises(ConfigError, match=r"tensor 'b' is I32; expected bf16, fp16 or fp32"):
        reader.check_header("b", (3,))


@pytest.mark.parametrize(
    ("index", "error"),
    [
        ("[" * 5000 + "]" * 5000, "not valid JSON \\(nested deeper than"),
        ('{"weight_map": [1]}', "key 'weight_map' must map tensor names to file names"),
        ('{"weight_map": {"a": 3}}', "key 'weight_map' must map tensor names to file names"),
        ("{}", "key 'weight_map' must map tensor names to file names"),
    ],
)
def test_a_bad_weights_index_is_one_line(tmp_path: Path, index: str, error: str) -> None:
    (tmp_path / hf.INDEX).write_text(index)
    with pytest.raises(ConfigError, match=error) as info:
        hf.SafetensorsReader(tmp_path)
    assert "\n" not in str(info.value)


def test_a_rope_scaling_past_any_context_names_rope_scaling(tmp_path: Path) -> None:
    """It named ``max_position_embeddings`` (a key the user did not write) and a 2^53 limit."""
    yarn = {"rope_type": "yarn", "factor": 1e6, "original_max_position_embeddings": 10**12}
    with pytest.raises(
        ConfigError, match=r"key 'rope_scaling': factor 1000000.0 × 1000000000000 original positions exceeds"
    ):
        _read(tmp_path, {**TINYLLAMA, "rope_scaling": yarn})
    spec = _read(
        tmp_path,
        {**TINYLLAMA, "rope_scaling": {**yarn, "factor": 4.0, "original_max_position_embeddings": 2048}},
    )
    assert spec.max_position_embeddings == 8192


def test_harmless_unused_tensors() -> None:
    assert hf.unused_is_harmless("lm_head.weight") and hf.unused_is_harmless("score.weight")
    assert hf.unused_is_harmless("model.layers.3.self_attn.rotary_emb.inv_freq")
    assert not hf.unused_is_harmless("model.layers.0.mlp.down_proj.bias")
    assert not hf.unused_is_harmless("model.layers.0.self_attn.q_proj.weight_scale_inv")


def test_a_tied_models_own_lm_head_is_found_when_it_is_not_the_embedding(tmp_path: Path) -> None:
    """config.json ties the head, the checkpoint holds one of its own: a copy of the embedding is
    harmless, a head trained apart (one row differs) is what preflight warns about."""
    small = {**TINYLLAMA, "vocab_size": 64, "hidden_size": 8}
    small.update(num_attention_heads=2, num_key_value_heads=1)
    tied = _read(tmp_path, {**small, "tie_word_embeddings": True})
    embed = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    apart = embed.clone()
    apart[63] += 0.5  # the last row only: the rows compared reach both ends of the vocabulary
    for head, untied in ((None, False), (embed.clone(), False), (apart, True), (embed[:32].clone(), True)):
        tensors = {"model.embed_tokens.weight": embed}
        if head is not None:
            tensors["lm_head.weight"] = head
        save_file(tensors, str(tmp_path / "m" / hf.SINGLE))
        assert hf.untied_head(hf.SafetensorsReader(tmp_path / "m"), tied) is untied
    assert not hf.untied_head(hf.SafetensorsReader(tmp_path / "m"), _read(tmp_path, small))


@pytest.mark.parametrize(
    ("key", "value"), [("rope_theta", 1e-300), ("rope_theta", 0.5), ("rms_norm_eps", 1e-300)]
)
def test_absurdly_small_rope_theta_and_epsilon_are_refused(tmp_path: Path, key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"{key} must be at least"):
        _read(tmp_path, {**TINYLLAMA, key: value})


def test_describe_says_what_it_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nereus.cli import main

    cfg = {**TINYLLAMA, "model_type": "mistral", "sliding_window": 1024, "max_position_embeddings": 32768}
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    assert main(["describe", "model", str(path), "--json", "--seq-len", "4096"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["sliding_window"], doc["max_window_layers"], doc["rope"]) == (1024, 0, "default")
    assert (doc["rms_norm_eps"], doc["max_position_embeddings"], doc["attention_bias"]) == (
        1e-5,
        32768,
        False,
    )
    spec = _read(tmp_path, cfg)
    # a token attends to 1,024 tokens at most: the mean over a 4,096-token pass is far below 2,048.5
    assert doc["flops_per_token"] == spec.forward_flops_per_token(float(spec.causal_sum(4096.0)) / 4096)
    assert spec.causal_sum(4096.0) / 4096 < 1024


def _export_source(tmp_path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor], Path]:
    """A tiny model, one tensor of it, and a tokenizer folder ``tok`` holding ``tokenizer.json``."""
    from nereus.spec import load_model

    model = load_model("tiny-llama")
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    return model, {"model.norm.weight": torch.ones(model.hidden_size)}, src


def test_an_export_carries_its_companion_files_and_never_replaces_its_own(tmp_path: Path) -> None:
    model, tensors, src = _export_source(tmp_path)
    (src / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    hf.save(tmp_path / "out", model, tensors, (src / "tokenizer.json", src / "generation_config.json"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    ]  # fmt: skip
    assert (tmp_path / "out" / "generation_config.json").read_text() == '{"eos_token_id": [1, 2]}'
    (src / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="may not replace the checkpoint's own"):
        hf.save(tmp_path / "other", model, tensors, (src / "config.json",))
    assert not (tmp_path / "other").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_an_export_names_its_sources_special_token_ids(tmp_path: Path) -> None:
    """The tokenizer folder's config.json ids (Llama 3.1: several eos ids) reach the export's
    config.json, as its source had them; a bad value or no such file leaves them out."""
    model, tensors, src = _export_source(tmp_path)
    (src / "config.json").write_text('{"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": "x"}')
    hf.save(tmp_path / "out", model, tensors, (src / "tokenizer.json",))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == [2, 3] and "pad_token_id" not in config
    (src / "config.json").unlink()
    hf.save(tmp_path / "bare", model, tensors, (src / "tokenizer.json",))
    assert "eos_token_id" not in json.loads((tmp_path / "bare" / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"max_position_embeddings": "abc"}, "key 'max_position_embeddings': expected int, got 'abc'"),
        ({"max_position_embeddings": [1]}, "key 'max_position_embeddings': expected int, got [1]"),
        ({"head_dim": 0}, "key 'head_dim': expected a positive integer, got 0"),
    ],
)
def test_a_mistyped_context_or_head_width_is_one_line(
    tmp_path: Path, change: dict[str, Any], line: str
) -> None:
    """Not a TypeError from comparing a string with RoPE's context, nor a head_dim of 0 read as
    hidden/heads (what our own model files mean by it; transformers would build zero-width heads)."""
    with pytest.raises(ConfigError) as err:
        _read(tmp_path, {**TINYLLAMA, **change})
    assert str(err.value).endswith(line), str(err.value)


def test_a_config_is_named_for_its_folder_and_another_json_for_itself(tmp_path: Path) -> None:
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
    assert _read(tmp_path, cfg).name == "m"
    other = tmp_path / "m" / "small-llama.json"
    other.write_text(json.dumps(cfg))
    assert ModelSpec.from_hf_config(other).name == "small-llama"
