"""Joins to a running job (part of ``membership.Membership``): a newcomer's signed request and
its wait for the leader's answer; the leader's verification of the queue at a step boundary.

A newcomer pushes a signed request carrying a fresh ticket to ``JOIN_QUEUE`` and waits for the
leader's signed answer under ``join/answer/<ticket>``, pushing again (freshly timed) every
``REPUSH_S``. The leader verifies requests at a boundary (the MAC, a ticket never seen, a fresh
timestamp), answers a good one with its GPU id and the generation to join, sends a signed refusal
to an authentic bad one, and only logs an unauthentic one, leaving a note under
``join/unverified/<ticket>`` so that a newcomer with a wrong secret gives up rather than waits.
Edge module (the job's store).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass

import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from nereus.runtime.signed import SignedStore, UnauthenticError

MAX_REQUEST_AGE_S = 300.0  # a join request older than this is a replay
MAX_REQUESTS_PER_BOUNDARY = 64  # more wait for the next boundary (a flood delays, never blocks)
MAX_REQUEST_BYTES = 4096
REPUSH_S = 30.0  # a newcomer with no answer pushes its request again, freshly timed
UNVERIFIED_GRACE_S = 5.0  # a newcomer the leader cannot verify gives up after this long
JOIN_QUEUE = "join/queue"
TICKET = re.compile(r"[0-9a-f]{32}")


class JoinRefusedError(PermissionError):
    """The leader refused this process's join request."""


@dataclass(frozen=True, slots=True)
class JoinRequest:
    ticket: str  # the newcomer's answer key: join/answer/<ticket>
    host: str
    pid: int
    gpu: int | None  # the GPU id asked for (a local worker coming back), or None: the next free one


class Joins:
    """The join half of ``Membership`` (which sets these attributes)."""

    store: TCPStore
    signed: SignedStore
    node: str
    gpu: int
    _seen: dict[str, float]
    _noted: dict[str, float]

    def log(self, line: str, kind: str = "") -> None:
        """Write ``line`` to the job's membership journal (``Membership.log``)."""
        raise NotImplementedError  # Membership's own, which comes first in its method order

    def start_heartbeat(self) -> None:
        """Beat under ``hb/<gpu>`` from now on (``Membership.start_heartbeat``)."""
        raise NotImplementedError

    def request_join(
        self, gpu: int | None = None, timeout_s: float = 3600.0
    ) -> tuple[int, int, tuple[int, ...]]:
        """A newcomer: ask to join; returns (GPU id, generation, its members) once the leader
        accepts (at a step boundary). The request is pushed again, freshly timed, every
        ``REPUSH_S`` until an authentic answer comes (a long step, or a stranger who took it off
        the queue); answers that do not verify are waited past."""
        ticket = secrets.token_hex(16)
        key = f"join/answer/{ticket}"
        deadline = time.monotonic() + timeout_s
        answer: object = None
        bad = ""
        while answer is None:
            body = {"ticket": ticket, "time": time.time(), "host": self.node[:64],  # SLURM's node name
                    "pid": os.getpid(), "gpu": gpu}  # fmt: skip
            try:
                self.store.queue_push(JOIN_QUEUE, self.signed.envelope(JOIN_QUEUE, body))
            except dist.DistError as exc:  # the leader's store went away: the job ended or failed
                raise JoinRefusedError(f"the job's rendezvous closed before answering ({exc})") from None
            repush = min(deadline, time.monotonic() + REPUSH_S)
            try:
                answer, bad = self._await_answer(key, ticket, repush, bad)
            except dist.DistError as exc:  # the store went away while we waited: the job ended
                raise JoinRefusedError(f"the job's rendezvous closed before answering ({exc})") from None
            if answer is None and time.monotonic() >= deadline:
                why = (
                    f"; an answer that does not verify with this secret ({bad}): a bad secret?" if bad else ""
                )
                raise JoinRefusedError(
                    f"join refused: no answer from the job's leader in {timeout_s:.0f} s{why}"
                )
        if not isinstance(answer, dict):
            raise JoinRefusedError("join refused: the leader's answer is malformed")
        if "refused" in answer:
            raise JoinRefusedError(f"join refused by the job's leader: {answer['refused']}")
        self.gpu = int(answer["gpu"])
        self.start_heartbeat()  # the leader's roll call tells a newcomer lost from here on in seconds
        return self.gpu, int(answer["generation"]), gpu_list(answer, "members")

    def _await_answer(self, key: str, ticket: str, until: float, bad: str) -> tuple[object, str]:
        """The leader's answer at ``key`` if one verifies before ``until`` (else None), and the
        last reason an answer did not verify."""
        answer: object = None
        while answer is None and time.monotonic() < until:
            try:
                answer = self.signed.read(key)
            except UnauthenticError as exc:
                bad = bad if "missing" in str(exc) else str(exc)
                time.sleep(0.05)
            if answer is None and self._unverified(ticket):
                raise JoinRefusedError(
                    "join refused: the job's leader could not verify this request with the job's "
                    "secret (a bad secret?)"
                )
        return answer, bad

    def _unverified(self, ticket: str) -> bool:
        """Whether the leader noted that a request with this ticket did not verify, and that note
        does not verify with this process's secret either (then this secret is not the job's; a
        note that verifies means a stranger used the ticket, and the wait goes on). A note first
        seen is trusted only after ``UNVERIFIED_GRACE_S`` without an answer."""
        key = f"join/unverified/{ticket}"
        if not self.store.check([key]):
            return False
        try:
            self.signed.read(key)
            return False
        except UnauthenticError:
            first = self._noted.setdefault(ticket, time.monotonic())
            return time.monotonic() - first > UNVERIFIED_GRACE_S

    def pending_joins(self) -> list[JoinRequest]:
        """The leader: requests that arrived since the last call, verified. An authentic request
        that is refused (stale) gets a signed refusal; anything unauthentic is only logged (a
        stranger cannot make the leader answer for a ticket), and a repeat of a ticket already
        answered is ignored, so an answer is never overwritten. Never fatal."""
        out: list[JoinRequest] = []
        waiting = int(self.store.queue_len(JOIN_QUEUE))
        for _ in range(min(waiting, MAX_REQUESTS_PER_BOUNDARY)):
            try:
                raw = self.store.queue_pop(JOIN_QUEUE, False)
            except dist.DistError:  # emptied meanwhile (someone else popped): nothing more now
                break
            ticket = _ticket_of(raw)
            if ticket is not None and ticket in self._seen:
                self.log(f"ignored a join request for ticket {ticket[:8]}…, already answered", "join")
                continue
            why, req, authentic = self._verify(raw)
            if req is not None:
                self._seen[req.ticket] = time.time()
                out.append(req)
                continue
            self.log(f"refused join request: {why}", "join")
            if authentic and ticket is not None:
                self._seen[ticket] = time.time()
                self.signed.put(f"join/answer/{ticket}", {"refused": why})
            elif ticket is not None:  # say so, where only a note (never an answer) can go
                self.signed.put(f"join/unverified/{ticket}", {"ticket": ticket})
        self._forget_old()
        return out

    def _verify(self, raw: bytes) -> tuple[str, JoinRequest | None, bool]:
        """(why it is refused, the request, whether it was signed with the job's secret)."""
        if len(raw) > MAX_REQUEST_BYTES:
            return f"{len(raw)} bytes (at most {MAX_REQUEST_BYTES})", None, False
        try:
            data = self.signed.open(JOIN_QUEUE, raw)
        except UnauthenticError as exc:
            return f"bad secret ({exc})", None, False
        try:
            ticket, host, pid = data["ticket"], data["host"], data["pid"]
            gpu, sent = data["gpu"], float(data["time"])
            if not (isinstance(ticket, str) and TICKET.fullmatch(ticket) and isinstance(host, str)):
                raise ValueError("ticket or host")
            if not isinstance(pid, int) or not (gpu is None or (isinstance(gpu, int) and 0 <= gpu < 1 << 20)):
                raise ValueError("pid or gpu")
        except (KeyError, TypeError, ValueError) as exc:
            return f"malformed request ({exc})", None, True
        host = host[:64]
        age = time.time() - sent
        if not -60 < age < MAX_REQUEST_AGE_S:
            return f"replayed or stale request (from {host} pid {pid})", None, True
        return "", JoinRequest(ticket, host, pid, gpu), True

    def _forget_old(self) -> None:
        """Tickets older than any acceptable request can be forgotten: a replay of one is stale."""
        cutoff = time.time() - 2 * MAX_REQUEST_AGE_S
        for t in [t for t, at in self._seen.items() if at < cutoff]:
            del self._seen[t]

    def answer(self, req: JoinRequest, gpu: int, generation: int, members: tuple[int, ...]) -> None:
        self.signed.put(
            f"join/answer/{req.ticket}", {"gpu": gpu, "generation": generation, "members": list(members)}
        )
        self.log(f"accepted join request from {req.host} pid {req.pid} as GPU {gpu}")

    def refuse(self, req: JoinRequest, why: str) -> None:
        self.signed.put(f"join/answer/{req.ticket}", {"refused": why})
        self.log(f"refused join request from {req.host} pid {req.pid}: {why}")


def _ticket_of(raw: bytes) -> str | None:
    """The ticket a request names, if it names a well-formed one (to send a refusal to)."""
    try:
        ticket = json.loads(raw)["value"]["ticket"]
    except (ValueError, KeyError, TypeError):
        return None
    return ticket if isinstance(ticket, str) and TICKET.fullmatch(ticket) else None


def gpu_list(answer: object, field: str) -> tuple[int, ...]:
    values = answer.get(field) if isinstance(answer, dict) else None
    if not isinstance(values, list) or not all(isinstance(g, int) and g >= 0 for g in values):
        raise RuntimeError(f"the leader's {field} is malformed: {str(values)[:60]}")
    return tuple(values)
