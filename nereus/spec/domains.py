"""Failure domains: which GPUs can be taken away, in what units, and how often.

Shared clusters mix GPUs the job holds for its whole allocation (*reserved*: on-demand instances,
a SLURM reservation) with GPUs that may be revoked at any time (*revocable*: spot instances,
preemptible partitions). Revocations take whole instances (an instance's GPUs go together) and
arrive, for planning purposes, as independent Poisson events at ``revocations_per_hour`` per
revocable instance. Two things follow (issue 19, paper-notes §2.9):

* placement keeps at least one replica of every trainer's state on reserved GPUs when it fits,
  so a revocation never takes a trainer's last copy and the job moves in place instead of
  restarting from a checkpoint;
* admission prices what a plan still risks: the probability that some trainer loses every copy
  during a step, times the seconds a restart costs.

Pure: no clocks, no I/O; GPU ids are the cluster's global ids.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MAX_RATE_PER_HOUR = 1e6


@dataclass(frozen=True, slots=True)
class FailureDomains:
    """GPUs ``reserved`` are never revoked; every other GPU belongs to a revocable instance of
    ``gpus_per_instance`` consecutive ids (instance ``g // gpus_per_instance``), each revoked at
    ``revocations_per_hour`` (0: revocable, rate unknown — placement still prefers reserved GPUs,
    admission prices no risk)."""

    reserved: frozenset[int]
    gpus_per_instance: int
    revocations_per_hour: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "reserved", frozenset(self.reserved))
        if isinstance(self.gpus_per_instance, bool) or self.gpus_per_instance <= 0:
            raise ValueError(f"gpus_per_instance must be a positive integer, got {self.gpus_per_instance}")
        rate = self.revocations_per_hour
        if not (math.isfinite(rate) and 0.0 <= rate <= MAX_RATE_PER_HOUR):
            raise ValueError(f"revocations_per_hour must be in [0, {MAX_RATE_PER_HOUR:g}], got {rate}")
        if any(g < 0 for g in self.reserved):
            raise ValueError("reserved GPU ids must be non-negative")

    def on_reserved(self, gpus: Iterable[int]) -> bool:
        """Every GPU of ``gpus`` is reserved."""
        return all(g in self.reserved for g in gpus)

    def revocable_instances(self, gpus: Iterable[int]) -> frozenset[int]:
        """The revocable instances that ``gpus`` touch."""
        return frozenset(g // self.gpus_per_instance for g in gpus if g not in self.reserved)

    def loss_probability(self, gpus: Iterable[int], seconds: float) -> float:
        """Probability that at least one instance under ``gpus`` is revoked within ``seconds``."""
        exposed = len(self.revocable_instances(gpus))
        if exposed == 0 or self.revocations_per_hour <= 0 or seconds <= 0:
            return 0.0
        return -math.expm1(-self.revocations_per_hour * exposed * seconds / 3600.0)

    def all_lost_probability(self, replicas: Iterable[Iterable[int]], seconds: float) -> float:
        """Probability that every one of ``replicas`` loses a GPU within ``seconds``. Replicas on
        disjoint instances fail independently; replicas sharing an instance fail together, so
        they are counted per distinct set of instances (an upper bound when sets overlap)."""
        groups = {self.revocable_instances(r) for r in replicas}
        if not groups or frozenset() in groups:
            return 0.0
        p = 1.0
        for instances in groups:
            p *= -math.expm1(-self.revocations_per_hour * len(instances) * max(seconds, 0.0) / 3600.0)
        return p

    @classmethod
    def from_nodes(
        cls, reserved_nodes: int, gpus_per_node: int, total_gpus: int, revocations_per_hour: float
    ) -> FailureDomains:
        """Nodes ``[0, reserved_nodes)`` reserved, every later node a revocable instance."""
        reserved = frozenset(range(min(total_gpus, reserved_nodes * gpus_per_node)))
        return cls(reserved, gpus_per_node, revocations_per_hour)
