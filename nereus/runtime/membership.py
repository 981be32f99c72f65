"""Who is in the job: a long-lived rendezvous store, generations of the world, joins and losses.

The job's leader (the worker on GPU 0, which also hosts the controller) owns one ``TCPStore`` for
the job's lifetime, bound to its node's address on a per-job port. Every *generation* of the
world is a ``init_process_group`` over ``PrefixStore(f"gen{g}", …)`` with the members of that
generation; members are identified by their GPU id, which never changes, while their rank is their
index among the generation's members. Re-forming the world keeps every tensor resident
(architecture §6).

- **Joins** go through a queue on the store: a newcomer appends a request signed with the job's
  secret (HMAC-SHA256 over the request, with a nonce and a timestamp); the leader verifies it at a
  step boundary, refuses and logs a bad one, and answers a good one with its GPU id and the
  generation to join.
- **Losses**: when a collective fails (a peer died), every survivor drops its references to the
  process groups (which closes its gloo connections, so peers blocked on it fail too), checks in
  for the next generation, and the leader decides the survivors: those that checked in, waiting
  only for members whose heartbeat is fresh.
- **Heartbeats**: each member's thread writes the time to ``hb/<gpu>`` every second over its own
  store connection.

Edge module (torch.distributed, sockets, threads).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

HEARTBEAT_S = 1.0
STALE_S = 4.0  # a heartbeat older than this: the member is gone
MAX_REQUEST_AGE_S = 300.0  # a join request older than this is a replay


class JoinRefusedError(PermissionError):
    """The leader refused this process's join request."""


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the job's store listens (written to ``rendezvous.json`` in the job folder)."""

    host: str
    port: int
    launch_id: str = ""  # which launch wrote it (a requeued job's new leader writes a new one)

    def __post_init__(self) -> None:
        if not self.host or not 0 < self.port < 65536:
            raise ValueError(f"rendezvous: bad address {self.host}:{self.port}")

    def write(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"host": self.host, "port": self.port, "launch_id": self.launch_id}, f)
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path, timeout_s: float = 120.0, launch_id: str | None = None) -> Rendezvous:
        """Wait for the leader to write ``path`` (of launch ``launch_id`` when given: not the one
        a requeued job's previous leader left); a clear error when it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            if path.is_file():
                data = json.loads(path.read_text())
                found = cls(str(data["host"]), int(data["port"]), str(data.get("launch_id", "")))
                if launch_id is None or found.launch_id == launch_id:
                    return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: the job's leader wrote no rendezvous in {timeout_s:.0f} s")
            time.sleep(0.1)


@dataclass(frozen=True, slots=True)
class JoinRequest:
    index: int
    host: str
    pid: int
    gpu: int | None  # the GPU id asked for (a local worker coming back), or None: the next free one


def sign(secret: bytes, body: dict[str, Any]) -> str:
    msg = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def node_address() -> str:
    """This node's address for the store: ``NEREUS_RDZV_HOST``, else the host name's address."""
    explicit = os.environ.get("NEREUS_RDZV_HOST")
    if explicit:
        return explicit
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def node_name() -> str:
    """This process's node: SLURM's name for it (several slurmd may share a host), else the host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class Membership:
    """This process's view of the job's members; one per worker process."""

    def __init__(
        self, store: TCPStore, secret: bytes, gpu: int, leader: bool, log: Path | None = None,
        timeout: timedelta = timedelta(minutes=30), node: str | None = None,
    ) -> None:  # fmt: skip
        self.store = store
        self.node = node or node_name()
        self.secret = secret
        self.gpu = gpu
        self.leader = leader
        self.log_path = log
        self.timeout = timeout
        self.members: tuple[int, ...] = ()
        self.generation = -1
        self._next_request = 1
        self._seen_nonces: set[str] = set()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # ------------------------------------------------------------------ the store
    @classmethod
    def host(
        cls, secret: bytes, gpu: int = 0, address: str = "127.0.0.1", port: int = 0, log: Path | None = None,
        node: str | None = None,
    ) -> Membership:  # fmt: skip
        """The leader: start the job's store on ``address`` (port 0: a free one)."""
        store = TCPStore(address, port, None, True, timeout=timedelta(minutes=30), wait_for_workers=False)
        return cls(store, secret, gpu, True, log, node=node)

    @classmethod
    def connect(cls, rdzv: Rendezvous, secret: bytes, gpu: int, node: str | None = None) -> Membership:
        store = TCPStore(rdzv.host, rdzv.port, None, False, timeout=timedelta(minutes=30))
        return cls(store, secret, gpu, False, node=node)

    @property
    def rendezvous(self) -> Rendezvous:
        return Rendezvous(self.store.host, self.store.port)

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
        self.members, self.generation = tuple(sorted(members)), generation
        dist.init_process_group(
            "gloo",
            store=PrefixStore(f"gen{generation}", self.store),
            rank=self.rank,
            world_size=len(self.members),
            timeout=self.timeout,
        )
        self.store.set(f"host/{self.gpu}", self.node)
        self.start_heartbeat()

    def hosts(self) -> dict[int, str]:
        """The node each member runs on."""
        return {g: self.store.get(f"host/{g}").decode() for g in self.members}

    def abandon(self) -> None:
        """Leave the current generation: destroy the world and collect every group object, so
        this process's gloo connections close and peers blocked on it fail at once."""
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken world still has to go
                dist.destroy_process_group()
        gc.collect()

    # ------------------------------------------------------------------ heartbeats
    def start_heartbeat(self) -> None:
        if self._beat is not None:
            return
        client = self.store.clone()  # type: ignore[attr-defined]  # its own connection

        def beat() -> None:
            while not self._stop.is_set():
                try:
                    client.set(f"hb/{self.gpu}", repr(time.time()))
                except Exception:  # the leader is gone; the main thread will see it
                    return
                self._stop.wait(HEARTBEAT_S)

        self._beat = threading.Thread(target=beat, name=f"nereus-heartbeat-{self.gpu}", daemon=True)
        self._beat.start()

    def alive(self, gpu: int, now: float | None = None) -> bool:
        key = f"hb/{gpu}"
        if not self.store.check([key]):
            return False
        return (now or time.time()) - float(self.store.get(key)) < STALE_S

    def close(self) -> None:
        self._stop.set()
        self.abandon()

    # ------------------------------------------------------------------ losses
    def recover(self, grace_s: float = 60.0) -> tuple[int, ...]:
        """After a failed collective in the current generation: check in, and return the
        survivors (the leader decides; the others wait for its answer). Does not form the next
        generation: the caller does, with the survivors, at ``generation + 1``."""
        g = self.generation
        self.abandon()
        self.store.set(f"recover/{g}/alive/{self.gpu}", "1")
        key = f"recover/{g}/members"
        if self.leader:
            deadline = time.monotonic() + grace_s
            while True:
                checked = [m for m in self.members if self.store.check([f"recover/{g}/alive/{m}"])]
                waiting = [m for m in self.members if m not in checked and self.alive(m)]
                if not waiting or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            survivors = tuple(checked)
            self.store.set(key, json.dumps(survivors))
            lost = sorted(set(self.members) - set(survivors))
            self.log(f"generation {g}: lost GPUs {lost}; survivors {list(survivors)}")
            return survivors
        self.store.wait([key], timedelta(seconds=grace_s + 30))
        survivors = tuple(json.loads(self.store.get(key)))
        if self.gpu not in survivors:
            raise RuntimeError(f"GPU {self.gpu} checked in too late for generation {g + 1}")
        return survivors

    # ------------------------------------------------------------------ joins
    def request_join(
        self, gpu: int | None = None, timeout_s: float = 3600.0
    ) -> tuple[int, int, tuple[int, ...]]:
        """A newcomer: ask to join; returns (GPU id, generation, its members) once the leader
        accepts (at a step boundary)."""
        index = self.store.add("join/count", 1)
        body = {
            "nonce": secrets.token_hex(16), "time": time.time(), "host": socket.gethostname(),
            "pid": os.getpid(), "gpu": gpu,
        }  # fmt: skip
        self.store.set(f"join/req/{index}", json.dumps({**body, "mac": sign(self.secret, body)}))
        key = f"join/answer/{index}"
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
            answer = json.loads(self.store.get(key))
        except dist.DistError as exc:  # the leader's store went away: the job ended or failed
            raise JoinRefusedError(f"the job's rendezvous closed before answering ({exc})") from None
        if "refused" in answer:
            raise JoinRefusedError(f"join refused by the job's leader: {answer['refused']}")
        self.gpu = int(answer["gpu"])
        return self.gpu, int(answer["generation"]), tuple(int(g) for g in answer["members"])

    def pending_joins(self) -> list[JoinRequest]:
        """The leader: requests that arrived since the last call, verified; bad ones are refused
        and logged."""
        count = self.store.add("join/count", 0)
        out: list[JoinRequest] = []
        while self._next_request <= count:
            i = self._next_request
            key = f"join/req/{i}"
            if not self.store.check([key]):
                break  # its writer is between add() and set(); next boundary
            self._next_request += 1
            why, req = self._verify(i, self.store.get(key))
            if req is None:
                self.store.set(f"join/answer/{i}", json.dumps({"refused": why}))
                self.log(f"refused join request {i}: {why}")
            else:
                out.append(req)
        return out

    def _verify(self, index: int, raw: bytes) -> tuple[str, JoinRequest | None]:
        try:
            data = json.loads(raw)
            mac = str(data.pop("mac"))
            host, pid, nonce = str(data["host"]), int(data["pid"]), str(data["nonce"])
            gpu = None if data["gpu"] is None else int(data["gpu"])
            age = time.time() - float(data["time"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return "malformed request", None
        if not hmac.compare_digest(mac, sign(self.secret, data)):
            return f"bad secret (from {host} pid {pid})", None
        if nonce in self._seen_nonces or not -60 < age < MAX_REQUEST_AGE_S:
            return f"replayed or stale request (from {host} pid {pid})", None
        self._seen_nonces.add(nonce)
        return "", JoinRequest(index, host, pid, gpu)

    def answer(self, req: JoinRequest, gpu: int, generation: int, members: tuple[int, ...]) -> None:
        body = {"gpu": gpu, "generation": generation, "members": list(members)}
        self.store.set(f"join/answer/{req.index}", json.dumps(body))
        self.log(f"accepted join request {req.index} from {req.host} pid {req.pid} as GPU {gpu}")

    def refuse(self, req: JoinRequest, why: str) -> None:
        self.store.set(f"join/answer/{req.index}", json.dumps({"refused": why}))
        self.log(f"refused join request {req.index} from {req.host} pid {req.pid}: {why}")

    # ------------------------------------------------------------------ the membership log
    def log(self, line: str) -> None:
        if self.log_path is None:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        with open(self.log_path, "a") as f:
            f.write(f"{stamp} {line}\n")
