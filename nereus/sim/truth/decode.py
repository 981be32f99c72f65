"""Generation the way vLLM runs it: chunked prefill, continuous-batching decode, KV preemption.

A decode iteration at batch B reads the stage's weights once and each sequence's KV cache
(context × KV bytes per token; a sliding-window layer reads its window only) and runs the weight
GEMMs at m = B: its time is the slower of the HBM stream (at the fitted achieved bandwidth) and
the GEMMs (``gemm.py``), plus a fixed per-step overhead (scheduler, sampling, launches) and two
TP all-reduces of B·h per layer. Throughput therefore rises with B, quickly while weights
dominate and then sub-linearly as KV reads and the GEMMs catch up. Pipeline stages take turns on
B/pp micro-groups (no decode speed-up, more KV room).

KV cache: the engine's pool is what the GPU has free after weights and the prefill working set
(``free_bytes``). If the sequences in flight at their full length need more, vLLM preempts: a
fraction 1 − pool/demand of the sequences lose their blocks and are recomputed (their prompt and
the half of the response generated so far run through prefill again), and the concurrency the
pool sustains drops to what fits at the mean context (Kwon et al. 2023 §4.5, recompute mode;
vLLM V1's default). The tail of the step (p95 − mean tokens) decodes at a small batch.

Fitted: the achieved HBM fraction and the per-iteration overhead, on vLLM TPOT at batch 1-8
(``truth_decode.csv``); the GEMM side uses the GEMM fit.
"""

from __future__ import annotations

import math

from nereus.sim.truth.gemm import gemm_seconds
from nereus.sim.truth.memory import fragmentation, generation_fixed, kv_blocks_bytes
from nereus.sim.truth.params import PREFILL_CHUNK_TOKENS, TAIL_BATCH_FRACTION, TruthParams
from nereus.sim.truth.shard import Placement, Shard
from nereus.sim.truth.work import Acc, Lengths, StageResult
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec

ACT = 2.0


def iteration(acc: Acc, s: Shard, pl: Placement, batch: float, context: float, times: float = 1.0) -> None:
    """``times`` decode iterations at ``batch`` sequences of mean ``context`` tokens."""
    c, p = acc.cluster, acc.p
    group = max(batch / pl.pp, 1.0)
    nbytes = 2.0 * s.stage_params(pl.pp) + group * s.attended(context) * s.kv_bytes_per_token()
    t_mem = nbytes / (c.hbm_bandwidth_gbs * 1e9 * p.decode_hbm_eff)
    t_gemm = s.layers * sum(gemm_seconds(m, n, k, c, p) for m, n, k in s.gemms(group))
    if s.lm_head:
        t_gemm += gemm_seconds(group, s.vocab, s.h, c, p)
    slots = pl.pp * times
    acc.add("memory" if t_mem >= t_gemm else "gemm", max(t_mem, t_gemm) * slots)
    acc.add("memory", p.decode_step_s * times)
    acc.collective("allreduce", pl.tp_group, group * s.h * ACT, 2.0 * s.layers * slots)
    if pl.pp > 1:
        acc.collective("sendrecv", pl.pp_group, group * s.h * ACT, slots)


def decode_step_seconds(
    model: ModelSpec, cluster: ClusterSpec, batch: float, context: float, p: TruthParams, tp: int = 1
) -> float:
    """One decode iteration of ``batch`` sequences at ``context`` tokens (TPOT), TP ``tp`` on one node."""
    acc = Acc(cluster, p)
    iteration(
        acc, Shard.of(model, tp, 1), Placement.of(tp, 1, 1, tuple(range(tp)), max(tp, 8)), batch, context
    )
    return sum(acc.by.values())


def _prefill(acc: Acc, s: Shard, pl: Placement, tokens: float, sum_sq: float, sequences: float) -> None:
    c, p = acc.cluster, acc.p
    chunks = math.ceil(tokens / PREFILL_CHUNK_TOKENS)
    chunk = tokens / chunks
    acc.add("gemm", chunks * s.layers * sum(gemm_seconds(m, n, k, c, p) for m, n, k in s.gemms(chunk)))
    if s.lm_head:
        acc.add("gemm", gemm_seconds(sequences, s.vocab, s.h, c, p))  # each sequence samples one token
    for _ in range(s.layers):
        acc.attention(s, sum_sq)
    acc.memory(s.layers * s.elementwise_bytes(tokens, pl.tp, False))
    acc.collective("allreduce", pl.tp_group, chunk * s.h * ACT, 2.0 * s.layers * chunks)
    if pl.pp > 1:
        acc.collective("sendrecv", pl.pp_group, chunk * s.h * ACT, chunks)


def generation(
    model: ModelSpec,
    cluster: ClusterSpec,
    pl: Placement,
    sequences: int,
    lengths: Lengths,
    free_bytes: float | None,
    p: TruthParams,
) -> StageResult:
    s = Shard.of(model, pl.tp, pl.pp)
    per_replica = math.ceil(sequences / pl.dp)
    conc = float(min(pl.micro_batch, per_replica))
    fixed = generation_fixed(s, pl.pp, pl.tp, conc)
    per_seq = kv_blocks_bytes(s, lengths.mean)  # a sequence holds its blocks until it finishes
    demand = conc * per_seq
    pool = demand if free_bytes is None else max(free_bytes - fixed, 0.0)
    if demand <= pool:
        eff_conc, preempted = conc, 0.0
    else:
        eff_conc = max(1.0, min(conc, pool / kv_blocks_bytes(s, lengths.prompt + lengths.response_mean / 2)))
        preempted = 1.0 - pool / demand
    acc = Acc(cluster, p)
    redo = preempted * per_replica
    prefill_tokens = per_replica * lengths.prompt + redo * (lengths.prompt + lengths.response_mean / 2)
    sum_sq = per_replica * s.causal_square(lengths.prompt) + redo * s.causal_square(
        lengths.prompt + lengths.response_mean / 2
    )
    _prefill(acc, s, pl, prefill_tokens, sum_sq, per_replica + redo)
    steady = per_replica * lengths.response_mean / eff_conc
    iteration(acc, s, pl, eff_conc, lengths.prompt + lengths.response_mean / 2, steady)
    tail = lengths.response_p95 - lengths.response_mean
    if tail > 0:
        late = lengths.prompt + (lengths.response_mean + lengths.response_p95) / 2
        iteration(acc, s, pl, max(1.0, TAIL_BATCH_FRACTION * eff_conc), late, tail)
    used = min(demand, pool) if free_bytes is not None else demand
    if free_bytes is not None and pool < kv_blocks_bytes(s, lengths.prompt + lengths.response_p95):
        used = kv_blocks_bytes(s, lengths.prompt + lengths.response_p95)  # cannot hold one long sequence
    work = fixed - 2.0 * s.stage_params(pl.pp)
    peak = fixed + used + fragmentation(work, math.ceil(prefill_tokens / PREFILL_CHUNK_TOKENS))
    return StageResult(dict(acc.by), peak, 2.0 * s.stage_params(pl.pp), preempted)
