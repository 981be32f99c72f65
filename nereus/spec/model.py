"""ModelSpec: the architecture of a Llama-family decoder (Llama 3, Qwen2/2.5, Qwen3, Mistral).

Exact parameter counts, FLOPs per token and KV-cache bytes per token are derived from the shapes,
so a model is fully described by its Hugging Face ``config.json`` (or our YAML with the same keys).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from nereus.errors import ConfigError
from nereus.spec.files import brief, load_json
from nereus.spec.schema import (
    build,
    coerce_enums,
    load_spec,
    require_at_least,
    require_at_most,
    require_finite,
    require_positive,
)

# Upper bounds far beyond any real model: beyond them a value is a typo (or hostile) and the cost
# model's arithmetic would overflow.
MAX_WIDTH = 1 << 18  # hidden_size, head_dim·heads
MAX_HEADS = 4096
MAX_LAYERS = 4096
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 27

FloatLike = TypeVar("FloatLike", float, NDArray[np.float64])  # a length, or an array of them


class ModelFamily(StrEnum):
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"


class Head(StrEnum):
    """Output head: the LM head (actor, reference) or a scalar value head (critic, reward model)."""

    LM = "lm"
    VALUE = "value"


ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")  # transformers' names
RUNNABLE_ROPE = ("default", "llama3")
UNMODELLED_ROPE = tuple(t for t in ROPE_TYPES if t not in RUNNABLE_ROPE)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (``"rope_type": "llama3"`` in ``config.json``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        require_positive(
            self, "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"
        )
        require_finite(self, "factor", "low_freq_factor", "high_freq_factor")
        require_at_most(self, 1e6, "factor", "low_freq_factor", "high_freq_factor")
        require_at_most(self, MAX_POSITIONS, "original_max_position_embeddings")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor {self.low_freq_factor}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer with RMSNorm, RoPE, GQA attention and a SwiGLU MLP."""

    name: str
    family: ModelFamily
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    rope_scaling: RopeScaling | None = None
    # a RoPE kind priced but not run (yarn, linear, dynamic, longrope: the engines apply default
    # and llama3 only); "": default, or llama3 with ``rope_scaling`` (``rope_kind`` says which)
    rope_type: str = ""
    # sliding-window attention (Mistral; Qwen2/3 with use_sliding_window): layers from index
    # max_window_layers on attend to the last sliding_window tokens; 0: no layer slides
    sliding_window: int = 0
    max_window_layers: int = 0
    head: Head = Head.LM
    hf_repo: str = ""  # where the official weights live, for reference

    def __post_init__(self) -> None:
        coerce_enums(self, family=ModelFamily, head=Head)
        require_positive(
            self,
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
        )
        require_finite(self, "rms_norm_eps", "rope_theta")
        # below these the engines' arithmetic is not a model's: RoPE's inverse frequencies
        # overflow, and an epsilon under fp32's resolution of a mean square is no epsilon
        require_at_least(self, 1.0, "rope_theta")
        require_at_least(self, 1e-12, "rms_norm_eps")
        require_at_most(self, MAX_WIDTH, "hidden_size")
        require_at_most(self, MAX_LAYERS, "num_hidden_layers")
        require_at_most(self, MAX_HEADS, "num_attention_heads", "num_key_value_heads")
        require_at_most(self, MAX_INTERMEDIATE, "intermediate_size")
        require_at_most(self, MAX_VOCAB, "vocab_size")
        require_at_most(self, MAX_POSITIONS, "max_position_embeddings")
        require_at_most(self, 1e12, "rope_theta")
        if self.rope_type and self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {', '.join(ROPE_TYPES)}, got {brief(self.rope_type)}")
        unmodelled_with_factors = self.rope_type in UNMODELLED_ROPE and self.rope_scaling is not None
        if self.rope_type and (self.rope_type != self.rope_kind or unmodelled_with_factors):
            raise ValueError(
                f"rope_type {self.rope_type}: rope_scaling holds llama3's factors (rope_type llama3), "
                "and only them"
            )
        if not self.rms_norm_eps < 1:
            raise ValueError(f"rms_norm_eps must be below 1, got {self.rms_norm_eps}")
        if not 0 <= self.head_dim <= MAX_WIDTH:
            raise ValueError(
                f"head_dim must be in [1, {MAX_WIDTH}] (or 0 for hidden/heads), got {brief(self.head_dim)}"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._check_window()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def _check_window(self) -> None:
        if not 0 <= self.sliding_window <= MAX_POSITIONS:
            raise ValueError(
                f"sliding_window must be in [0, {MAX_POSITIONS}] (0: none), got {brief(self.sliding_window)}"
            )
        if not 0 <= self.max_window_layers <= self.num_hidden_layers:
            raise ValueError(
                f"max_window_layers must be in [0, num_hidden_layers {self.num_hidden_layers}], "
                f"got {brief(self.max_window_layers)}"
            )
        if not self.sliding_window or self.max_window_layers == self.num_hidden_layers:
            object.__setattr__(self, "sliding_window", 0)  # one spelling of "no layer slides"
            object.__setattr__(self, "max_window_layers", 0)

    @property
    def rope_kind(self) -> str:
        """The RoPE this model uses: ``rope_type`` if set, else llama3 or default."""
        if self.rope_type in UNMODELLED_ROPE:
            return self.rope_type
        return "default" if self.rope_scaling is None else "llama3"

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_yaml(cls, path: Path) -> ModelSpec:
        """A model YAML; ``head`` is not its to say: each role sets its own (the actor and the
        reference an LM head, the critic and the reward model a value head), so it is refused
        rather than silently overridden."""
        spec = load_spec(cls, path)
        if spec.head is not Head.LM:
            raise ConfigError(
                f"{path}: key 'head': set by the role that runs the model (the critic and reward "
                "model take a value head, the actor and reference an LM head); remove it"
            )
        return spec

    @classmethod
    def from_hf_config(cls, path: Path, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` as transformers reads it (``nereus.spec.hf_config``:
        keys that do not change the function, e.g. dropout, are ignored; keys that change it in
        a way this model does not describe are refused)."""
        from nereus.spec.hf_config import hf_fields  # reads this module's types

        fields = hf_fields(load_json(path, "model config"), path)
        # a folder's config.json is named for its folder (Hugging Face's layout), another file for itself
        fields["name"] = name or (path.parent.name if path.name == "config.json" else "") or path.stem
        return build(cls, fields, str(path))

    # ---------------------------------------------------------------- tensor parallelism
    def tp_conflict(self, tp: int) -> str:
        """Why ``tp`` ranks cannot shard this model's attention Megatron-style ("" when they can):
        tp must divide the attention heads, and tp and the KV heads must divide one another (tp
        above the KV heads replicates each KV head over tp / kv ranks, as Megatron and vLLM do).
        The one rule the planner, ``nereus price``, plan files and the state geometry share."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if tp < 1 or heads % tp:
            return f"tp {tp} must divide the {heads} attention heads"
        if kv % tp and tp % kv:
            return f"tp {tp} and the {kv} KV heads must divide one another"
        return ""

    def tp_options(self, upto: int | None = None) -> tuple[int, ...]:
        """The power-of-two tp up to ``upto`` (default: the attention heads, beyond which none
        does) that shard this model (``tp_conflict`` is "")."""
        out, tp = [], 1
        while tp <= (self.num_attention_heads if upto is None else upto):
            if not self.tp_conflict(tp):
                out.append(tp)
            tp *= 2
        return tuple(out)

    def tp_refusal(self, tp: int, upto: int | None = None) -> str:
        """``tp_conflict`` for a user ("" when none): with the head counts and the power-of-two tp
        up to ``upto`` that would do, e.g. ``tp 4 and the 6 KV heads must divide one another
        (m: 48 attention heads, 6 KV heads; allowed tp: 1, 2)``."""
        conflict = self.tp_conflict(tp)
        if not conflict:
            return ""
        allowed = ", ".join(str(t) for t in self.tp_options(upto))
        return (
            f"{conflict} ({self.name}: {self.num_attention_heads} attention heads, "
            f"{self.num_key_value_heads} KV heads; allowed tp: {allowed})"
        )

    def layout_conflict(self, tp: int, pp: int) -> str:
        """Why a (tp, pp) replica cannot shard this model ("" when it can): ``tp_conflict``, or
        more pipeline stages than layers. What ``nereus.state.geometry.check_layout`` enforces."""
        conflict = self.tp_conflict(tp)
        if conflict:
            return conflict
        if pp > self.num_hidden_layers:
            return f"pp {pp} exceeds the {self.num_hidden_layers} layers"
        return ""

    def with_head(self, head: Head) -> ModelSpec:
        """The same backbone with another output head (a critic or reward model from an actor)."""
        return self if head is self.head else dataclasses.replace(self, head=head)

    # ---------------------------------------------------------------- shapes
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def attention_params(self) -> int:
        """q, k, v, o projections (+ q/k/v bias for Qwen2, + per-head q/k RMSNorm for Qwen3)."""
        h = self.hidden_size
        params = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            params += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def mlp_params(self) -> int:
        """SwiGLU: gate and up (h→I), down (I→h), no bias."""
        return 3 * self.hidden_size * self.intermediate_size

    def layer_params(self) -> int:
        """One decoder layer: attention + MLP + two RMSNorm weight vectors."""
        return self.attention_params() + self.mlp_params() + 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Output head weights stored separately from the embedding (0 when tied)."""
        if self.head is Head.VALUE:
            return self.hidden_size  # score = Linear(h, 1, bias=False), as in *ForSequenceClassification
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def param_count(self) -> int:
        """Exact number of parameters (what the safetensors index sums to)."""
        return (
            self.embedding_params()
            + self.num_hidden_layers * self.layer_params()
            + self.hidden_size  # final norm
            + self.head_params()
        )

    def non_embedding_params(self) -> int:
        """Parameters outside the embedding and an untied LM head (the model cards' convention)."""
        untied_lm_head = self.head_params() if self.head is Head.LM else 0
        return self.param_count() - self.embedding_params() - untied_lm_head

    # ---------------------------------------------------------------- compute
    def head_matmul_params(self) -> int:
        """Weights the head multiplies per token (a tied LM head still does the V×h matmul)."""
        if self.head is Head.VALUE:
            return self.hidden_size
        return self.vocab_size * self.hidden_size

    def matmul_params(self) -> int:
        """Parameters used in a matmul per token: all linear layers and the head, not the embedding."""
        layer = self.hidden_size * (2 * self.q_size + 2 * self.kv_size) + self.mlp_params()
        return self.num_hidden_layers * layer + self.head_matmul_params()

    def attention_flops_per_context_token(self) -> int:
        """Forward FLOPs a token spends per attended token: QKᵀ and AV, 2·nh·hd each, per layer."""
        return 4 * self.num_hidden_layers * self.q_size

    def forward_flops_per_token(self, context: float) -> float:
        """Forward FLOPs of one token attending ``context`` tokens.

        Source: Kaplan et al. 2020, Tab. 1 (2N + 2·n_layer·n_ctx·d_attn), with the attention term
        counted for both QKᵀ and AV and with GQA (K/V projections sized by the KV heads).
        """
        return 2.0 * self.matmul_params() + self.attention_flops_per_context_token() * context

    def sequence_forward_flops(self, length: float) -> float:
        """Forward FLOPs of a causal pass over ``length`` tokens (mean context (length+1)/2)."""
        return length * self.forward_flops_per_token((length + 1.0) / 2.0)

    # ---------------------------------------------------------------- sliding window
    @property
    def sliding_layers(self) -> int:
        """Layers that attend to the last ``sliding_window`` tokens only (0: none)."""
        return self.num_hidden_layers - self.max_window_layers if self.sliding_window else 0

    def slides(self, layer: int) -> bool:
        """Whether global layer ``layer`` attends to a sliding window."""
        return self.sliding_window > 0 and layer >= self.max_window_layers

    def attended(self, length: FloatLike) -> FloatLike:
        """Tokens a token at ``length`` (1-based) attends to, and holds in KV, per layer on
        average over the layers: ``length`` in a full layer, at most the window in a sliding one."""
        if not self.sliding_window:
            return length
        s = self.sliding_layers / self.num_hidden_layers
        out: FloatLike = (1.0 - s) * length + s * np.minimum(length, self.sliding_window)
        return out

    def kv_held(self, length: FloatLike, in_flight: float) -> FloatLike:
        """Tokens of KV cache a sequence of ``length`` holds at most, per layer on average: all of
        them in a full layer; in a sliding layer the window and the ``in_flight`` tokens of a
        prefill chunk (vLLM frees the blocks that leave the window once a step is processed,
        so it admits a request for window − 1 + max_num_batched_tokens tokens)."""
        if not self.sliding_window:
            return length
        s = self.sliding_layers / self.num_hidden_layers
        out: FloatLike = (1.0 - s) * length + s * np.minimum(length, self.sliding_window - 1 + in_flight)
        return out

    def causal_sum(self, length: FloatLike) -> FloatLike:
        """Σ ``attended(p)`` over p = 1 … ``length``: a causal pass's attended pairs per layer
        on average (length·(length+1)/2 without a window)."""
        full = length * (length + 1.0) / 2.0
        if not self.sliding_window:
            return full
        w = float(self.sliding_window)
        inside = np.minimum(length, w)
        windowed = inside * (inside + 1.0) / 2.0 + np.maximum(length - w, 0.0) * w
        s = self.sliding_layers / self.num_hidden_layers
        out: FloatLike = (1.0 - s) * full + s * windowed
        return out

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache per token for the whole model: K and V, every layer, every KV head."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes


def check_runnable(model: ModelSpec) -> None:
    """Refuse a model the runtime cannot run though the planner can price it: the engines rotate
    query and key pairs over the whole head (RoPE), so ``head_dim`` must be even, apply the
    default and llama3 RoPE only, and vLLM serves a sliding window on every layer or none."""
    if model.rope_kind not in RUNNABLE_ROPE:
        raise ConfigError(
            f"model: {model.name}'s rope_type {model.rope_kind} is priced but not run (the runtime's "
            f"engines apply {' and '.join(RUNNABLE_ROPE)} RoPE)"
        )
    if model.attention_bias and model.family is not ModelFamily.QWEN2:
        raise ConfigError(
            f"model: {model.name} is a {model.family.value} with attention_bias; the engines' q/k/v "
            f"biases are Qwen2's (transformers' {model.family.value} adds an o_proj bias): set family qwen2"
        )
    if model.sliding_window and model.max_window_layers:
        raise ConfigError(
            f"model: {model.name} slides a window over layers {model.max_window_layers}+ only; it is "
            "priced but not run (vLLM serves a sliding window on every layer or on none)"
        )
    if model.head_dim % 2:
        raise ConfigError(
            f"model: {model.name}'s head_dim {model.head_dim} is odd; the runtime's rotary embeddings "
            f"need an even head_dim (set head_dim, or hidden_size / num_attention_heads, to an even number)"
        )


def check_context(model: ModelSpec, prompt_len: int, response_len: float, flags: str) -> None:
    """Refuse sequences longer than ``model``'s context: a prompt of ``prompt_len`` tokens and a
    response of ``response_len`` (its longest priced length), named as ``flags`` in the error."""
    total = prompt_len + response_len
    if total > model.max_position_embeddings:
        raise ConfigError(
            f"{flags}: {prompt_len} + {response_len:.0f} = {total:.0f} tokens exceed {model.name}'s "
            f"max_position_embeddings {model.max_position_embeddings}"
        )
