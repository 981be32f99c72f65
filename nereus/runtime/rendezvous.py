"""Where a job's store listens: the address, the rendezvous file, this node's name (edge module).

The leader binds the store's socket to the address it is given — its node's address
(``NEREUS_RDZV_HOST``, else the host name's; never a loopback address when the job spans several
nodes: ``node_address``), 127.0.0.1 for local runs — and only there, then
writes that address into the job folder's ``rendezvous.json`` (0600; with the id of the launch
that wrote it, so a requeued job's members do not read the previous leader's).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nereus.errors import ConfigError

POLL_MIN_S, POLL_MAX_S = 0.05, 1.0  # the rendezvous file's polls back off between these (s)


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
        a requeued job's previous leader left); a clear error when it never does. The polls back
        off (0.05 s doubling to ``POLL_MAX_S``, jittered): thousands of ranks polling one file on
        a parallel file system every 0.1 s would load its metadata server."""
        deadline = time.monotonic() + timeout_s
        delay = POLL_MIN_S
        while True:
            if path.is_file():
                data = json.loads(path.read_text())
                found = cls(str(data["host"]), int(data["port"]), str(data.get("launch_id", "")))
                if launch_id is None or found.launch_id == launch_id:
                    return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: the job's leader wrote no rendezvous in {timeout_s:.0f} s")
            time.sleep(min(delay * random.uniform(0.5, 1.0), max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, POLL_MAX_S)

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


# The variables that name the interface the other nodes reach this one on, in order of preference.
IFNAME_VARS = ("NEREUS_RDZV_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux <linux/sockios.h>: an interface's IPv4 address


def job_nodes(env: Mapping[str, str] | None = None) -> int:
    """How many nodes the job spans, as SLURM tells it (``SLURM_NNODES``, ``SLURM_JOB_NUM_NODES``); 1
    when nothing says."""
    env = os.environ if env is None else env
    for key in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(key, "").isdigit() and int(env[key]) > 0:
            return int(env[key])
    return 1


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux: the SIOCGIFADDR ioctl), or None: no
    such interface, no IPv4 address on it, or not Linux."""
    try:
        import fcntl
    except ImportError:  # not Unix
        return None
    if not name or len(name.encode()) >= 16:  # IFNAMSIZ
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def named_interface(env: Mapping[str, str]) -> tuple[str, str] | None:
    """The variable and interface name that say which interface the other nodes reach: the first
    of ``IFNAME_VARS`` that is set, its first comma-separated name (NCCL's ``=`` prefix dropped; a
    ``^`` exclusion list names none)."""
    for var in IFNAME_VARS:
        value = env.get(var, "").strip()
        if not value or value.startswith("^"):
            continue
        first = value.split(",")[0].strip().removeprefix("=")
        if first:
            return var, first
    return None


def _prefix_address(prefix: str) -> str | None:
    """NCCL reads an interface name as a prefix (``ib`` is ``ib0``, ``ib1``…): the first interface
    with that prefix and an IPv4 address."""
    try:
        names = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        return None
    for name in names:
        if name.startswith(prefix) and (address := interface_address(name)):
            return address
    return None


def host_address() -> str | None:
    """The address this node's host name resolves to, or None."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def node_address(nodes: int | None = None, env: Mapping[str, str] | None = None) -> str:
    """This node's address for the store: ``NEREUS_RDZV_HOST``, else the host name's address.

    A job of more than one node (``nodes``, else SLURM's node count) never gets a loopback address
    (Ubuntu and DGX images map the host name to 127.0.1.1 in /etc/hosts: the others could not
    connect): the IPv4 address of the interface ``NEREUS_RDZV_IFNAME``, ``GLOO_SOCKET_IFNAME`` or
    ``NCCL_SOCKET_IFNAME`` names, else the host name's when it is not loopback, else a one-line
    ``ConfigError``. A one-node job whose host name is loopback takes that interface's address too
    when one is named (a grown job's newcomers on other nodes can then connect), else loopback."""
    env = os.environ if env is None else env
    explicit = env.get("NEREUS_RDZV_HOST")
    if explicit:
        return explicit
    nodes = job_nodes(env) if nodes is None else nodes
    host = host_address()
    if nodes <= 1 and host is not None and not is_loopback(host):
        return host
    named = named_interface(env)
    found = None
    if named is not None:
        found = interface_address(named[1]) or _prefix_address(named[1])
        if found is not None and not is_loopback(found):
            return found
    if nodes <= 1:
        return host or "127.0.0.1"
    if host is not None and not is_loopback(host):
        return host
    why = (
        f"{named[0]}={named[1]} has {'only a loopback' if found else 'no'} IPv4 address on this node"
        if named is not None
        else f"none of {', '.join(IFNAME_VARS)} names an interface"
    )
    raise ConfigError(
        f"rendezvous: the job spans {nodes} nodes but this node's host name {socket.gethostname()!r} "
        f"resolves to {host or 'nothing'} and {why}: set NEREUS_RDZV_IFNAME to the interface the other "
        "nodes reach (e.g. ib0, hsn0; `ip -br addr`) or NEREUS_RDZV_HOST to its address"
    )


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
