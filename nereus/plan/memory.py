"""Per-GPU memory of a candidate replica: weights, optimizer, gradients, activations, KV cache.

Everything is in bytes on the most loaded GPU of a replica (the pipeline stage with the largest
total). Inputs that vary with the DP degree (micro-batch, concurrent sequences) may be arrays, so
one call prices every DP degree of a layout.

Sources, one line each where used:
* Mixed-precision bytes per parameter: Megatron-LM distributed-optimizer guide (bf16 param 2,
  fp32 grad 4, fp32 master 4, Adam m and v 4 + 4 = 18 B without a distributed optimizer).
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation", Tab. 2 and §4, with
  the per-layer tensors re-derived for GQA attention and a SwiGLU MLP (see ``_layer_act_elems``).
* 1F1B keeps ``pp − p`` micro-batches in flight on stage p: Narayanan et al. 2021, §2.2.
* KV cache: 2 (K, V) × layers × KV heads × head_dim × 2 B per token (PagedAttention allocates
  only the tokens in use: Kwon et al. 2023).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from nereus.plan.layout import Layout, split_layers
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Precision, Recompute

FloatArray = npt.NDArray[np.float64]
ACT_BYTES = 2  # bf16 activations
KV_BYTES = 2  # bf16 KV cache
LOGIT_BYTES = 4  # fp32 logits for log-probs / cross-entropy: Korthikanti et al. 2022, App. (4sbv/t)
PREFILL_CHUNK_TOKENS = 8192  # vLLM's default max_num_batched_tokens (chunked prefill)

# (weights, optimizer state) bytes per parameter kept between stages, and gradient bytes.
_TRAIN_BYTES = {
    Precision.BF16_MIXED: (2.0, 12.0, 4.0),  # bf16 param; fp32 master + Adam m, v; fp32 grads
    Precision.FP32: (4.0, 8.0, 4.0),  # fp32 param; Adam m, v; fp32 grads
}
_WEIGHT_BYTES = {Precision.BF16_MIXED: 2.0, Precision.FP32: 4.0}


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Bytes on the most loaded GPU of one replica. ``persistent`` stays while the stage is idle."""

    params: FloatArray
    optimizer: FloatArray
    grads: FloatArray
    activations: FloatArray
    kv_cache: FloatArray
    correction: float = 1.0  # calibrated factor on the active footprint (paper §2.5)

    @property
    def persistent(self) -> FloatArray:
        return self.params + self.optimizer

    @property
    def active(self) -> FloatArray:
        return (self.persistent + self.grads + self.activations + self.kv_cache) * self.correction


# ------------------------------------------------------------------ parameters per rank
def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads a TP rank holds; replicated (one per rank) when tp exceeds the KV heads."""
    return max(model.num_key_value_heads // tp, 1)


def layer_params_per_rank(model: ModelSpec, tp: int) -> float:
    """One decoder layer's parameters on one TP rank (Megatron column/row split, norms replicated)."""
    h = model.hidden_size
    q = model.q_size / tp
    kv = kv_heads_per_rank(model, tp) * model.head_dim
    attn = 2 * h * q + 2 * h * kv
    if model.attention_bias:
        attn += q + 2 * kv
    if model.qk_norm:
        attn += 2 * model.head_dim
    mlp = 3 * h * math.ceil(model.intermediate_size / tp)
    return attn + mlp + 2 * h


def stage_params(model: ModelSpec, layout: Layout) -> tuple[float, ...]:
    """Parameters on one GPU of each pipeline stage: layers, embedding (first), norm + head (last)."""
    vocab_shard = math.ceil(model.vocab_size / layout.tp) * model.hidden_size
    layer = layer_params_per_rank(model, layout.tp)
    counts = []
    stages = split_layers(model.num_hidden_layers, layout.pp)
    last = len(stages) - 1
    for p, layers in enumerate(stages):
        n = layers * layer
        if p == 0:
            n += vocab_shard
        if p == last:
            n += model.hidden_size  # final norm
            if model.head is Head.VALUE:
                n += model.hidden_size
            elif not model.tie_word_embeddings or layout.pp > 1:
                n += vocab_shard  # untied head, or the tied copy Megatron keeps on the last stage
        counts.append(n)
    return tuple(counts)


# ------------------------------------------------------------------ activations
def _layer_act_elems(
    model: ModelSpec, tp: int, sequence_parallel: bool, flash: bool, seq_len: float
) -> float:
    """Activation elements one token stores in one layer for the backward pass (no recompute).

    Saved tensors: RMSNorm inputs and outputs of attention and MLP (4h; sharded only with sequence
    parallelism), q, k, v and the attention output (2q + 2kv; q/k before QK-norm too for Qwen3),
    gate, up and SiLU(gate)·up (3I). Without fused (flash) attention the score and softmax matrices
    add 2·heads·s elements (Korthikanti Tab. 2's 5as/h term, without the dropout mask).
    """
    kv = kv_heads_per_rank(model, tp) * model.head_dim
    q = model.q_size / tp
    sharded = 2 * q + 2 * kv + 3 * model.intermediate_size / tp
    if model.qk_norm:
        sharded += q + kv
    replicated = 4 * model.hidden_size
    elems = sharded + (replicated / tp if sequence_parallel else replicated)
    if not flash:
        elems += 2 * model.num_attention_heads * seq_len / tp
    return elems


def layer_activation_bytes(
    model: ModelSpec,
    tp: int,
    tokens: FloatArray,
    seq_len: float,
    recompute: Recompute,
    sequence_parallel: bool,
    flash: bool,
) -> FloatArray:
    """Bytes one layer keeps for ``tokens`` tokens of a micro-batch until its backward pass."""
    if recompute is Recompute.FULL:
        elems = model.hidden_size / tp if sequence_parallel else float(model.hidden_size)
    else:
        # selective recompute drops the attention score matrices (Korthikanti §4.2)
        elems = _layer_act_elems(
            model, tp, sequence_parallel, flash or recompute is Recompute.SELECTIVE, seq_len
        )
    return tokens * elems * ACT_BYTES


def _logit_bytes(model: ModelSpec, tp: int, tokens: FloatArray) -> FloatArray:
    if model.head is Head.VALUE:
        return tokens * 0.0
    return tokens * math.ceil(model.vocab_size / tp) * LOGIT_BYTES


def _pick_worst(per_stage: list[tuple[FloatArray, ...]]) -> tuple[FloatArray, ...]:
    """Per element, the terms of the stage whose sum is largest."""
    totals = np.stack([sum(t, np.zeros(())) for t in per_stage])
    worst = np.argmax(totals, axis=0)
    return tuple(
        np.choose(worst, [np.broadcast_to(t[i], totals.shape[1:]) for t in per_stage])
        for i in range(len(per_stage[0]))
    )


# ------------------------------------------------------------------ per stage kind
def trainer_memory(
    model: ModelSpec,
    layout: Layout,
    micro_batch: FloatArray,
    grad_accum: FloatArray,
    seq_len: float,
    precision: Precision,
    recompute: Recompute,
    sequence_parallel: bool,
    flash: bool,
    correction: float = 1.0,
) -> MemoryTerms:
    """A training replica under 1F1B: stage p holds min(pp − p, a) micro-batches of activations."""
    weight_b, optim_b, grad_b = _TRAIN_BYTES[precision]
    stages = split_layers(model.num_hidden_layers, layout.pp)
    tokens = np.asarray(micro_batch, dtype=np.float64) * seq_len
    layer_act = layer_activation_bytes(model, layout.tp, tokens, seq_len, recompute, sequence_parallel, flash)
    working = (
        layer_activation_bytes(model, layout.tp, tokens, seq_len, Recompute.NONE, sequence_parallel, flash)
        if recompute is Recompute.FULL
        else tokens * 0.0
    )  # a fully recomputed layer rebuilds its activations during backward
    per_stage: list[tuple[FloatArray, ...]] = []
    for p, (layers, params) in enumerate(zip(stages, stage_params(model, layout), strict=True)):
        in_flight = np.minimum(layout.pp - p, np.asarray(grad_accum, dtype=np.float64))
        acts = in_flight * layers * layer_act + working
        if p == layout.pp - 1:
            acts = acts + _logit_bytes(model, layout.tp, tokens)
        zero = np.zeros_like(acts)
        per_stage.append(
            (zero + params * weight_b, zero + params * optim_b, zero + params * grad_b, acts, zero)
        )
    params_b, optim, grads, acts, kv = _pick_worst(per_stage)
    return MemoryTerms(params_b, optim, grads, acts, kv, correction)


def inference_memory(
    model: ModelSpec,
    layout: Layout,
    micro_batch: FloatArray,
    seq_len: float,
    precision: Precision,
    sequence_parallel: bool,
    flash: bool,
    correction: float = 1.0,
) -> MemoryTerms:
    """A forward-only replica: weights plus one layer's working set and the logits of a micro-batch."""
    weight_b = _WEIGHT_BYTES[precision]
    tokens = np.asarray(micro_batch, dtype=np.float64) * seq_len
    working = layer_activation_bytes(
        model, layout.tp, tokens, seq_len, Recompute.NONE, sequence_parallel, flash
    )
    per_stage: list[tuple[FloatArray, ...]] = []
    for p, params in enumerate(stage_params(model, layout)):
        acts = working + (_logit_bytes(model, layout.tp, tokens) if p == layout.pp - 1 else 0.0)
        zero = np.zeros_like(acts)
        per_stage.append((zero + params * weight_b, zero, zero, acts, zero))
    params_b, optim, grads, acts, kv = _pick_worst(per_stage)
    return MemoryTerms(params_b, optim, grads, acts, kv, correction)


def kv_bytes_per_token_rank(model: ModelSpec, tp: int, layers: int) -> float:
    """KV cache bytes per token on one rank holding ``layers`` layers."""
    return 2.0 * layers * kv_heads_per_rank(model, tp) * model.head_dim * KV_BYTES


def generation_memory(
    model: ModelSpec,
    layout: Layout,
    concurrency: FloatArray,
    prompt_len: float,
    max_len: float,
    precision: Precision,
    correction: float = 1.0,
) -> MemoryTerms:
    """A generation replica holding ``concurrency`` sequences of up to ``max_len`` tokens in KV."""
    weight_b = _WEIGHT_BYTES[precision]
    conc = np.asarray(concurrency, dtype=np.float64)
    prefill_tokens = np.minimum(conc * prompt_len, PREFILL_CHUNK_TOKENS)
    working = layer_activation_bytes(
        model, layout.tp, prefill_tokens, prompt_len, Recompute.NONE, False, True
    )
    per_stage: list[tuple[FloatArray, ...]] = []
    stages = split_layers(model.num_hidden_layers, layout.pp)
    for p, (layers, params) in enumerate(zip(stages, stage_params(model, layout), strict=True)):
        kv = conc * max_len * kv_bytes_per_token_rank(model, layout.tp, layers)
        acts = working + (_logit_bytes(model, layout.tp, conc) if p == layout.pp - 1 else 0.0)
        zero = np.zeros_like(kv)
        per_stage.append((zero + params * weight_b, zero, zero, acts + zero, kv))
    params_b, optim, grads, acts, kv = _pick_worst(per_stage)
    return MemoryTerms(params_b, optim, grads, acts, kv, correction)
