"""True bytes on one GPU: state, activations, KV cache, logits, and allocator fragmentation.

State per parameter (``params.py``): bf16 weights everywhere; a trainer also keeps its fp32
gradient buffer and fp32 master weights + Adam m, v between steps (Megatron-LM distributed-optimizer
guide). Activations are the truth's own count of the tensors a layer saves for backward (bf16):
the two RMSNorm inputs and the MLP input (h each, TP-split only with sequence parallelism), q, k,
v and the attention output, gate, up and their SwiGLU product; flash attention keeps only its
row log-sum-exp (fp32, one per head and token). Full recomputation keeps each layer's input and
rebuilds one layer's tensors during backward. 1F1B keeps min(pp, micro-batches) micro-batches in
flight on the first stage (Narayanan et al. 2021 §2.2). The LM head's logits are fp32 and the
log-softmax keeps a second copy for backward.

Fragmentation: the caching allocator's blocks split and are reused for differently sized tensors
as micro-batches come and go; the truth charges a fraction of the activation working set that
saturates with the number of allocate/free cycles (``FRAG_MAX``, ``FRAG_CYCLES``: a modelling
assumption, see ``params.py``).

Generation (vLLM): weights, the KV blocks in use, and the prefill chunk's working set; the KV pool
is sized to the memory left free (a full pool preempts, it does not run out of memory).
"""

from __future__ import annotations

import math

from nereus.sim.truth.params import (
    FRAG_CYCLES,
    FRAG_MAX,
    KV_BLOCK_TOKENS,
    PREFILL_CHUNK_TOKENS,
    TRAIN_GRAD_B,
    TRAIN_OPTIM_B,
    TRAIN_WEIGHT_B,
)
from nereus.sim.truth.shard import Shard
from nereus.spec.workload import Recompute

BF16, FP32 = 2.0, 4.0


def fragmentation(working_bytes: float, cycles: float) -> float:
    """Bytes lost to fragmentation after ``cycles`` allocate/free cycles of ``working_bytes``."""
    return FRAG_MAX * working_bytes * (1.0 - math.exp(-max(cycles, 0.0) / FRAG_CYCLES))


def saved_per_token_layer(s: Shard, tp: int, sequence_parallel: bool, recompute: Recompute) -> float:
    """Bytes one token leaves in one layer until its backward pass."""
    hid = s.h / tp if sequence_parallel else float(s.h)
    if recompute is Recompute.FULL:
        return BF16 * hid
    elems = 3 * hid + (s.q + 2 * s.kv) + s.q + 3 * s.inter
    return BF16 * elems + FP32 * s.heads


def working_per_token_layer(s: Shard, tp: int, sequence_parallel: bool) -> float:
    """Bytes one layer's forward needs at once for one token (inference, recompute)."""
    return saved_per_token_layer(s, tp, sequence_parallel, Recompute.NONE)


def logits_bytes(s: Shard, tokens: float, backward: bool) -> float:
    if not s.lm_head:
        return 0.0
    return tokens * s.vocab * FP32 * (2.0 if backward else 1.0)


def trainer_state(s: Shard, pp: int) -> tuple[float, float]:
    """(resident while idle, of which gradient buffer) bytes of a trainer GPU."""
    n = s.stage_params(pp)
    return n * (TRAIN_WEIGHT_B + TRAIN_GRAD_B + TRAIN_OPTIM_B), n * TRAIN_GRAD_B


def trainer_peak(
    s: Shard,
    tp: int,
    pp: int,
    micro_batch: int,
    micro_batches: int,
    tokens_per_seq: float,
    recompute: Recompute,
    sequence_parallel: bool,
) -> float:
    """Peak bytes of a trainer GPU during a step."""
    state, _ = trainer_state(s, pp)
    tokens = micro_batch * tokens_per_seq
    in_flight = min(pp, micro_batches)
    saved = s.layers * tokens * saved_per_token_layer(s, tp, sequence_parallel, recompute) * in_flight
    if recompute is Recompute.FULL:
        saved += tokens * working_per_token_layer(s, tp, sequence_parallel)  # one layer rebuilt
    work = saved + logits_bytes(s, tokens, backward=True)
    return state + work + fragmentation(work, micro_batches)


def inference_peak(
    s: Shard, pp: int, tp: int, micro_batch: int, chunks: int, tokens_per_seq: float, sequence_parallel: bool
) -> float:
    """Peak bytes of a forward-only (log-prob, value, reward) GPU."""
    tokens = micro_batch * tokens_per_seq
    work = 2.0 * tokens * working_per_token_layer(s, tp, sequence_parallel) + logits_bytes(s, tokens, False)
    return BF16 * s.stage_params(pp) + work + fragmentation(work, chunks)


def generation_fixed(s: Shard, pp: int, tp: int, concurrency: float) -> float:
    """Bytes a generation GPU needs besides its KV blocks: weights, the prefill chunk's working
    set and one decode step's logits."""
    work = PREFILL_CHUNK_TOKENS * working_per_token_layer(s, tp, False) + logits_bytes(s, concurrency, False)
    return BF16 * s.stage_params(pp) + work


def kv_blocks_bytes(s: Shard, tokens: float) -> float:
    """KV bytes of ``tokens`` tokens of one sequence, in whole blocks. A sliding layer keeps the
    blocks its window touches (vLLM frees the ones that fall out of it): at most one more than the
    window fills."""
    blocks = math.ceil(tokens / KV_BLOCK_TOKENS)
    if s.window:
        kept = min(blocks, math.ceil(s.window / KV_BLOCK_TOKENS) + 1)
        return ((1.0 - s.sliding) * blocks + s.sliding * kept) * KV_BLOCK_TOKENS * s.kv_bytes_per_token()
    return blocks * KV_BLOCK_TOKENS * s.kv_bytes_per_token()
