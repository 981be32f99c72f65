"""What a plan risks: expected seconds per step lost to revocations (issue 19).

Two losses. A step whose GPUs lose one while it runs loses its work: its collectives fail and it
runs again. With p the probability that some GPU of the plan is revoked within its step L(S),
a step completes after L/(1 − p) seconds on average (each try a Bernoulli trial), so the work
lost per completed step is L · p/(1 − p) — small in a calm pool, and dominant right after the pool
changed, when spot capacity is least stable (``FailureDomains.age_factors``). And a trainer's
optimizer state exists only on its replicas: if every replica of some trainer loses a GPU within
the step, nothing can move in place at the next boundary and the job restarts from its
checkpoint:

    R(S) = L · p/(1 − p) + (1 − Π_trainers (1 − Π_replicas P(replica loses a GPU within L))) · restart_s

The restart term is 0 when each trainer keeps a replica on reserved GPUs — what reserved-first
placement gives whenever a replica fits there; the lost work is 0 only on reserved GPUs.
Admission adds R to each plan's predicted step latency, so a faster plan on less stable GPUs pays
for its risk.
"""

from __future__ import annotations

from collections.abc import Mapping

from nereus.plan.layout import Plan
from nereus.spec.cluster import ClusterSpec
from nereus.spec.domains import FailureDomains
from nereus.spec.workload import Stage

MAX_LOSS_P = 0.95  # a step lost with certainty would never complete: its lost work is capped


def last_copy_loss(
    plan: Plan, domains: FailureDomains, seconds: float, since_s: float | None = None
) -> float:
    """Probability that some trainer of ``plan`` loses every replica within ``seconds``
    (``since_s`` after the pool last changed, if known)."""
    held = len(domains.revocable_instances(plan.pool))
    survive = 1.0
    for c in plan.candidates:
        if plan.stage_of(c) is Stage.TRAIN:
            replicas = [c.replica_gpus(r) for r in range(c.dp)]
            survive *= 1.0 - domains.all_lost_probability(replicas, seconds, held, since_s)
    return 1.0 - survive


def lost_work(plan: Plan, domains: FailureDomains, step_s: float, since_s: float | None = None) -> float:
    """Expected seconds of work lost per completed step of ``plan`` (``step_s`` long): a step
    that loses a GPU runs again, so L · p/(1 − p), with p capped at ``MAX_LOSS_P``."""
    held = len(domains.revocable_instances(plan.pool))
    gpus = [g for c in plan.candidates for g in c.gpus]
    p = min(MAX_LOSS_P, domains.any_lost_probability(gpus, step_s, held, since_s))
    return step_s * p / (1.0 - p)


def restart_seconds(
    plan: Plan, resident: Mapping[str, float], cluster: ClusterSpec, relaunch_s: float
) -> float:
    """A checkpoint restart onto ``plan``: relaunch, then every model-stage's state (``resident``
    bytes per GPU) read from shared storage, each node of the plan reading its share."""
    state = sum(resident[c.model_stage] * c.num_gpus for c in plan.candidates)
    nodes = max(1, len({cluster.node_of(g) for c in plan.candidates for g in c.gpus}))
    return relaunch_s + state / (cluster.storage_read_gbs * 1e9 * nodes)
