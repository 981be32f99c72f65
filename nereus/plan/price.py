"""``nereus price``: the cost model's latency and memory of one model-stage in a layout the user
names, so a verl or NeMo-RL setup can be priced against the planner's choice.

The query is a stage (``gen``, ``inf`` or ``train``), a layout (tp, pp, dp) and the work: ``N``
sequences of a mean prompt and response length (the p95 response sizes memory). Training prices
one pass over the N sequences with an optimizer step every ``global_batch`` sequences and
per-replica micro-batches of ``micro_batch``; inference runs micro-batches of ``micro_batch``;
generation decodes up to ``concurrency`` sequences at once per replica. The engine's behaviour is
ours unless named: ``overlap_dp_sync`` prices a trainer that overlaps its DP gradient all-reduce
with backward (Megatron, DDP, FSDP), ``paged_kv`` a generation engine with a paged KV pool at mean
occupancy that preempts when it fills (vLLM), ``kv_memory_fraction`` f a generation engine that
sizes its KV cache as f of the GPU memory left free once weights, working activations and the
runtime reserve are allocated, instead of the planner's 10% headroom on the whole GPU
(TensorRT-LLM's ``KvCacheConfig.free_gpu_memory_fraction``, default 0.9), ``fsdp`` a trainer that
shards its parameters and gathers them layer by layer behind compute (FSDP, ZeRO-3:
``CostModel._fsdp_sync``; its parameters, gradients and optimizer state sharded over DP,
``memory.trainer_memory``). The model-stage priced is
the actor's (``actor.gen``, ``actor.train``) or, for inference, the reference model's
(``ref.inf``, no weight sync), or with ``head`` value a critic's or reward model's (``critic.inf``,
``critic.train``: a scalar head in place of the vocabulary's): the stage's own work, without the
step's weight synchronisation.
The layout is placed alone on the first tp·pp·dp GPUs by the planner's best fit
(``CostModel(alone=True)``): on nodes of 12, one TP-8 group is inside node 0 and four leave one
across two nodes, as Megatron's contiguous ranks would. ``pool`` (``--gpus``) places it on a pool
of that many GPUs instead, as ``nereus plan --gpus`` places a model-stage that has the pool to
itself: two TP-4 groups on 12 GPUs in nodes of 6 then stay inside a node each.
Pure (no torch, no processes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nereus.errors import ConfigError
from nereus.plan.calibration import Efficiencies
from nereus.plan.candidates import Shape, estimate
from nereus.plan.cost import STEP_SYNCS, CostModel, LatencyTerms
from nereus.plan.evaluate import class_shapes, unsized
from nereus.plan.layout import Layout, is_power_of_two
from nereus.plan.problem import DEFAULT_HEADROOM, PlanningProblem, SearchSpace, SeqStats
from nereus.spec.cluster import GIB, ClusterSpec
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Algorithm, Precision, Recompute, Role, Stage, WorkloadSpec

PRICED = {Stage.GEN: "actor.gen", Stage.INF: "ref.inf", Stage.TRAIN: "actor.train"}
PRICED_VALUE = {Stage.INF: "critic.inf", Stage.TRAIN: "critic.train"}  # a value head's (--head value)
MAX_SEQUENCES = 1 << 24
MAX_MICRO_BATCH = 1 << 16  # the workload's bound on micro_batch and inference_micro_batch
DEFAULTS = WorkloadSpec(name="defaults", algorithm=Algorithm.PPO)  # micro-batches when not named
MAX_TOKENS = 1 << 24


@dataclass(frozen=True, slots=True)
class PriceQuery:
    """One model-stage's work in one layout; messages name the command's flags."""

    stage: Stage
    tp: int
    pp: int
    dp: int
    sequences: int
    prompt_len: int
    seq_len: int
    seq_len_p95: int = 0  # 0: seq_len
    micro_batch: int = 0  # train/inf; 0: WorkloadSpec's default (train: largest up to it dividing a share)
    global_batch: int = 0  # train; 0: all N sequences in one optimizer step
    recompute: Recompute = Recompute.NONE
    concurrency: int = 0  # gen; 0: every sequence of a replica at once
    precision: Precision = Precision.BF16_MIXED
    overlap_dp_sync: bool = False  # train: the engine overlaps the DP all-reduce with backward
    paged_kv: bool = False  # gen: the engine's KV pool is paged at mean occupancy (preempts)
    kv_memory_fraction: float = 0.0  # gen: KV may take this share of the memory free after weights
    fsdp: bool = False  # train: the engine shards parameters (FSDP): gathers overlap compute
    pipelined_gen: bool = False  # gen: the engine pipelines generation (torch-native); vLLM does not
    head: Head = Head.LM  # value: a critic's or reward model's (critic.inf, critic.train)
    pool: int | None = None  # GPUs the layout is placed on by best fit (None: its own tp·pp·dp)

    def __post_init__(self) -> None:
        if self.head is Head.VALUE and self.stage is Stage.GEN:
            raise ConfigError("--head value prices a critic or reward model's inf or train; --stage is gen")
        for flag, value in (("tp", self.tp), ("pp", self.pp)):
            if not (isinstance(value, int) and value >= 1 and is_power_of_two(value)):
                raise ConfigError(f"--{flag}: expected a power of two ≥ 1, got {value!r}")
        for flag, value, most in (
            ("dp", self.dp, 1 << 16),
            ("sequences", self.sequences, MAX_SEQUENCES),
            ("prompt-len", self.prompt_len, MAX_TOKENS),
            ("seq-len", self.seq_len, MAX_TOKENS),
        ):
            if not (isinstance(value, int) and 1 <= value <= most):
                raise ConfigError(f"--{flag}: expected an integer in [1, {most}], got {value!r}")
        for flag, value, most in (
            ("seq-len-p95", self.seq_len_p95, MAX_TOKENS),
            ("micro-batch", self.micro_batch, MAX_MICRO_BATCH),
            ("global-batch", self.global_batch, MAX_SEQUENCES),
            ("concurrency", self.concurrency, MAX_SEQUENCES),
        ):
            if not (isinstance(value, int) and 0 <= value <= most):
                raise ConfigError(f"--{flag}: expected an integer in [1, {most}], got {value!r}")
        if self.pool is not None and not (isinstance(self.pool, int) and self.gpus <= self.pool <= 1 << 20):
            raise ConfigError(
                f"--gpus: expected an integer in [{self.gpus}, {1 << 20}] (at least --tp × --pp × --dp), "
                f"got {self.pool!r}"
            )
        if self.seq_len_p95 and self.seq_len_p95 < self.seq_len:
            raise ConfigError(f"--seq-len-p95 {self.seq_len_p95} must be at least --seq-len {self.seq_len}")
        if self.dp > self.sequences:
            raise ConfigError(f"--dp {self.dp}: more replicas than --sequences {self.sequences}")
        if self.overlap_dp_sync and self.stage is not Stage.TRAIN:
            raise ConfigError(f"--overlap-dp-sync prices training; --stage is {self.stage.value}")
        if self.paged_kv and self.stage is not Stage.GEN:
            raise ConfigError(f"--paged-kv prices generation; --stage is {self.stage.value}")
        if not (isinstance(self.kv_memory_fraction, int | float) and 0.0 <= self.kv_memory_fraction <= 1.0):
            raise ConfigError(
                f"--kv-memory-fraction: expected a number in [0, 1], got {self.kv_memory_fraction!r}"
            )
        if self.fsdp and self.stage is not Stage.TRAIN:
            raise ConfigError(f"--fsdp prices training; --stage is {self.stage.value}")
        if self.kv_memory_fraction and self.stage is not Stage.GEN:
            raise ConfigError(f"--kv-memory-fraction prices generation; --stage is {self.stage.value}")
        if self.pipelined_gen and self.stage is not Stage.GEN:
            raise ConfigError(f"--pipelined-gen prices generation; --stage is {self.stage.value}")
        if self.stage is Stage.GEN and self.pp > 1 and not self.pipelined_gen:
            raise ConfigError(
                f"--pp {self.pp}: vLLM does not pipeline generation (--pipelined-gen prices the "
                "torch-native engine's, as plan --pipelined-gen plans it)"
            )
        if self.stage is not Stage.TRAIN:
            for flag, given in (
                ("--global-batch", bool(self.global_batch)),
                ("--recompute", self.recompute is not Recompute.NONE),
            ):
                if given:
                    raise ConfigError(f"{flag} prices training; --stage is {self.stage.value}")
            if self.concurrency and self.stage is not Stage.GEN:
                raise ConfigError("--concurrency prices generation (sequences decoded at once per replica)")
            if self.micro_batch and self.stage is Stage.GEN:
                raise ConfigError("--micro-batch prices training and inference; --stage is gen")
            share = -(-self.sequences // self.dp)
            if self.concurrency > share:
                raise ConfigError(
                    f"--concurrency {self.concurrency}: more than a replica's {share} sequences "
                    f"(--sequences {self.sequences} / --dp {self.dp})"
                )
            if self.micro_batch > share:
                raise ConfigError(
                    f"--micro-batch {self.micro_batch}: more than a replica's {share} sequences "
                    f"(--sequences {self.sequences} / --dp {self.dp})"
                )
            return
        if self.concurrency:
            raise ConfigError("--concurrency prices generation; --stage is train")
        batch = self.global_batch or self.sequences
        if self.sequences % batch or batch % self.dp:
            raise ConfigError(
                f"--global-batch {batch}: must divide --sequences {self.sequences} and be a multiple of "
                f"--dp {self.dp} (each replica takes an equal share of every optimizer step)"
            )
        if self.micro_batch and (batch // self.dp) % self.micro_batch:
            raise ConfigError(
                f"--micro-batch {self.micro_batch}: must divide a replica's share of the global batch "
                f"({batch // self.dp} = {batch} / dp {self.dp})"
            )

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def shape(self) -> Shape:
        return Shape(self.layout, self.dp, self._micro(), self.recompute)

    def _micro(self) -> int:
        if self.stage is Stage.GEN:
            return self.concurrency or math.ceil(self.sequences / self.dp)
        if self.stage is Stage.INF:
            return self.micro_batch or DEFAULTS.inference_micro_batch
        share = (self.global_batch or self.sequences) // self.dp
        cap = min(share, DEFAULTS.micro_batch)
        return self.micro_batch or max(b for b in range(1, cap + 1) if share % b == 0)

    @property
    def model_stage(self) -> str:
        """The model-stage priced: the actor's or reference's, or with ``head`` value the critic's."""
        return (PRICED_VALUE if self.head is Head.VALUE else PRICED)[self.stage]

    def workload(self) -> WorkloadSpec:
        """The workload whose model-stage ``model_stage`` is exactly this work."""
        micro = self._micro()
        return WorkloadSpec(
            name="price", algorithm=Algorithm.PPO, prompts_per_step=self.sequences, samples_per_prompt=1,
            prompt_len=self.prompt_len, max_prompt_len=max(self.prompt_len, 1),
            max_response_len=max(self.seq_len_p95, self.seq_len),
            global_batch=self.global_batch or self.sequences,
            micro_batch=micro if self.stage is Stage.TRAIN else 1,
            inference_micro_batch=micro if self.stage is Stage.INF else 1,
            max_num_seqs=micro if self.stage is Stage.GEN else 1, epochs=1, precision=self.precision,
            recompute=self.recompute, reward_model=False,
        )  # fmt: skip

    def space(self) -> SearchSpace:
        """The engine properties the query names, on the priced model-stage."""
        name = self.model_stage
        return SearchSpace(
            overlap_dp_sync=(name,) if self.overlap_dp_sync else (), paged_kv=(name,) if self.paged_kv else ()
        )


@dataclass(frozen=True, slots=True)
class Price:
    """The verdict: seconds (total and per op class), peak bytes per GPU against the capacity."""

    model_stage: str
    shape: Shape
    latency_s: float
    by_class: dict[str, float]
    by_term: dict[str, float]
    peak_bytes: float
    limit_bytes: float  # capacity after headroom, less the runtime reserve (or the engine's KV budget)
    # ``price(track=True)`` only: per op class, the (size, ranks per node) of its work (0: none),
    # what a measurement of the class carries for calibration by shape (``nereus.plan.shapefit``)
    shapes: dict[str, tuple[float, float]] = field(default_factory=dict)
    fsdp: bool = False  # a trainer sharding parameters, gradients and optimizer state over DP

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.limit_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "latency_s": self.latency_s,
            "peak_mem_gib": self.peak_bytes / GIB,
            "fits": self.fits,
            "by_class": self.by_class,
            "model_stage": self.model_stage,
            "shape": str(self.shape),
            "fsdp": self.fsdp,
            "gpus": self.shape.num_gpus,
            "limit_gib": self.limit_bytes / GIB,
            "by_term": self.by_term,
        }


def _seconds(terms: LatencyTerms) -> tuple[float, dict[str, float], dict[str, float]]:
    own = {name: part for name, part in terms.parts.items() if name not in STEP_SYNCS}
    by_term = {name: float(np.sum(part.total)) for name, part in own.items()}
    by_class: dict[str, float] = {}
    for part in own.values():
        for op, seconds in part.by_class.items():
            by_class[op.value] = by_class.get(op.value, 0.0) + float(np.sum(seconds))
    return sum(by_term.values()), by_class, by_term


def price(
    model: ModelSpec, cluster: ClusterSpec, query: PriceQuery, efficiencies: Efficiencies | None = None,
    headroom: float = DEFAULT_HEADROOM, track: bool = False,
) -> Price:  # fmt: skip
    """The cost model's price of ``query`` on ``cluster`` (``efficiencies``: calibrated ones);
    ``track``: also the shape of each class's work (``Price.shapes``)."""
    if query.tp > cluster.gpus_per_node:
        raise ConfigError(
            f"--tp {query.tp} exceeds the {cluster.gpus_per_node} GPUs of a node of {cluster.name} "
            "(tensor parallelism stays inside a node)"
        )
    refusal = model.tp_refusal(query.tp, cluster.gpus_per_node)  # the planner's and the runtime's rule
    if refusal:
        raise ConfigError(f"--{refusal}")
    if query.pp > model.num_hidden_layers:
        raise ConfigError(f"--pp {query.pp} exceeds the model's {model.num_hidden_layers} layers")
    if query.gpus > cluster.total_gpus:
        raise ConfigError(
            f"--tp × --pp × --dp = {query.gpus} GPUs exceeds cluster {cluster.name} ({cluster.total_gpus})"
        )
    if query.pool is not None and query.pool > cluster.total_gpus:
        raise ConfigError(f"--gpus {query.pool} exceeds cluster {cluster.name} ({cluster.total_gpus} GPUs)")
    seq = SeqStats(query.prompt_len, query.seq_len, query.seq_len_p95 or query.seq_len)
    extra: dict[str, Any] = {} if efficiencies is None else {"efficiencies": efficiencies}
    pool = tuple(range(query.pool or query.gpus))
    try:
        problem = PlanningProblem(
            query.workload(), dict.fromkeys(Role, model), cluster, pool, seq,
            space=query.space(), headroom=headroom, **extra,
        )  # fmt: skip
    except ValueError as exc:  # what the query's own checks did not name
        raise ConfigError(str(exc)) from None
    model_stage = problem.workflow.get(query.model_stage)
    fsdp = frozenset({model_stage.name}) if query.fsdp else frozenset()
    est = estimate(CostModel(problem, fsdp, alone=True), model_stage, query.shape())
    total, by_class, by_term = _seconds(est.latency)
    peak = est.active_bytes  # the stage's own peak: active already holds its persistent state
    limit = problem.capacity_bytes - problem.reserved_bytes
    if query.kv_memory_fraction:  # the engine's own KV budget: f of what weights etc. leave free
        kv = float(est.memory.kv_cache) * est.memory.correction
        rest = peak - kv
        limit = rest + query.kv_memory_fraction * (cluster.gpu_memory_bytes - problem.reserved_bytes - rest)
    shapes: dict[str, tuple[float, float]] = {}
    if track:
        s = query.shape()
        one = np.ones(1, dtype=np.int64)
        terms, _ = CostModel(problem, fsdp, track=True, alone=True).evaluate(
            model_stage, s.layout, one * s.dp, one * s.micro_batch, s.recompute
        )
        shapes = {
            op.value: (c.size, c.group)
            for op, c in class_shapes(terms, STEP_SYNCS, unsized(query.stage)).items()
        }
    return Price(model_stage.name, est.shape, total, by_class, by_term, peak, limit, shapes, query.fsdp)
