"""L_tran and transition feasibility before anything moves (paper §2.8–2.9, §2.13).

``TransitionEstimator`` is the interface admission uses. ``BandwidthEstimator`` is the estimate
we use until the transition engine's DAG critical path replaces it: for every GPU, the bytes of
state it must receive (its shard of each model-stage whose shard on it changes) over the link it
receives on, summed across model-stages (transfers into one GPU share its link), maximum over
GPUs, plus communicator setup. Memory: a shard is rebuilt in place a layer at a time (Split grows
it from peers, Merge slices what is resident, Extend fills an empty GPU), so a GPU holds the
larger of each model-stage's old and new shard plus a one-layer staging buffer for the model-stage
being moved. Release before acquire: a replica leaving a GPU is freed first when another replica
of its model-stage keeps the state (a sole replica stays until its copy lands elsewhere).
A model-stage whose every replica touches a lost GPU has no intact copy: the transition is
infeasible in place (checkpoint and restart).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Candidate, Plan
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import Stage

COMMUNICATOR_SETUP_S = 0.25  # creating the transition's communicators (per transition)


@dataclass(frozen=True, slots=True)
class TransitionEstimate:
    seconds: float
    peak_bytes: float  # largest per-GPU memory during the transition (with the runtime reserve)
    feasible: bool
    reason: str = ""
    changed: tuple[str, ...] = ()  # model-stages whose candidate changes
    resharded: tuple[str, ...] = ()  # model-stages whose (tp, pp) changes
    moved_bytes: float = 0.0
    per_gpu_seconds: Mapping[int, float] = field(default_factory=dict)
    # what the fitted cost model multiplies: (transfer s, generation rebuilds, other rebuilds, regroups)
    features: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)


class TransitionEstimator(Protocol):
    def estimate(
        self, problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset()
    ) -> TransitionEstimate: ...

    def observe(self, estimate: TransitionEstimate, measured_s: float) -> None: ...


def _shard_of(c: Candidate, gpu: int) -> tuple[int, int] | None:
    """(position inside its replica, replica) of ``gpu`` in ``c``, or None."""
    try:
        i = c.gpus.index(gpu)
    except ValueError:
        return None
    return i % c.layout.size, i // c.layout.size


def intact_replicas(c: Candidate, lost: frozenset[int]) -> int:
    return sum(1 for r in range(c.dp) if not set(c.replica_gpus(r)) & lost)


STORAGE = "storage"  # the source of a frozen model's weights when no replica survives


def state_source(current: Plan, name: str, lost: frozenset[int]) -> Candidate | str | None:
    """Where ``name``'s state comes from when its GPUs change.

    Its own intact replicas; else, for a copy of a trainer's weights (generation, old log-probs,
    critic values), the trainer if it is intact (the weight-sync source); else, for a frozen model
    (reference, reward), its weights on shared storage. A trainer with no intact replica has lost
    its optimizer state: None (checkpoint and restart).
    """
    old = current.candidate(name)
    if intact_replicas(old, lost):
        return old
    trainer = current.workflow.sync_source(name)
    if trainer is not None:
        src = current.candidate(trainer)
        return src if intact_replicas(src, lost) else None
    if current.workflow.get(name).stage is Stage.TRAIN:
        return None
    return STORAGE


class BandwidthEstimator:
    """Bytes over link bandwidth, per receiving GPU; a stand-in for the DAG critical path.

    The estimate is w · (transfer seconds, generation engines rebuilt, other engines rebuilt,
    model-stages regrouped): moving bytes is only part of a transition, and the rest (rebuilding
    an inference engine for a new layout, re-forming process groups) is learned from measured
    transitions by recursive least squares, starting from the pure bandwidth model w = (1, 0, 0, 0).
    """

    def __init__(self, forgetting: float = 0.95) -> None:
        self.weights = np.array([1.0, 0.0, 0.0, 0.0])
        self._cov = np.diag([0.1, 1e4, 1e4, 1e4])  # trust the bandwidth prior, not the fixed costs
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
        self, problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset()
    ) -> TransitionEstimate:
        cluster = problem.cluster
        gpn = cluster.gpus_per_node
        old_cost = price(problem, shapes_of(current))
        new_cost = price(problem, shapes_of(target))
        changed, resharded = [], []
        recv: dict[int, float] = {}
        receives: set[tuple[str, int]] = set()  # (model-stage, GPU) pairs that get a new shard
        layers: dict[str, int] = {}  # layers per GPU in the target layout
        for new in target.candidates:
            name = new.model_stage
            old = current.candidate(name)
            if old == new:
                continue
            changed.append(name)
            if old.layout != new.layout:
                resharded.append(name)
            source = state_source(current, name, lost)
            if source is None:
                return TransitionEstimate(
                    0.0, 0.0, False, f"{name} has no intact replica (checkpoint and restart)"
                )
            nodes = set() if source == STORAGE else {g // gpn for g in source.gpus if g not in lost}  # type: ignore[union-attr]
            layers[name] = -(-problem.model_of(target.workflow.get(name)).num_hidden_layers // new.layout.pp)
            for g in new.gpus:
                same = old.layout == new.layout and g not in lost
                if same and _shard_of(old, g) is not None and _shard_of(old, g) == _shard_of(new, g):
                    continue  # this GPU keeps its shard
                receives.add((name, g))
                recv[g] = recv.get(g, 0.0) + new_cost.resident[name] / self._rate(problem, g, nodes, new)
        moved = sum(new_cost.resident[n] * target.candidate(n).num_gpus for n in changed)
        setup = COMMUNICATOR_SETUP_S if changed else 0.0
        gen = sum(1 for n in resharded if target.workflow.get(n).stage is Stage.GEN)
        features = (
            max(recv.values(), default=0.0) + setup,
            gen,
            len(resharded) - gen,
            len(changed) - len(resharded),
        )
        seconds = float(np.dot(self.weights, features))
        peak, where = self._peak(
            problem, current, target, old_cost.resident, new_cost.resident, receives, layers
        )
        limit = problem.capacity_bytes
        reason = ""
        if peak > limit:
            reason = (
                f"GPU {where} would hold {peak / 2**30:.1f} GiB while state moves "
                f"(capacity {limit / 2**30:.1f} GiB after headroom)"
            )
        return TransitionEstimate(
            seconds, peak, peak <= limit, reason, tuple(changed), tuple(resharded), moved, recv, features
        )

    @staticmethod
    def _rate(problem: PlanningProblem, gpu: int, source_nodes: set[int], new: Candidate) -> float:
        """Bytes/s into ``gpu``: shared storage, or the link from the nearest source."""
        cluster = problem.cluster
        gpn = cluster.gpus_per_node
        if not source_nodes:
            return cluster.storage_read_gbs * 1e9 / gpn  # the node's storage link, shared by its GPUs
        intra = gpu // gpn in source_nodes and new.layout.size <= gpn
        link = Link.INTRA if intra else Link.INTER
        bw = cluster.intra_node_bandwidth_gbs if intra else cluster.inter_node_bandwidth_gbs
        return problem.efficiencies[OpClass.of(Collective.BROADCAST, link)] * bw * 1e9

    @staticmethod
    def _peak(
        problem: PlanningProblem,
        current: Plan,
        target: Plan,
        old_res: Mapping[str, float],
        new_res: Mapping[str, float],
        receives: set[tuple[str, int]],
        layers: Mapping[str, int],
    ) -> tuple[float, int]:
        gpus = {g for p in (current, target) for c in p.candidates for g in c.gpus}
        worst, where = 0.0, -1
        for g in gpus:
            held, extra = 0.0, 0.0
            for c in target.candidates:
                name = c.model_stage
                before = current.candidate(name)
                old = old_res[name] if g in before.gpus else 0.0
                new = new_res[name] if g in c.gpus else 0.0
                if new == 0.0 and before.dp > 1:
                    old = 0.0  # release before acquire: another replica keeps this state
                held += max(old, new)
                if (name, g) in receives:  # staging buffer: one layer of the larger shard
                    extra = max(extra, max(old, new) / max(1, layers[name]))
            total = held + extra + problem.reserved_bytes
            if total > worst:
                worst, where = total, g
        return worst, where
