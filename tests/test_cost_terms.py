"""Cost model golden values: every term of one training, one inference and one generation shape, by hand.

The expected seconds are plain arithmetic on the model's sizes, the cluster's peaks and bandwidths
and the documented formulas (``nereus.plan.cost`` docstring, ``nereus.plan.links``), never the
functions under test, so a changed factor (recompute multipliers, p2p sends, the decode context,
the head's stage, the optimizer's updates, sequence parallelism) fails here at rel 1e-9.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from nereus.plan.cost import Cost, CostModel, _decode_context
from nereus.plan.layout import Layout
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.spec import load_model
from nereus.spec.workload import Recompute
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

ETA = PRIOR_EFFICIENCY  # a fresh model prices every class at its prior η (no shape curves)
# h100-ib: 989 TFLOP/s bf16, 3350 GB/s HBM, 450 GB/s NVLink, 2 µs per intra-node ring hop
PEAK, HBM, NVLINK, HOP = 989e12, 3350e9, 450e9, 2e-6
BF16 = 2.0  # bytes of an activation / a weight in the compute dtype (bf16-mixed)


def _parts(
    problem: PlanningProblem, name: str, layout: Layout, dp: int, micro: int, rc: Recompute
) -> dict[str, Cost]:
    model_stage = problem.workflow.get(name)
    terms, _ = CostModel(problem).evaluate(model_stage, layout, np.array([dp]), np.array([micro]), rc)
    return dict(terms.parts)


def _check(got: Cost, want: dict[OpClass, float]) -> None:
    """Each op class's seconds as expected; classes absent from ``want`` must be zero."""
    for op in set(got.by_class) | set(want):
        value = float(np.ravel(got.by_class.get(op, np.zeros(1)))[0])
        assert value == pytest.approx(want.get(op, 0.0), rel=1e-9, abs=1e-15), op


def _add(*costs: dict[OpClass, float]) -> dict[OpClass, float]:
    out: dict[OpClass, float] = {}
    for c in costs:
        for op, t in c.items():
            out[op] = out.get(op, 0.0) + t
    return out


def _scale(c: dict[OpClass, float], k: float) -> dict[OpClass, float]:
    return {op: t * k for op, t in c.items()}


def _ring_intra(kind: str, ranks: int, nbytes: float) -> float:
    """One ring collective inside a node (NCCL-tests bus bandwidth): all-reduce 2(n−1)/n·B over
    2(n−1) hops, broadcast and send/recv B over n−1 hops (send/recv: 1), all over η."""
    if kind == "allreduce":
        factor, steps, op = 2.0 * (ranks - 1) / ranks, 2.0 * (ranks - 1), OpClass.ALLREDUCE_INTRA
    elif kind == "broadcast":
        factor, steps, op = 1.0, ranks - 1.0, OpClass.BROADCAST_INTRA
    else:
        factor, steps, op = 1.0, 1.0, OpClass.SENDRECV_INTRA
    return (factor * nbytes / NVLINK + steps * HOP) / ETA[op]


def test_decode_context_is_prompt_plus_half_the_response() -> None:
    model = load_model("llama-3.1-8b")
    assert not model.sliding_window
    assert _decode_context(model, 100, 50) == 125


def test_training_terms_by_hand() -> None:
    """actor.train of llama-3.1-8b on h100-ib: tp 2 · pp 2, dp 2, micro-batch 2, full recompute,
    sequence parallelism, 4 optimizer updates per step; 8 GPUs, so every group is inside a node."""
    prompt, response = 256, 1024
    p = make_problem("llama-3.1-8b", "h100-ib", 16, response, prompt=prompt, prompts_per_step=256,
                     global_batch=64, micro_batch=2, recompute=Recompute.FULL)  # fmt: skip
    assert p.workload.sequence_parallel
    m = p.models[next(iter(p.models))]
    h, q, kv, inter, vocab = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size, m.vocab_size
    tp, pp, dp, b = 2, 2, 2, 2
    layers = m.num_hidden_layers // pp  # 16 on each stage
    updates = 256 // 64  # mini-batches of global_batch per step (1 epoch)
    accum = 64 / (dp * b)  # micro-batches per replica per update
    s = prompt + response
    tokens = b * s
    # forward matmul FLOPs per token of the busiest GPU: 2·(matmul params) per layer, the LM head's
    # 2·V·h on the last stage only, the whole over tp
    layer_flops = 2.0 * (h * (2 * q + 2 * kv) + 3 * h * inter)
    head_flops = 2.0 * vocab * h
    # forward attention: QKᵀ and AV, 4·q_size per attended pair per layer, causal s(s+1)/2 pairs
    fwd_attn = 4.0 * q * layers * b * s * (s + 1) / 2 / tp
    # training = 3× forward, +1 forward of the layers recomputed (full recompute; the LM head is
    # not recomputed, Megatron-LM's formula): the layers' GEMMs ×4, the head's ×3, attention ×4
    train_gemm = (4 * layers * layer_flops + 3 * head_flops) / tp * tokens
    compute = {OpClass.GEMM: train_gemm / (ETA[OpClass.GEMM] * PEAK),
               OpClass.ATTENTION: 4 * fwd_attn / (ETA[OpClass.ATTENTION] * PEAK)}  # fmt: skip
    # TP: 2 all-reduces of b·s·h per layer forward, 2 backward, 2 in the recomputed forward = 6
    tp_ar = {OpClass.ALLREDUCE_INTRA: _ring_intra("allreduce", tp, tokens * h * BF16) * 6 * layers}
    # PP: one activation send forward and one gradient send backward per micro-batch (2 sends),
    # each b·s·h / tp with sequence parallelism
    pp_p2p = {OpClass.SENDRECV_INTRA: 2 * _ring_intra("sendrecv", 2, tokens * h * BF16 / tp)}
    slot = _add(compute, tp_ar, pp_p2p)
    per_step = updates * accum
    # parameters on one GPU of the last stage (the fuller: + final norm + untied LM head shard)
    layer_params = 2 * h * (q / tp) + 2 * h * (kv // tp) + 3 * h * math.ceil(inter / tp) + 2 * h
    params_gpu = layers * layer_params + h + math.ceil(vocab / tp) * h
    # DP: one all-reduce of fp32 gradients among dp ranks per update (serial, after backward)
    dp_sync = {OpClass.ALLREDUCE_INTRA: _ring_intra("allreduce", dp, params_gpu * 4.0) * updates}
    # Adam: ~30 B of HBM per parameter, at the memory-bound η, once per update
    optimizer = {OpClass.MEMORY: params_gpu * 30.0 / (HBM * ETA[OpClass.MEMORY]) * updates}

    got = _parts(p, "actor.train", Layout(tp, pp), dp, b, Recompute.FULL)
    assert set(got) == {"compute", "tp_comm", "pp_comm", "bubble", "dp_sync", "optimizer"}
    _check(got["compute"], _scale(compute, per_step))
    _check(got["tp_comm"], _scale(tp_ar, per_step))
    _check(got["pp_comm"], _scale(pp_p2p, per_step))
    _check(got["bubble"], _scale(slot, updates * (pp - 1)))  # 1F1B: p − 1 slots per update
    _check(got["dp_sync"], dp_sync)
    _check(got["optimizer"], optimizer)


def test_inference_terms_by_hand() -> None:
    """ref.inf of llama-3.1-8b on h100-ib: tp 2 · pp 2, dp 2, micro-batch 4 over 256 sequences
    (32 micro-batches per replica), sequence parallelism; no weight sync (the reference is frozen)."""
    prompt, response = 256, 1024
    p = make_problem("llama-3.1-8b", "h100-ib", 16, response, prompt=prompt, prompts_per_step=256,
                     global_batch=64)  # fmt: skip
    assert p.workload.sequence_parallel
    m = p.models[next(iter(p.models))]
    h, q, kv, inter, vocab = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size, m.vocab_size
    tp, pp, dp, b = 2, 2, 2, 4
    layers = m.num_hidden_layers // pp
    chunks = 256 / dp / b  # micro-batches per replica
    s = prompt + response
    tokens = b * s
    # one forward: the layers' matmuls, and the LM head's on the last stage (the busiest), over tp
    gemm = (layers * 2.0 * (h * (2 * q + 2 * kv) + 3 * h * inter) + 2.0 * vocab * h) / tp * tokens
    attn = 4.0 * q * layers * b * s * (s + 1) / 2 / tp
    compute = {OpClass.GEMM: gemm / (ETA[OpClass.GEMM] * PEAK),
               OpClass.ATTENTION: attn / (ETA[OpClass.ATTENTION] * PEAK)}  # fmt: skip
    # TP: 2 all-reduces of b·s·h per layer (attention and MLP outputs), forward only
    tp_ar = {OpClass.ALLREDUCE_INTRA: _ring_intra("allreduce", tp, tokens * h * BF16) * 2 * layers}
    # PP: one activation send per micro-batch, b·s·h / tp under sequence parallelism (as training's)
    pp_p2p = {OpClass.SENDRECV_INTRA: _ring_intra("sendrecv", 2, tokens * h * BF16 / tp)}
    slot = _add(compute, tp_ar, pp_p2p)

    got = _parts(p, "ref.inf", Layout(tp, pp), dp, b, Recompute.NONE)
    assert set(got) == {"compute", "tp_comm", "pp_comm", "bubble"}
    _check(got["compute"], _scale(compute, chunks))
    _check(got["tp_comm"], _scale(tp_ar, chunks))
    _check(got["pp_comm"], _scale(pp_p2p, chunks))
    _check(got["bubble"], _scale(slot, pp - 1))  # the pipeline fills once: p − 1 slots


def test_generation_terms_by_hand() -> None:
    """actor.gen of llama-125m (12 layers) on h100-ib: tp 1 · pp 8 (2 layers on the first stage,
    1 with the LM head on the last), dp 2, 64 concurrent sequences, p95 response above the mean."""
    prompt, response, p95 = 256, 512, 768
    p = make_problem(
        "llama-125m", "h100-ib", 16, response, prompt=prompt, prompts_per_step=256, global_batch=64
    )
    p = dataclasses.replace(p, seq=SeqStats(prompt, response, p95))
    m = p.models[next(iter(p.models))]
    h, q, kv, inter, vocab = m.hidden_size, m.q_size, m.kv_size, m.intermediate_size, m.vocab_size
    pp, dp, conc = 8, 2, 64
    first_layers, last_layers = 2, 1  # 12 layers over 8 stages: the first 4 take one more
    per_replica = math.ceil(256 / dp)  # PPO: one rollout per prompt
    # forward matmul FLOPs per token of the busiest stage: the LM head (2·V·h) only on the last
    layer_flops = 2.0 * (h * (2 * q + 2 * kv) + 3 * h * inter)
    gemm_tok = max(first_layers * layer_flops, last_layers * layer_flops + 2.0 * vocab * h)
    assert gemm_tok == last_layers * layer_flops + 2.0 * vocab * h  # the head's stage is the busiest

    def flops(gemm: float, attn: float) -> dict[OpClass, float]:
        return {
            OpClass.GEMM: gemm / (ETA[OpClass.GEMM] * PEAK),
            OpClass.ATTENTION: attn / (ETA[OpClass.ATTENTION] * PEAK),
        }

    # prefill: every prompt token through the matmuls, causal p(p+1)/2 attended pairs per prompt
    prefill = flops(
        gemm_tok * per_replica * prompt, 4.0 * q * first_layers * per_replica * prompt * (prompt + 1) / 2
    )
    # decode: a step of per_group = conc / min(conc, pp) sequences each attending prompt + response/2
    ctx = prompt + response / 2
    per_group = conc / min(conc, pp)
    steps = per_replica * response / conc + (p95 - response)  # the p95 sequence ends the batch
    slots = steps * pp
    # weights (bf16) of the fuller first stage: 2 layers + the embedding
    layer_params = 2 * h * q + 2 * h * kv + 3 * h * inter + 2 * h
    weights = (first_layers * layer_params + vocab * h) * BF16
    kv_tok = 2 * first_layers * m.num_key_value_heads * m.head_dim * 2  # K and V, bf16, per layer
    t_mem = (weights + per_group * ctx * kv_tok) / (HBM * ETA[OpClass.DECODE])
    t_cmp = flops(per_group * gemm_tok, 4.0 * q * first_layers * per_group * ctx)
    decode = {OpClass.DECODE: t_mem} if t_mem > sum(t_cmp.values()) else t_cmp  # roofline
    assert OpClass.DECODE in decode  # decode reads bound this shape
    pp_comm = {OpClass.SENDRECV_INTRA: _ring_intra("sendrecv", 2, per_group * h * BF16) * slots}
    # weight sync: the trainer's bf16 weights broadcast inside the replica (8 GPUs, one node)
    sync = {OpClass.BROADCAST_INTRA: _ring_intra("broadcast", 2, weights)}

    got = _parts(p, "actor.gen", Layout(1, pp), dp, conc, Recompute.NONE)
    assert set(got) == {"prefill", "decode", "tp_comm", "pp_comm", "weight_sync"}
    _check(got["prefill"], prefill)
    _check(got["decode"], _scale(decode, slots))
    _check(got["tp_comm"], {})  # tp 1: no TP collectives
    _check(got["pp_comm"], pp_comm)
    _check(got["weight_sync"], sync)


def test_an_fsdp_trainer_updates_its_shard() -> None:
    """Under FSDP each GPU holds and updates 1/dp of the replica's parameters: the AdamW step's
    HBM traffic is the shard's (``nereus price --fsdp``)."""
    p = make_problem("llama-3.1-8b", "h100-ib", 16, 1024, prompts_per_step=256, global_batch=64)
    stage = p.workflow.get("actor.train")
    dp = 8

    def optimizer(fsdp: frozenset[str]) -> float:
        terms, _ = CostModel(p, fsdp=fsdp).evaluate(stage, Layout(1, 1), np.array([dp]), np.array([1]))
        return float(np.ravel(terms.parts["optimizer"].total)[0])

    whole, shard = optimizer(frozenset()), optimizer(frozenset({"actor.train"}))
    m = p.models[next(iter(p.models))]
    updates = p.workload.updates_per_step  # 256 sequences in global batches of 64
    assert updates == 4
    assert whole == pytest.approx(m.param_count() * 30.0 / (HBM * ETA[OpClass.MEMORY]) * updates, rel=1e-9)
    assert shard == pytest.approx(whole / dp, rel=1e-12)
