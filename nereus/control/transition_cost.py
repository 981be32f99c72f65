"""L_tran and transition feasibility before anything moves (paper §2.8–2.9, §2.13).

``TransitionEstimator`` is the interface admission uses. ``DagEstimator`` builds the global
transition DAG from the running plan to the target (``nereus.transition``): feasibility is the
DAG's (every acquisition gets its memory, every model-stage has a source of state), the peak is
the largest per-GPU bound the DAG guarantees plus the runtime reserve, and the moving time is the
list schedule's makespan (bytes over links, shared-link contention, communicator setup).

Transitions also pay costs bytes do not explain: rebuilding an engine for a new layout,
re-forming process groups. The estimate is w · (DAG makespan, generation rebuilds, other
rebuilds, regroups), w fitted by recursive least squares from measured transitions, starting
from the pure DAG model w = (1, 0, 0, 0). At a boundary where the job's world re-forms anyway (a
worker joined or left), every engine and group is rebuilt whether the plan changes or not: those
costs are sunk, the features count the DAG alone (``sunk``), and the fit learns from the DAG's
measured seconds only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import Stage
from nereus.transition import NoSourceError, Transition
from nereus.transition.between import Priced, ledger_capacity, price_transition, with_staging


@dataclass(frozen=True, slots=True)
class TransitionEstimate:
    seconds: float
    peak_bytes: float  # largest per-GPU memory during the transition (with the runtime reserve)
    feasible: bool
    reason: str = ""
    changed: tuple[str, ...] = ()  # model-stages whose units change
    resharded: tuple[str, ...] = ()  # model-stages whose (tp, pp) changes
    moved_bytes: float = 0.0
    per_gpu_seconds: Mapping[int, float] = field(default_factory=dict)  # when each GPU is done
    # what the fitted cost model multiplies: (DAG makespan s, generation rebuilds, other rebuilds, regroups)
    features: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    priced: Priced | None = None  # what was priced: a class plan, or the DAG and schedule a move runs
    sunk: bool = False  # rebuilds and regroups happen anyway (the world re-forms): not charged

    @property
    def transition(self) -> Transition | None:
        """The per-unit DAG and schedule a move runs (a class plan's is built on first use)."""
        return self.priced.transition if self.priced is not None else None


class TransitionEstimator(Protocol):
    def estimate(
        self, problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset(),
        skip: frozenset[str] = frozenset(), sunk: bool = False,
    ) -> TransitionEstimate: ...  # fmt: skip

    def observe(self, estimate: TransitionEstimate, measured_s: float) -> None: ...


class DagEstimator:
    """L_tran from the transition DAG's schedule, with fixed costs learned from measurements."""

    def __init__(self, forgetting: float = 0.95) -> None:
        self.weights = np.array([1.0, 0.0, 0.0, 0.0])
        self._cov = np.diag([0.1, 1e4, 1e4, 1e4])  # trust the DAG's timing, not the fixed costs
        self.forgetting = forgetting

    def observe(self, estimate: TransitionEstimate, measured_s: float) -> None:
        """Fold one measured transition into the weights (RLS with forgetting, weights ≥ 0)."""
        f = np.asarray(estimate.features, dtype=np.float64)
        if measured_s <= 0 or not f.any():
            return
        pf = self._cov @ f
        gain = pf / (self.forgetting + f @ pf)
        self.weights = np.maximum(self.weights + gain * (measured_s - f @ self.weights), 0.0)
        self._cov = (self._cov - np.outer(gain, pf)) / self.forgetting

    def estimate(
        self, problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset(),
        skip: frozenset[str] = frozenset(), sunk: bool = False,
    ) -> TransitionEstimate:  # fmt: skip
        """``skip``: model-stages left out of the transition (weight copies that a weight sync
        rebuilds after it, when a failed step's rollback dropped them). ``sunk``: the world
        re-forms at this boundary, so rebuilds and regroups are not the transition's to pay."""
        try:
            tr = price_transition(problem, current, target, lost, skip)
        except NoSourceError as exc:
            return TransitionEstimate(0.0, 0.0, False, str(exc))
        if tr.classes is None:  # a per-unit DAG: its zero-copy staging counts in its memory
            tr = Priced(with_staging(tr.transition, ledger_capacity(problem)))
        changed, resharded = tr.changed, tr.resharded
        peak = tr.peak_max + problem.reserved_bytes
        if not tr.feasible:
            return TransitionEstimate(
                0.0, peak, False, tr.transition.dag.reason, changed, resharded, tr.moved_bytes, priced=tr
            )
        done = tr.gpu_done()
        gen = sum(1 for n in resharded if target.workflow.get(n).stage is Stage.GEN)
        features = (
            tr.l_tran_s,
            0.0 if sunk else float(gen),
            0.0 if sunk else float(len(resharded) - gen),
            0.0 if sunk else float(len(changed) - len(resharded)),
        )
        seconds = float(np.dot(self.weights, features))
        return TransitionEstimate(
            seconds, peak, True, "", changed, resharded, float(tr.moved_bytes), done, features, tr, sunk
        )
