"""The restart a plan risks: expected seconds per step lost to revocations (issue 19).

A trainer's optimizer state exists only on its replicas. If every replica of some trainer loses
a GPU within one step, nothing can move in place at the next boundary: the job restarts from its
checkpoint. Under ``FailureDomains`` (independent Poisson revocations per revocable instance) the
expected cost per step of a plan is

    R(S) = (1 − Π_trainers (1 − Π_replicas P(replica loses a GPU within L(S)))) · restart_s

which is 0 when each trainer keeps a replica on reserved GPUs — what reserved-first placement
gives whenever a replica fits there. Admission adds R to each plan's predicted step latency, so a
faster plan that leaves a trainer exposed pays for its risk.
"""

from __future__ import annotations

from collections.abc import Mapping

from nereus.plan.layout import Plan
from nereus.spec.cluster import ClusterSpec
from nereus.spec.domains import FailureDomains
from nereus.spec.workload import Stage


def last_copy_loss(plan: Plan, domains: FailureDomains, seconds: float) -> float:
    """Probability that some trainer of ``plan`` loses every replica within ``seconds``."""
    held = len(domains.revocable_instances(plan.pool))
    survive = 1.0
    for c in plan.candidates:
        if plan.stage_of(c) is Stage.TRAIN:
            replicas = [c.replica_gpus(r) for r in range(c.dp)]
            survive *= 1.0 - domains.all_lost_probability(replicas, seconds, held)
    return 1.0 - survive


def restart_seconds(
    plan: Plan, resident: Mapping[str, float], cluster: ClusterSpec, relaunch_s: float
) -> float:
    """A checkpoint restart onto ``plan``: relaunch, then every model-stage's state (``resident``
    bytes per GPU) read from shared storage, each node of the plan reading its share."""
    state = sum(resident[c.model_stage] * c.num_gpus for c in plan.candidates)
    nodes = max(1, len({cluster.node_of(g) for c in plan.candidates for g in c.gpus}))
    return relaunch_s + state / (cluster.storage_read_gbs * 1e9 * nodes)
