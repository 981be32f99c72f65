"""What happens at a step boundary, as values: the action, how a worker's run ends, what moved.

The controller's ``Decision`` carries an ``Action``; the runtime executes it on every worker and
the simulator charges its true cost, so both read the same three cases:

- ``Keep``: the plan stays;
- ``Move(target, transition)``: run the transition the controller priced (its DAG and schedule,
  not rebuilt) and adopt ``target``; ``drain`` marks a move the launcher asked for (a shrink),
  which the controller adopts without having admitted it;
- ``Restart(plan)``: nothing transitions in place; reload the latest checkpoint onto ``plan``
  (``None``: wherever the pool allows, the executor's choice).

``TransitionRecord`` is one thing that moved at a boundary (a transition, a restart, a membership
change, a recovery, a preemption) as metrics report it. ``Outcome`` is how a worker's run ended.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nereus.plan.layout import Plan
from nereus.plan.report import plan_summary
from nereus.transition.between import Transition


@dataclass(frozen=True, slots=True)
class Keep:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Move:
    target: Plan
    transition: Transition
    reason: str = ""
    drain: bool = False  # a shrink the launcher asked for: adopted, not admitted

    @property
    def kind(self) -> str:
        """The primitives the transition runs, e.g. ``extend+merge`` (``regroup``: none, only new
        process groups)."""
        return "+".join(sorted({n.primitive.value for n in self.transition.dag.nodes})) or "regroup"


@dataclass(frozen=True, slots=True)
class Restart:
    plan: Plan | None
    reason: str = ""


Action = Keep | Move | Restart


class Outcome(StrEnum):
    """How a worker's run of the job ended."""

    DONE = "done"  # every step ran
    PREEMPTED = "preempted"  # checkpointed at a boundary after SLURM's signal; the job requeues
    LEFT = "left"  # this process left the job (a scripted loss, or its node was drained)


class RecordKind(StrEnum):
    MOVE = "move"  # a transition (reported by its primitives: ``split+merge``, ``regroup``…)
    RESTART = "restart"
    MEMBERSHIP = "membership"
    RECOVERED = "recovered"
    PREEMPTED = "preempted"


@dataclass(frozen=True, slots=True)
class TransitionRecord:
    """One thing that moved at a step boundary, with what metrics report about it."""

    kind: RecordKind
    seconds: float
    reason: str = ""
    label: str = ""  # a move's primitives (``split+merge``), else the kind
    moved_bytes: int | None = None
    before: Mapping[str, str] | None = None
    after: Mapping[str, str] | None = None
    from_step: int | None = None  # a restart: the checkpoint's step
    generation: int | None = None  # a membership change or a recovery: the world's generation
    left: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    members: tuple[int, ...] = ()
    oom: str = ""  # a recovery: the model-stage that ran out of memory, if that was the failure
    rebuild_s: float | None = None  # a move: of its seconds, building and re-binding engines

    @classmethod
    def move(
        cls, action: Move, seconds: float, before: Plan, rebuild_s: float | None = None
    ) -> TransitionRecord:
        return cls(
            RecordKind.MOVE, seconds, action.reason, action.kind, action.transition.moved_bytes,
            plan_summary(before), plan_summary(action.target), rebuild_s=rebuild_s,
        )  # fmt: skip

    @classmethod
    def restart(
        cls, seconds: float, reason: str, from_step: int, before: Plan, after: Plan
    ) -> TransitionRecord:
        return cls(
            RecordKind.RESTART, seconds, reason, from_step=from_step, before=plan_summary(before),
            after=plan_summary(after),
        )  # fmt: skip

    @classmethod
    def membership(
        cls, seconds: float, generation: int, left: tuple[int, ...], joined: tuple[int, ...]
    ) -> TransitionRecord:
        return cls(RecordKind.MEMBERSHIP, seconds, generation=generation, left=left, joined=joined)

    @classmethod
    def recovered(
        cls, seconds: float, lost: tuple[int, ...], members: tuple[int, ...], generation: int, oom: str = ""
    ) -> TransitionRecord:
        return cls(RecordKind.RECOVERED, seconds, lost=lost, members=members, generation=generation, oom=oom)

    def to_json(self) -> dict[str, Any]:
        """The object ``metrics.jsonl`` lists under ``transitions``."""
        out: dict[str, Any] = {"kind": self.label or self.kind.value, "seconds": self.seconds}
        if self.kind is RecordKind.MOVE:
            out.update(reason=self.reason, bytes=self.moved_bytes, before=self.before, after=self.after)
            if self.rebuild_s is not None:
                out["rebuild_s"] = self.rebuild_s
        elif self.kind is RecordKind.RESTART:
            out.update(reason=self.reason, from_step=self.from_step, before=self.before, after=self.after)
        elif self.kind is RecordKind.MEMBERSHIP:
            out.update(generation=self.generation, left=list(self.left), joined=list(self.joined))
        elif self.kind is RecordKind.RECOVERED:
            out.update(lost=list(self.lost), members=list(self.members), generation=self.generation)
            if self.oom:
                out["oom"] = self.oom
        return out
