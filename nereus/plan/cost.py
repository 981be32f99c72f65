"""Latency of one model-stage under a candidate layout (paper §2.3), vectorised over DP degrees.

Per replica: compute (FLOPs / (η_class · peak)), TP collectives per layer, PP send/recv and the
pipeline bubble; per model-stage: the slowest replica (the one with ⌈N/dp⌉ sequences) plus DP
gradient synchronisation. Generation is prefill plus memory-bound decode with a growing KV cache.
Every time is ``ideal / η`` with η the calibrated efficiency of the op class (``opclass.py``).

Sources, one line each where used:
* Ring collectives (n ranks, B bytes): all-reduce 2(n−1)/n·B, all-gather (n−1)/n·B, broadcast and
  send/recv B, over the link's bandwidth, plus one hop latency per ring step: NCCL-tests
  PERFORMANCE.md ("bus bandwidth").
* Megatron TP: 2 all-reduces of b·s·h per layer forward and 2 backward (with sequence parallelism,
  the same volume as all-gather + reduce-scatter): Narayanan et al. 2021 §3.2, Korthikanti 2022 §3.
* 1F1B pipeline: (m + p − 1) slots of one micro-batch's stage time, bubble (p − 1) slots:
  Narayanan et al. 2021 §2.2.
* Training FLOPs = 3× forward (+1 forward with full recomputation): Narayanan et al. 2021 §5.1.
* Decode is bound by HBM reads of weights and KV cache (roofline: max of memory and compute
  time): Kwon et al. 2023 (vLLM) §2, Williams et al. 2009.
* Adam step: ~30 B of HBM traffic per parameter (read grad, master, m, v; write master, m, v,
  bf16 param).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout, split_layers
from nereus.plan.memory import (
    FloatArray,
    MemoryTerms,
    generation_memory,
    inference_memory,
    kv_bytes_per_token_rank,
    stage_params,
    trainer_memory,
)
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.problem import PlanningProblem
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import ModelStage, Recompute, Stage

IntArray = npt.NDArray[np.int64]
ACT_BYTES = 2.0
ADAM_BYTES_PER_PARAM = 30.0
PREFILL_CHUNK_TOKENS = 8192.0


@dataclass(frozen=True, slots=True)
class LatencyTerms:
    """Named seconds per RL step (compute, tp_comm, pp_comm, bubble, dp_sync, ...)."""

    terms: Mapping[str, FloatArray]

    @property
    def total(self) -> FloatArray:
        return sum(self.terms.values(), np.zeros(()))


@dataclass(frozen=True, slots=True)
class Links:
    """Bandwidth, hop latency and calibrated efficiencies of one cluster's links."""

    cluster: ClusterSpec
    eff: Efficiencies

    def link_for(self, span: int) -> Link:
        """The slowest link a group of ``span`` consecutive, node-aligned GPUs crosses."""
        return Link.INTRA if span <= self.cluster.gpus_per_node else Link.INTER

    def collective(self, kind: Collective, link: Link, ranks: int, nbytes: FloatArray | float) -> FloatArray:
        """Seconds for one ring collective of ``nbytes`` per rank over ``ranks`` ranks."""
        nb = np.asarray(nbytes, dtype=np.float64)
        if ranks <= 1:
            return np.zeros_like(nb)
        if link is Link.INTRA:
            bw, hop = (
                self.cluster.intra_node_bandwidth_gbs * 1e9,
                self.cluster.intra_node_latency_us,
            )
        else:
            bw, hop = (
                self.cluster.inter_node_bandwidth_gbs * 1e9,
                self.cluster.inter_node_latency_us,
            )
        factor, steps = {
            Collective.ALLREDUCE: (2.0 * (ranks - 1) / ranks, 2 * (ranks - 1)),
            Collective.ALLGATHER: ((ranks - 1) / ranks, ranks - 1),
            Collective.BROADCAST: (1.0, ranks - 1),
            Collective.SENDRECV: (1.0, 1),
        }[kind]
        eta = self.eff[OpClass.of(kind, link)]
        result: FloatArray = factor * nb / (eta * bw) + steps * hop * 1e-6
        return result

    def compute(self, gemm_flops: FloatArray | float, attn_flops: FloatArray | float) -> FloatArray:
        peak = self.cluster.peak_flops
        g = np.asarray(gemm_flops, dtype=np.float64) / (self.eff[OpClass.GEMM] * peak)
        a = np.asarray(attn_flops, dtype=np.float64) / (self.eff[OpClass.ATTENTION] * peak)
        result: FloatArray = g + a
        return result

    def memory_bound(self, nbytes: FloatArray | float) -> FloatArray:
        bw = self.cluster.hbm_bandwidth_gbs * 1e9 * self.eff[OpClass.MEMORY]
        result: FloatArray = np.asarray(nbytes, dtype=np.float64) / bw
        return result


def _layer_matmul_params(model: ModelSpec) -> float:
    return float(model.hidden_size * (2 * model.q_size + 2 * model.kv_size) + model.mlp_params())


def _stage_gemm_flops_per_token(model: ModelSpec, layout: Layout) -> float:
    """Forward matmul FLOPs per token on the slowest pipeline stage's GPU."""
    stages = split_layers(model.num_hidden_layers, layout.pp)
    layer = 2.0 * _layer_matmul_params(model)
    head = 2.0 * model.head_matmul_params()
    worst = max(n * layer + (head if p == len(stages) - 1 else 0.0) for p, n in enumerate(stages))
    return worst / layout.tp


def _stage_attn_flops(model: ModelSpec, layout: Layout, tokens_times_ctx: FloatArray) -> FloatArray:
    """Forward attention FLOPs (QKᵀ and AV) on the busiest stage's GPU."""
    layers = max(split_layers(model.num_hidden_layers, layout.pp))
    result: FloatArray = 4.0 * model.q_size * layers * tokens_times_ctx / layout.tp
    return result


class CostModel:
    """Latency and memory of every candidate shape of a planning problem."""

    def __init__(self, problem: PlanningProblem) -> None:
        self.problem = problem
        self.links = Links(problem.cluster, problem.efficiencies)
        self.gpn = problem.cluster.gpus_per_node

    # ------------------------------------------------------------ dispatch
    def evaluate(
        self,
        model_stage: ModelStage,
        layout: Layout,
        dp: IntArray,
        micro_batch: IntArray,
        recompute: Recompute = Recompute.NONE,
    ) -> tuple[LatencyTerms, MemoryTerms]:
        """Latency terms and per-GPU memory for ``layout`` at each (dp, micro_batch) pair."""
        model = self.problem.model_of(model_stage)
        n = self.problem.workload.sequences(model_stage)
        if model_stage.stage is Stage.GEN:
            lat, mem = self._generation(model, layout, dp, micro_batch, n)
        elif model_stage.stage is Stage.INF:
            lat, mem = self._inference(model, layout, dp, micro_batch, n)
        else:
            lat, mem = self._training(model, layout, dp, micro_batch, recompute)
        if self.problem.workflow.sync_source(model_stage.name) is not None:
            lat = LatencyTerms(
                MappingProxyType({**lat.terms, "weight_sync": self._weight_sync(model, layout, dp)})
            )
        return lat, mem

    # ------------------------------------------------------------ pieces
    def _weight_sync(self, model: ModelSpec, layout: Layout, dp: IntArray) -> FloatArray:
        """Receiving updated bf16 weights from the colocated trainer at the step boundary."""
        nbytes = max(stage_params(model, layout)) * 2.0
        link = self.links.link_for(layout.size)
        return self.links.collective(Collective.BROADCAST, link, 2, nbytes) + 0.0 * dp

    def _pp_link(self, layout: Layout) -> Link:
        return self.links.link_for(layout.size)

    def _tp_link(self, layout: Layout) -> Link:
        return self.links.link_for(layout.tp)

    # ------------------------------------------------------------ training
    def _training(
        self,
        model: ModelSpec,
        layout: Layout,
        dp: IntArray,
        micro_batch: IntArray,
        recompute: Recompute,
    ) -> tuple[LatencyTerms, MemoryTerms]:
        w = self.problem.workload
        seq = self.problem.seq
        b = micro_batch.astype(np.float64)
        accum = w.global_batch / (dp * b)  # micro-batches per replica per update
        s = seq.mean_len
        tokens = b * s
        fwd_gemm = _stage_gemm_flops_per_token(model, layout) * tokens
        fwd_attn = _stage_attn_flops(model, layout, b * s * (s + 1.0) / 2.0)
        gemm_mult = 4.0 if recompute is Recompute.FULL else 3.0
        attn_mult = 3.0 if recompute is Recompute.NONE else 4.0
        t_compute = self.links.compute(gemm_mult * fwd_gemm, attn_mult * fwd_attn)
        layers = max(split_layers(model.num_hidden_layers, layout.pp))
        n_ar = (6 if recompute is Recompute.FULL else 4) * layers
        t_tp = n_ar * self.links.collective(
            Collective.ALLREDUCE,
            self._tp_link(layout),
            layout.tp,
            tokens * model.hidden_size * ACT_BYTES,
        )
        p2p = tokens * model.hidden_size * ACT_BYTES
        if w.sequence_parallel:
            p2p = p2p / layout.tp
        t_pp = (
            2.0 * self.links.collective(Collective.SENDRECV, self._pp_link(layout), 2, p2p)
            if layout.pp > 1
            else np.zeros_like(tokens)
        )
        slot = t_compute + t_tp + t_pp
        params_gpu = max(stage_params(model, layout))
        dp_sync = np.array(
            [
                self.links.collective(
                    Collective.ALLREDUCE,
                    self.links.link_for(layout.size * int(d)),
                    int(d),
                    params_gpu * 4.0,
                )
                for d in dp.ravel()
            ]
        ).reshape(dp.shape)
        updates = w.updates_per_step
        terms = {
            "compute": updates * accum * t_compute,
            "tp_comm": updates * accum * t_tp,
            "pp_comm": updates * accum * t_pp,
            "bubble": updates * (layout.pp - 1) * slot,
            "dp_sync": updates * dp_sync,
            "optimizer": updates
            * self.links.memory_bound(params_gpu * ADAM_BYTES_PER_PARAM)
            * np.ones_like(b),
        }
        mem = trainer_memory(
            model,
            layout,
            b,
            accum,
            seq.max_len,
            w.precision,
            recompute,
            w.sequence_parallel,
            w.flash_attention,
            self.problem.efficiencies.memory(Stage.TRAIN),
        )
        return LatencyTerms(MappingProxyType(terms)), mem

    # ------------------------------------------------------------ inference
    def _inference(
        self, model: ModelSpec, layout: Layout, dp: IntArray, micro_batch: IntArray, n: int
    ) -> tuple[LatencyTerms, MemoryTerms]:
        w = self.problem.workload
        seq = self.problem.seq
        per_replica = np.ceil(n / dp)
        b = np.minimum(micro_batch, per_replica).astype(np.float64)
        chunks = np.ceil(per_replica / b)  # micro-batches per replica
        s = seq.mean_len
        tokens = per_replica * s / chunks  # tokens per micro-batch
        seqs_mb = per_replica / chunks
        fwd_gemm = _stage_gemm_flops_per_token(model, layout) * tokens
        fwd_attn = _stage_attn_flops(model, layout, seqs_mb * s * (s + 1.0) / 2.0)
        t_compute = self.links.compute(fwd_gemm, fwd_attn)
        layers = max(split_layers(model.num_hidden_layers, layout.pp))
        t_tp = (2 * layers) * self.links.collective(
            Collective.ALLREDUCE,
            self._tp_link(layout),
            layout.tp,
            tokens * model.hidden_size * ACT_BYTES,
        )
        t_pp = (
            self.links.collective(
                Collective.SENDRECV,
                self._pp_link(layout),
                2,
                tokens * model.hidden_size * ACT_BYTES,
            )
            if layout.pp > 1
            else np.zeros_like(tokens)
        )
        slot = t_compute + t_tp + t_pp
        terms = {
            "compute": chunks * t_compute,
            "tp_comm": chunks * t_tp,
            "pp_comm": chunks * t_pp,
            "bubble": (layout.pp - 1) * slot,
        }
        mem = inference_memory(
            model,
            layout,
            b,
            seq.max_len,
            w.precision,
            w.sequence_parallel,
            w.flash_attention,
            self.problem.efficiencies.memory(Stage.INF),
        )
        return LatencyTerms(MappingProxyType(terms)), mem

    # ------------------------------------------------------------ generation
    def _generation(
        self, model: ModelSpec, layout: Layout, dp: IntArray, concurrency: IntArray, n: int
    ) -> tuple[LatencyTerms, MemoryTerms]:
        w = self.problem.workload
        seq = self.problem.seq
        per_replica = np.ceil(n / dp)
        conc = np.minimum(concurrency, per_replica).astype(np.float64)
        h = model.hidden_size
        layers = max(split_layers(model.num_hidden_layers, layout.pp))
        tp_link, pp_link = self._tp_link(layout), self._pp_link(layout)
        # prefill: compute-bound, chunked; the slowest stage sets the pipeline's throughput
        prompt = seq.prompt_len
        prefill_tokens = per_replica * prompt
        chunks = np.ceil(prefill_tokens / PREFILL_CHUNK_TOKENS)
        prefill = self.links.compute(
            _stage_gemm_flops_per_token(model, layout) * prefill_tokens,
            _stage_attn_flops(model, layout, per_replica * prompt * (prompt + 1.0) / 2.0),
        )
        prefill_tp = (
            (2 * layers)
            * chunks
            * self.links.collective(
                Collective.ALLREDUCE, tp_link, layout.tp, prefill_tokens / chunks * h * ACT_BYTES
            )
        )
        # decode: continuous batching keeps `conc` sequences in flight; the longest (p95) ends it
        steps = per_replica * seq.response_len / conc + (seq.response_p95 - seq.response_len)
        ctx = prompt + seq.response_len / 2.0
        groups = np.minimum(conc, layout.pp)  # micro-groups in the pipeline
        per_group = conc / groups
        weights = max(stage_params(model, layout)) * 2.0
        kv_tok = kv_bytes_per_token_rank(model, layout.tp, layers)
        t_mem = self.links.memory_bound(weights + per_group * ctx * kv_tok)
        t_cmp = self.links.compute(
            per_group * _stage_gemm_flops_per_token(model, layout),
            _stage_attn_flops(model, layout, per_group * ctx),
        )
        decode = steps * layout.pp * np.maximum(t_mem, t_cmp)
        decode_tp = (
            steps
            * layout.pp
            * (2 * layers)
            * self.links.collective(Collective.ALLREDUCE, tp_link, layout.tp, per_group * h * ACT_BYTES)
        )
        decode_pp = (
            steps
            * layout.pp
            * self.links.collective(Collective.SENDRECV, pp_link, 2, per_group * h * ACT_BYTES)
            if layout.pp > 1
            else np.zeros_like(steps)
        )
        terms = {
            "prefill": prefill,
            "decode": decode,
            "tp_comm": prefill_tp + decode_tp,
            "pp_comm": decode_pp,
        }
        mem = generation_memory(
            model,
            layout,
            conc,
            prompt,
            seq.max_len,
            w.precision,
            self.problem.efficiencies.memory(Stage.GEN),
        )
        return LatencyTerms(MappingProxyType(terms)), mem
