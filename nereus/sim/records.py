"""What a simulation runs (``Scenario``) and what it records (``StepRecord``, ``Summary``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nereus.control.action import TransitionRecord
from nereus.errors import InfeasibleError
from nereus.plan.problem import SearchSpace, SeqStats
from nereus.sim.seqcurve import SeqCurve
from nereus.sim.trace import GpuSupply
from nereus.sim.truth import Episode
from nereus.sim.truth.asynchrony import AsyncStep
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Role, WorkloadSpec

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
    # the job times collectives by size and group before its first plan (``nereus.plan.sweep``)
    collective_sweep: bool = True
    # generation on the torch-native engine, which pipelines; default: vLLM's, at pp 1
    pipelined_gen: bool = False

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ValueError("steps must be positive")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be non-negative, got {self.max_staleness}")
        if self.in_flight not in IN_FLIGHT:
            raise ValueError(f"in_flight must be one of {', '.join(IN_FLIGHT)}, got {self.in_flight!r}")
        if self.workload.precision is not Precision.BF16_MIXED:  # the truth's state and kernels are bf16
            raise ValueError(
                f"precision {self.workload.precision.value}: the simulator's hardware truth models "
                "bf16-mixed training only (allowed: bf16-mixed)"
            )
        if self.supply.max_gpus > self.cluster.total_gpus:
            raise ValueError(
                f"max_gpus {self.supply.max_gpus} exceeds cluster {self.cluster.name} "
                f"({self.cluster.total_gpus} GPUs)"
            )

    @property
    def space(self) -> SearchSpace:
        """The job's engine limits, which every plan of every policy keeps (``nereus run``'s)."""
        return SearchSpace.engines(self.workload, self.pipelined_gen)

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
    # what the planner's model (the controller's calibrated view) predicts for the plan's step,
    # and the truth's steady step on a quiet machine (no noise, episodes, waits or syncs): the
    # model's error on the plan it ran, per step and (``stage_*``) per model-stage
    predicted_s: float | None = None
    quiet_s: float | None = None
    stage_predicted_s: Mapping[str, float] | None = None
    stage_quiet_s: Mapping[str, float] | None = None
    # a move at the boundary before the step: the quiet truth of the plan it left, on this
    # step's lengths (the move's realized gain is ``moved_from_s − quiet_s``)
    moved_from_s: float | None = None
    startup_s: float = 0.0  # the first step: the start-up collective sweep before the first plan

    @property
    def lost(self) -> bool:
        """The step's work is lost (out of memory or preempted) and the step runs again."""
        return self.oom or self.preempted

    @property
    def wall_s(self) -> float:
        return self.step_s + self.transition_s + self.restart_s + self.stalled_s + self.startup_s

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
            "startup_s": self.startup_s,
            "wall_s": self.wall_s,
            "oom": self.oom,
            "tp_pp_change": self.tp_pp_change,
            "preempted": self.preempted,
            "decision": self.decision,
            "transitions": [t.to_json() for t in self.transitions],
            "async": self.pipeline.to_json() if self.pipeline is not None else None,
            "dropped_rollouts": self.dropped_rollouts,
            "predicted_s": self.predicted_s,
            "quiet_s": self.quiet_s,
            "stage_predicted_s": dict(self.stage_predicted_s or {}),
            "stage_quiet_s": dict(self.stage_quiet_s or {}),
            "moved_from_s": self.moved_from_s,
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

    def breakdown(self) -> dict[str, float]:
        """Wall seconds per completed step by where they went: ``useful`` (steps that completed),
        ``lost`` (steps preempted or out of memory, run again), ``moves``, ``restarts`` and
        ``stalled`` (waiting for GPUs) and ``startup`` (the start-up collective sweep); they add up
        to ``mean_step_s``."""
        done = sum(1 for r in self.records if not r.lost) or 1
        return {
            "useful_s": sum(r.step_s for r in self.records if not r.lost) / done,
            "lost_s": sum(r.step_s for r in self.records if r.lost) / done,
            "moves_s": sum(r.transition_s for r in self.records) / done,
            "restarts_s": sum(r.restart_s for r in self.records) / done,
            "stalled_s": sum(r.stalled_s for r in self.records) / done,
            "startup_s": sum(r.startup_s for r in self.records) / done,
        }

    def model_error(self) -> dict[str, Any]:
        """How the planner's model saw the plans this run ran: per completed step, its predicted
        step over the truth's quiet one (``step_ratio``: mean predicted / truth; ``step_mape``),
        the same per model-stage (``stage_ratio``), and for the moves admitted: predicted gain
        per step and cost against the realized ones, over the opportunistic moves (``moves``;
        ``urgent_moves`` counts the rest). The gain is the step latency's (current minus target
        latency, against the truth's quiet step of the plan left minus that of the plan moved
        to); the admission's ΔL also holds the change in risk, which no quiet step shows
        (``move_risk_gain_predicted_s``: current minus target risk per move). The risk is
        checked try by try over the steps a decision priced (``priced_tries``; a lost step's rerun is a try of
        its own): a plan's risk R = L·p/(1 − p) (+ its restart risk) is the work lost per
        completed step over all its tries, so each try is lost with p = R/(L + R) (an upper bound
        where a restart is at risk too). ``lost_tries_predicted`` sums p over the tries and
        ``lost_tries`` counts those lost; ``lost_s_predicted`` and ``lost_s_realized`` are the
        seconds per try, L·p against the lost tries' seconds."""
        seen = [r for r in self.records if not r.lost and r.predicted_s and r.quiet_s]
        ratios = [r.predicted_s / r.quiet_s for r in seen if r.predicted_s and r.quiet_s]
        stage: dict[str, list[float]] = {}
        for r in seen:
            for name, truth in (r.stage_quiet_s or {}).items():
                pred = (r.stage_predicted_s or {}).get(name, 0.0)
                if truth > 0 and pred > 0:
                    stage.setdefault(name, []).append(pred / truth)
        every = [r for r in self.records if r.moved_from_s is not None and r.decision]
        # gains are read for opportunistic moves only: an urgent move's plan left had lost GPUs
        # and could not run, so "the plan left minus the plan moved to" means nothing there
        moves = [r for r in every if r.decision and not r.decision.get("urgent")]
        gain_pred = [_latency_gain(r.decision) for r in moves if r.decision]
        gain_real = [(r.moved_from_s or 0.0) - (r.quiet_s or 0.0) for r in moves]
        cost_pred = [float(r.decision["l_tran_s"] or 0.0) for r in moves if r.decision]
        risk_gain = [_risk(r.decision, "current") - _risk(r.decision, "target") for r in moves if r.decision]
        priced = [r for r in self.records if r.decision]
        tries = [_try_loss(r.decision, r.step_s) for r in priced if r.decision]  # (p, L·p) per try
        lost = [r.step_s for r in priced if r.lost]
        return {
            "step_ratio": sum(ratios) / len(ratios) if ratios else None,
            "step_mape": sum(abs(x - 1.0) for x in ratios) / len(ratios) if ratios else None,
            "stage_ratio": {n: sum(v) / len(v) for n, v in sorted(stage.items())},
            "urgent_moves": len(every) - len(moves),
            "moves": len(moves),
            "move_gain_predicted_s": sum(gain_pred) / len(moves) if moves else None,
            "move_gain_realized_s": sum(gain_real) / len(moves) if moves else None,
            "move_cost_predicted_s": sum(cost_pred) / len(moves) if moves else None,
            "move_cost_realized_s": sum(r.transition_s for r in moves) / len(moves) if moves else None,
            "move_risk_gain_predicted_s": sum(risk_gain) / len(moves) if moves else None,
            "priced_tries": len(priced),
            "lost_tries": len(lost),
            "lost_tries_predicted": sum(p for p, _ in tries),
            "lost_s_predicted": sum(x for _, x in tries) / len(priced) if priced else None,
            "lost_s_realized": sum(lost) / len(priced) if priced else None,
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


def _risk(decision: Mapping[str, Any], which: str) -> float:
    return float(decision.get(f"{which}_risk_s") or 0.0)


def _try_loss(decision: Mapping[str, Any], step_s: float) -> tuple[float, float]:
    """The probability that the step this decision priced is lost, p = R/(L + R) from the risk
    R = L·p/(1 − p) of the plan that runs it (the target where the decision moved), and the
    seconds it expects that try to lose, L·p (L: the predicted latency, else the step's)."""
    which = "target" if decision.get("verdict") in ("admit", "restart") else "current"
    risk = _risk(decision, which)
    latency = decision.get(f"{which}_latency_s")
    latency = step_s if latency is None else float(latency)
    p = risk / (latency + risk) if risk > 0 else 0.0
    return p, latency * p


def _latency_gain(decision: Mapping[str, Any]) -> float:
    """An opportunistic move's predicted gain in step latency (its current plan is valid, so
    both latencies are known): ΔL less the change in risk it also holds."""
    return float(decision["current_latency_s"]) - float(decision["target_latency_s"])
