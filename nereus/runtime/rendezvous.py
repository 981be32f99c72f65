"""Where a job's store listens: the address, the rendezvous file, this node's name (edge module).

The leader binds the store's socket to the address it is given — its node's address
(``NEREUS_RDZV_HOST``, else the host name's), 127.0.0.1 for local runs — and only there, then
writes that address into the job folder's ``rendezvous.json`` (0600; with the id of the launch
that wrote it, so a requeued job's members do not read the previous leader's).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path


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

    def answers(self, timeout_s: float = 10.0) -> bool:
        """Whether something accepts connections at this store within ``timeout_s`` (a client
        TCPStore would retry for its whole 30-minute timeout when the leader is gone)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=2.0):
                    return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.5)


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


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address`` only (TCPStore alone would listen on every interface)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(512)
    return s
