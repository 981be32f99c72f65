"""What GPUs a node has: the pure value types (``GpuInfo``, ``Link``, ``NodeInventory``) and
``read_node`` (NVML, then amdsmi, then "none"). Whether a GPU is healthy is ``health``'s rule;
how the inventory compares with the cluster spec is ``compare``'s.

Nothing here imports torch or a GPU library at import time: ``read_node`` imports the readers
(``nereus.telemetry.nvml``, ``nereus.telemetry.amd``) when called, and they import their library
(``pynvml`` from ``nvidia-ml-py``, ``amdsmi``) lazily, so a CPU machine without either still reads
an inventory: source "none", no GPUs, and in ``tried`` why each library was not used.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from nereus.spec.cluster import GIB, MAX_GPUS_PER_NODE
from nereus.telemetry.fields import (
    MAX_TEXT,
    check_count,
    check_lines,
    check_text,
    mapping,
    opt_int,
    opt_str,
    strings,
)
from nereus.telemetry.health import GpuHealth, unhealthy

if TYPE_CHECKING:
    from nereus.telemetry.nvml import XidWatch

GpuVendor = Literal["nvidia", "amd"]
Source = Literal["nvml", "amdsmi", "none"]
# nvlink / xgmi: a direct GPU link (NVLink or NVSwitch; AMD Infinity Fabric). pcie: through PCIe
# switches or one host bridge. numa: through the CPU within one NUMA node. smp: across sockets.
LinkKind = Literal["nvlink", "xgmi", "pcie", "numa", "smp"]
LINK_KINDS: tuple[str, ...] = get_args(LinkKind)
VENDOR_OF_SOURCE: dict[str, str] = {"nvml": "nvidia", "amdsmi": "amd"}


# ------------------------------------------------------------------ value types
@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInfo:
    """One GPU as its management library sees it. ``index`` is the library's (NVML's index, in
    PCI bus order; amdsmi's processor order), not CUDA's: match a worker's device by
    ``pci_bus_id`` (``NodeInventory.for_device``). None: not known."""

    index: int
    vendor: GpuVendor
    model: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    health: GpuHealth = field(default_factory=GpuHealth)
    pci_bus_id: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise ValueError(f"GpuInfo.index must be an integer, got {self.index!r}")
        if not 0 <= self.index < MAX_GPUS_PER_NODE:
            raise ValueError(f"GpuInfo.index must be in [0, {MAX_GPUS_PER_NODE}), got {self.index}")
        if self.vendor not in get_args(GpuVendor):
            raise ValueError(f"GpuInfo.vendor must be one of {get_args(GpuVendor)}, got {self.vendor!r}")
        check_text(self, "model", self.model, optional=True)
        check_text(self, "pci_bus_id", self.pci_bus_id, optional=True)
        check_count(self, "memory_total_bytes", self.memory_total_bytes)
        check_count(self, "memory_used_bytes", self.memory_used_bytes)
        total, used = self.memory_total_bytes, self.memory_used_bytes
        if total is not None and used is not None and used > total:
            raise ValueError(f"GpuInfo.memory_used_bytes {used} exceeds memory_total_bytes {total}")
        if not isinstance(self.health, GpuHealth):
            raise ValueError("GpuInfo.health must be a GpuHealth")

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "vendor": self.vendor,
            "model": self.model,
            "pci_bus_id": self.pci_bus_id,
            "memory_total_bytes": self.memory_total_bytes,
            "memory_used_bytes": self.memory_used_bytes,
            "health": self.health.to_json(),
        }

    @classmethod
    def from_json(cls, doc: object) -> GpuInfo:
        d = mapping(doc, "gpu")
        index = d.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"gpu: 'index' must be an integer, got {index!r}")
        return cls(
            index=index,
            vendor=cast(GpuVendor, opt_str(d, "vendor")),
            model=opt_str(d, "model"),
            memory_total_bytes=opt_int(d, "memory_total_bytes"),
            memory_used_bytes=opt_int(d, "memory_used_bytes"),
            health=GpuHealth.from_json(d.get("health", {})),
            pci_bus_id=opt_str(d, "pci_bus_id"),
        )


@dataclass(frozen=True, slots=True)
class Link:
    """How GPUs ``a < b`` (library indices) of one node reach each other: the best path."""

    a: int
    b: int
    kind: LinkKind

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_GPUS_PER_NODE:
                raise ValueError(f"Link.{name} must be a GPU index, got {v!r}")
        if not self.a < self.b:
            raise ValueError(f"Link needs a < b, got {self.a}, {self.b}")
        if self.kind not in LINK_KINDS:
            raise ValueError(f"Link.kind must be one of {LINK_KINDS}, got {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "kind": self.kind}


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInventory:
    """One node's GPUs, the links between them, and where the facts came from. ``tried``: each
    library tried and not used, with why ("pynvml: not installed ..."); ``errors``: the calls that
    failed (each cost only its own field)."""

    node: str
    source: Source
    gpus: tuple[GpuInfo, ...] = ()
    links: tuple[Link, ...] = ()
    tried: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_text(self, "node", self.node)
        if self.source not in get_args(Source):
            raise ValueError(f"NodeInventory.source must be one of {get_args(Source)}, got {self.source!r}")
        check_lines(self, "tried", self.tried)
        check_lines(self, "errors", self.errors)
        if not isinstance(self.gpus, tuple) or not all(isinstance(g, GpuInfo) for g in self.gpus):
            raise ValueError("NodeInventory.gpus must be a tuple of GpuInfo")
        if not isinstance(self.links, tuple) or not all(isinstance(k, Link) for k in self.links):
            raise ValueError("NodeInventory.links must be a tuple of Link")
        if self.source == "none" and (self.gpus or self.links):
            raise ValueError("NodeInventory with source 'none' has no GPUs and no links")
        indices = [g.index for g in self.gpus]
        if len(set(indices)) != len(indices):
            raise ValueError(f"NodeInventory.gpus repeats an index: {indices}")
        vendor = VENDOR_OF_SOURCE.get(self.source)
        for g in self.gpus:
            if g.vendor != vendor:
                raise ValueError(f"NodeInventory from {self.source} holds a GPU of vendor {g.vendor}")
        pairs = [(k.a, k.b) for k in self.links]
        if len(set(pairs)) != len(pairs):
            raise ValueError("NodeInventory.links names a pair of GPUs twice")
        known = set(indices)
        for a, b in pairs:
            if a not in known or b not in known:
                raise ValueError(f"NodeInventory link {a}-{b} names a GPU the inventory does not hold")

    # ------------------------------------------------------------------ derived facts
    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def model(self) -> str | None:
        """The GPUs' model, if every GPU reports the same one."""
        models = {g.model for g in self.gpus}
        return models.pop() if len(models) == 1 else None

    @property
    def memory_per_gpu_bytes(self) -> int | None:
        """The smallest memory total any GPU reports (a plan must fit the smallest)."""
        known = [g.memory_total_bytes for g in self.gpus if g.memory_total_bytes is not None]
        return min(known) if known else None

    def gpu(self, index: int) -> GpuInfo:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(f"no GPU {index} on {self.node}")

    def link(self, a: int, b: int) -> LinkKind | None:
        lo, hi = min(a, b), max(a, b)
        for k in self.links:
            if (k.a, k.b) == (lo, hi):
                return k.kind
        return None

    def islands(self, kind: LinkKind = "nvlink") -> tuple[tuple[int, ...], ...]:
        """The groups of GPUs joined by ``kind`` links (connected components), each sorted, in
        order of their first GPU; a GPU with no such link is an island of its own."""
        parent = {g.index: g.index for g in self.gpus}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for k in self.links:
            if k.kind == kind:
                parent[root(k.b)] = root(k.a)
        groups: dict[int, list[int]] = {}
        for i in sorted(parent):
            groups.setdefault(root(i), []).append(i)
        return tuple(sorted((tuple(v) for v in groups.values()), key=lambda t: t[0]))

    def for_device(self, device: int | str) -> NodeInventory:
        """The inventory of one GPU: by library index (int) or PCI bus id (str, as torch's
        ``get_device_properties(i).pci_bus_id`` or NVML write it). What a worker reports."""
        if isinstance(device, str):
            want = bus_key(device)
            keep = [g for g in self.gpus if g.pci_bus_id is not None and bus_key(g.pci_bus_id) == want]
        else:
            keep = [g for g in self.gpus if g.index == device]
        if not keep:
            raise KeyError(f"no GPU {device!r} on {self.node}")
        return replace(self, gpus=tuple(keep), links=())

    def summary(self) -> str:
        """One line: what the node has, or why nothing was found."""
        if not self.gpus:
            why = "; ".join(self.tried) or "nothing tried"
            return f"{self.node}: no GPUs found (tried {why})"
        bad = unhealthy(self)
        mem = self.memory_per_gpu_bytes
        size = f", {mem / GIB:.1f} GiB each" if mem is not None else ""
        health = f", unhealthy: {list(bad)}" if bad else ", all healthy"
        what = self.model or "mixed GPUs"
        return f"{self.node}: {self.gpu_count} × {what}{size} (via {self.source}){health}"

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "source": self.source,
            "gpu_count": self.gpu_count,
            "gpus": [g.to_json() for g in self.gpus],
            "links": [k.to_json() for k in self.links],
            "unhealthy": list(unhealthy(self)),
            "tried": list(self.tried),
            "errors": list(self.errors),
        }

    @classmethod
    def from_json(cls, doc: object) -> NodeInventory:
        """An inventory from ``to_json``'s output (a worker's report); ValueError if malformed.
        Health verdicts are recomputed, never taken from the document."""
        d = mapping(doc, "inventory")
        gpus, links = d.get("gpus", []), d.get("links", [])
        if not isinstance(gpus, list) or len(gpus) > MAX_GPUS_PER_NODE:
            raise ValueError("inventory: 'gpus' must be a list of GPUs")
        if not isinstance(links, list) or len(links) > MAX_GPUS_PER_NODE**2:
            raise ValueError("inventory: 'links' must be a list of links")
        parsed_links = []
        for k in links:
            kd = mapping(k, "link")
            a, b = kd.get("a"), kd.get("b")
            if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int):
                raise ValueError(f"link: 'a' and 'b' must be integers, got {a!r}, {b!r}")
            parsed_links.append(Link(a, b, cast(LinkKind, kd.get("kind"))))
        return cls(
            node=cast(str, d.get("node")),
            source=cast(Source, d.get("source")),
            gpus=tuple(GpuInfo.from_json(g) for g in gpus),
            links=tuple(parsed_links),
            tried=strings(d, "tried"),
            errors=strings(d, "errors"),
        )


def bus_key(bus_id: str) -> tuple[int, str]:
    """``00000000:18:00.0`` (NVML) and ``0000:18:00.0`` (torch, amdsmi) name the same device."""
    domain, sep, rest = bus_id.strip().lower().rpartition(":")
    head, _, bus = domain.rpartition(":") if sep else ("", "", "")
    try:
        return int(head or "0", 16), f"{bus}:{rest}"
    except ValueError:
        return -1, bus_id.strip().lower()


# ------------------------------------------------------------------ reading
def read_node(
    node: str | None = None, *, topology: bool = True, xids: XidWatch | None = None
) -> NodeInventory:
    """This node's inventory: NVML first, then amdsmi, else source "none" with why each library
    was not used. ``topology``: also read the links between GPUs (N² calls); ``xids``: an open
    ``nvml.XidWatch`` whose XIDs (seen since it opened) count in the health. Never raises for
    a missing library, driver or GPU."""
    from nereus.telemetry import amd, nvml

    host = _host(node)
    tried: list[str] = []
    got = nvml.read(host, topology=topology, xids=xids)
    if isinstance(got, NodeInventory):
        return got
    tried.append(f"pynvml: {got}")
    got = amd.read(host, topology=topology)
    if isinstance(got, NodeInventory):
        return replace(got, tried=tuple(tried))
    tried.append(f"amdsmi: {got}")
    return NodeInventory(node=host, source="none", tried=tuple(tried))


def _host(node: str | None) -> str:
    name = node if node is not None else socket.gethostname()
    name = "".join(c for c in name if c.isprintable())[:MAX_TEXT]
    return name or "localhost"
