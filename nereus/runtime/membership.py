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
  moment it reads the leader's answer). A member is gone when its own beat is stale or it never
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
from nereus.runtime.rollcall import JOIN_GRACE_S, STALE_S, UNVERIFIED, FormationError, RollCalls
from nereus.runtime.signed import SECRET_MIN_BYTES, BoundedLog, SignedStore, UnauthenticError, sign

HEARTBEAT_S = 1.0
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
        let_go()  # groups frozen with the run's objects, or pinned by a library's stored traceback

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeat(self) -> None:
        if self._beat is not None:
            return
        beats = SignedStore(self.store.clone(), self.signed.secret)  # type: ignore[attr-defined]
        beats.put(f"hb/{self.gpu}", {"t": time.time()})  # the first before this returns

        def beat() -> None:
            last = time.monotonic()
            while not self._stop.is_set():
                if time.monotonic() - last > STALE_S and not self.rendezvous.answers(HEARTBEAT_S):
                    return  # this process was stopped a while and the job ended meanwhile
                try:
                    beats.put(f"hb/{self.gpu}", {"t": time.time()})
                except Exception:  # the leader is gone; the main thread will see it
                    return
                last = time.monotonic()
                self._stop.wait(HEARTBEAT_S)

        self._beat = threading.Thread(target=beat, name=f"nereus-heartbeat-{self.gpu}", daemon=True)
        self._beat.start()

    def gone(self, gpu: int, now: float | None = None) -> bool:
        """Whether ``gpu``'s own heartbeat says it is gone: it never beat, or its last beat is
        stale. An entry that does not verify (a stranger's, which is logged) says nothing: only
        the member's own beat, or its absence, decides, so a stranger's writes cannot push a
        member out of the job."""
        beat = self._last_beat(gpu)
        if beat == UNVERIFIED:
            return False
        return beat is None or (now or time.time()) - beat >= STALE_S

    def _last_beat(self, gpu: int) -> float | None:
        """When ``gpu`` last beat: None when it never did, ``UNVERIFIED`` when the entry does not
        verify (logged)."""
        key = f"hb/{gpu}"
        if not self.store.check([key]):
            return None
        try:
            entry = self.signed.read(key)
            beat = float(entry["t"]) if isinstance(entry, dict) else math.nan
        except (UnauthenticError, KeyError, TypeError, ValueError) as exc:
            self.log(f"ignored the heartbeat of GPU {gpu}: {exc}", "heartbeat")
            return UNVERIFIED
        return beat if math.isfinite(beat) else UNVERIFIED

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
            deadline = time.monotonic() + grace_s
            while True:
                checked = {m: e for m in self.members if (e := self._check_in(g, m)) is not None}
                waiting = [m for m in self.members if m not in checked and not self.gone(m)]
                if not waiting or time.monotonic() > deadline:
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
