"""The roll call that starts every generation after the first (edge module: the job's store).

Every member checks in under ``form/<g>/in/<gpu>`` (signed) before connecting; the leader waits
until all have, or until one that has not is gone, and writes its verdict under
``form/<g>/verdict``: the GPUs lost and the members it formed the generation with. Every member
reads that one verdict, so all agree. A member lost there, or a member whose list of members is
not the leader's (a newcomer answered before a recovery the others then went through),
fails the formation with ``FormationError``: a peer failure, from which the members recover as
from a failed collective (a newcomer leaves and asks to join again). Without it, gloo's own
rendezvous would hold the others for the formation's 30 minutes.

A missing member is gone when its heartbeat has not changed for ``STALE_S`` of the leader's own
monotonic clock (beats are compared with each other, never with the leader's wall clock, so a
node whose clock is off is judged as any other), or for the *hold* its last beat announced if
that is longer (a member about to hold the interpreter in a full garbage collection, when its
heartbeat thread cannot run, says so first: ``Membership.holding``), or when it never beat: a
member of the last generation at once, a newcomer (which beats from the moment it reads the
leader's answer) after ``join_grace_s``. A heartbeat entry that does not verify (a stranger's)
says nothing. The recoveries' check-ins follow the same rule.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from nereus.runtime.joins import gpu_list
from nereus.runtime.signed import SignedStore, UnauthenticError

STALE_S = 4.0  # a heartbeat unchanged this long (or its hold, if longer): the member is gone
HOLD_S = 30.0  # what a member says it may be silent for around a full garbage collection
MAX_HOLD_S = 120.0  # a longer hold is not a heartbeat of ours: it says nothing
JOIN_GRACE_S = 60.0  # a newcomer that has not beaten this long into a roll call: gone (it died
# before reading the leader's answer, or before reaching the formation)
VERDICT_MARGIN_S = 60.0  # members wait this much longer for the verdict than the leader waits


class Beat(NamedTuple):
    """A member's heartbeat: its own clock (compared only with its earlier beats), and the
    seconds it said it may be silent for from then (``Membership.holding``)."""

    t: float
    hold: float = 0.0


UNVERIFIED = Beat(float("inf"))  # a heartbeat entry that does not verify: it says nothing


class FormationError(dist.DistError):
    """Generation ``generation`` did not form (``lost``: the GPUs it lost; ``why`` says how). A
    peer failure (``comm.is_peer_failure``): the members recover from it."""

    def __init__(self, generation: int, lost: tuple[int, ...], why: str = "") -> None:
        why = why or f"GPUs {list(lost)} never checked in and are gone"
        super().__init__(f"generation {generation} did not form: {why}")
        self.generation = generation
        self.lost = lost


class RollCalls:
    """The roll-call half of ``Membership`` (which sets these attributes)."""

    store: TCPStore
    signed: SignedStore
    gpu: int
    leader: bool
    members: tuple[int, ...]
    generation: int
    timeout: timedelta
    join_grace_s: float

    def log(self, line: str, kind: str = "") -> None:
        raise NotImplementedError  # Membership's own, which comes first in its method order

    def _last_beat(self, gpu: int) -> Beat | None:
        raise NotImplementedError  # Membership's: None when it never beat, else the beat or UNVERIFIED

    def roll_call(self, previous: frozenset[int]) -> None:
        """Check in to this generation's roll call and learn the leader's verdict (``previous``:
        the last generation's members); FormationError when the generation cannot form."""
        g = self.generation
        self.signed.put(f"form/{g}/in/{self.gpu}", {"gpu": self.gpu})
        key = f"form/{g}/verdict"
        if self.leader:
            lost = self._call_roll(previous)
            self.signed.put(key, {"lost": list(lost), "members": list(self.members)})
            if lost:
                self.log(f"generation {g} did not form: GPUs {list(lost)} never checked in and are gone")
                raise FormationError(g, lost)
            return
        wait_s = self.timeout.total_seconds() + VERDICT_MARGIN_S
        try:
            answer = self.signed.wait_valid(
                key, wait_s, lambda why: self.log(f"ignored {key}: {why}", "form")
            )
        except TimeoutError:  # only forged verdicts came: as good as none
            raise FormationError(g, (), f"no verdict from the leader in {wait_s:.0f} s") from None
        lost, theirs = gpu_list(answer, "lost"), gpu_list(answer, "members")
        if theirs != self.members:
            raise FormationError(
                g,
                (),
                f"the leader formed it with GPUs {list(theirs)}, this GPU was told {list(self.members)}",
            )
        if lost:
            raise FormationError(g, lost)

    def _call_roll(self, previous: frozenset[int]) -> tuple[int, ...]:
        """The leader: () once every member checked in; else the members that did not and are
        gone, or, past the formation's timeout, every member still missing."""
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        beats: dict[int, tuple[Beat, float]] = {}  # GPU → (its last beat seen, when it was first seen)
        while True:
            missing = [m for m in self.members if not self._checked_in(m)]
            if not missing:
                return ()
            now = time.monotonic()
            gone = tuple(m for m in missing if self._silent(m, m in previous, beats, start, now))
            if gone or now > deadline:
                return gone or tuple(missing)
            time.sleep(0.05)

    def _checked_in(self, gpu: int) -> bool:
        key = f"form/{self.generation}/in/{gpu}"
        if not self.store.check([key]):
            return False
        try:
            entry = self.signed.read(key)
        except UnauthenticError as exc:
            self.log(f"ignored a roll-call entry for GPU {gpu}: {exc}", "form")
            return False
        return isinstance(entry, dict) and entry.get("gpu") == gpu

    def _silent(
        self, gpu: int, member: bool, beats: dict[int, tuple[Beat, float]], start: float, now: float
    ) -> bool:
        """Whether missing ``gpu`` is gone (the module's rule): ``beats`` holds what the leader
        saw of each heartbeat and since when, on its monotonic clock; ``member``: of the last
        generation."""
        beat = self._last_beat(gpu)
        if beat == UNVERIFIED:
            return False
        if beat is None:
            return member or now - start > self.join_grace_s
        seen, since = beats.get(gpu, (None, now))
        if beat != seen:
            beats[gpu] = (beat, now)
            return False
        return now - since >= max(STALE_S, beat.hold)
