"""True time and memory of one model-stage on one step: training and forward-only inference.

Training (per optimizer update, per replica): ⌈global_batch/dp⌉ sequences in whole micro-batches
(the last one may be short but costs a slot); each micro-batch slot runs every layer's weight
GEMMs forward and backward at their own shapes (``gemm.py``), flash attention on each sequence's
own length (E[s²], not the mean's square), the elementwise HBM traffic, the LM head and its
fp32 log-softmax, 4 TP all-reduces of the layer's activations per layer (6 with full recompute,
which also re-runs the forward), and a pipeline send/recv each way; 1F1B takes (m + pp − 1) slots.
Then the DP gradient all-reduce of the stage's fp32 gradients, bucket by bucket, and the fused
Adam step (memory-bound). Inference runs the forward only, in micro-batches.
Generation lives in ``decode.py``.
"""

from __future__ import annotations

import math

from nereus.sim.truth.decode import generation
from nereus.sim.truth.gemm import gemm_seconds, training_gemms_seconds
from nereus.sim.truth.memory import inference_peak, trainer_peak, trainer_state
from nereus.sim.truth.params import ADAM_TRAFFIC_PER_PARAM, GRAD_BUCKET_BYTES, TruthParams, load
from nereus.sim.truth.shard import Placement, Shard
from nereus.sim.truth.work import Acc, Lengths, StageResult
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Recompute, Stage, WorkloadSpec

PARAMS = load()
ACT = 2.0  # bf16 activations on the wire


def _forward(
    acc: Acc, s: Shard, tokens: float, sum_sq: float, times: float, backward: bool, pl: Placement, sp: bool
) -> None:
    """One micro-batch's forward (and, with ``backward``, its backward) through the stage."""
    c, p = acc.cluster, acc.p
    for m, n, k in s.gemms(tokens):
        f, b = training_gemms_seconds(m, n, k, c, p) if backward else (gemm_seconds(m, n, k, c, p), 0.0)
        acc.add("gemm", s.layers * (f * times + b))
    if s.lm_head:
        f, b = (
            training_gemms_seconds(tokens, s.vocab, s.h, c, p)
            if backward
            else (gemm_seconds(tokens, s.vocab, s.h, c, p), 0.0)
        )
        acc.add("gemm", f + b)
        acc.memory(tokens * s.vocab * 4.0 * (3.0 if backward else 2.0))  # fp32 log-softmax passes
    for _ in range(s.layers):
        acc.attention(s, sum_sq)
        if times > 1 or (backward and pl.recompute is Recompute.SELECTIVE):
            acc.attention(s, sum_sq)  # recomputed forward
        if backward:
            acc.attention(s, sum_sq, backward=True)
    acc.memory(s.layers * s.elementwise_bytes(tokens, pl.tp, sp) * (times + (2.0 if backward else 0.0)))
    n_ar = (2.0 * times + (2.0 if backward else 0.0)) * s.layers
    acc.collective("allreduce", pl.tp_group, tokens * s.h * ACT, n_ar)
    if pl.pp > 1:
        acc.collective(
            "sendrecv", pl.pp_group, tokens * s.h * ACT / (pl.tp if sp else 1), 2.0 if backward else 1.0
        )


def training(
    model: ModelSpec,
    w: WorkloadSpec,
    cluster: ClusterSpec,
    pl: Placement,
    sequences: int,
    lengths: Lengths,
    p: TruthParams = PARAMS,
) -> StageResult:
    s = Shard.of(model, pl.tp, pl.pp)
    per_update = math.ceil(w.global_batch / pl.dp)
    b = min(pl.micro_batch, per_update)
    micro = math.ceil(per_update / b)
    updates = math.ceil(sequences / w.global_batch) * w.epochs
    slot = Acc(cluster, p)
    times = 2.0 if pl.recompute is Recompute.FULL else 1.0
    _forward(slot, s, b * lengths.mean, b * lengths.second_moment, times, True, pl, w.sequence_parallel)
    total = Acc(cluster, p)
    total.merge(slot, updates * (micro + pl.pp - 1))
    grads = s.stage_params(pl.pp) * 4.0
    full, rest = divmod(grads, GRAD_BUCKET_BYTES)
    total.collective("allreduce", pl.dp_group, GRAD_BUCKET_BYTES, full * updates)
    total.collective("allreduce", pl.dp_group, rest, updates)
    total.memory(s.stage_params(pl.pp) * ADAM_TRAFFIC_PER_PARAM * updates)
    peak = trainer_peak(
        s, pl.tp, pl.pp, b, micro, lengths.prompt + lengths.response_p95, pl.recompute, w.sequence_parallel
    )
    return StageResult(dict(total.by), peak, trainer_state(s, pl.pp)[0])


def inference(
    model: ModelSpec,
    w: WorkloadSpec,
    cluster: ClusterSpec,
    pl: Placement,
    sequences: int,
    lengths: Lengths,
    p: TruthParams = PARAMS,
) -> StageResult:
    s = Shard.of(model, pl.tp, pl.pp)
    per_replica = math.ceil(sequences / pl.dp)
    b = min(pl.micro_batch, per_replica)
    chunks = math.ceil(per_replica / b)
    slot = Acc(cluster, p)
    _forward(slot, s, b * lengths.mean, b * lengths.second_moment, 1.0, False, pl, w.sequence_parallel)
    total = Acc(cluster, p)
    total.merge(slot, chunks + pl.pp - 1)
    peak = inference_peak(
        s, pl.pp, pl.tp, b, chunks, lengths.prompt + lengths.response_p95, w.sequence_parallel
    )
    return StageResult(dict(total.by), peak, 2.0 * s.stage_params(pl.pp))


def weight_sync(
    result: StageResult, model: ModelSpec, cluster: ClusterSpec, pl: Placement, p: TruthParams = PARAMS
) -> StageResult:
    """Add receiving the trainer's new bf16 weights at the step boundary, bucket by bucket."""
    acc = Acc(cluster, p)
    acc.by.update(result.seconds)
    nbytes = 2.0 * Shard.of(model, pl.tp, pl.pp).stage_params(pl.pp)
    full, rest = divmod(nbytes, GRAD_BUCKET_BYTES)
    pair = pl.replica if pl.replica.nodes > 1 else pl.replica.__class__(2, 1)
    acc.collective("broadcast", pair, GRAD_BUCKET_BYTES, full)
    acc.collective("broadcast", pair, rest)
    return StageResult(dict(acc.by), result.peak_bytes, result.resident_bytes, result.preempted)


def run_stage(
    model: ModelSpec,
    w: WorkloadSpec,
    cluster: ClusterSpec,
    stage: Stage,
    pl: Placement,
    sequences: int,
    lengths: Lengths,
    free_bytes: float | None = None,
    syncs_weights: bool = False,
    p: TruthParams = PARAMS,
) -> StageResult:
    """True seconds per op class and true memory of one model-stage for one step. ``free_bytes``:
    what a generation engine may use on its fullest GPU (its KV pool is sized to it)."""
    if stage is Stage.TRAIN:
        return training(model, w, cluster, pl, sequences, lengths, p)
    if stage is Stage.INF:
        result = inference(model, w, cluster, pl, sequences, lengths, p)
    else:
        result = generation(model, cluster, pl, sequences, lengths, free_bytes, p)
    return weight_sync(result, model, cluster, pl, p) if syncs_weights else result
