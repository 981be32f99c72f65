"""Replan triggers (paper §2.7): events and thresholds, with the horizon H_x of each signal.

* Events: the GPU pool changed (urgent when the running plan lost GPUs), a memory violation is
  predicted for the next step, or a step ran out of memory (both urgent).
* Thresholds: a drifting signal x fires when |x − x_ref| / x_ref > δ_x. Signals: the mean response
  length (δ_len = 30%) and the achieved efficiency of every timed op class (δ_eff = 25%).
  References are reset after every replan, also when the target is rejected, so a persistent
  deviation does not re-fire every step while steady growth still crosses again and again.
* H_x, the expected number of steps until x next crosses (or the pool next changes), is an EMA of
  the observed intervals between crossings, updated only at a crossing; 1 step before the first
  interval is seen (paper §2.8).
* **Our addition**: a pool change that only adds GPUs is the ``pool.growth`` signal, whose horizon
  is the steps until the pool next *loses* GPUs (an EMA of the intervals between losses, the first
  counted from the first step this monitor saw, and no less than the steps since the last loss, or
  since that first step). A move onto added GPUs gains until those GPUs go: a further growth does
  not undo it (the next move starts from it), so the paper's "until the pool next changes"
  undercounts its gain on a pool that grows step after step, and the move that would have used
  the GPUs is refused every time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from nereus.control.telemetry import Telemetry
from nereus.plan.opclass import OpClass

SEQ_LEN = "seq_len"
POOL = "pool"
GROWTH = "pool.growth"  # a pool change that only adds GPUs (its horizon: until the pool next loses some)


class TriggerKind(StrEnum):
    POOL = "pool"  # the pool changed; the running plan keeps its GPUs
    GPU_LOSS = "gpu-loss"  # the running plan lost GPUs: it is invalid
    MEMORY = "memory"  # the running plan is predicted to run out of memory next step
    MARGIN = "memory.margin"  # ... to fit its memory, but past the headroom kept for model error
    OOM = "oom"  # a step ran out of memory
    DRIFT = "drift"  # a signal moved more than δ from its reference
    PERIODIC = "periodic"  # a periodic policy's timer
    DEFERRED = "deferred"  # a rejected target would now pay back: the signal stayed stable
    SETTLED = "settled"  # the pool has settled since GPUs were left idle (nereus.control.settling)

    @property
    def urgent(self) -> bool:
        return self in (TriggerKind.GPU_LOSS, TriggerKind.MEMORY, TriggerKind.OOM)


@dataclass(frozen=True, slots=True)
class Trigger:
    kind: TriggerKind
    signal: str
    value: float
    reference: float
    horizon_steps: float  # H_x

    @property
    def urgent(self) -> bool:
        return self.kind.urgent

    def describe(self) -> str:
        if self.kind is TriggerKind.DRIFT:
            return f"{self.signal} {self.reference:.4g}→{self.value:.4g}"
        if self.kind in (TriggerKind.POOL, TriggerKind.GPU_LOSS):
            return f"{self.kind.value} {self.reference:g}→{self.value:g} GPUs"
        if self.kind is TriggerKind.MEMORY:
            return "memory: next step predicted over capacity"
        if self.kind is TriggerKind.MARGIN:
            return "memory: next step predicted past the headroom, within capacity"
        if self.kind is TriggerKind.OOM:
            return "oom: the last step ran out of memory"
        if self.kind is TriggerKind.DEFERRED:
            return f"deferred: {self.signal} stable for H = {self.horizon_steps:.3g} steps"
        if self.kind is TriggerKind.SETTLED:
            return f"settled: pool unchanged for {self.value:.4g} s"
        return f"{self.kind.value} every {self.horizon_steps:g} steps"


class Horizon:
    """EMA of the steps between a signal's crossings; 1 step until the first interval is seen."""

    def __init__(self, weight: float) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError("EMA weight must be in (0, 1]")
        self.weight = weight
        self.steps = 1.0
        self._last: int | None = None
        self._origin: int | None = None  # the first step observed
        self._intervals = 0

    def observed(self, step: int) -> None:
        """The signal was observed at ``step`` (the first such step is its origin). It does not
        start the first interval: the first crossing still has H = 1 step (paper §2.8)."""
        if self._origin is None:
            self._origin = step

    def start(self, step: int) -> None:
        """The signal is known stable from ``step`` (no crossing): the first crossing after it
        counts its interval from ``step``."""
        if self._last is None:
            self._last = step

    def effective(self, step: int) -> float:
        """H at ``step``: the EMA, but no less than the steps the signal has now been stable
        (a pool that has not changed for 8 steps is not expected to change in 1): since its last
        crossing, or, where it never crossed, since it was first observed (``observed``)."""
        since_step = self._last if self._last is not None else self._origin
        since = 0.0 if since_step is None else float(step - since_step)
        return max(self.steps, since)

    def crossed(self, step: int) -> None:
        if self._last is not None and step > self._last:
            interval = float(step - self._last)
            self.steps = (
                interval
                if self._intervals == 0
                else (self.weight * interval + (1.0 - self.weight) * self.steps)
            )
            self._intervals += 1
        self._last = step


class Threshold:
    """One drifting signal: fires when it moves more than ``delta`` (relative) from its reference."""

    def __init__(self, signal: str, delta: float, weight: float) -> None:
        if delta <= 0:
            raise ValueError(f"δ for {signal} must be positive")
        self.signal = signal
        self.delta = delta
        self.reference: float | None = None
        self.horizon = Horizon(weight)

    def observe(self, step: int, value: float) -> Trigger | None:
        if self.reference is None or self.reference <= 0:
            self.reference = value
            return None
        if abs(value - self.reference) / self.reference <= self.delta:
            return None
        self.horizon.crossed(step)
        return Trigger(TriggerKind.DRIFT, self.signal, value, self.reference, self.horizon.steps)

    def reset(self, value: float) -> None:
        self.reference = value


class TriggerMonitor:
    """All triggers of one job; ``observe`` once per step, ``reset`` after every replan."""

    def __init__(
        self,
        delta_len: float = 0.30,
        delta_eff: float = 0.25,
        weight: float = 0.5,
        pool: Iterable[int] | None = None,
    ) -> None:
        """``pool``: the GPUs the running plan was made for, where known — a pool that grew
        before the first telemetry (a worker joined during start-up) then fires at once."""
        self.weight = weight
        self.delta_eff = delta_eff
        self.seq_len = Threshold(SEQ_LEN, delta_len, weight)
        self.efficiency: dict[OpClass, Threshold] = {}
        self.pool_horizon = Horizon(weight)
        self.loss_horizon = Horizon(weight)  # steps between pool changes that lose GPUs
        self._pool: frozenset[int] | None = None if pool is None else frozenset(pool)

    def observe(
        self, t: Telemetry, plan_gpus: frozenset[int], memory_violation: bool, into_margin: bool = False
    ) -> list[Trigger]:
        """Triggers that fire at the end of step ``t.step`` for a plan running on ``plan_gpus``:
        ``memory_violation`` the plan predicted over its GPUs' memory next step, ``into_margin``
        predicted to fit it but past the headroom (a replan that must pay back, not urgent)."""
        fired: list[Trigger] = []
        pool = frozenset(t.pool)
        gone = t.lost_of(plan_gpus)  # out of the pool, or revoked during the step and back
        self.loss_horizon.start(t.step)  # no loss seen yet: stable since the first step observed
        self.pool_horizon.observed(t.step)  # a pool that never changed: stable since then
        if self._pool is not None and (pool != self._pool or t.lost):
            self.pool_horizon.crossed(t.step)
            if self._pool - pool or t.lost:
                self.loss_horizon.crossed(t.step)
            elif not gone:  # GPUs added, none lost: the gain of using them lasts until a loss
                h = self.loss_horizon.effective(t.step)
                fired.append(Trigger(TriggerKind.POOL, GROWTH, len(pool), len(self._pool), h))
            if not fired:
                kind = TriggerKind.GPU_LOSS if gone else TriggerKind.POOL
                fired.append(Trigger(kind, POOL, len(pool), len(self._pool), self.pool_horizon.steps))
        elif gone:  # the plan already runs on GPUs that are gone
            fired.append(Trigger(TriggerKind.GPU_LOSS, POOL, len(pool), len(pool), self.pool_horizon.steps))
        self._pool = pool
        if t.oom:
            fired.append(Trigger(TriggerKind.OOM, "memory", 1.0, 0.0, 1.0))
        elif memory_violation:
            fired.append(Trigger(TriggerKind.MEMORY, "memory", 1.0, 0.0, 1.0))
        elif into_margin:  # a move away lasts until the pool next changes
            fired.append(Trigger(TriggerKind.MARGIN, "memory", 1.0, 0.0, self.pool_horizon.effective(t.step)))
        drift = self.seq_len.observe(t.step, t.seq_len_mean)
        if drift is not None:
            fired.append(drift)
        for op in sorted({m.op_class for m in t.measurements}):
            eff = t.efficiency(op)
            if eff is None:
                continue
            tracker = self.efficiency.setdefault(
                op, Threshold(f"efficiency.{op.value}", self.delta_eff, self.weight)
            )
            drift = tracker.observe(t.step, eff)
            if drift is not None:
                fired.append(drift)
        return fired

    def horizon_now(self, signal: str, step: int) -> float:
        """The effective horizon of ``signal`` (``pool``, ``pool.growth``, ``seq_len`` or
        ``efficiency.<op>``)."""
        if signal == POOL:
            return self.pool_horizon.effective(step)
        if signal == GROWTH:
            return self.loss_horizon.effective(step)
        if signal == SEQ_LEN:
            return self.seq_len.horizon.effective(step)
        for tracker in self.efficiency.values():
            if tracker.signal == signal:
                return tracker.horizon.effective(step)
        return 1.0

    def rebase(self) -> None:
        """The job now runs another plan (a move, a restart, a rollback onto rebuilt engines):
        each op class's efficiency is measured on other shapes, so its reference is the first
        measurement on the new plan, and that first change is no drift (**our addition**: the
        references ``reset`` kept were the left plan's, and the first step on the new one crossed
        them, with H = 1, cutting the H of the next decision to 1)."""
        for tracker in self.efficiency.values():
            tracker.reference = None

    def reset(self, t: Telemetry) -> None:
        """New references after a replan, whatever its verdict (paper §2.7)."""
        self.seq_len.reset(t.seq_len_mean)
        for op, tracker in self.efficiency.items():
            eff = t.efficiency(op)
            if eff is not None:
                tracker.reset(eff)


def horizon(triggers: list[Trigger]) -> float:
    """H for an admission decision: the smallest H_x among the signals that fired (paper §2.8).
    A plan past its headroom (``MARGIN``) is no signal that changes: its H (until the pool next
    changes) stands only where no signal fired with it."""
    signals = [t for t in triggers if t.kind is not TriggerKind.MARGIN] or triggers
    return min((t.horizon_steps for t in signals), default=1.0)
