"""Per-GPU memory of a candidate replica: weights, optimizer, gradients, activations, KV cache.

Everything is in bytes on the most loaded GPU of a replica (the first or the last pipeline stage,
see ``replica.py``), as arrays over candidate rows.

Sources, one line each where used:
* Mixed-precision bytes per parameter: Megatron-LM distributed-optimizer guide (bf16 param 2,
  fp32 grad 4, fp32 master 4, Adam m and v 4 + 4 = 18 B without a distributed optimizer).
* The fp32 gradient buffer stays allocated between steps: Megatron-LM's DistributedDataParallel
  keeps one contiguous main-grad buffer for the model's lifetime (``megatron/core/distributed/
  param_and_grad_buffer.py``; zeroed, not freed, after each optimizer step), so a trainer's idle
  state on a GPU it shares with generation and inference is weights + optimizer + gradients.
* Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation", Tab. 2 and §4, with
  the per-layer tensors re-derived for GQA attention and a SwiGLU MLP (see ``_layer_act_elems``).
* 1F1B keeps ``pp − p`` micro-batches in flight on stage p: Narayanan et al. 2021, §2.2.
* KV cache: 2 (K, V) × layers × KV heads × head_dim × 2 B per token. How much a replica holds is
  its engine's policy (``kv_pool_tokens``): reserved at full length for every concurrent sequence
  (our vLLM engine: ``backends/vllm/setup.kv_cache_bytes`` gives vLLM max_num_seqs ×
  max_model_len tokens; TensorRT-LLM's default GUARANTEED_NO_EVICT admits a request only when
  prompt + max output tokens are free), or a paged pool for the mean occupancy (PagedAttention
  allocates blocks as sequences grow, Kwon et al. 2023 §4.2; vLLM's scheduler preempts when the
  pool runs out: ``vllm/v1/core/sched/scheduler.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from nereus.plan.replica import FloatArray, ReplicaFacts, layer_params_per_rank
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Precision, Recompute, Stage

_ACT_BYTES = {Precision.BF16_MIXED: 2.0, Precision.FP32: 4.0}  # activations: the compute dtype


def act_bytes(precision: Precision) -> float:
    """Bytes of one activation element (and of a weight as compute gathers it) at ``precision``."""
    return _ACT_BYTES[precision]


KV_BYTES = 2  # bf16 KV cache
LOGIT_BYTES = 4  # fp32 logits for log-probs / cross-entropy: Korthikanti et al. 2022, App. (4sbv/t)
# training holds the loss's fp32 logits and, when backward starts, their gradient of the same size
# (log_softmax's backward allocates it; PyTorch keeps both until the LM head's backward runs)
TRAIN_LOGIT_COPIES = 2.0
PREFILL_CHUNK_TOKENS = 8192  # vLLM's default max_num_batched_tokens (chunked prefill)
KV_BLOCK_TOKENS = 16  # vLLM's default block_size on GPUs (CacheConfig.block_size)

# (weights, optimizer state, gradients) bytes per parameter of a trainer
_TRAIN_BYTES = {
    Precision.BF16_MIXED: (2.0, 12.0, 4.0),  # bf16 param; fp32 master + Adam m, v; fp32 grads
    Precision.FP32: (4.0, 8.0, 4.0),  # fp32 param; Adam m, v; fp32 grads
}
_WEIGHT_BYTES = {Precision.BF16_MIXED: 2.0, Precision.FP32: 4.0}


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Bytes on the most loaded GPU of one replica. ``persistent`` stays while the stage is idle
    (weights, optimizer state and the gradient buffer); ``checkpoint`` is what a checkpoint holds
    and a restart reads back (weights and optimizer state)."""

    params: FloatArray
    optimizer: FloatArray
    grads: FloatArray
    activations: FloatArray
    kv_cache: FloatArray
    correction: float = 1.0  # calibrated factor on the active footprint (paper §2.5)

    @property
    def checkpoint(self) -> FloatArray:
        return self.params + self.optimizer

    @property
    def persistent(self) -> FloatArray:
        return self.params + self.optimizer + self.grads

    @property
    def active(self) -> FloatArray:
        return (self.persistent + self.activations + self.kv_cache) * self.correction

    def each(self, f: Callable[[FloatArray], FloatArray]) -> MemoryTerms:
        """These terms with ``f`` applied to every byte array (e.g. one row of a table)."""
        arrays = (self.params, self.optimizer, self.grads, self.activations, self.kv_cache)
        p, o, g, a, kv = (f(x) for x in arrays)
        return MemoryTerms(p, o, g, a, kv, self.correction)


# ------------------------------------------------------------------ activations
def _layer_act_elems(
    model: ModelSpec, tp: FloatArray, sequence_parallel: bool, flash: bool, seq_len: float
) -> FloatArray:
    """Activation elements one token stores in one layer for the backward pass (no recompute).

    Saved tensors: RMSNorm inputs and outputs of attention and MLP (4h; sharded only with sequence
    parallelism), q, k, v and the attention output (2q + 2kv; q/k before QK-norm too for Qwen3),
    gate, up and SiLU(gate)·up (3I). Without fused (flash) attention the score and softmax matrices
    add 2·heads·s elements (Korthikanti Tab. 2's 5as/h term, without the dropout mask).
    """
    kv = np.maximum(model.num_key_value_heads // tp, 1) * model.head_dim
    q = model.q_size / tp
    sharded = 2 * q + 2 * kv + 3 * model.intermediate_size / tp
    if model.qk_norm:
        sharded = sharded + q + kv
    replicated = 4.0 * model.hidden_size
    elems: FloatArray = sharded + (replicated / tp if sequence_parallel else replicated)
    if not flash:
        elems = elems + 2.0 * model.num_attention_heads * seq_len / tp
    return elems


def layer_activation_bytes(
    model: ModelSpec,
    tp: FloatArray,
    tokens: FloatArray,
    seq_len: float,
    recompute: Recompute,
    sequence_parallel: bool,
    flash: bool,
    act_b: float,
) -> FloatArray:
    """Bytes one layer keeps for ``tokens`` tokens of a micro-batch until its backward pass
    (``act_b`` bytes an element, ``act_bytes``)."""
    tp = np.asarray(tp, dtype=np.float64)
    if recompute is Recompute.FULL:
        elems = model.hidden_size / tp if sequence_parallel else np.full_like(tp, model.hidden_size)
    else:
        # selective recompute drops the attention score matrices (Korthikanti §4.2)
        elems = _layer_act_elems(
            model, tp, sequence_parallel, flash or recompute is Recompute.SELECTIVE, seq_len
        )
    result: FloatArray = tokens * elems * act_b
    return result


def _logit_bytes(model: ModelSpec, tp: FloatArray, tokens: FloatArray) -> FloatArray:
    if model.head is Head.VALUE:
        return np.zeros_like(tokens * tp)
    result: FloatArray = tokens * np.ceil(model.vocab_size / tp) * LOGIT_BYTES
    return result


def kv_bytes_per_token_rank(model: ModelSpec, kv_heads: FloatArray, layers: FloatArray) -> FloatArray:
    """KV cache bytes per token on one rank holding ``layers`` layers and ``kv_heads`` KV heads."""
    result: FloatArray = 2.0 * layers * kv_heads * model.head_dim * KV_BYTES
    return result


_Terms = tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]


def _worst(first: _Terms, last: _Terms, correction: float) -> MemoryTerms:
    """Per row, the terms (params, optimizer, grads, activations, KV) of the fuller stage."""
    take_last = sum(last) > sum(first)
    p, o, g, a, kv = (np.where(take_last, b, f) for f, b in zip(first, last, strict=True))
    return MemoryTerms(p, o, g, a, kv, correction)


# ------------------------------------------------------------------ per stage kind
def trainer_memory(
    model: ModelSpec,
    rep: ReplicaFacts,
    micro_batch: FloatArray,
    grad_accum: FloatArray,
    seq_len: float,
    precision: Precision,
    recompute: Recompute,
    sequence_parallel: bool,
    flash: bool,
    correction: float = 1.0,
    shard: FloatArray | None = None,
) -> MemoryTerms:
    """A training replica under 1F1B: stage p holds min(pp − p, a) micro-batches of activations.

    ``shard``: the DP degree an FSDP (ZeRO-3) engine shards its state over (``nereus price
    --fsdp``; ours shards nothing, ZeRO-0). Each GPU then keeps 1/dp of the fp32 parameters (the
    master copy), Adam's moments and the fp32 gradients, and gathers the rest as compute needs
    it: the root unit's parameters (embedding, final norm, head: torchtitan wraps each block as a
    unit and the model as the root, gathered through the step) and two blocks (the one computing
    and the one prefetched, FSDP2 ``reshard_after_forward``), in the compute dtype. Backward also
    holds the root's unsharded gradients (compute dtype) and one block's in the reduce dtype
    (fp32) until its reduce-scatter (PyTorch FSDP2 docs: ``fully_shard``, ``MixedPrecisionPolicy``)."""
    weight_b, optim_b, grad_b = _TRAIN_BYTES[precision]
    act_b = act_bytes(precision)
    tokens = np.asarray(micro_batch, dtype=np.float64) * seq_len
    layer_act = layer_activation_bytes(
        model, rep.tp, tokens, seq_len, recompute, sequence_parallel, flash, act_b
    )
    working = (
        layer_activation_bytes(
            model, rep.tp, tokens, seq_len, Recompute.NONE, sequence_parallel, flash, act_b
        )
        if recompute is Recompute.FULL
        else np.zeros_like(layer_act)
    )  # a fully recomputed layer rebuilds its activations during backward
    logits = TRAIN_LOGIT_COPIES * _logit_bytes(model, rep.tp, tokens)
    in_flight = np.minimum(rep.pp, grad_accum)
    acts_first = in_flight * rep.layers_first * layer_act + working + np.where(rep.single_stage, logits, 0.0)
    acts_last = rep.layers_last * layer_act + working + logits

    def stage(params: FloatArray, layers: FloatArray, acts: FloatArray) -> _Terms:
        if shard is None:
            return (params * weight_b, params * optim_b, params * grad_b, acts, np.zeros_like(acts))
        block = np.asarray([layer_params_per_rank(model, int(t)) for t in rep.tp])  # one block, per GPU
        root = np.maximum(params - layers * block, 0.0)
        gathered = (root + np.minimum(layers, 2.0) * block) * weight_b
        # the sharded fp32 parameters are the master copy (mixed) or the weights themselves (fp32)
        state_b = optim_b + (weight_b if precision is Precision.FP32 else 0.0)
        grads = params * grad_b / shard + root * act_b + np.minimum(layers, 1.0) * block * grad_b
        return (gathered, params * state_b / shard, grads, acts, np.zeros_like(acts))

    return _worst(
        stage(rep.params_first, rep.layers_first, acts_first),
        stage(rep.params_last, rep.layers_last, acts_last),
        correction,
    )


def inference_memory(
    model: ModelSpec,
    rep: ReplicaFacts,
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
        model, rep.tp, tokens, seq_len, Recompute.NONE, sequence_parallel, flash, act_bytes(precision)
    )
    logits = _logit_bytes(model, rep.tp, tokens)
    zero = np.zeros_like(working)
    first: _Terms = (
        rep.params_first * weight_b,
        zero,
        zero,
        working + np.where(rep.single_stage, logits, 0.0),
        zero,
    )
    last: _Terms = (rep.params_last * weight_b, zero, zero, working + logits, zero)
    return _worst(first, last, correction)


def _blocks(tokens: FloatArray | float) -> FloatArray:
    result: FloatArray = np.ceil(np.asarray(tokens, dtype=np.float64) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return result


def kv_pool_tokens(concurrency: FloatArray, held_mean: float, held_max: float, paged: bool) -> FloatArray:
    """Tokens of KV cache a generation replica holds per rank for ``concurrency`` sequences, where
    a sequence holds ``held_mean`` tokens on average over its generation (prompt + half the mean
    response) and ``held_max`` at its longest (prompt + p95 response); both per layer on average,
    so a sliding window caps them (``ModelSpec.attended``, ``ModelSpec.kv_held``).

    Reserved (``paged=False``): every sequence at ``held_max`` — what our vLLM engine is given,
    so it never preempts. Paged: whole blocks for the mean occupancy per concurrent sequence;
    never less than one sequence of ``held_max`` (vLLM refuses a max_model_len its pool cannot
    hold), so the p95 sequence still fits. A paged pool may run out when the batch's sequences
    grow together: ``preempted_tokens`` prices the recomputation.
    """
    conc = np.asarray(concurrency, dtype=np.float64)
    if not paged:
        return conc * held_max
    return np.maximum(conc * _blocks(held_mean), _blocks(held_max))


def preempted_tokens(
    concurrency: FloatArray, pool_tokens: FloatArray, held_end: float
) -> tuple[FloatArray, FloatArray]:
    """(tokens recomputed, their mean length) when ``concurrency`` sequences that start together
    grow in a pool of ``pool_tokens`` (vLLM's recompute preemption: when a running sequence needs
    a block and none is free, the newest running sequence is preempted, its blocks freed, and it
    is prefilled again, prompt and generated tokens, when it resumes).

    Lockstep growth: with c sequences at length x each the pool holds K/x of them, so from
    x = a = K/c to x = b = ``held_end`` (prompt + response, per layer on average: a sliding
    window stops the growth at the window) the running set shrinks as K/x and the sequences
    preempted at length x number K/x² dx: recomputed tokens ∫ₐᵇ x · K/x² dx = c · a · ln(b/a),
    over c(1 − a/b) sequences. Only the first wave starts in lockstep; its preemptions and
    completions stagger the later ones, which then sit near the mean occupancy (not priced).
    """
    conc = np.asarray(concurrency, dtype=np.float64)
    a = np.asarray(pool_tokens, dtype=np.float64) / np.maximum(conc, 1.0)
    b = held_end
    over = b > a
    ratio = np.where(over, b / np.minimum(a, b), 1.0)
    tokens: FloatArray = np.where(over, conc * a * np.log(ratio), 0.0)
    count = np.where(over, conc * (1.0 - a / b), 0.0)
    mean_len: FloatArray = np.where(count > 0, tokens / np.maximum(count, 1e-300), 0.0)
    return tokens, mean_len


def generation_memory(
    model: ModelSpec,
    rep: ReplicaFacts,
    concurrency: FloatArray,
    prompt_len: float,
    max_len: float,
    precision: Precision,
    correction: float = 1.0,
    pool_tokens: FloatArray | None = None,
) -> MemoryTerms:
    """A generation replica with ``concurrency`` sequences in flight and a KV pool of
    ``pool_tokens`` tokens (default: every sequence reserved at ``max_len``, ``kv_pool_tokens``)."""
    weight_b = _WEIGHT_BYTES[precision]
    conc = np.asarray(concurrency, dtype=np.float64)
    prefill_tokens = np.minimum(conc * prompt_len, PREFILL_CHUNK_TOKENS)
    working = layer_activation_bytes(
        model, rep.tp, prefill_tokens, prompt_len, Recompute.NONE, False, True, act_bytes(precision)
    )
    logits = _logit_bytes(model, rep.tp, conc)
    zero = np.zeros_like(working)

    longest = model.kv_held(max_len, PREFILL_CHUNK_TOKENS)
    pool = conc * longest if pool_tokens is None else np.asarray(pool_tokens, dtype=np.float64)

    def stage(params: FloatArray, layers: FloatArray, acts: FloatArray) -> _Terms:
        kv = pool * kv_bytes_per_token_rank(model, rep.kv_heads, layers)
        return (params * weight_b, zero, zero, acts, kv)

    first = stage(rep.params_first, rep.layers_first, working + np.where(rep.single_stage, logits, 0.0))
    last = stage(rep.params_last, rep.layers_last, working + logits)
    return _worst(first, last, correction)


def coresident_bounds(
    stage_of: Mapping[str, Stage],
    resident: Mapping[str, float],
    active: Mapping[str, float],
    generation_apart: bool,
) -> dict[str, float]:
    """Per model-stage: its active bytes plus, for every other stage sharing its GPUs, the largest
    resident state that stage can leave on a GPU — the placement-independent rule the search keeps
    under capacity (``search.py``). With ``generation_apart`` (async) generation shares nothing."""
    shared = {s for s in stage_of.values() if not (generation_apart and s is Stage.GEN)}
    top = {s: max(resident[n] for n, st in stage_of.items() if st is s) for s in shared}
    return {
        name: active[name] + (sum(v for s, v in top.items() if s is not st) if st in shared else 0.0)
        for name, st in stage_of.items()
    }
