"""Sliding-window attention as Hugging Face configs state it, read the way transformers reads it.

Mistral: every layer attends to the last ``sliding_window`` tokens; a config without the key gets
transformers' default, 4096 (Mistral 7B v0.1's window), and ``null`` (v0.2 on) means none.
Qwen2/Qwen3: only with ``use_sliding_window: true``, and then only the layers from index
``max_window_layers`` on (transformers' default 28). Where a config lists ``layer_types``
(transformers 5 writes them), they decide. Llama has none.

The result is ``(sliding_window, max_window_layers)``: layer i attends to the last
``sliding_window`` tokens (itself included) when ``sliding_window`` > 0 and i ≥
``max_window_layers``; (0, 0) when no layer slides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.spec.files import brief

MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig.sliding_window
QWEN_DEFAULT_WINDOW = 4096  # transformers' Qwen2Config / Qwen3Config.sliding_window
QWEN_DEFAULT_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config.max_window_layers
LAYER_TYPES = ("full_attention", "sliding_attention")


def _int_or_none(data: dict[str, Any], key: str, default: int | None, path: Path) -> int | None:
    value = data.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{path}: key '{key}': expected a non-negative integer or null, got {brief(value)}")
    return value


def _first_sliding(types: Any, layers: Any, path: Path) -> int | None:
    """The index of the first sliding layer from ``layer_types`` (None: none slides); only full
    layers followed by sliding layers are modelled (what Qwen2's ``max_window_layers`` says)."""
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(
            f"{path}: key 'layer_types': expected a list of {' or '.join(LAYER_TYPES)}, got {brief(types)}"
        )
    if isinstance(layers, int) and len(types) != layers:
        raise ConfigError(f"{path}: key 'layer_types': {len(types)} entries for num_hidden_layers {layers}")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not sliding:
        return None
    if sliding != list(range(sliding[0], len(types))):
        raise ConfigError(
            f"{path}: key 'layer_types': interleaved full and sliding layers are not modelled "
            "(only full-attention layers followed by sliding-window layers)"
        )
    return sliding[0]


def window_from_hf(data: dict[str, Any], family: str, path: Path) -> tuple[int, int]:
    """``(sliding_window, max_window_layers)`` of a ``config.json`` of ``family``."""
    layers = data.get("num_hidden_layers")
    if family == "mistral":
        types = data.get("layer_types")
        if types is not None and _first_sliding(types, layers, path) is not None:
            raise ConfigError(
                f"{path}: key 'layer_types': a Mistral config with per-layer attention types is a "
                "Ministral model (not supported: expected model_type llama, mistral, qwen2 or qwen3 "
                "without layer_types)"
            )
        window = _int_or_none(data, "sliding_window", MISTRAL_DEFAULT_WINDOW, path)
        first: int | None = 0
    elif family in ("qwen2", "qwen3"):
        use = data.get("use_sliding_window", False)
        if not isinstance(use, bool):
            raise ConfigError(f"{path}: key 'use_sliding_window': expected true or false, got {brief(use)}")
        window = _int_or_none(data, "sliding_window", QWEN_DEFAULT_WINDOW, path) if use else None
        first = _int_or_none(data, "max_window_layers", QWEN_DEFAULT_WINDOW_LAYERS, path)
        if window and data.get("layer_types") is not None:
            first = _first_sliding(data["layer_types"], layers, path)
    else:
        if (
            data.get("layer_types") is not None
            and _first_sliding(data["layer_types"], layers, path) is not None
        ):
            raise ConfigError(
                f"{path}: key 'layer_types': sliding-window layers in a {family} config are not "
                "supported (transformers' Llama has none)"
            )
        return 0, 0
    if not window or first is None:
        return 0, 0
    if isinstance(layers, int) and first >= layers:
        return 0, 0  # max_window_layers past the last layer: every layer is full
    return window, first
