"""The state a failed step rolls back to: the sources' units at the step boundary.

Only the model-stages without a weight-sync source need keeping (trainers and frozen models; a
weight sync rebuilds the copies). Frozen models are held as they are (nothing changes them);
trainers are copied, since a step changes them in place. On the CPU the copy is a clone. On a GPU
it goes to pinned host memory on a side stream, overlapping generation and inference (which only
read the trainers); the training kernels wait for it (``fence``) and the runtime waits for the
copy itself only when it needs it (``restore``, after a failure). ``restore`` copies again, so a
second failure finds the snapshot intact.

A snapshot is tagged with the step it precedes, the plan that step runs on, and its ``Mark``.
Up to two are kept: the runtime takes the newest at the start of a step (``take``), then waits
at a world barrier and drops the older one (``settle``): once the barrier completes on a rank,
every rank has taken the newest. A peer that dies around a boundary can leave the survivors one
snapshot apart (some got through the boundary's last collective and took the next one, others
failed inside it), never more, and every survivor still holds the older of the two; the
survivors go back to the oldest of their newest snapshots (``agreed``), so they agree on the
step. Edge module (torch).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nereus.devices import CPU
from nereus.plan.layout import Plan
from nereus.runtime.rollout import Batch
from nereus.state.holder import RankState

KEPT = 2  # snapshots kept at most: the newest and, until it settles, the one before


class Mark(NamedTuple):
    """When a snapshot was taken: the world's generation, and how many this rank took before it
    in that generation. Every member of a generation takes the same snapshots in the same order
    (a newcomer forms the generation with the others, before any step of it), so a mark names the
    same boundary on every rank, and marks order in time. A step number does neither: a restart
    or a rollback runs steps again, and the step after a recovery's move is snapshotted again on
    another plan."""

    generation: int
    seq: int


def agreed(newest: Iterable[Mark | None]) -> Mark | None:
    """The snapshot the survivors of a failure go back to, from each one's newest: the oldest of
    them (every survivor still holds it), a rank without any (a newcomer that has not started a
    step) not counting; None when none holds one."""
    return min((m for m in newest if m is not None), default=None)


@dataclass(slots=True)
class Kept:
    """One snapshot: the units, and the boundary they belong to."""

    mark: Mark
    step: int  # the step it precedes: the step that runs again after a rollback to it
    plan: Plan  # the plan that step runs on
    units: dict[str, RankState]
    done: torch.cuda.Event | None = None  # a GPU's copy to pinned host memory has finished
    pending: dict[int, Batch] = field(default_factory=dict)  # async: the batches generated ahead


class Snapshot:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._kept: list[Kept] = []  # oldest first, at most ``KEPT``
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def marks(self) -> tuple[Mark, ...]:
        """The snapshots held, oldest first."""
        return tuple(k.mark for k in self._kept)

    def steps(self) -> tuple[int, ...]:
        """The steps the snapshots held precede, oldest first."""
        return tuple(k.step for k in self._kept)

    def newest(self) -> Mark | None:
        return self._kept[-1].mark if self._kept else None

    def boundary(self, mark: Mark) -> tuple[int, Plan]:
        """The step snapshot ``mark`` precedes and its plan."""
        k = self._find(mark)
        return k.step, k.plan

    def pending(self, mark: Mark) -> dict[int, Batch]:
        """The batches generated ahead (async RL) at snapshot ``mark``'s boundary (immutable: shared)."""
        return dict(self._find(mark).pending)

    def take(
        self, generation: int, step: int, plan: Plan, units: Mapping[str, RankState],
        sources: Collection[str], pending: Mapping[int, Batch] | None = None,
    ) -> Mark:  # fmt: skip
        """Keep ``units`` of model-stages in ``sources`` as they are now, before ``step`` on
        ``plan`` in world generation ``generation``, as the newest snapshot (with ``pending``, the
        batches generated ahead: immutable, kept as they are); the one before stays until
        ``settle``. Returns its mark."""
        last = self.newest()
        mark = Mark(generation, last.seq + 1 if last is not None and last.generation == generation else 0)
        if last is not None and mark <= last:
            raise ValueError(f"snapshot {mark} taken after {last}: generations only grow")
        kept = {n: rs for n, rs in units.items() if n in sources}
        if self._stream is None:
            entry = Kept(
                mark, step, plan, {n: _clone(rs) if rs.policy.trains else rs for n, rs in kept.items()}
            )
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                copied = {
                    n: rs.to(CPU, pinned=True, non_blocking=True) if rs.policy.trains else rs
                    for n, rs in kept.items()
                }
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(self._stream)
            entry = Kept(mark, step, plan, copied, done)
        entry.pending = dict(pending or {})
        self._kept = [*self._kept[-(KEPT - 1) :], entry]
        return mark

    def settle(self) -> None:
        """Every rank has taken the newest snapshot: the ones before it are not needed any more."""
        self._kept = self._kept[-1:]

    def fence(self) -> None:
        """Before anything changes the trainers: the device waits until the copies have read them."""
        for k in self._kept:
            if k.done is not None:
                torch.cuda.current_stream(self.device).wait_event(k.done)

    def restore(self, mark: Mark) -> dict[str, RankState]:
        """The units of snapshot ``mark``, on the device, as fresh copies (it stays intact)."""
        k = self._find(mark)
        if k.done is not None:
            k.done.synchronize()
        return {n: _clone(rs).to(self.device) if rs.policy.trains else rs for n, rs in k.units.items()}

    def back_to(self, mark: Mark) -> dict[str, RankState]:
        """After a failure the survivors agreed on ``mark``: forget the snapshots taken after it
        (their steps run again) and return its units as fresh copies; none when this rank took
        no snapshot up to ``mark`` (it joined after that boundary, whose plan gives it no units)."""
        for k in self._kept:
            if k.mark > mark and k.done is not None:
                k.done.synchronize()  # nothing is still copying into what is dropped
        self._kept = [k for k in self._kept if k.mark <= mark]
        return self.restore(mark) if self._kept else {}

    def _find(self, mark: Mark) -> Kept:
        for k in self._kept:
            if k.mark == mark:
                return k
        held = ", ".join(f"{tuple(k.mark)} before step {k.step}" for k in self._kept) or "none"
        raise LookupError(f"no snapshot {tuple(mark)} on this rank (it holds: {held})")


def _clone(rs: RankState) -> RankState:
    bufs = {k: b.clone() for k, b in rs.buffers.items()}
    return RankState(rs.model_stage, rs.model, rs.layout, rs.t, rs.p, rs.policy, bufs, rs.state)
