"""What a simulation runs (``Scenario``) and what it records (``StepRecord``, ``Summary``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nereus.control.action import TransitionRecord
from nereus.errors import InfeasibleError
from nereus.plan.problem import SeqStats
from nereus.sim.seqcurve import SeqCurve
from nereus.sim.trace import GpuSupply
from nereus.sim.truth import Episode
from nereus.sim.truth.asynchrony import AsyncStep
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Role, WorkloadSpec

IN_FLIGHT = ("drain", "drop")


class SimulationError(InfeasibleError):
    """The scenario cannot run: no pool in the trace fits any plan (exit 3, like any infeasible plan)."""


@dataclass(frozen=True, slots=True)
class Scenario:
    workload: WorkloadSpec
    models: Mapping[Role, ModelSpec]
    cluster: ClusterSpec
    supply: GpuSupply
    curve: SeqCurve
    steps: int
    seed: int = 0
    noise: float = 0.03
    episodes: tuple[Episode, ...] = ()
    restart_s: float = 120.0  # relaunch, rendezvous, warm-up after a crash or restart
    storage_gbs: float = 2.0  # checkpoint read bandwidth per node, GB/s
    max_staleness: int = 1  # async: how many batches generation may run ahead of training
    in_flight: str = "drain"  # async: rollouts generated ahead at a transition or restart: kept or dropped

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ValueError("steps must be positive")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be non-negative, got {self.max_staleness}")
        if self.in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {', '.join(IN_FLIGHT)}, got {self.in_flight!r}")
        if self.supply.max_gpus > self.cluster.total_gpus:
            raise ValueError(
                f"max_gpus {self.supply.max_gpus} exceeds cluster {self.cluster.name} "
                f"({self.cluster.total_gpus} GPUs)"
            )

    def lengths(self, step: int) -> SeqStats:
        mean, p95 = self.curve.at(step)
        cap = float(self.workload.max_response_len)
        mean = min(mean, cap)
        return SeqStats(self.workload.prompt_len, mean, max(mean, min(p95, cap)))


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    start_s: float
    gpus: int
    seq_len_mean: float
    seq_len_p95: float
    plan: dict[str, str]
    step_s: float
    transition_s: float = 0.0
    restart_s: float = 0.0
    stalled_s: float = 0.0
    oom: bool = False
    tp_pp_change: bool = False
    decision: dict[str, Any] | None = None
    preempted: bool = False  # GPUs of the plan were revoked during the step
    transitions: tuple[TransitionRecord, ...] = ()  # what moved at the boundary before the step
    pipeline: AsyncStep | None = None  # async: overlap, waits, sync and staleness of the step
    dropped_rollouts: int = 0  # async: rollouts generated ahead and dropped at or after this step

    @property
    def lost(self) -> bool:
        """The step's work is lost (out of memory or preempted) and the step runs again."""
        return self.oom or self.preempted

    @property
    def wall_s(self) -> float:
        return self.step_s + self.transition_s + self.restart_s + self.stalled_s

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "start_s": self.start_s,
            "gpus": self.gpus,
            "seq_len_mean": self.seq_len_mean,
            "seq_len_p95": self.seq_len_p95,
            "plan": self.plan,
            "step_s": self.step_s,
            "transition_s": self.transition_s,
            "restart_s": self.restart_s,
            "stalled_s": self.stalled_s,
            "wall_s": self.wall_s,
            "oom": self.oom,
            "tp_pp_change": self.tp_pp_change,
            "preempted": self.preempted,
            "decision": self.decision,
            "transitions": [t.to_json() for t in self.transitions],
            "async": self.pipeline.to_json() if self.pipeline is not None else None,
            "dropped_rollouts": self.dropped_rollouts,
        }


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    mean_step_s: float
    total_s: float
    transitions: int
    tp_pp_transitions: int
    oom_steps: int
    preempted_steps: int
    restarts: int
    stalled_s: float
    replans: int
    records: tuple[StepRecord, ...] = field(default=(), repr=False)
    dropped_rollouts: int = 0  # async: rollouts generated ahead and dropped

    @property
    def pipelined(self) -> tuple[AsyncStep, ...]:
        return tuple(r.pipeline for r in self.records if r.pipeline is not None and not r.lost)

    def to_json(self) -> dict[str, Any]:
        return {
            "mean_step_s": self.mean_step_s,
            "total_s": self.total_s,
            "transitions": self.transitions,
            "tp_pp_transitions": self.tp_pp_transitions,
            "oom_steps": self.oom_steps,
            "preempted_steps": self.preempted_steps,
            "restarts": self.restarts,
            "stalled_s": self.stalled_s,
            "replans": self.replans,
            "dropped_rollouts": self.dropped_rollouts,
            **(self._async_json() if self.pipelined else {}),
        }

    def _async_json(self) -> dict[str, float]:
        steps = self.pipelined
        return {
            "mean_overlap_s": sum(a.overlap_s for a in steps) / len(steps),
            "mean_gen_wait_s": sum(a.gen_wait_s for a in steps) / len(steps),
            "mean_train_wait_s": sum(a.train_wait_s for a in steps) / len(steps),
            "mean_sync_s": sum(a.sync_s for a in steps) / len(steps),
            "mean_staleness": sum(a.staleness for a in steps) / len(steps),
        }
