"""PlanningProblem: everything one search needs, fixed for its duration (paper Eq. 1 inputs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout, Plan
from nereus.spec.cluster import GIB, ClusterSpec
from nereus.spec.domains import FailureDomains
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import ModelStage, Recompute, Role, Stage, Workflow, WorkloadSpec

DEFAULT_HEADROOM = 0.10  # paper §2.4: feasibility keeps 10% of GPU memory free
# ``ModelSpec.with_head`` of a job's models (a new validated spec each call), kept: a replan asks it
# of every model-stage it prices
_HEADED: dict[tuple[int, Head], tuple[ModelSpec, ModelSpec]] = {}


@dataclass(frozen=True, slots=True)
class SeqStats:
    """Sequence lengths the plan is sized for: means drive time, the p95 response drives memory."""

    prompt_len: float
    response_len: float
    response_p95: float

    def __post_init__(self) -> None:
        if self.prompt_len <= 0 or self.response_len <= 0:
            raise ValueError("prompt_len and response_len must be positive")
        if self.response_p95 < self.response_len:
            raise ValueError("response_p95 must be at least response_len")

    @classmethod
    def fixed(cls, prompt_len: float, response_len: float) -> SeqStats:
        return cls(prompt_len, response_len, response_len)

    @property
    def mean_len(self) -> float:
        return self.prompt_len + self.response_len

    @property
    def max_len(self) -> float:
        return self.prompt_len + self.response_p95


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Choices beyond layout and dp. The urgent path widens them (paper §2.9)."""

    recompute: tuple[Recompute, ...] = (Recompute.NONE,)
    shrink_micro_batch: bool = False  # also try per-replica micro-batches below the workload's
    max_tp: int = 0  # 0: GPUs per node (TP stays inside a node)
    # model-stages whose (tp, pp) is held fixed; only their DP degree and GPUs may change
    fixed_layouts: tuple[tuple[str, Layout], ...] = ()
    # model-stages whose engine does not pipeline (vLLM's generation here): pp = 1 only
    flat: tuple[str, ...] = ()
    # model-stages whose DP degree (and micro-batch, when not 0) are held too (``nereus plan --fix``)
    fixed_shapes: tuple[tuple[str, int, int], ...] = ()
    # model-stages whose engine overlaps the DP gradient all-reduce with backward compute
    # (Megatron overlap_grad_reduce, PyTorch DDP buckets, FSDP); torch_native reduces after backward
    overlap_dp_sync: tuple[str, ...] = ()
    # model-stages whose engine sizes a paged KV pool for the mean occupancy and preempts when it
    # fills (vLLM given a KV budget); our vLLM engine reserves max_num_seqs × max_model_len
    paged_kv: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.recompute:
            raise ValueError("recompute options must not be empty")
        if self.max_tp < 0:
            raise ValueError("max_tp must be non-negative")
        names = [n for n, _ in self.fixed_layouts]
        if len(set(names)) != len(names):
            raise ValueError("fixed_layouts names a model-stage twice")
        shaped = [n for n, _, _ in self.fixed_shapes]
        if len(set(shaped)) != len(shaped):
            raise ValueError("fixed_shapes names a model-stage twice")
        if any(dp < 1 or micro < 0 for _, dp, micro in self.fixed_shapes):
            raise ValueError("fixed_shapes: dp must be positive and micro-batch non-negative")

    @classmethod
    def urgent(cls) -> SearchSpace:
        return cls(recompute=tuple(Recompute), shrink_micro_batch=True)

    def keeping(self, other: SearchSpace) -> SearchSpace:
        """This space with ``other``'s engine properties (``flat``, ``overlap_dp_sync``,
        ``paged_kv``): what any space of a job keeps."""
        same = (self.flat, self.overlap_dp_sync, self.paged_kv) == (
            other.flat,
            other.overlap_dp_sync,
            other.paged_kv,
        )
        if same:
            return self
        return replace(self, flat=other.flat, overlap_dp_sync=other.overlap_dp_sync, paged_kv=other.paged_kv)

    def fixed_layout(self, model_stage: str) -> Layout | None:
        return dict(self.fixed_layouts).get(model_stage)

    def fixed_shape(self, model_stage: str) -> tuple[int, int] | None:
        """The (dp, micro-batch) held for ``model_stage`` (micro-batch 0: free), if any."""
        return next(((dp, mb) for n, dp, mb in self.fixed_shapes if n == model_stage), None)

    def holding(self, layouts: Mapping[str, Layout]) -> SearchSpace:
        """The same space with these model-stages' layouts held fixed (DP and GPUs still free)."""
        return replace(self, fixed_layouts=tuple(sorted(layouts.items())))

    @classmethod
    def engines(cls, workload: WorkloadSpec, pipelined_gen: bool = False) -> SearchSpace:
        """The space of the default engines: generation on vLLM, which does not pipeline (pp 1);
        ``pipelined_gen``: the torch-native engine's generation, which does."""
        if pipelined_gen:
            return cls()
        return cls(flat=tuple(ms.name for ms in workload.workflow().model_stages if ms.stage is Stage.GEN))


@dataclass(frozen=True, slots=True)
class PlanningProblem:
    """A job (workload and its models) on a pool of GPUs of one cluster, at given lengths."""

    workload: WorkloadSpec
    models: Mapping[Role, ModelSpec]
    cluster: ClusterSpec
    pool: tuple[int, ...]
    seq: SeqStats
    efficiencies: Efficiencies = field(default_factory=Efficiencies)
    space: SearchSpace = field(default_factory=SearchSpace)
    headroom: float = DEFAULT_HEADROOM
    anchor: Plan | None = None  # the running plan: placement keeps its unchanged replicas in place
    # reserved and revocable GPUs: placement keeps a copy of every trainer on reserved ones
    domains: FailureDomains | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        if not self.pool:
            raise ValueError("the GPU pool is empty")
        if len(set(self.pool)) != len(self.pool):
            raise ValueError("pool GPU ids repeat")
        if any(not 0 <= g < self.cluster.total_gpus for g in self.pool):
            raise ValueError(
                f"pool GPU ids must lie in [0, {self.cluster.total_gpus}) for cluster {self.cluster.name}"
            )
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        missing = [r.value for r in self.workload.workflow().roles if r not in self.models]
        if missing:
            raise ValueError(f"no model given for roles {missing}")

    @property
    def workflow(self) -> Workflow:
        return self.workload.workflow()

    @property
    def gpus(self) -> int:
        return len(self.pool)

    @property
    def capacity_bytes(self) -> float:
        """Per-GPU memory a plan may predict: capacity × (1 − headroom)."""
        return self.cluster.gpu_memory_bytes * (1.0 - self.headroom)

    @property
    def reserved_bytes(self) -> float:
        """Per-GPU runtime reserve (context, collective buffers), counted once per GPU."""
        return self.cluster.runtime_reserved_gib * GIB

    def model_of(self, model_stage: ModelStage) -> ModelSpec:
        """The model a model-stage runs, with the head its role needs (value head for critic/reward)."""
        base = self.models[model_stage.role]
        head = model_stage.head
        if head is base.head:
            return base
        key = (id(base), head)
        found = _HEADED.get(key)
        if found is not None and found[0] is base:
            return found[1]
        headed = base.with_head(head)
        if len(_HEADED) >= 64:
            _HEADED.clear()
        _HEADED[key] = (base, headed)  # the base held: its id stays unique while the entry lives
        return headed

    def holding(self, layouts: Mapping[str, Layout]) -> PlanningProblem:
        """This problem with ``layouts`` held as well (DP and GPUs still free); the layouts its
        space already holds (a policy's own) win."""
        return replace(self, space=self.space.holding({**layouts, **dict(self.space.fixed_layouts)}))

    @property
    def max_tp(self) -> int:
        return self.space.max_tp or self.cluster.gpus_per_node
