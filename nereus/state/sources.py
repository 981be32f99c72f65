"""Where a model-stage's state comes from when its GPUs change (RL semantics, paper §2.9).

Its own intact replicas first. A copy of a trainer's weights (generation, old log-probs, critic
values) can come from its trainer through the weight sync; a frozen model (reference, reward)
from its weights on shared storage. A trainer with no intact replica has lost its optimizer
state: only a checkpoint brings it back.
"""

from __future__ import annotations

from nereus.plan.layout import Candidate, Plan
from nereus.spec.workload import Stage
from nereus.state.emu import Emu, replicas

STORAGE = "storage"  # the source of a frozen model's weights when no replica survives


def intact_replicas(c: Candidate, lost: frozenset[int]) -> int:
    return sum(1 for r in range(c.dp) if not set(c.replica_gpus(r)) & lost)


def intact_units(c: Candidate, lost: frozenset[int]) -> tuple[Emu, ...]:
    """Every replica of ``c`` that touches no lost GPU, in replica order."""
    return tuple(u for u in replicas(c) if not set(u.gpus) & lost)


def state_source(current: Plan, name: str, lost: frozenset[int]) -> Candidate | str | None:
    """``name``'s own candidate if a replica is intact; else its trainer, STORAGE, or None."""
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
