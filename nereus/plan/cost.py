"""Latency of one model-stage under a candidate layout (paper §2.3), vectorised over DP degrees.

Per replica: compute (FLOPs / (η_class · peak)), TP collectives per layer, PP send/recv and the
pipeline bubble; per model-stage: the slowest replica (the one with ⌈N/dp⌉ sequences) plus DP
gradient synchronisation. Generation is prefill plus memory-bound decode with a growing KV cache.
Every time is ``ideal / η`` with η the calibrated efficiency of the op class (``opclass.py``).

Sources, one line each where used:
* Ring collectives: ``nereus.plan.links`` (the one bandwidth model), NCCL-tests PERFORMANCE.md.
* Megatron TP: 2 all-reduces of b·s·h per layer forward and 2 backward (with sequence parallelism,
  the same volume as all-gather + reduce-scatter): Narayanan et al. 2021 §3.2, Korthikanti 2022 §3.
* 1F1B pipeline: (m + p − 1) slots of one micro-batch's stage time, bubble (p − 1) slots:
  Narayanan et al. 2021 §2.2.
* Training FLOPs = 3× forward, +1 forward of the decoder layers with full recomputation (not of
  the LM head, which is not recomputed): Narayanan et al. 2021 §5.1.
* Decode is bound by HBM reads of weights and KV cache (roofline: max of memory and compute
  time): Kwon et al. 2023 (vLLM) §2, Williams et al. 2009.
* Adam step: ~30 B of HBM traffic per parameter (read grad, master, m, v; write master, m, v,
  bf16 param), over the GPU's parameters (an FSDP trainer's shard of them, ``--fsdp``).
* DP gradient sync, FSDP, weight syncs: ``nereus.plan.commcost``.
* Paged KV (``SearchSpace.paged_kv``): pool at mean occupancy, recompute preemption priced as
  prefill (``memory.kv_pool_tokens``, ``memory.preempted_tokens``; vLLM docs "Preemption").

Links on the job's pool (``nereus.plan.bestfit``): a group that fits in a node is priced inside one
when best fit can put it there; on a fragmented pool (spot instances smaller than a node) the TP
groups, replicas and DP groups best fit splits across nodes are priced on the inter-node link. On
nodes of 6 or 12 GPUs a TP group or replica that does not divide the node is priced between nodes
unless its model-stage is placed alone (its stage-mates may take the room it would need).

Efficiency by shape (``nereus.plan.shapefit``): where calibration has a curve for a class, each
row's η is read at that row's size: GEMM at the forward FLOPs of one layer's matmuls on one GPU
for one micro-batch (prefill chunk, decode step), attention likewise, a collective at its bytes
per rank and (all-reduce, all-gather) its ranks per node, memory-bound work (decode reads in
``OpClass.DECODE``, the optimizer step in ``OpClass.MEMORY``) at the bytes of one pass.
``CostModel(track=True)`` also records, per class, the seconds-weighted ln size and ln group
of what it priced (``Cost.feats``): the shape a measurement of that class carries
(``evaluate.ideal_shapes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import numpy as np

from nereus.plan.bestfit import alone_on_pool, anchored, group_spans, occupancy, pool_span
from nereus.plan.commcost import GRAD_BYTES, CommTerms
from nereus.plan.costterms import Cost, LatencyTerms, collective, compute, memory_bound
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.memory import (
    PREFILL_CHUNK_TOKENS,
    MemoryTerms,
    act_bytes,
    generation_memory,
    inference_memory,
    kv_bytes_per_token_rank,
    kv_pool_tokens,
    preempted_tokens,
    trainer_memory,
)
from nereus.plan.opclass import OpClass
from nereus.plan.problem import PlanningProblem
from nereus.plan.replica import FloatArray, IntArray, ReplicaFacts
from nereus.spec.model import ModelSpec
from nereus.spec.workload import ExecutionMode, ModelStage, Recompute, Stage

__all__ = ["Cost", "CostModel", "LatencyTerms", "collective", "compute", "memory_bound"]

Spans = tuple[FloatArray, FloatArray, FloatArray]  # per row: TP group, replica, DP group (GPUs)
# async: a trainer's share of the weight sync that ends each step (``CostModel._async_sync``)
SYNC_WAIT = "sync_wait"
# the terms of the step's weight sync, not of the model-stage's own work (``nereus price``)
STEP_SYNCS = ("weight_sync", SYNC_WAIT)
ADAM_BYTES_PER_PARAM = 30.0


def _gemm_flops_per_token(
    model: ModelSpec, rep: ReplicaFacts, layer_mult: float = 1.0, head_mult: float = 1.0
) -> FloatArray:
    """Matmul FLOPs per token on one GPU of the slowest pipeline stage: the forward's, with the
    decoder layers' counted ``layer_mult`` times and the LM head's ``head_mult`` times (training:
    3 and 3, forward and backward; under full recompute the layers' forward runs again, 4 and 3:
    Megatron-LM's formula recomputes the layers, not the head, Narayanan et al. 2021 §5.1)."""
    layer = 2.0 * float(model.hidden_size * (2 * model.q_size + 2 * model.kv_size) + model.mlp_params())
    head = 2.0 * model.head_matmul_params() * head_mult
    first = rep.layers_first * layer * layer_mult + np.where(rep.single_stage, head, 0.0)
    last = rep.layers_last * layer * layer_mult + head
    result: FloatArray = np.maximum(first, last) / rep.tp
    return result


def _attn_flops(model: ModelSpec, rep: ReplicaFacts, tokens_times_ctx: FloatArray) -> FloatArray:
    """Forward attention FLOPs (QKᵀ and AV) on one GPU of the busiest stage."""
    result: FloatArray = 4.0 * model.q_size * rep.layers_first * tokens_times_ctx / rep.tp
    return result


def _decode_context(model: ModelSpec, prompt: float, response: float) -> float:
    """Mean tokens a decode step attends to (and reads from the KV cache) per layer, over a
    response of ``response`` tokens after ``prompt``: prompt + response / 2 without a window."""
    full = prompt + response / 2.0
    if not model.sliding_window or response <= 0:
        return float(model.attended(full))
    # what the window takes off the mean: Σ (p − attended(p)) over the response's positions
    capped = model.causal_sum(prompt + response) - model.causal_sum(prompt)
    whole = response * (2.0 * prompt + response + 1.0) / 2.0
    return full - float(whole - capped) / response


class CostModel(CommTerms):
    """Latency and memory of every candidate shape of a planning problem."""

    def __init__(
        self,
        problem: PlanningProblem,
        fsdp: frozenset[str] = frozenset(),
        track: bool = False,
        alone: bool = False,
    ) -> None:
        self.problem = problem
        # record each class's seconds-weighted shape (``Cost.feats``): for pairing measurements
        self.track = track
        # model-stages whose trainer shards its parameters (FSDP, ZeRO-3): priced for
        # ``nereus price --fsdp`` only; the search plans our own engines, which do not shard
        self.fsdp = fsdp
        self.links = Links(problem.cluster, problem.efficiencies)
        # the matmul peak and the activation bytes of the workload's precision
        self.peak = problem.cluster.peak_flops_at(problem.workload.precision)
        self.act_b = act_bytes(problem.workload.precision)
        # free GPUs per node (``()``: whole nodes): where best fit must split groups across nodes
        self.occupancy = occupancy(problem.pool, problem.cluster.gpus_per_node)
        # running model-stages that stay where they are, priced where they run at their shape
        self.anchored = {a[0]: a[1:] for a in anchored(problem)}
        self.workflow = problem.workflow  # (built anew on every ``problem.workflow``)
        # model-stages whose links are those of best fit on the pool by themselves: the ones
        # placement places alone (``bestfit.alone_on_pool``); ``alone``: every one (``nereus
        # price``: one layout on GPUs of its own)
        mode = problem.workload.mode
        self.alone = frozenset(
            ms.name for ms in self.workflow.model_stages if alone or alone_on_pool(self.workflow, mode, ms)
        )
        # async: generation runs on GPUs of its own, and its weights arrive from the trainer's,
        # across the pool the two share (``_weight_sync``)
        self.gen_apart = problem.workload.mode is ExecutionMode.ASYNC
        self.pool_span = pool_span(problem.pool, problem.cluster.gpus_per_node)
        self.pool_per_node = len(problem.pool) / len({self.links.node_of(g) for g in problem.pool})

    # ------------------------------------------------------------ dispatch
    def evaluate_rows(
        self,
        model_stage: ModelStage,
        layouts: Sequence[Layout],
        layout_index: IntArray,
        dp: IntArray,
        micro_batch: IntArray,
        recompute: Recompute = Recompute.NONE,
        replicas: ReplicaFacts | None = None,
    ) -> tuple[LatencyTerms, MemoryTerms]:
        """Latency terms and per-GPU memory of rows (layouts[layout_index[i]], dp[i], micro_batch[i]);
        ``replicas``: the rows' layout facts when the caller already has them."""
        model = self.problem.model_of(model_stage)
        rep = replicas if replicas is not None else ReplicaFacts.of(model, layouts).take(layout_index)
        dpf = dp.astype(np.float64)
        micro = micro_batch.astype(np.float64)
        n = self.problem.workload.sequences(model_stage)
        space = self.problem.space
        spans = self.spans(rep, dpf, model_stage.name)
        if model_stage.stage is Stage.GEN:
            paged = model_stage.name in space.paged_kv
            terms, mem = self._generation(model, rep, dpf, micro, n, spans, paged)
        elif model_stage.stage is Stage.INF:
            terms, mem = self._inference(model, rep, dpf, micro, n, spans)
        else:
            overlap = model_stage.name in space.overlap_dp_sync
            fsdp = model_stage.name in self.fsdp
            terms, mem = self._training(model, rep, dpf, micro, recompute, spans, overlap or fsdp, fsdp)
        if self.syncs(model_stage):
            terms["weight_sync"] = self._weight_sync(rep, model_stage)
        elif self.gen_apart and model_stage.stage is Stage.TRAIN:
            wait = self._async_sync(dpf)
            if wait.by_class:  # (none when generation receives no trainer's weights)
                terms[SYNC_WAIT] = wait
        return LatencyTerms(MappingProxyType(terms)), mem

    def syncs(self, model_stage: ModelStage) -> bool:
        """Whether ``model_stage`` receives a trainer's weights at the step boundary (its last
        latency term, ``weight_sync``)."""
        return self.workflow.sync_source(model_stage.name) is not None

    def weight_sync(self, replicas: ReplicaFacts, model_stage: ModelStage) -> Cost:
        """The ``weight_sync`` term of ``model_stage``'s rows with these layout facts."""
        return self._weight_sync(replicas, model_stage)

    def evaluate(
        self,
        model_stage: ModelStage,
        layout: Layout,
        dp: IntArray,
        micro_batch: IntArray,
        recompute: Recompute = Recompute.NONE,
    ) -> tuple[LatencyTerms, MemoryTerms]:
        """``evaluate_rows`` for one layout at each (dp, micro_batch) pair."""
        index = np.zeros(len(dp), dtype=np.int64)
        return self.evaluate_rows(model_stage, [layout], index, dp, micro_batch, recompute)

    # ------------------------------------------------------------ pieces
    def _compute(
        self,
        gemm_flops: FloatArray | float,
        attn_flops: FloatArray | float,
        model: ModelSpec,
        rep: ReplicaFacts,
        tokens: FloatArray,
        tokens_ctx: FloatArray,
    ) -> Cost:
        """Compute of ``tokens`` per kernel set (Σ context ``tokens_ctx`` for attention)."""
        eff = self.problem.efficiencies
        sizes = None
        if self.track or eff.shaped(OpClass.GEMM, OpClass.ATTENTION):
            layer = 2.0 * float(
                model.hidden_size * (2 * model.q_size + 2 * model.kv_size) + model.mlp_params()
            )
            sizes = (layer * tokens / rep.tp, 4.0 * model.q_size * tokens_ctx / rep.tp)
        return compute(self.peak, eff, gemm_flops, attn_flops, sizes, self.track)

    def spans(self, rep: ReplicaFacts, dp: FloatArray, name: str = "") -> Spans:
        """Per row, the spans of its TP groups, replicas and DP groups on this problem's pool:
        the layout's own on whole nodes, what best fit makes of them on a fragmented pool
        (``bestfit.group_spans``); where model-stage ``name`` already runs at the row's shape
        and stays (``bestfit.anchored``), where it runs."""
        gpn = self.links.gpus_per_node
        spans = group_spans(self.occupancy, gpn, rep.tp, rep.size, dp, name in self.alone)
        if name not in self.anchored:
            return spans
        tp, pp, d, where = self.anchored[name]
        here = (rep.tp == tp) & (rep.pp == pp) & (dp == d)
        if not here.any():
            return spans
        a, b, c = (
            np.where(here, w, np.broadcast_to(x, here.shape)) for x, w in zip(spans, where, strict=True)
        )
        return a, b, c

    # ------------------------------------------------------------ training
    def _training(
        self,
        model: ModelSpec,
        rep: ReplicaFacts,
        dp: FloatArray,
        b: FloatArray,
        recompute: Recompute,
        spans: Spans,
        overlap: bool = False,
        fsdp: bool = False,
    ) -> tuple[dict[str, Cost], MemoryTerms]:
        w = self.problem.workload
        seq = self.problem.seq
        accum = w.global_batch / (dp * b)  # micro-batches per replica per update
        s = seq.mean_len
        tokens = b * s
        fwd_gemm = _gemm_flops_per_token(model, rep) * tokens
        fwd_attn = _attn_flops(model, rep, b * s * (s + 1.0) / 2.0)
        layer_mult = 4.0 if recompute is Recompute.FULL else 3.0  # the LM head's: 3 either way
        attn_mult = 3.0 if recompute is Recompute.NONE else 4.0
        ctx_mb = b * s * (s + 1.0) / 2.0
        tp_span, rep_span, dp_span = spans
        train_gemm = _gemm_flops_per_token(model, rep, layer_mult, 3.0) * tokens
        t_compute = self._compute(train_gemm, attn_mult * fwd_attn, model, rep, tokens, ctx_mb)
        n_ar = (6.0 if recompute is Recompute.FULL else 4.0) * rep.layers_first
        t_tp = self._tp(rep, tokens * model.hidden_size * self.act_b, tp_span) * n_ar
        p2p = tokens * model.hidden_size * self.act_b / (rep.tp if w.sequence_parallel else 1.0)
        t_pp = self._p2p(rep, p2p, rep_span) * 2.0
        slot = t_compute + t_tp + t_pp
        params_gpu = np.maximum(rep.params_first, rep.params_last)
        # backward of one micro-batch (recomputed forward included): what an overlapping engine
        # hides its last buckets behind
        backward = (
            self._compute(
                _gemm_flops_per_token(model, rep, layer_mult - 1.0, 2.0) * tokens,
                (attn_mult - 1.0) * fwd_attn,
                model,
                rep,
                tokens,
                ctx_mb,
            )
            if overlap
            else None
        )
        updates = w.updates_per_step
        per_step = updates * accum  # micro-batch slots per step (before the bubble)
        if fsdp and backward is not None:  # every micro-batch gathers and reduce-scatters
            forward = self._compute(fwd_gemm, fwd_attn, model, rep, tokens, ctx_mb)
            dp_sync = self._fsdp_sync(rep, dp, params_gpu, forward, backward, dp_span) * per_step
        else:
            dp_sync = self._dp_sync(rep, dp, params_gpu * GRAD_BYTES, backward, dp_span) * updates
        terms = {
            "compute": t_compute * per_step,
            "tp_comm": t_tp * per_step,
            "pp_comm": t_pp * per_step,
            "bubble": slot * (updates * (rep.pp - 1.0)),
            "dp_sync": dp_sync,
            # AdamW over this GPU's parameters: FSDP's shard of them (1/dp), the whole replica's otherwise
            "optimizer": memory_bound(
                self.links, params_gpu / (dp if fsdp else 1.0) * ADAM_BYTES_PER_PARAM, self.track
            )
            * updates,
        }
        mem = trainer_memory(
            model,
            rep,
            b,
            accum,
            seq.max_len,
            w.precision,
            recompute,
            w.sequence_parallel,
            w.flash_attention,
            self.problem.efficiencies.memory(Stage.TRAIN),
            shard=dp if fsdp else None,
        )
        return terms, mem

    # ------------------------------------------------------------ inference
    def _inference(
        self, model: ModelSpec, rep: ReplicaFacts, dp: FloatArray, micro: FloatArray, n: int, spans: Spans
    ) -> tuple[dict[str, Cost], MemoryTerms]:
        w = self.problem.workload
        seq = self.problem.seq
        per_replica = np.ceil(n / dp)
        b = np.minimum(micro, per_replica)
        chunks = np.ceil(per_replica / b)  # micro-batches per replica
        s = seq.mean_len
        seqs_mb = per_replica / chunks
        tokens = seqs_mb * s  # tokens per micro-batch
        ctx_mb = seqs_mb * s * (s + 1.0) / 2.0
        t_compute = self._compute(
            _gemm_flops_per_token(model, rep) * tokens,
            _attn_flops(model, rep, ctx_mb),
            model,
            rep,
            tokens,
            ctx_mb,
        )
        tp_span, rep_span, _ = spans
        t_tp = self._tp(rep, tokens * model.hidden_size * self.act_b, tp_span) * (2.0 * rep.layers_first)
        # a stage's activations, scattered over tp under sequence parallelism (as in training)
        sp = rep.tp if w.sequence_parallel else 1.0
        t_pp = self._p2p(rep, tokens * model.hidden_size * self.act_b / sp, rep_span)
        slot = t_compute + t_tp + t_pp
        terms = {
            "compute": t_compute * chunks,
            "tp_comm": t_tp * chunks,
            "pp_comm": t_pp * chunks,
            "bubble": slot * (rep.pp - 1.0),
        }
        mem = inference_memory(
            model,
            rep,
            b,
            seq.max_len,
            w.precision,
            w.sequence_parallel,
            w.flash_attention,
            self.problem.efficiencies.memory(Stage.INF),
        )
        return terms, mem

    # ------------------------------------------------------------ generation
    def _generation(
        self,
        model: ModelSpec,
        rep: ReplicaFacts,
        dp: FloatArray,
        concurrency: FloatArray,
        n: int,
        spans: Spans,
        paged: bool = False,
    ) -> tuple[dict[str, Cost], MemoryTerms]:
        w = self.problem.workload
        seq = self.problem.seq
        per_replica = np.ceil(n / dp)
        conc = np.minimum(concurrency, per_replica)
        h = model.hidden_size
        layers = rep.layers_first
        gemm_per_token = _gemm_flops_per_token(model, rep)
        # prefill: compute-bound, chunked; the slowest stage sets the pipeline's throughput
        prompt = seq.prompt_len
        prefill_tokens = per_replica * prompt
        chunks = np.ceil(prefill_tokens / PREFILL_CHUNK_TOKENS)
        prefill_ctx = per_replica * model.causal_sum(prompt)  # attended pairs (a window caps them)
        prefill = self._compute(
            gemm_per_token * prefill_tokens,
            _attn_flops(model, rep, prefill_ctx),
            model, rep, prefill_tokens / chunks, prefill_ctx / chunks,
        )  # fmt: skip
        tp_span, rep_span, _ = spans
        prefill_tp = self._tp(rep, prefill_tokens / chunks * h * self.act_b, tp_span) * (
            2.0 * layers * chunks
        )
        # decode: continuous batching keeps `conc` sequences in flight; the longest (p95) ends it.
        # With pp stages, min(conc, pp) micro-groups circulate; a step = pp slots of one group.
        steps = per_replica * seq.response_len / conc + (seq.response_p95 - seq.response_len)
        ctx = _decode_context(model, prompt, seq.response_len)
        per_group = conc / np.minimum(conc, rep.pp)
        weights = np.maximum(rep.params_first, rep.params_last) * 2.0
        kv_tok = kv_bytes_per_token_rank(model, rep.kv_heads, layers)
        t_mem = memory_bound(
            self.links, weights + per_group * ctx * kv_tok, self.track, rep.pp, OpClass.DECODE
        )
        t_cmp = self._compute(
            per_group * gemm_per_token,
            _attn_flops(model, rep, per_group * ctx),
            model,
            rep,
            per_group,
            per_group * ctx,
        )
        slots = steps * rep.pp
        longest = model.kv_held(seq.max_len, PREFILL_CHUNK_TOKENS)
        pool = kv_pool_tokens(conc, model.attended(prompt + seq.response_len / 2.0), longest, paged)
        terms = {
            "prefill": prefill,
            "decode": Cost.slower(t_mem, t_cmp) * slots,
            "tp_comm": prefill_tp
            + self._tp(rep, per_group * h * self.act_b, tp_span) * (2.0 * layers * slots),
            "pp_comm": self._p2p(rep, per_group * h * self.act_b, rep_span) * slots,
        }
        if paged:  # recompute preemption: the preempted sequences' tokens are prefilled again
            redo, redo_len = preempted_tokens(conc, pool, model.attended(prompt + seq.response_len))
            redo_ctx = np.where(
                redo_len > 0, redo / np.maximum(redo_len, 1.0) * model.causal_sum(redo_len), 0.0
            )
            chunk = np.maximum(np.ceil(redo / PREFILL_CHUNK_TOKENS), 1.0)
            terms["preemption"] = self._compute(
                gemm_per_token * redo,
                _attn_flops(model, rep, redo_ctx),
                model,
                rep,
                redo / chunk,
                redo_ctx / chunk,
            )
        mem = generation_memory(
            model, rep, conc, prompt, seq.max_len, w.precision, self.problem.efficiencies.memory(Stage.GEN),
            pool_tokens=pool,
        )  # fmt: skip
        return terms, mem
