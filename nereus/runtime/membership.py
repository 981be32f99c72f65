"""Who is in the job: a long-lived rendezvous store, generations of the world, joins and losses.

The job's leader (the worker on GPU 0, which also hosts the controller) owns one ``TCPStore`` for
the job's lifetime, listening only on the address it is given (its node's address; 127.0.0.1 for
local runs) on a per-job port. Every *generation* of the world is an ``init_process_group`` over
``PrefixStore(f"gen{g}", …)`` with the members of that generation; members are identified by their
GPU id, which never changes, while their rank is their index among the generation's members.
Re-forming the world keeps every tensor resident (architecture §6).

Everything Nereus itself reads from the store is authenticated (``signed.py``: HMAC-SHA256 with
the job's secret over the key and the value, so a value is bound to its key, and keys name their
slot and generation): join requests, the leader's answers, node names, heartbeats, recovery
check-ins and the survivors' list. An entry that does not verify or does not parse is logged
(rate-limited, bounded log) and ignored, never fatal.

- **Joins** go through a queue on the store: a newcomer pushes a signed request carrying a fresh
  ticket and waits for the leader's signed answer under ``join/answer/<ticket>``; the leader
  verifies requests at a step boundary (the MAC, the ticket never seen, a fresh timestamp),
  refuses and logs a bad one, and answers a good one with its GPU id and the generation to join
  (``joins.py``).
- **Losses**: when a collective fails (a peer died), every survivor drops its references to the
  process groups (which closes its gloo connections, so peers blocked on it fail too), checks in
  for the next generation, and the leader decides the survivors: those that checked in, waiting
  only for members whose heartbeat does not say they are gone.
- **Heartbeats**: each member's thread writes the time to ``hb/<gpu>`` every second over its own
  store connection, from the moment it starts forming its first generation (a newcomer: from the
  moment it reads the leader's answer). A member is gone when its own beat has not changed for
  a while on the leader's clock (``rollcall.py``'s rule: 4 s, or the hold the member announced
  before a full garbage collection, during which its heartbeat thread cannot run) or it never
  beat; an entry that does not verify says nothing, so a stranger's writes cannot push a member
  out (they can still stall a formation or a recovery: the store's availability is not
  protected).
- **Forming a generation** after the first starts with a roll call (``rollcall.py``): a member
  lost before it connects fails the formation on every member within seconds, and they recover
  from it as from a failed collective, instead of waiting in gloo's rendezvous for the
  formation's 30 minutes. A member that dies after the roll call and before gloo connects still
  holds the others there.

What the secret does not protect: torch.distributed's own rendezvous keys (gloo's addresses under
``gen<g>/``), which c10d reads directly (torch 2.13 cannot build gloo subgroups over a Python store
that could check them), and the store's availability. See docs/launcher.md, "Security".
Edge module (torch.distributed, sockets, threads).
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from nereus.backends.registry import release_engine_groups
from nereus.devices import CPU, Devices, abort_world, init_world
from nereus.runtime.comm import first_line
from nereus.runtime.joins import JOIN_QUEUE, JoinRefusedError, JoinRequest, Joins, gpu_list
from nereus.runtime.pins import let_go
from nereus.runtime.rendezvous import Rendezvous, listening_socket, node_address, node_name
from nereus.runtime.rollcall import (
    HOLD_S,
    JOIN_GRACE_S,
    MAX_HOLD_S,
    STALE_S,
    UNVERIFIED,
    Beat,
    FormationError,
    RollCalls,
)
from nereus.runtime.signed import SECRET_MIN_BYTES, BoundedLog, SignedStore, UnauthenticError, sign

HEARTBEAT_S = 1.0
HOLD_WRITE_S = 1.0  # how long ``holding`` waits for its beat to be written
STORE_GONE_S = 3.0  # a member recovering: the job's store not answering this long is gone (a
# client write would only fail after torch has printed its stack)

__all__ = [
    "JOIN_QUEUE",
    "FormationError",
    "JoinRefusedError",
    "JoinRequest",
    "Membership",
    "Rendezvous",
    "node_address",
    "node_name",
    "sign",
]


class LeftBehindError(RuntimeError):
    """This GPU is not in the next generation: it checked in too late (blocked past the grace in
    a collective with a dead peer, say), or the job's store went away while it recovered (the
    others went on and the job ended). It leaves the job; the job's outcome is the leader's."""


class Membership(RollCalls, Joins):
    """This process's view of the job's members; one per worker process."""

    def __init__(
        self, store: TCPStore, secret: bytes, gpu: int, leader: bool, log: Path | None = None,
        timeout: timedelta = timedelta(minutes=30), node: str | None = None,
        listener: socket.socket | None = None, devices: Devices | None = None,
    ) -> None:  # fmt: skip
        if len(secret) < SECRET_MIN_BYTES:
            raise ValueError(f"the job's secret must be at least {SECRET_MIN_BYTES} bytes, got {len(secret)}")
        self.store = store
        self.signed = SignedStore(store, secret)
        self.node = node or node_name()
        self.gpu = gpu
        self.leader = leader
        self.journal = BoundedLog(log)
        self.timeout = timeout  # forming a generation, and each collective outside a step
        self.join_grace_s = JOIN_GRACE_S  # a newcomer that never beat in a roll call: gone after this
        self.members: tuple[int, ...] = ()
        self.generation = -1
        self._listener = listener  # kept open: the store serves on its descriptor
        self.devices = devices or Devices(CPU)  # what the world's backends are chosen for
        self._seen: dict[str, float] = {}  # tickets answered, with when (replays are refused)
        self._noted: dict[str, float] = {}  # a newcomer: when it first saw "unverified" for its ticket
        self.oom: dict[int, str] = {}  # after ``recover``: GPU → the model-stage that ran out of memory
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._hold_until = 0.0  # monotonic: until then, beats say this member may fall silent
        self._beats = threading.Condition()  # the heartbeat thread's wake-up, and holds it wrote
        self._asked = 0  # changes of the hold asked of the heartbeat thread
        self._written = 0  # the last of them a beat it wrote carries

    # ------------------------------------------------------------------ the store
    @classmethod
    def host(
        cls, secret: bytes, gpu: int = 0, address: str = "127.0.0.1", port: int = 0, log: Path | None = None,
        node: str | None = None, devices: Devices | None = None,
    ) -> Membership:  # fmt: skip
        """The leader: start the job's store on ``address`` only (port 0: a free one)."""
        if len(secret) < SECRET_MIN_BYTES:
            raise ValueError(f"the job's secret must be at least {SECRET_MIN_BYTES} bytes, got {len(secret)}")
        listener = listening_socket(address, port)
        store = TCPStore(
            address, listener.getsockname()[1], None, True, timeout=timedelta(minutes=30),
            wait_for_workers=False, master_listen_fd=listener.fileno(),
        )  # fmt: skip
        return cls(store, secret, gpu, True, log, node=node, listener=listener, devices=devices)

    @classmethod
    def connect(
        cls,
        rdzv: Rendezvous,
        secret: bytes,
        gpu: int,
        node: str | None = None,
        devices: Devices | None = None,
    ) -> Membership:
        store = TCPStore(rdzv.host, rdzv.port, None, False, timeout=timedelta(minutes=30))
        return cls(store, secret, gpu, False, node=node, devices=devices)

    @property
    def rendezvous(self) -> Rendezvous:
        return Rendezvous(self.store.host, self.store.port)

    def log(self, line: str, kind: str = "") -> None:
        """A line in ``membership.log`` (``kind``: rate-limited per kind, for what strangers can cause)."""
        self.journal.write(line, kind)

    # ------------------------------------------------------------------ generations
    @property
    def rank(self) -> int:
        return self.members.index(self.gpu)

    def rank_of(self, gpu: int) -> int:
        return self.members.index(gpu)

    def form(self, members: tuple[int, ...], generation: int) -> None:
        """Join generation ``generation`` of the world with ``members`` (collective over them)."""
        if self.gpu not in members:
            raise RuntimeError(f"GPU {self.gpu} is not a member of generation {generation}: {members}")
        self.abandon()
        previous = frozenset(self.members)
        self.members, self.generation = tuple(sorted(members)), generation
        self.start_heartbeat()  # a newcomer beats from its roll call on
        if generation > 0:  # generation 0: everyone starts at once; the launchers watch that
            self.roll_call(previous)
        init_world(
            self.devices,
            PrefixStore(f"gen{generation}", self.store),
            self.rank,
            len(self.members),
            self.timeout,
        )
        self.signed.put(f"host/{self.gpu}", {"node": self.node})

    def hosts(self) -> dict[int, str]:
        """The node each member runs on (a member whose entry does not verify counts as a node of
        its own, and the entry is logged)."""
        out = {}
        for g in self.members:
            try:
                entry = self.signed.read(f"host/{g}")
                out[g] = (
                    str(entry["node"])
                    if isinstance(entry, dict) and isinstance(entry.get("node"), str)
                    else ""
                )
            except (UnauthenticError, KeyError) as exc:
                self.log(f"ignored the node name of GPU {g}: {exc}", "host")
                out[g] = ""
            out[g] = out[g] or f"gpu{g}"
        return out

    def abandon(self) -> None:
        """Leave the current generation: destroy the world and collect every group object, so
        this process's gloo connections close and peers blocked on it fail at once."""
        abort_world()
        release_engine_groups()  # vLLM's own, and its engine holding ours
        with self.holding(HOLD_S):  # a full collection holds the interpreter, the heartbeat's too
            let_go()  # groups frozen with the run's objects, or pinned by a library's stored traceback

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeat(self) -> None:
        if self._beat is not None:
            return
        beats = SignedStore(self.store.clone(), self.signed.secret)  # type: ignore[attr-defined]
        beats.put(f"hb/{self.gpu}", self._beat_entry())  # the first before this returns

        def beat() -> None:
            last = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() - last > STALE_S and not self.rendezvous.answers(HEARTBEAT_S):
                    return  # this process was stopped a while and the job ended meanwhile
                with self._beats:
                    if self._stop.is_set():  # closing: no beat after the last (nor a hold in it)
                        return
                    asked, entry = self._asked, self._beat_entry()
                try:
                    beats.put(f"hb/{self.gpu}", entry)
                except Exception:  # the leader is gone; the main thread will see it
                    return
                last = time.monotonic()
                with self._beats:
                    self._written = asked
                    self._beats.notify_all()
                    if self._asked == asked and not self._stop.is_set():  # nothing new asked meanwhile
                        self._beats.wait(HEARTBEAT_S)

        self._beat = threading.Thread(target=beat, name=f"nereus-heartbeat-{self.gpu}", daemon=True)
        self._beat.start()

    def _beat_entry(self) -> dict[str, float]:
        """A heartbeat: this process's clock, and the seconds it may yet fall silent (``holding``)."""
        return {"t": time.time(), "hold": round(max(0.0, self._hold_until - time.monotonic()), 3)}

    @contextmanager
    def holding(self, seconds: float) -> Iterator[None]:
        """Around work that holds the interpreter (a full garbage collection of a heap with vLLM
        and torch in it: a second or two alone, many more on a loaded node), during which the
        heartbeat thread cannot run: the heartbeat thread first writes a beat saying this member
        may be silent for up to ``seconds`` (the roll calls' rule), so a live member is not taken
        for a lost one, and one that dies meanwhile is found ``seconds`` later; its next beat
        after the work says no more. Only that thread touches the store (a store gone silent
        holds it, not the caller), and the caller waits at most ``HOLD_WRITE_S`` for each of the
        two writes: a member that freezes or dies right after the work is then judged by the
        usual 4 s again. Nothing is held once the member is closing (its heartbeat stops)."""
        if self._stop.is_set():
            yield
            return
        self._ask_beat(min(seconds, MAX_HOLD_S))
        try:
            yield
        finally:
            self._ask_beat(0.0)

    def _ask_beat(self, hold_s: float) -> None:
        """Set the hold (seconds from now; 0: none), wake the heartbeat thread and wait up to
        ``HOLD_WRITE_S`` for a beat that carries it."""
        with self._beats:
            self._hold_until = time.monotonic() + hold_s if hold_s > 0 else 0.0
            self._asked += 1
            asked = self._asked
            self._beats.notify_all()
            if self._beating() and not self._stop.is_set():
                self._beats.wait_for(lambda: self._written >= asked or not self._beating(), HOLD_WRITE_S)

    def _beating(self) -> bool:
        return self._beat is not None and self._beat.is_alive()

    def _last_beat(self, gpu: int) -> Beat | None:
        """``gpu``'s last heartbeat: None when it never beat, ``UNVERIFIED`` when the entry does
        not verify (logged)."""
        key = f"hb/{gpu}"
        if not self.store.check([key]):
            return None
        try:
            entry = self.signed.read(key)
            if not isinstance(entry, dict):
                raise TypeError(f"expected a mapping, got {type(entry).__name__}")
            beat = Beat(float(entry["t"]), float(entry.get("hold", 0.0)))
        except (UnauthenticError, KeyError, TypeError, ValueError, OverflowError) as exc:
            self.log(f"ignored the heartbeat of GPU {gpu}: {exc}", "heartbeat")
            return UNVERIFIED
        ok = math.isfinite(beat.t) and math.isfinite(beat.hold) and 0 <= beat.hold <= MAX_HOLD_S
        return beat if ok else UNVERIFIED

    def close(self) -> None:
        self._stop.set()
        self.abandon()

    # ------------------------------------------------------------------ losses
    def recover(self, grace_s: float = 60.0, oom: str = "") -> tuple[int, ...]:
        """After a failed step in the current generation (a peer died, or a model-stage ran out
        of memory here: ``oom`` names it): check in, and return the survivors (the leader
        decides; the others wait for its answer). ``self.oom`` then says which model-stage ran
        out of memory on which GPU. Does not form the next generation: the caller does, with the
        survivors, at ``generation + 1``."""
        g = self.generation
        start = time.monotonic()
        beats: dict[int, tuple[Beat, float]] = {}  # what the roll calls' rule has seen of each beat
        if self.leader:  # seen before its own collection: a dead member's 4 s run from here
            for m in self.members:
                self._silent(m, True, beats, start, start)
        self.abandon()
        if not self.leader and not self.rendezvous.answers(STORE_GONE_S):  # the job ended meanwhile
            raise LeftBehindError(
                f"GPU {self.gpu} found the job's store gone recovering generation {g}: the job ended, or "
                "its leader failed"
            )
        try:
            self.signed.put(f"recover/{g}/alive/{self.gpu}", {"gpu": self.gpu, "oom": oom})
        except dist.DistError as exc:
            if self.leader:  # its own store: a failure here is the job's
                raise
            raise LeftBehindError(
                f"GPU {self.gpu} lost the job's store recovering generation {g} ({first_line(exc)}): "
                "the job ended, or its leader failed"
            ) from None
        key = f"recover/{g}/members"
        if self.leader:
            while True:
                now = time.monotonic()
                checked = {m: e for m in self.members if (e := self._check_in(g, m)) is not None}
                waiting = [
                    m
                    for m in self.members
                    if m not in checked and not self._silent(m, True, beats, start, now)
                ]
                if not waiting or now > start + grace_s:
                    break
                time.sleep(0.05)
            survivors = tuple(sorted(checked))
            self.oom = {m: stage for m, stage in checked.items() if stage}
            self.signed.put(key, {"members": list(survivors), "oom": [[m, s] for m, s in self.oom.items()]})
            lost = sorted(set(self.members) - set(survivors))
            self.log(
                f"generation {g}: lost GPUs {lost}; survivors {list(survivors)}; out of memory {self.oom}"
            )
            return survivors
        try:
            answer = self.signed.wait_valid(
                key, grace_s + 30, lambda why: self.log(f"ignored {key}: {why}", "recover")
            )
        except dist.DistError as exc:
            raise LeftBehindError(
                f"GPU {self.gpu} lost the job's store recovering generation {g} ({first_line(exc)}): "
                "the job ended, or its leader failed"
            ) from None
        survivors = gpu_list(answer, "members")
        if self.gpu not in survivors:
            raise LeftBehindError(
                f"GPU {self.gpu} checked in too late for generation {g + 1}: the job went on without it"
            )
        pairs = answer.get("oom", []) if isinstance(answer, dict) else []
        self.oom = {int(m): str(s) for m, s in pairs if isinstance(m, int) and isinstance(s, str)}
        return survivors

    def _check_in(self, generation: int, gpu: int) -> str | None:
        """A verified check-in of ``gpu``: the model-stage that ran out of memory there ("" for
        none), or None when it has not checked in."""
        key = f"recover/{generation}/alive/{gpu}"
        if not self.store.check([key]):
            return None
        try:
            entry = self.signed.read(key)
        except UnauthenticError as exc:
            self.log(f"ignored a check-in for GPU {gpu}: {exc}", "recover")
            return None
        if not isinstance(entry, dict) or entry.get("gpu") != gpu:
            return None
        stage = entry.get("oom", "")
        return stage if isinstance(stage, str) else ""
