"""Scripted drift for local runs (an experiment's ``drift:`` list): workers lost, killed, gained,
out of memory, unhealthy, hung or frozen at given steps, and a response-length schedule, so that
adaptation and recovery are visible on one machine. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.spec.files import brief
from nereus.spec.workload import MAX_TOKENS

MAX_STEPS = 10_000_000  # a run's most steps
MAX_HANG_S = 600.0  # a scripted hang lasts at most this long


DEFAULT_OOM_STAGE = "actor.train"
DEFAULT_HANG_S = 20.0


@dataclass(frozen=True, slots=True)
class DriftEvent:
    """Scripted drift for local runs. ``lose``: workers whose processes leave at the boundary
    before ``step`` (their state is gone); ``kill``: workers whose processes are killed
    (SIGKILL) in the middle of ``step``, after generation; ``gain``: new worker processes started
    at the boundary before ``step``, which join the running job (one both gained and killed dies
    once the leader has accepted it, before the new generation forms: a node lost as it joins,
    which the others find in the formation's roll call and recover from); ``oom``: workers on which
    ``oom_stage``'s work raises ``torch.OutOfMemoryError`` once in ``step`` (a fault injected where a
    real one would come from); ``unhealthy``: workers whose GPU health check reports a fatal XID at
    the boundary before ``step`` (the leader treats them as lost); ``hang``: workers whose
    processes, when ``step`` fails (a worker killed in it), let go of their groups and stop
    (SIGSTOP: every thread, the heartbeat's too) for ``hang_s`` seconds before they check in to
    the recovery: a worker stuck that long (in a connect to a dead peer, say), which the job
    recovers without and which then asks to rejoin; ``freeze``: workers whose processes stop
    (SIGSTOP) for ``hang_s`` seconds in the middle of ``step``, after generation, holding their
    connections, as a node that froze: the others' collectives time out after the experiment's
    ``collective_timeout_s``, the job recovers without them, and they ask to rejoin when they wake;
    ``max_new_tokens``: the response length limit from ``step`` on."""

    step: int
    lose: tuple[int, ...] = ()
    kill: tuple[int, ...] = ()
    gain: tuple[int, ...] = ()
    oom: tuple[int, ...] = ()
    oom_stage: str = DEFAULT_OOM_STAGE
    unhealthy: tuple[int, ...] = ()
    hang: tuple[int, ...] = ()
    freeze: tuple[int, ...] = ()
    hang_s: float = DEFAULT_HANG_S
    max_new_tokens: int = 0  # 0: unchanged

    def __post_init__(self) -> None:
        if not 0 <= self.step <= MAX_STEPS:
            raise ValueError(f"step must be in [0, {MAX_STEPS}], got {brief(self.step)}")
        for name in ("lose", "kill", "gain", "oom", "unhealthy", "hang", "freeze"):
            workers = getattr(self, name)
            if len(set(workers)) != len(workers):
                raise ValueError(f"step {self.step}: {name} names a worker twice ({list(workers)})")
        gone = (set(self.lose), set(self.kill), set(self.unhealthy))
        if any(a & b for i, a in enumerate(gone) for b in gone[i + 1 :]) or (
            set(self.lose) | set(self.unhealthy)
        ) & set(self.gain):
            raise ValueError(
                f"step {self.step}: a worker cannot be lost, killed or unhealthy at once, nor lost "
                "or unhealthy as it is gained (gained and killed: it dies as it joins)"
            )
        if not 0 <= self.max_new_tokens <= MAX_TOKENS:
            raise ValueError(f"max_new_tokens must be in [0, {MAX_TOKENS}], got {brief(self.max_new_tokens)}")
        if set(self.oom) & (set().union(*gone) | set(self.gain)):
            raise ValueError(f"step {self.step}: a worker that runs out of memory stays in the job")
        if set(self.hang) & (set().union(*gone) | set(self.gain) | set(self.oom)):
            raise ValueError(f"step {self.step}: a worker that hangs is not lost, gained or out of memory")
        if set(self.freeze) & (set().union(*gone) | set(self.gain) | set(self.oom) | set(self.hang)):
            raise ValueError(
                f"step {self.step}: a worker that freezes is not lost, gained, out of memory or hung"
            )
        if not 0.0 < self.hang_s <= MAX_HANG_S:
            raise ValueError(f"hang_s must be in (0, {MAX_HANG_S:g}] seconds, got {brief(self.hang_s)}")
        if self.hang_s != DEFAULT_HANG_S and not (self.hang or self.freeze):
            raise ValueError(f"step {self.step}: hang_s is how long hang or freeze workers stop; name some")
        if self.oom_stage != DEFAULT_OOM_STAGE and not self.oom:
            raise ValueError(f"step {self.step}: oom_stage is where oom workers run out of memory; name some")
        if not (self.lose or self.kill or self.gain or self.oom or self.unhealthy or self.hang or self.freeze
                or self.max_new_tokens):  # fmt: skip
            raise ValueError(
                f"step {self.step}: the event changes nothing (name lose, kill, gain, oom, unhealthy, "
                "hang, freeze or max_new_tokens)"
            )
        if self.oom_stage.count(".") != 1:
            raise ValueError(
                f"oom_stage: expected a model-stage (<model>.<stage>), got {brief(self.oom_stage)}"
            )
