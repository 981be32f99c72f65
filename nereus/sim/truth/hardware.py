"""Per-step noise, episodes (congestion, throttling) and the true cost of transitions.

The structural truth (``stage.py``, ``decode.py``) says what a model-stage costs on a quiet
machine; ``Hardware`` applies what a real cluster adds on top: seeded log-normal jitter per op
class, episodes that slow a scope of op classes over a range of steps, a small jitter on memory
peaks, and a transition's true seconds: its state moves as the truth walks them (``moves.py``)
plus the engines it rebuilds and the process groups it re-forms (``engines.py``: vLLM's compile
cache warm for a layout built before), neither of which is the planner's estimate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nereus.errors import ConfigError
from nereus.sim.truth.engines import CompileCache, Engine, regroup_seconds
from nereus.sim.truth.params import TruthParams, load
from nereus.spec.files import brief, shorten

COMPUTE_CLASSES = frozenset({"gemm", "attention", "memory"})
SCOPES = ("inter", "intra", "compute", "all")
MIN_FACTOR = 1e-3  # an episode slows an op class to 0.1% of its speed at most


@dataclass(frozen=True, slots=True)
class Episode:
    """Steps [start, end) during which op classes in ``scope`` run at ``factor`` of their speed."""

    start: int
    end: int
    scope: str
    factor: float

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"episode steps must satisfy 0 ≤ start < end, got {self.start}-{self.end}")
        if self.scope not in SCOPES:
            raise ValueError(f"episode scope must be one of {', '.join(SCOPES)}, got {brief(self.scope)}")
        if not MIN_FACTOR <= self.factor <= 1:
            raise ValueError(f"episode factor must be in [{MIN_FACTOR:g}, 1], got {self.factor}")

    @classmethod
    def parse(cls, text: str) -> Episode:
        """``START-END:SCOPE:FACTOR``, e.g. ``100-140:inter:0.5`` (congested network)."""
        form = f"expected START-END:SCOPE:FACTOR with SCOPE one of {', '.join(SCOPES)}"
        parts = text.split(":")
        bounds = parts[0].split("-") if len(parts) == 3 else []
        try:
            start, end, factor = int(bounds[0]), int(bounds[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ConfigError(f"--episode {brief(text)}: {form}, e.g. 100-140:inter:0.5") from None
        if len(bounds) != 2:
            raise ConfigError(f"--episode {brief(text)}: {form}, e.g. 100-140:inter:0.5")
        try:
            return cls(start, end, parts[1], factor)
        except ValueError as exc:
            raise ConfigError(f"--episode {brief(text)}: {shorten(str(exc), 200)}") from None

    def covers(self, op: str, step: int) -> bool:
        """Whether op class ``op`` (its name, e.g. ``allreduce.inter``) is slowed at ``step``."""
        if not self.start <= step < self.end:
            return False
        if self.scope == "all":
            return True
        if self.scope == "compute":
            return op in COMPUTE_CLASSES
        return op.endswith("." + self.scope)


class Hardware:
    """Seeded noise, episodes and transition truth on top of the structural truth."""

    def __init__(
        self,
        seed: int,
        noise: float = 0.03,
        episodes: Sequence[Episode] = (),
        params: TruthParams | None = None,
    ) -> None:
        self.params = params or load()
        self.compiled = CompileCache()  # the generation layouts this job has compiled
        self.rng = np.random.default_rng(seed)
        self._startup_rng = np.random.default_rng([seed, 1])  # apart: the steps' noise stays as it was
        self._sweep_rng = np.random.default_rng([seed, 2])
        self.noise = noise
        self.episodes = tuple(episodes)

    def _jitter(self, rng: np.random.Generator | None = None) -> float:
        return float((rng or self.rng).lognormal(0.0, self.noise)) if self.noise > 0 else 1.0

    def slowdown(self, op: str, step: int) -> float:
        factor = 1.0
        for ep in self.episodes:
            if ep.covers(op, step):
                factor *= ep.factor
        return max(factor, MIN_FACTOR)  # overlapping episodes compound, to 0.1% of the speed at most

    def run(self, quiet_s: Mapping[str, float], step: int) -> dict[str, float]:
        """Measured seconds per op class at ``step``: the quiet-machine truth, slowed by the
        episodes covering it and jittered."""
        return {op: t / self.slowdown(op, step) * self._jitter() for op, t in quiet_s.items() if t > 0}

    def peak(self, true_bytes: float) -> float:
        """A measured peak: the true footprint with a little run-to-run variation."""
        return true_bytes * min(1.02, self._jitter())

    def startup(self, engines: Sequence[Engine]) -> tuple[list[float], list[float]]:
        """What the job measures building its first plan, per model-stage's engine of
        ``engines``: seconds to build the engine (compile caches cold) and to form its process
        groups (the costs a transition pays again for what it re-lays out or regroups)."""
        p = self.params
        builds = [self.compiled.build(e, p) * self._jitter(self._startup_rng) for e in engines]
        return builds, [regroup_seconds(e, p) * self._jitter(self._startup_rng) for e in engines]

    def sweep(self, quiet_s: Sequence[float]) -> list[float]:
        """What the job's start-up collective sweep measures of collectives that take ``quiet_s``
        on a quiet machine: each with its own jitter (the median of a few timed calls is still
        one draw of the fabric's state)."""
        return [t * self._jitter(self._sweep_rng) for t in quiet_s]

    def transition(self, moving_s: float, rebuilt: Sequence[Engine], regrouped: Sequence[Engine]) -> float:
        """True seconds of a transition whose state moves take ``moving_s`` (the truth's walk of
        its DAG), that rebuilds the engines of ``rebuilt`` (re-laid-out model-stages, which form
        their groups anew too) and re-forms the groups of ``regrouped`` (DP changed only)."""
        p = self.params
        fixed = sum(self.compiled.build(e, p) + regroup_seconds(e, p) for e in rebuilt)
        fixed += sum(regroup_seconds(e, p) for e in regrouped)
        return (moving_s + fixed) * self._jitter()
