"""Shared pieces of the engine's single-rank tests: tiny transformers models (the oracle), their
checkpoints, and a one-rank engine. fp32 on CPU: Llama 3 with llama3 RoPE scaling, Qwen3 with tied
embeddings and q/k norms, Qwen2 with q/k/v bias, Mistral with a 6-token sliding window, all with
O(1) random weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import Tensor

from nereus.backends import hf
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.optim import AdamWConfig
from nereus.backends.protocol import TokenBatch
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
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
KINDS = ("llama", "qwen3", "qwen2", "mistral")
WINDOW = 6  # the Mistral model's sliding window
LAYOUT = Layout(1, 1)


# ---------------------------------------------------------------------------- builders
def hf_model(kind: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny transformers model with O(1) random weights (not the tiny default init)."""
    if kind == "llama":
        cfg = transformers.LlamaConfig(**SHAPE, rope_scaling=dict(LLAMA3_ROPE), rope_theta=10000.0)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_theta=1e6)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
    else:  # a window much shorter than the test sequences (12-28 tokens)
        cfg = transformers.MistralConfig(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False)
        cls = transformers.MistralForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    reinit(model, seed)
    return model.eval()


def reinit(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def hf_lm_logits(model: transformers.PreTrainedModel, ids: Tensor, valid: Tensor) -> Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=valid, position_ids=hf_positions(valid))
    logits: Tensor = out.logits
    return logits


def hf_positions(valid: Tensor) -> Tensor:
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


def next_token_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """(B, T): entry i = log p(ids[i] | ids[:i]) from ``logits`` at i − 1; entry 0 is 0."""
    lp = torch.log_softmax(logits[:, :-1].double() / temperature, -1)
    lp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0)).float()


def scored_mask(valid: Tensor) -> Tensor:
    """Where a next-token log-prob is meaningful: the token and the one before it are real."""
    out = torch.zeros_like(valid, dtype=torch.bool)
    out[:, 1:] = valid[:, 1:].bool() & valid[:, :-1].bool()
    return out


def left_padded(rows: int, length: int, pads: list[int], vocab: int, seed: int) -> TokenBatch:
    """Random ids with ``pads[b]`` left-padding slots in row b (pad slots hold garbage ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    valid = torch.ones(rows, length, dtype=torch.long)
    for b, p in enumerate(pads):
        valid[b, :p] = 0
    return TokenBatch(ids, valid)


def one_rank_engine(
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


def buffer_copies(eng: TorchNativeEngine) -> dict[BufferKind, Tensor]:
    return {k: b.clone() for k, b in eng.state.buffers.items()}


def safetensor_keys(directory: Path) -> set[str]:
    with safe_open(str(directory / hf.SINGLE), "pt") as f:
        return set(f.keys())


def write_checkpoints(root: Path) -> dict[str, tuple[Path, object]]:
    """kind -> (directory written by save_pretrained, the transformers model)."""
    out: dict[str, tuple[Path, object]] = {}
    for i, kind in enumerate(KINDS):
        model = hf_model(kind, seed=10 * i)
        d = root / kind
        model.save_pretrained(d, safe_serialization=True)
        out[kind] = (d, model)
    return out
