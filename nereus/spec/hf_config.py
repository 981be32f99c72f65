"""A Hugging Face ``config.json`` read the way transformers reads it, into ``ModelSpec`` fields.

Keys that do not change the function (dropout, ``torch_dtype``, ``pretraining_tp``) are ignored;
a key missing from the file takes transformers' default for the family (``rms_norm_eps`` 1e-6;
``max_position_embeddings`` 2048 for Llama, 131072 for Mistral, 32768 for Qwen2/3; ``head_dim``
128 for Qwen3, hidden/heads for the others). The sizes (hidden, layers, heads, MLP width,
vocabulary) have no default worth guessing and are required. Keys that
change the function in a way ``ModelSpec`` does not describe are refused in one line naming the
key, so that no engine loads such a checkpoint and computes something else: an activation other
than SiLU, MLP biases, Llama's or Qwen3's ``attention_bias`` (q/k/v and o_proj biases; Qwen2's is
q/k/v only and always on, Mistral has none whatever the key says), quantized weights, a
multimodal wrapper's nested ``text_config``, and an expert count (a mixture-of-experts config
relabelled with a dense family's ``model_type``: transformers would build it dense and drop the
experts' weights).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.spec.files import brief
from nereus.spec.model import MAX_POSITIONS as MAX_CONTEXT
from nereus.spec.model import ROPE_TYPES, RUNNABLE_ROPE, ModelFamily, RopeScaling
from nereus.spec.schema import build
from nereus.spec.window import window_from_hf

KEEP = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings", "attention_bias",
    "rms_norm_eps", "rope_theta", "max_position_embeddings",
)  # fmt: skip
RMS_NORM_EPS = 1e-6  # transformers' default for all four families
MAX_POSITIONS = {  # transformers' defaults
    ModelFamily.LLAMA: 2048,
    ModelFamily.MISTRAL: 131072,
    ModelFamily.QWEN2: 32768,
    ModelFamily.QWEN3: 32768,
}
HEAD_DIMS = {ModelFamily.QWEN3: 128}  # transformers' defaults where not hidden/heads
SILU = ("silu", "swish")  # transformers' ACT2FN names for x·sigmoid(x)
# expert counts of the MoE families (Mixtral, Qwen2/3-MoE, DeepSeek, OLMoE, DBRX-style configs)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def hf_fields(data: Any, path: Path) -> dict[str, Any]:
    """``ModelSpec`` fields (without ``name``) of the parsed ``config.json`` at ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    families = ", ".join(f.value for f in ModelFamily)
    try:
        family = ModelFamily(str(model_type))
    except ValueError:
        raise ConfigError(
            f"{path}: key 'model_type': expected one of {families}, got {brief(model_type)}"
        ) from None
    _refuse_unmodelled(data, family, path)
    fields: dict[str, Any] = {k: v for k, v in data.items() if k in KEEP and v is not None}
    fields.setdefault("rms_norm_eps", RMS_NORM_EPS)
    fields.setdefault("max_position_embeddings", MAX_POSITIONS[family])
    if "head_dim" not in data and family in HEAD_DIMS:  # (a null one: hidden/heads, as ours reads 0)
        fields["head_dim"] = HEAD_DIMS[family]
    theta, scaling, kind, positions = _rope(data, path)
    if theta is not None:
        fields["rope_theta"] = theta
    if scaling is not None:
        fields["rope_scaling"] = dataclasses.asdict(scaling)
    if kind not in RUNNABLE_ROPE:
        fields["rope_type"] = kind
    if _is_int(current := fields["max_position_embeddings"]):  # else the typed build names it
        fields["max_position_embeddings"] = max(current, positions)
    if "head_dim" in fields and _is_int(fields["head_dim"]) and fields["head_dim"] <= 0:
        # our model specs read 0 as hidden/heads; transformers would build heads of that width
        raise ConfigError(f"{path}: key 'head_dim': expected a positive integer, got {fields['head_dim']}")
    fields.setdefault("num_key_value_heads", data.get("num_attention_heads"))
    fields["family"] = family.value
    fields["qk_norm"] = family is ModelFamily.QWEN3
    if family is ModelFamily.QWEN2:
        fields["attention_bias"] = True  # transformers' Qwen2 always has q/k/v biases
    elif family is ModelFamily.MISTRAL:
        fields["attention_bias"] = False  # and its Mistral never has any
    fields["sliding_window"], fields["max_window_layers"] = window_from_hf(data, family.value, path)
    return fields


def _refuse_unmodelled(data: dict[str, Any], family: ModelFamily, path: Path) -> None:
    if "text_config" in data and "hidden_size" not in data:
        raise ConfigError(
            f"{path}: key 'text_config': a multimodal model's nested language model is not supported "
            "(expected a causal-LM config.json with hidden_size at its top level)"
        )
    act = data.get("hidden_act", "silu")
    if act not in SILU:
        raise ConfigError(f"{path}: key 'hidden_act': expected silu (SwiGLU MLP), got {brief(act)}")
    mlp_bias = data.get("mlp_bias")
    if mlp_bias not in (False, None):
        raise ConfigError(
            f"{path}: key 'mlp_bias': expected false (MLP biases are not modelled), got {brief(mlp_bias)}"
        )
    bias = data.get("attention_bias", False)
    if family in (ModelFamily.LLAMA, ModelFamily.QWEN3) and bias not in (False, None):
        raise ConfigError(
            f"{path}: key 'attention_bias': expected false ({family.value} with attention_bias has "
            f"q, k, v and o_proj biases, which are not modelled), got {brief(bias)}"
        )
    for key in MOE_KEYS:
        experts = data.get(key)
        if experts not in (None, 0, 1, False):
            raise ConfigError(
                f"{path}: key {key!r}: mixture-of-experts models are not supported (a {family.value} "
                f"config reads as a dense model; expected no experts), got {brief(experts)}"
            )
    if data.get("quantization_config") is not None:
        raise ConfigError(
            f"{path}: key 'quantization_config': quantized checkpoints are not supported (the engines "
            "load bf16, fp16 or fp32 weights; dequantize the checkpoint first)"
        )


def _rope(data: dict[str, Any], path: Path) -> tuple[float | None, RopeScaling | None, str, int]:
    """(rope_theta, scaling, rope type, positions) from ``rope_scaling`` + ``rope_theta``
    (transformers 4) or ``rope_parameters`` (transformers 5). ``llama3`` scaling is modelled; the
    other types transformers knows are kept by name (priced like any RoPE, not run), and reach
    ``factor`` × the original positions, as vLLM serves them; positions 0: the config's."""
    key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
    params = data.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: key {key!r}: expected a mapping, got {brief(params)}")
    theta = params.get("rope_theta", data.get("rope_theta"))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None, "default", 0
    if kind not in ROPE_TYPES:
        raise ConfigError(
            f"{path}: key 'rope_type': expected one of {', '.join(ROPE_TYPES)}, got {brief(kind)}"
        )
    if kind != "llama3":
        factor = params.get("factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1.0 <= factor <= 1e6:
            raise ConfigError(
                f"{path}: key 'rope_scaling.factor': expected a number in [1, 1e6], got {brief(factor)}"
            )
        original = params.get("original_max_position_embeddings") or data.get("max_position_embeddings") or 0
        if isinstance(original, bool) or not isinstance(original, int) or original < 0:
            raise ConfigError(
                f"{path}: key 'rope_scaling.original_max_position_embeddings': expected a positive integer, "
                f"got {brief(original)}"
            )
        if original * factor > MAX_CONTEXT:
            raise ConfigError(
                f"{path}: key 'rope_scaling': factor {brief(factor)} × {original} original positions exceeds "
                f"{MAX_CONTEXT} positions"
            )
        return theta, None, str(kind), int(original * factor)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = build(RopeScaling, {k: params.get(k) for k in keys}, str(path), prefix="rope_scaling.")
    return theta, scaling, "llama3", 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
