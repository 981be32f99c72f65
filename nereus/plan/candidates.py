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
from types import MappingProxyType
from typing import Any

import numpy as np

from nereus.plan.bestfit import anchored
from nereus.plan.cost import Cost, CostModel, LatencyTerms
from nereus.plan.layout import Layout
from nereus.plan.memory import MemoryTerms
from nereus.plan.problem import PlanningProblem
from nereus.plan.replica import FloatArray, IntArray, ReplicaFacts
from nereus.spec.workload import ModelStage, Recompute, Stage, WorkloadSpec


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
class RowPrices:
    """What pricing a table computed besides its totals: per recomputation block (``rows`` rows
    each), the latency and memory terms as arrays over the block's rows."""

    blocks: tuple[tuple[LatencyTerms, MemoryTerms], ...]
    rows: int
    # per block, Σ of the latency terms before ``weight_sync`` (the last term, when there is one):
    # what a twin model-stage that differs only in receiving weights starts from
    base_totals: tuple[FloatArray, ...] = ()

    def estimate(self, model_stage: str, shape: Shape, row: int) -> Estimate:
        terms, mem = self.blocks[row // self.rows]
        i = row % self.rows

        def at(values: FloatArray) -> FloatArray:
            v = np.asarray(values)
            return np.asarray(float(v.flat[i if v.size > 1 else 0]))

        latency = LatencyTerms(
            {name: Cost({op: at(t) for op, t in part.by_class.items()}) for name, part in terms.parts.items()}
        )
        memory = mem.each(at)
        return Estimate(model_stage, shape, latency, memory)


@dataclass(frozen=True, slots=True)
class CandidateTable:
    """The shapes of one model-stage and their GPUs, latency and per-GPU memory, as arrays.

    Row i is layout ``layouts[layout_index[i]]``, ``dp[i]`` replicas, micro-batch ``micro_batch[i]``
    and ``recomputes[recompute_index[i]]``.
    """

    model_stage: ModelStage
    layouts: tuple[Layout, ...]
    recomputes: tuple[Recompute, ...]
    layout_index: IntArray
    dp: IntArray
    micro_batch: IntArray
    recompute_index: IntArray
    gpus: IntArray
    latency: FloatArray
    persistent: FloatArray
    active: FloatArray
    prices: RowPrices | None = None  # every term of every row of the table this one was cut from
    source: IntArray | None = None  # each row's position in that table (None: the same rows)

    def __len__(self) -> int:
        return len(self.gpus)

    def shape(self, i: int) -> Shape:
        return Shape(
            self.layouts[int(self.layout_index[i])],
            int(self.dp[i]),
            int(self.micro_batch[i]),
            self.recomputes[int(self.recompute_index[i])],
        )

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return tuple(self.shape(i) for i in range(len(self)))

    def take(self, index: IntArray) -> CandidateTable:
        return CandidateTable(
            self.model_stage,
            self.layouts,
            self.recomputes,
            self.layout_index[index],
            self.dp[index],
            self.micro_batch[index],
            self.recompute_index[index],
            self.gpus[index],
            self.latency[index],
            self.persistent[index],
            self.active[index],
            self.prices,
            None if self.prices is None else (index if self.source is None else self.source[index]),
        )

    def estimate(self, shape: Shape) -> Estimate | None:
        """The full breakdown of ``shape`` from the terms its pricing kept (None: not a row here,
        or no terms kept). Equal to ``estimate(cost, model_stage, shape)``: the same arithmetic,
        element by element."""
        if self.prices is None or shape.layout not in self.layouts or shape.recompute not in self.recomputes:
            return None
        hit = np.flatnonzero(
            (self.layout_index == self.layouts.index(shape.layout))
            & (self.dp == shape.dp)
            & (self.micro_batch == shape.micro_batch)
            & (self.recompute_index == self.recomputes.index(shape.recompute))
        )
        if hit.size == 0:
            return None
        row = int(hit[0]) if self.source is None else int(self.source[hit[0]])
        return self.prices.estimate(self.model_stage.name, shape, row)


def layouts(problem: PlanningProblem, model_stage: ModelStage) -> list[Layout]:
    """Power-of-two (tp, pp) a replica of ``model_stage`` may use on this pool (or its fixed one)."""
    fixed = problem.space.fixed_layout(model_stage.name)
    if fixed is not None:
        return [fixed] if fixed.size <= problem.gpus else []
    model = problem.model_of(model_stage)
    max_pp = 1 if model_stage.name in problem.space.flat else model.num_hidden_layers
    result = []
    for tp in model.tp_options(min(problem.max_tp, problem.gpus)):  # the state geometry's rule
        pp = 1
        while pp <= max_pp and tp * pp <= problem.gpus:
            result.append(Layout(tp, pp))
            pp *= 2
    return result


def trainer_micro_batches(workload: WorkloadSpec, dp: int) -> list[int]:
    """A trainer's micro-batches with ``dp`` replicas, ascending: those dividing a replica's
    share of the global batch, up to the workload's. The narrow search takes the largest; the
    urgent path's wider space all of them."""
    batch = workload.global_batch // dp
    return [b for b in range(1, min(workload.micro_batch, batch) + 1) if batch % b == 0]


def powers_of_two_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _shape_options(
    problem: PlanningProblem, model_stage: ModelStage, layout: Layout
) -> tuple[IntArray, IntArray]:
    """(dp, micro_batch) rows for one layout, each distinct in what a replica does."""
    max_dp = problem.gpus // layout.size
    held = problem.space.fixed_shape(model_stage.name)
    if held is not None:  # a user's layout, as it is (nereus plan --fix): no other shape
        return _held(problem, model_stage, held, max_dp)
    return _options_upto(problem, model_stage, max_dp)


def _options_upto(
    problem: PlanningProblem, model_stage: ModelStage, max_dp: int
) -> tuple[IntArray, IntArray]:
    """(dp, micro_batch) rows of up to ``max_dp`` replicas, by DP degree ascending: those of fewer
    replicas are a prefix (a row reads its own DP degree and the one before it only)."""
    w = problem.workload
    if model_stage.stage is Stage.TRAIN:
        pairs: list[tuple[int, int]] = []
        for d in range(1, max_dp + 1):
            if w.global_batch % d:
                continue
            divisors = trainer_micro_batches(w, d)
            chosen = divisors if problem.space.shrink_micro_batch else divisors[-1:]
            pairs.extend((d, b) for b in chosen)
        arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]
    if model_stage.stage is Stage.INF:
        cap = w.inference_micro_batch
        options = powers_of_two_upto(cap) if problem.space.shrink_micro_batch else [cap]
    else:
        cap = w.max_num_seqs
        options = sorted(set(powers_of_two_upto(cap)) | {cap})
    n = w.sequences(model_stage)
    dp = np.arange(1, min(max_dp, n) + 1, dtype=np.int64)
    per_replica = -(-n // dp)
    # a DP degree whose busiest replica gets as many sequences as with one replica fewer is not a
    # distinct candidate (same time and memory, more GPUs)
    distinct = np.concatenate([[True], per_replica[1:] < per_replica[:-1]])
    dp, per_replica = dp[distinct], per_replica[distinct]
    eff = np.minimum(np.array(options, dtype=np.int64)[None, :], per_replica[:, None])
    fresh = np.concatenate([np.ones((len(dp), 1), bool), eff[:, 1:] != eff[:, :-1]], axis=1)
    rows, cols = np.nonzero(fresh)
    return dp[rows], eff[rows, cols]


def _held(
    problem: PlanningProblem, model_stage: ModelStage, held: tuple[int, int], max_dp: int
) -> tuple[IntArray, IntArray]:
    """The one (dp, micro-batch) row of a held shape, or none where it cannot run: more replicas
    than GPUs or sequences, a trainer whose global batch does not split evenly. Micro-batch 0
    takes the workload's (for a trainer, the largest that divides a replica's share)."""
    dp, micro = held
    w = problem.workload
    none = np.zeros(0, dtype=np.int64)
    if dp > max_dp:
        return none, none
    if model_stage.stage is Stage.TRAIN:
        if w.global_batch % dp:
            return none, none
        batch = w.global_batch // dp
        micro = micro or trainer_micro_batches(w, dp)[-1]
        if batch % micro:
            return none, none
    else:
        n = w.sequences(model_stage)
        if dp > n:
            return none, none
        cap = w.inference_micro_batch if model_stage.stage is Stage.INF else w.max_num_seqs
        micro = min(micro or cap, -(-n // dp))
    return np.array([dp], dtype=np.int64), np.array([micro], dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Rows:
    """The shapes of one model-stage before pricing (one recomputation option): what a replan of
    the same job on the same pool size enumerates again, so the planner cache keeps it."""

    layouts: tuple[Layout, ...]
    layout_index: IntArray
    dp: IntArray
    micro_batch: IntArray
    gpus: IntArray
    replicas: ReplicaFacts  # per row

    def take(self, index: IntArray) -> Rows:
        return Rows(
            self.layouts,
            self.layout_index[index],
            self.dp[index],
            self.micro_batch[index],
            self.gpus[index],
            self.replicas.take(index),
        )


def recomputes_of(problem: PlanningProblem, model_stage: ModelStage) -> tuple[Recompute, ...]:
    """A trainer's activation recomputation options: the workload's ``recompute`` in the default
    space (what the user's training runs with), every option the space names otherwise (the
    urgent path's, which may recompute to fit); none for inference and generation."""
    if model_stage.stage is not Stage.TRAIN:
        return (Recompute.NONE,)
    options = tuple(problem.space.recompute)
    return (problem.workload.recompute,) if options == (Recompute.NONE,) else options


def enumerate_rows(problem: PlanningProblem, model_stage: ModelStage) -> Rows:
    """Every (layout, dp, micro-batch) row of ``model_stage`` on this pool, unpriced."""
    lays = tuple(layouts(problem, model_stage))
    if problem.space.fixed_shape(model_stage.name) is not None or not lays:
        parts = [_shape_options(problem, model_stage, lay) for lay in lays]
    else:  # one enumeration for the most replicas; each layout takes the prefix it has GPUs for
        dps, micros = _options_upto(problem, model_stage, problem.gpus // min(lay.size for lay in lays))
        ends = np.searchsorted(dps, [problem.gpus // lay.size for lay in lays], side="right").tolist()
        parts = [(dps[:end], micros[:end]) for end in ends]
    layout_index = np.concatenate(
        [np.full(len(d), i, dtype=np.int64) for i, (d, _) in enumerate(parts)] or [np.zeros(0, np.int64)]
    )
    dp = np.concatenate([d for d, _ in parts] or [np.zeros(0, np.int64)])
    micro = np.concatenate([m for _, m in parts] or [np.zeros(0, np.int64)])
    size = np.array([lay.size for lay in lays], dtype=np.int64)[layout_index] if lays else dp
    replicas = ReplicaFacts.of(problem.model_of(model_stage), lays).take(layout_index)
    gpus = dp * size
    for column in (layout_index, dp, micro, gpus):  # shared by the tables priced from these rows
        column.flags.writeable = False
    return Rows(lays, layout_index, dp, micro, gpus, replicas)


def price_rows(
    cost: CostModel,
    model_stage: ModelStage,
    rows: Rows,
    recomputes: tuple[Recompute, ...],
    twin: CandidateTable | None = None,
) -> CandidateTable:
    """The candidate table of ``rows`` under ``cost``: one block of rows per recomputation option.

    ``twin``: a table priced by ``cost`` from the same rows for a model-stage that differs from
    ``model_stage`` at most in receiving weights (same model, stage kind, sequences and engine
    options; see ``twin_key``): its terms are reused and only the weight sync is priced. The
    totals are the same sums in the same order, so the table is identical to a fresh pricing."""
    n = len(rows.dp)
    lats: list[FloatArray] = []
    pers: list[FloatArray] = []
    acts: list[FloatArray] = []
    blocks: list[tuple[LatencyTerms, MemoryTerms]] = []
    bases: list[FloatArray] = []
    syncs = cost.syncs(model_stage)
    sync: Cost | None = None
    for k, recompute in enumerate(recomputes):
        if twin is not None and twin.prices is not None:
            done, mem = twin.prices.blocks[k]
            parts = {name: c for name, c in done.parts.items() if name != "weight_sync"}
            base = twin.prices.base_totals[k]
            if syncs and sync is None:
                sync = cost.weight_sync(rows.replicas, model_stage)
        else:
            terms, mem = cost.evaluate_rows(
                model_stage,
                rows.layouts,
                rows.layout_index,
                rows.dp,
                rows.micro_batch,
                recompute,
                rows.replicas,
            )
            parts = {name: c for name, c in terms.parts.items() if name != "weight_sync"}
            sync = terms.parts.get("weight_sync")
            base = sum((c.total for c in parts.values()), np.zeros(()))  # LatencyTerms.total's order
        total = base
        if sync is not None:
            parts["weight_sync"] = sync
            total = total + sync.total
        bases.append(base)
        blocks.append((LatencyTerms(MappingProxyType(parts)), mem))
        for out, v in zip((lats, pers, acts), (total, mem.persistent, mem.active), strict=True):
            out.append(_column(v, n))
    k = len(recomputes)
    prices = RowPrices(tuple(blocks), n, tuple(bases))
    if k == 1:  # one block: the rows' own arrays (tables are never written to) and its columns
        zero = np.zeros(n, dtype=np.int64)
        return CandidateTable(
            model_stage, rows.layouts, recomputes, rows.layout_index, rows.dp, rows.micro_batch, zero,
            rows.gpus, lats[0], pers[0], acts[0], prices,
        )  # fmt: skip
    return CandidateTable(
        model_stage,
        rows.layouts,
        recomputes,
        np.tile(rows.layout_index, k),
        np.tile(rows.dp, k),
        np.tile(rows.micro_batch, k),
        np.repeat(np.arange(k, dtype=np.int64), n),
        np.tile(rows.gpus, k),
        np.concatenate(lats),
        np.concatenate(pers),
        np.concatenate(acts),
        prices,
    )


def _column(values: FloatArray, n: int) -> FloatArray:
    v = np.asarray(values)
    if v.shape == (n,) and v.dtype == np.float64:
        return v
    return np.broadcast_to(v, (n,)).astype(np.float64)


def twin_key(problem: PlanningProblem, model_stage: ModelStage) -> tuple[Any, ...]:
    """What the rows and the price of ``model_stage`` read besides the job, the pool and the
    prices: model-stages with equal keys have the same rows and the same terms but for the weight
    sync (e.g. PPO's actor.inf and ref.inf, critic.inf and reward.inf of one model); a running
    model-stage priced where it runs (``bestfit.anchored``) has a key of its own."""
    s, name = problem.space, model_stage.name
    return (problem.model_of(model_stage), model_stage.stage, problem.workload.sequences(model_stage),
            s.fixed_layout(name), s.fixed_shape(name), name in s.flat, name in s.overlap_dp_sync,
            name in s.paged_kv, recomputes_of(problem, model_stage),
            next((a for a in anchored(problem) if a[0] == name), None))  # fmt: skip


def candidate_table(cost: CostModel, model_stage: ModelStage) -> CandidateTable:
    """Every shape of ``model_stage`` with its latency and memory (no feasibility or dominance)."""
    problem = cost.problem
    rows = enumerate_rows(problem, model_stage)
    return price_rows(cost, model_stage, rows, recomputes_of(problem, model_stage))


def estimate(cost: CostModel, model_stage: ModelStage, shape: Shape) -> Estimate:
    """The full breakdown (latency terms, memory terms) of one shape."""
    dp = np.array([shape.dp], dtype=np.int64)
    micro = np.array([shape.micro_batch], dtype=np.int64)
    terms, mem = cost.evaluate(model_stage, shape.layout, dp, micro, shape.recompute)
    scalar_terms = LatencyTerms(
        {
            name: Cost({op: np.asarray(float(np.ravel(t)[0])) for op, t in part.by_class.items()})
            for name, part in terms.parts.items()
        }
    )

    def first(values: FloatArray) -> FloatArray:
        return np.asarray(float(np.ravel(values)[0]))

    scalar_mem = mem.each(first)
    return Estimate(model_stage.name, shape, scalar_terms, scalar_mem)
