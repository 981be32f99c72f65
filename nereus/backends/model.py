"""The torch-native decoder: one pipeline stage of a Llama-family model (Llama 3, Qwen2, Qwen3,
Mistral).

RMSNorm, rotary embeddings (with Llama 3's frequency scaling), grouped-query attention (Qwen3's
per-head q/k RMSNorm, Qwen2's q/k/v bias, Mistral's sliding window) and a SwiGLU MLP, written to
match Hugging Face's ``modeling_llama`` / ``modeling_qwen3`` operation for operation, with the
same state-dict names: ``model.embed_tokens.weight``, ``model.layers.<i>.…``,
``model.norm.weight``, ``lm_head.weight`` and, for a critic or reward model, ``score.weight``
(``*ForSequenceClassification``'s head, applied to every position). A ``DecoderStage`` holds the
layers of one pipeline stage (global layer indices, so names are unchanged); the whole model is
the stage with every layer.

Tensor parallelism needs nothing here: attention reads its local head counts from the shapes of
its projections' outputs, so the same module runs on a TP shard after ``parallelize_module``.
Pure torch (no torch.distributed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nereus.spec.model import Head, ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def inv_frequencies(model: ModelSpec) -> Tensor:
    """RoPE inverse frequencies (fp32), with Llama 3's scaling when the model has one."""
    hd = model.head_dim
    inv = 1.0 / (model.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    s = model.rope_scaling
    if s is None:
        return inv
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (B, T, head_dim) for integer ``positions`` (B, T)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: (B, H, T, hd); cos/sin: (B, T, hd)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@dataclass(slots=True)
class LayerCache:
    """One layer's preallocated keys and values: (B, local KV heads, capacity, head_dim)."""

    k: Tensor
    v: Tensor


class Attention(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        h, hd, bias = model.hidden_size, model.head_dim, model.attention_bias
        self.head_dim = hd
        self.q_proj = nn.Linear(h, model.q_size, bias=bias)
        self.k_proj = nn.Linear(h, model.kv_size, bias=bias)
        self.v_proj = nn.Linear(h, model.kv_size, bias=bias)
        self.o_proj = nn.Linear(model.q_size, h, bias=False)
        self.q_norm = RMSNorm(hd, model.rms_norm_eps) if model.qk_norm else None
        self.k_norm = RMSNorm(hd, model.rms_norm_eps) if model.qk_norm else None
        # With tp > KV heads, k/v inputs pass through this (identity forward, TP all-reduce of
        # the input gradient backward); set by the tensor-parallel binding.
        self.kv_input: Callable[[Tensor], Tensor] = _identity

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: LayerCache | None, start: int
    ) -> Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, t, -1, hd)
        kv_in = self.kv_input(x)
        k = self.k_proj(kv_in).view(b, t, -1, hd)
        v = self.v_proj(kv_in).view(b, t, -1, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            cache.k[:, :, start : start + t] = k
            cache.v[:, :, start : start + t] = v
            k, v = cache.k[:, :, : start + t], cache.v[:, :, : start + t]
        # grouped-query attention: on the CPU without copying the keys and values per query head
        # (its fused kernel takes a mask with enable_gqa); on a GPU repeated, since the
        # memory-efficient kernel refuses unequal head counts and a masked call would fall back
        # to the math kernel's whole score matrix
        rep = q.shape[1] // k.shape[1]
        gqa = rep > 1 and q.device.type == "cpu"
        if rep > 1 and not gqa:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hd), enable_gqa=gqa
        )
        result: Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return result


def _identity(x: Tensor) -> Tensor:
    return x


class Mlp(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        h, inter = model.hidden_size, model.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DecoderLayer(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.self_attn = Attention(model)
        self.post_attention_layernorm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.mlp = Mlp(model)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: LayerCache | None, start: int
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, start)
        result: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class Backbone(nn.Module):
    """``model.*``: the embedding (first stage), this stage's layers, the final norm (last stage)."""

    def __init__(self, model: ModelSpec, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(model.vocab_size, model.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(model) for i in layers})
        self.norm = RMSNorm(model.hidden_size, model.rms_norm_eps) if last else None


def attention_mask(valid: Tensor, query_slots: Tensor, window: int = 0) -> Tensor:
    """Boolean (B, 1, Tq, Tk) mask: a query at cache slot s sees valid keys at slots ≤ s, and
    always itself (so a padding row is never empty). ``valid`` is (B, Tk); ``query_slots`` (Tq,).
    With a ``window`` (sliding-window attention), only keys fewer than ``window`` positions back:
    the query's position minus the key's < window, as transformers and vLLM mask it."""
    keys = torch.arange(valid.shape[1], device=valid.device)
    causal = keys[None, :] <= query_slots[:, None]
    seen = causal[None] & valid.bool()[:, None, :]
    if window:
        key_pos = positions_of(valid)
        query_pos = key_pos[:, query_slots]
        seen &= (query_pos[:, :, None] - key_pos[:, None, :]) < window
    seen |= keys[None, None, :] == query_slots[None, :, None]
    return seen[:, None]


def positions_of(valid: Tensor) -> Tensor:
    """Position ids from a (B, T) validity mask: left padding does not advance the position."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


class DecoderStage(nn.Module):
    """Pipeline stage ``p`` of ``pp``: token ids (or hidden states) in, hidden states (or the
    head's output: LM logits, or values of shape (B, T)) out."""

    def __init__(self, model: ModelSpec, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.spec = model
        self.first, self.last = first, last
        self.model = Backbone(model, layers, first, last)
        self.lm_head: nn.Linear | None = None
        self.score: nn.Linear | None = None
        if last and model.head is Head.VALUE:
            self.score = nn.Linear(model.hidden_size, 1, bias=False)
        elif last:
            self.lm_head = nn.Linear(model.hidden_size, model.vocab_size, bias=False)
        self.inv_freq = inv_frequencies(model)  # not a parameter or a state-dict entry

    def kv_heads(self) -> int:
        """KV heads this rank holds (after tensor-parallel sharding)."""
        layer = next(iter(self.model.layers.values()))
        assert isinstance(layer, DecoderLayer)
        w = layer.self_attn.k_proj.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        return int(local.shape[0]) // self.spec.head_dim

    def layer_caches(self, batch: int, capacity: int, kv_heads: int, dtype: torch.dtype) -> list[LayerCache]:
        """A KV cache for this stage's layers, preallocated for ``capacity`` slots."""
        dev = next(self.parameters()).device
        shape = (batch, kv_heads, capacity, self.spec.head_dim)
        return [
            LayerCache(
                torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)
            )
            for _ in self.model.layers
        ]

    def forward(
        self,
        x: Tensor,
        valid: Tensor,
        caches: list[LayerCache] | None = None,
        start: int = 0,
        positions: Tensor | None = None,
    ) -> Tensor:
        """``x``: ids (B, T) on the first stage, else hidden (B, T, h). ``valid`` (B, start + T)
        marks real tokens among the cached and new slots; new tokens occupy slots start…start+T−1."""
        if self.first:
            assert self.model.embed_tokens is not None
            x = self.model.embed_tokens(x)
        t = x.shape[1]
        slots = torch.arange(start, start + t, device=x.device)
        if positions is None:
            positions = positions_of(valid)[:, start : start + t]
        spec = self.spec
        mask = attention_mask(valid, slots)
        windowed = attention_mask(valid, slots, spec.sliding_window) if spec.sliding_window else mask
        cos, sin = rotary(self.inv_freq, positions, x.dtype)
        for i, (name, layer) in enumerate(self.model.layers.items()):
            seen = windowed if spec.slides(int(name)) else mask
            x = layer(x, cos, sin, seen, caches[i] if caches is not None else None, start)
        if not self.last:
            return x
        assert self.model.norm is not None
        x = self.model.norm(x)
        if self.score is not None:
            values: Tensor = self.score(x).squeeze(-1)
            return values
        assert self.lm_head is not None
        logits: Tensor = self.lm_head(x)
        return logits
