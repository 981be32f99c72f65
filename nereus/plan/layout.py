"""Layout, Candidate and Plan: what the planner decides, as validated values (paper §2.1).

A ``Candidate`` assigns one model-stage a layout (tp × pp inside each replica), a DP degree and
concrete GPU ids. GPU ids are replica-major; inside a replica, rank ``p·tp + t`` holds TP rank t of
pipeline stage p, so every TP group is a run of consecutive ids (inside one node when aligned).
A ``Plan`` holds one candidate per model-stage of a workflow.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.workload import ExecutionMode, Recompute, Stage, Workflow


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def split_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Contiguous layer counts per pipeline stage; the first ``num_layers mod pp`` get one more."""
    if not 0 < pp <= num_layers:
        raise ValueError(f"pp must be in [1, {num_layers}] (the layer count), got {pp}")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """Tensor- and pipeline-parallel degrees inside one replica (powers of two, paper §2.1)."""

    tp: int
    pp: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not is_power_of_two(value):
                raise ValueError(f"{name} must be a power of two, got {value}")

    @property
    def size(self) -> int:
        """GPUs per replica."""
        return self.tp * self.pp

    # The one place that maps a replica's rank index to its (TP rank t, pipeline stage p).
    def index(self, t: int, p: int) -> int:
        """Rank index ``p·tp + t`` of TP rank ``t`` of pipeline stage ``p`` inside a replica."""
        if not (0 <= t < self.tp and 0 <= p < self.pp):
            raise IndexError(f"(t={t}, p={p}) outside {self}")
        return p * self.tp + t

    def position(self, index: int) -> tuple[int, int]:
        """(t, p) of rank index ``index`` inside a replica."""
        if not 0 <= index < self.size:
            raise IndexError(f"rank index {index} outside {self} ({self.size} ranks)")
        return index % self.tp, index // self.tp

    def positions(self) -> tuple[tuple[int, int], ...]:
        """(t, p) of every rank, in rank-index order."""
        return tuple((t, p) for p in range(self.pp) for t in range(self.tp))

    def __str__(self) -> str:
        return f"tp{self.tp}·pp{self.pp}"


@dataclass(frozen=True, slots=True)
class Candidate:
    """One model-stage's layout, DP degree and GPUs.

    ``micro_batch`` is the per-replica micro-batch of a trainer or an inference model-stage, and the
    most concurrent sequences of a generation replica.
    """

    model_stage: str
    layout: Layout
    dp: int
    gpus: tuple[int, ...]
    micro_batch: int = 1
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        if self.dp <= 0:
            raise ValueError(f"{self.model_stage}: dp must be positive, got {self.dp}")
        if self.micro_batch <= 0:
            raise ValueError(f"{self.model_stage}: micro_batch must be positive")
        need = self.layout.size * self.dp
        if len(self.gpus) != need:
            raise ValueError(
                f"{self.model_stage}: {self.layout} × dp{self.dp} needs {need} GPUs, got {len(self.gpus)}"
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"{self.model_stage}: GPU ids repeat in {self.gpus}")
        if any(g < 0 for g in self.gpus):
            raise ValueError(f"{self.model_stage}: GPU ids must be non-negative")

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def replica_gpus(self, replica: int) -> tuple[int, ...]:
        m = self.layout.size
        if not 0 <= replica < self.dp:
            raise IndexError(f"replica {replica} out of range for dp {self.dp}")
        return self.gpus[replica * m : (replica + 1) * m]

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every TP group, replica by replica, stage by stage."""
        tp = self.layout.tp
        return tuple(self.gpus[i : i + tp] for i in range(0, len(self.gpus), tp))


@dataclass(frozen=True, slots=True)
class Plan:
    """One candidate per model-stage of ``workflow``, on GPUs drawn from ``pool``.

    Model-stages of one stage run concurrently and must use disjoint GPUs; model-stages of
    different stages are serialized and may share GPUs (sync mode). In async mode generation
    overlaps inference and training, so it must not share GPUs with them either.
    """

    workflow: Workflow
    candidates: tuple[Candidate, ...]
    pool: tuple[int, ...]
    mode: ExecutionMode = ExecutionMode.SYNC

    def __post_init__(self) -> None:
        expected = [m.name for m in self.workflow.model_stages]
        got = [c.model_stage for c in self.candidates]
        if sorted(got) != sorted(expected):
            raise ValueError(f"plan must have one candidate per model-stage {expected}, got {got}")
        pool = set(self.pool)
        if len(pool) != len(self.pool):
            raise ValueError("pool GPU ids repeat")
        for c in self.candidates:
            outside = sorted(set(c.gpus) - pool)
            if outside:
                raise ValueError(f"{c.model_stage} uses GPUs {outside} outside the pool")
        for group in self._exclusive_groups():
            owner: dict[int, str] = {}
            for c in group:
                for g in c.gpus:
                    if g in owner:
                        raise ValueError(f"{owner[g]} and {c.model_stage} run concurrently but share GPU {g}")
                    owner[g] = c.model_stage

    def _exclusive_groups(self) -> list[list[Candidate]]:
        by_stage = {s: [c for c in self.candidates if self.stage_of(c) is s] for s in Stage}
        if self.mode is ExecutionMode.ASYNC:
            gen = by_stage[Stage.GEN]
            return [gen + by_stage[Stage.INF], gen + by_stage[Stage.TRAIN]]
        return list(by_stage.values())

    def stage_of(self, candidate: Candidate) -> Stage:
        return self.workflow.get(candidate.model_stage).stage

    def candidate(self, model_stage: str) -> Candidate:
        for c in self.candidates:
            if c.model_stage == model_stage:
                return c
        raise KeyError(model_stage)

    def resident_on(self, gpu: int) -> tuple[str, ...]:
        """Model-stages whose state lives on ``gpu``."""
        return tuple(c.model_stage for c in self.candidates if gpu in c.gpus)
