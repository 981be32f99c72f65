"""Every candidate shape of a model-stage, priced by the cost model (paper §2.6 step 1).

A ``Shape`` is a candidate without GPU ids: layout, DP degree, micro-batch (concurrent sequences
for generation) and recomputation. ``candidate_table`` enumerates all of them, with no pruning:
power-of-two tp (dividing the attention heads, inside a node unless widened) and pp (at most the
layer count); for trainers only DP degrees that keep the global batch dp × b × a exact; for
inference and generation any DP degree up to one replica per sequence. Equivalent shapes (a
micro-batch or concurrency above what a replica receives) are listed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nereus.plan.cost import CostModel, IntArray, LatencyTerms
from nereus.plan.layout import Layout
from nereus.plan.memory import FloatArray, MemoryTerms
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import ModelStage, Recompute, Stage


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """A candidate without GPU ids."""

    layout: Layout
    dp: int
    micro_batch: int
    recompute: Recompute = Recompute.NONE

    @property
    def num_gpus(self) -> int:
        return self.layout.size * self.dp

    def __str__(self) -> str:
        extra = "" if self.recompute is Recompute.NONE else f" recompute={self.recompute.value}"
        return f"{self.layout}·dp{self.dp} mb{self.micro_batch}{extra}"


@dataclass(frozen=True, slots=True)
class Estimate:
    """The cost model's verdict on one shape of one model-stage."""

    model_stage: str
    shape: Shape
    latency: LatencyTerms
    memory: MemoryTerms

    @property
    def latency_s(self) -> float:
        return float(self.latency.total)

    @property
    def persistent_bytes(self) -> float:
        return float(self.memory.persistent)

    @property
    def active_bytes(self) -> float:
        return float(self.memory.active)


@dataclass(frozen=True, slots=True)
class CandidateTable:
    """The shapes of one model-stage and their GPUs, latency and per-GPU memory, as arrays."""

    model_stage: ModelStage
    shapes: tuple[Shape, ...]
    gpus: IntArray
    latency: FloatArray
    persistent: FloatArray
    active: FloatArray

    def __len__(self) -> int:
        return len(self.shapes)

    def take(self, index: IntArray) -> CandidateTable:
        return CandidateTable(
            self.model_stage,
            tuple(self.shapes[i] for i in index.tolist()),
            self.gpus[index],
            self.latency[index],
            self.persistent[index],
            self.active[index],
        )


def layouts(problem: PlanningProblem, model_stage: ModelStage) -> list[Layout]:
    """Power-of-two (tp, pp) a replica of ``model_stage`` may use on this pool."""
    model = problem.model_of(model_stage)
    result = []
    tp = 1
    while tp <= min(problem.max_tp, problem.gpus):
        if model.num_attention_heads % tp == 0:
            pp = 1
            while pp <= model.num_hidden_layers and tp * pp <= problem.gpus:
                result.append(Layout(tp, pp))
                pp *= 2
        tp *= 2
    return result


def _powers_of_two_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _shape_options(
    problem: PlanningProblem, model_stage: ModelStage, layout: Layout
) -> list[tuple[int, int]]:
    """(dp, micro_batch) pairs for one layout, each distinct in what a replica does."""
    w = problem.workload
    n = w.sequences(model_stage)
    max_dp = problem.gpus // layout.size
    pairs: list[tuple[int, int]] = []
    if model_stage.stage is Stage.TRAIN:
        for dp in range(1, max_dp + 1):
            if w.global_batch % dp:
                continue
            per_replica = w.global_batch // dp
            divisors = [b for b in range(1, min(w.micro_batch, per_replica) + 1) if per_replica % b == 0]
            chosen = divisors if problem.space.shrink_micro_batch else divisors[-1:]
            pairs.extend((dp, b) for b in chosen)
        return pairs
    if model_stage.stage is Stage.INF:
        cap = w.inference_micro_batch
        options = _powers_of_two_upto(cap) if problem.space.shrink_micro_batch else [cap]
    else:
        cap = w.max_num_seqs
        options = sorted(set(_powers_of_two_upto(cap)) | {cap})
    for dp in range(1, min(max_dp, n) + 1):
        per_replica = -(-n // dp)
        if dp > 1 and -(-n // (dp - 1)) == per_replica:
            continue  # same load per replica as dp − 1, with more GPUs
        effective = sorted({min(b, per_replica) for b in options})
        pairs.extend((dp, b) for b in effective)
    return pairs


def candidate_table(cost: CostModel, model_stage: ModelStage) -> CandidateTable:
    """Every shape of ``model_stage`` with its latency and memory (no feasibility or dominance)."""
    problem = cost.problem
    recomputes = problem.space.recompute if model_stage.stage is Stage.TRAIN else (Recompute.NONE,)
    shapes: list[Shape] = []
    gpus: list[IntArray] = []
    lat: list[FloatArray] = []
    persist: list[FloatArray] = []
    active: list[FloatArray] = []
    for layout in layouts(problem, model_stage):
        pairs = _shape_options(problem, model_stage, layout)
        if not pairs:
            continue
        dp = np.array([p[0] for p in pairs], dtype=np.int64)
        micro = np.array([p[1] for p in pairs], dtype=np.int64)
        for recompute in recomputes:
            terms, mem = cost.evaluate(model_stage, layout, dp, micro, recompute)
            shapes.extend(Shape(layout, d, b, recompute) for d, b in pairs)
            gpus.append(dp * layout.size)
            lat.append(np.broadcast_to(terms.total, dp.shape).astype(np.float64))
            persist.append(np.broadcast_to(mem.persistent, dp.shape).astype(np.float64))
            active.append(np.broadcast_to(mem.active, dp.shape).astype(np.float64))
    if not shapes:
        return CandidateTable(model_stage, (), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0))
    return CandidateTable(
        model_stage,
        tuple(shapes),
        np.concatenate(gpus),
        np.concatenate(lat),
        np.concatenate(persist),
        np.concatenate(active),
    )


def estimate(cost: CostModel, model_stage: ModelStage, shape: Shape) -> Estimate:
    """The full breakdown (latency terms, memory terms) of one shape."""
    dp = np.array([shape.dp], dtype=np.int64)
    micro = np.array([shape.micro_batch], dtype=np.int64)
    terms, mem = cost.evaluate(model_stage, shape.layout, dp, micro, shape.recompute)
    scalar_terms = LatencyTerms({k: np.asarray(float(np.ravel(v)[0])) for k, v in terms.terms.items()})

    def first(values: FloatArray) -> FloatArray:
        return np.asarray(float(np.ravel(values)[0]))

    scalar_mem = MemoryTerms(
        params=first(mem.params),
        optimizer=first(mem.optimizer),
        grads=first(mem.grads),
        activations=first(mem.activations),
        kv_cache=first(mem.kv_cache),
        correction=mem.correction,
    )
    return Estimate(model_stage.name, shape, scalar_terms, scalar_mem)
