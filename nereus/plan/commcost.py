"""The communication terms of a model-stage's latency: DP gradient synchronisation, FSDP's
parameter gathers, TP and pipeline collectives, and the step's weight syncs (``CommTerms``, a part
of ``nereus.plan.cost.CostModel``).

Sources, one line each where used:
* DP gradient sync (``_dp_sync``): our torch_native trainer all-reduces one flat gradient buffer
  after the last backward (``backends/torch_native/training.reduce_grad``): serial. Engines that
  overlap (``SearchSpace.overlap_dp_sync``) all-reduce buckets as backward fills them, during the
  last micro-batch's backward only (gradient accumulation skips the sync before it): PyTorch DDP
  (``bucket_cap_mb`` = 25 MiB, buckets in reverse parameter order, "overlapping computation with
  communication", DDP notes), Megatron-Core ``DistributedDataParallelConfig.overlap_grad_reduce``
  (bucket_size max(4e7, 1e6·dp) parameters), FSDP (per-unit reduce-scatter during backward).
* FSDP / ZeRO-3 (``CostModel.fsdp``, ``nereus price --fsdp`` only): per layer, bf16 parameter
  all-gathers before forward and backward, fp32 gradient reduce-scatters after backward, each
  prefetched behind the neighbouring layer's compute (PyTorch FSDP2 docs; Zhao et al. 2023 §3.3).
* Weight sync: the colocated trainer's bf16 weights broadcast inside the receiving replica; async
  generation's across the pool the trainer and the generator share (``CommTerms._async_sync``).
"""

from __future__ import annotations

import numpy as np

from nereus.plan.costterms import Cost, collective, exposed
from nereus.plan.links import Links
from nereus.plan.opclass import Collective
from nereus.plan.problem import PlanningProblem
from nereus.plan.replica import FloatArray, ReplicaFacts
from nereus.spec.workload import ModelStage, Stage, Workflow

# Megatron-Core's default bucket: max(4e7, 1e6·dp) parameters ("larger DP sizes need larger
# buckets to ensure collectives do not become latency-bound"); PyTorch DDP's is 25 MiB
BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK = 4e7, 1e6
GRAD_BYTES = 4.0  # fp32 gradients in the all-reduce (ours; Megatron's grad_reduce_in_fp32)


class CommTerms:
    """The communication pieces of ``CostModel`` (which sets these attributes)."""

    problem: PlanningProblem
    links: Links
    track: bool
    workflow: Workflow
    gen_apart: bool
    pool_span: float
    pool_per_node: float
    act_b: float  # bytes of an activation, and of a weight in the compute dtype

    def _weight_sync(self, rep: ReplicaFacts, model_stage: ModelStage) -> Cost:
        """Receiving updated weights (compute dtype) from the colocated trainer at the step boundary, inside
        the receiving replica; async generation's, ``_async_sync``."""
        if self.gen_apart and model_stage.stage is Stage.GEN:
            return self._async_sync(np.asarray(rep.size, dtype=np.float64))
        nbytes = np.maximum(rep.params_first, rep.params_last) * self.act_b
        return collective(self.links, Collective.BROADCAST, rep.size, 2.0, nbytes, self.track)

    def _async_sync(self, rows: FloatArray) -> Cost:
        """Async: the weight sync that ends a step, shaped like ``rows``. Generation runs on GPUs
        of its own, so the actor's whole weights (compute dtype) go from the trainer's GPUs to the
        generator's, across the pool the two share: between nodes once it spans more than one,
        each node's GPUs carrying a share of them over the node's NICs (NCCL's hierarchical
        rings; the truth broadcasts them over the union of both sides' GPUs,
        ``sim.truth.asynchrony``), inside the node at the receiver's whole bytes otherwise.
        The sync runs after both sides (the truth's step is max(generation, inference + training)
        + sync, ``sim.truth.asynchrony.Pipeline``), so it is priced on both, generation's
        ``weight_sync`` and each trainer's ``SYNC_WAIT``: the step's max over the two sides is
        then max(gen, inf + train) + sync."""
        gen = self.workflow.by_stage(Stage.GEN)
        if not gen or self.workflow.sync_source(gen[0].name) is None:
            return Cost({})
        nbytes = self.act_b * float(self.problem.model_of(gen[0]).param_count())
        if self.pool_span > self.links.gpus_per_node:
            nbytes /= self.pool_per_node
        one = np.ones_like(rows, dtype=np.float64)
        return collective(
            self.links, Collective.BROADCAST, self.pool_span * one, 2.0, nbytes * one, self.track
        )

    def _tp(self, rep: ReplicaFacts, nbytes: FloatArray, span: FloatArray) -> Cost:
        """One TP all-reduce of ``nbytes`` inside the TP group (spanning ``span`` GPUs)."""
        return collective(self.links, Collective.ALLREDUCE, span, rep.tp, nbytes, self.track)

    def _p2p(self, rep: ReplicaFacts, nbytes: FloatArray, span: FloatArray) -> Cost:
        """One pipeline send/recv between neighbouring stages of a replica spanning ``span``
        GPUs (0 without PP)."""
        return collective(self.links, Collective.SENDRECV, span, 2.0, nbytes, self.track) * np.where(
            rep.pp > 1, 1.0, 0.0
        )

    def _dp_sync(
        self,
        rep: ReplicaFacts,
        dp: FloatArray,
        grad_bytes: FloatArray,
        backward: Cost | None,
        span: FloatArray,
    ) -> Cost:
        """The DP gradient all-reduce a step waits for. Serial (``backward`` None): one all-reduce
        of the whole buffer after backward. Overlapped: n equal buckets of at most
        ``GRAD_BUCKET_BYTES``, reduced in order behind the last micro-batch's backward
        (``exposed``). Attributed to the all-reduce's op class; the DP group spans ``span`` GPUs."""
        if backward is None:
            return collective(self.links, Collective.ALLREDUCE, span, dp, grad_bytes, self.track)
        bucket_bytes = np.maximum(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * dp) * GRAD_BYTES
        buckets = np.maximum(np.ceil(grad_bytes / bucket_bytes), 1.0)
        per_bucket = collective(self.links, Collective.ALLREDUCE, span, dp, grad_bytes / buckets, self.track)
        return exposed(per_bucket, buckets, backward)

    def _fsdp_sync(
        self,
        rep: ReplicaFacts,
        dp: FloatArray,
        params: FloatArray,
        forward: Cost,
        backward: Cost,
        span: FloatArray,
    ) -> Cost:
        """Per micro-batch, the communication an FSDP (ZeRO-3) trainer waits for: each layer's bf16
        parameters all-gathered before its forward and again before its backward, and its fp32
        gradients reduce-scattered after it (FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16,
        reduce_dtype=fp32)``, torchtitan's default; a reduce-scatter is the first half of a ring
        all-reduce, so it is priced and calibrated as half an all-reduce). Per layer (a bucket),
        prefetched one layer ahead: the forward's all-gathers hide behind forward compute, the
        backward's all-gathers and reduce-scatters behind backward compute; the first layer's
        gather and the last's reduce-scatter never hide (``exposed``)."""
        layers = np.maximum(rep.layers_first, 1.0)
        gather = collective(
            self.links, Collective.ALLGATHER, span, dp, params * self.act_b / layers, self.track
        )
        scatter = (
            collective(self.links, Collective.ALLREDUCE, span, dp, params * GRAD_BYTES / layers, self.track)
            * 0.5
        )
        return exposed(gather, layers, forward) + exposed(gather + scatter, layers, backward)
