"""Where a worker sits in a plan, and what its step's stages took: small value types of the worker.

``grid_of`` is a candidate's grid over world ranks (what ``Groups.build`` connects), ``Place`` a
GPU's position in one model-stage's candidate, ``StageTimes`` the seconds each model-stage's work
took on a rank during a step. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nereus.backends.protocol import Grid
from nereus.plan.layout import Candidate
from nereus.state.emu import replicas


def grid_of(c: Candidate, rank_of: Mapping[int, int] | None = None) -> Grid:
    """The candidate's grid over world ranks (``rank_of``: GPU id → rank; identity by default)."""
    gpus = [g for u in replicas(c) for g in u.gpus]
    return Grid(c.layout, tuple(rank_of[g] for g in gpus) if rank_of is not None else tuple(gpus))


@dataclass(slots=True)
class StageTimes:
    """Seconds each model-stage's work took on this rank during a step."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, s: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + s


@dataclass(frozen=True, slots=True)
class Place:
    """Where this worker's GPU sits in a model-stage's plan: DP rank, TP rank, pipeline stage."""

    dp: int
    t: int
    p: int

    @property
    def reports(self) -> bool:
        """The replica's first rank, which reports its results to the world."""
        return self.t == 0 and self.p == 0
