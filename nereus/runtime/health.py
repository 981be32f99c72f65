"""Each worker's GPU health, checked at step boundaries: what turns a failing GPU into a GPU loss.

A worker on a GPU reads its own device's inventory (``nereus.telemetry.read_node``, without the
N² topology calls, with an XID watch opened at start-up so that critical XIDs between checks are
not missed) at most every ``every_s`` seconds and sends it, as JSON, in its boundary report. The
leader decodes every report (``NodeInventory.from_json``: a report that does not decode is
logged and says nothing), applies the health rule (``nereus.telemetry.health_problems``: ECC,
retired pages, fatal XID/RAS events), and treats the GPUs it condemns as lost at that boundary:
they leave the pool, and the controller replans (or restarts, when a state's last copy was
there) exactly as for a lost worker. A worker on the CPU has nothing to report.

The scripted fault (``drift: [{step: k, unhealthy: [w]}]``) makes worker ``w``'s check report a
GPU with XID 79 (fallen off the bus) at the boundary before step ``k``: the leader's side — the
decoding, the rule, the loss — runs exactly as for a real one. Edge module (torch, NVML).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from nereus.devices import Devices
from nereus.telemetry import GpuHealth, GpuInfo, NodeInventory, health_problems, read_node
from nereus.telemetry.nvml import XidWatch

HEALTH_EVERY_S = 30.0  # between two reads of a GPU's health (NVML calls take milliseconds)
MAX_REPORT_CHARS = 16_384  # a health report longer than this is not decoded
INJECTED_EVENT = "xid 79"  # what the scripted fault reports: the GPU has fallen off the bus


class HealthCheck:
    """One worker's view of its GPU's health."""

    def __init__(
        self, bus_id: str | None, vendor: str = "nvidia", every_s: float = HEALTH_EVERY_S,
        read: Callable[..., NodeInventory] = read_node, clock: Callable[[], float] = time.monotonic,
        xids: XidWatch | None = None,
    ) -> None:  # fmt: skip
        """``bus_id``: the PCI bus id of the worker's GPU (None: a CPU worker, nothing to report);
        ``read``: how the node's inventory is read; ``xids``: an open XID watch, kept."""
        self.bus_id, self.vendor, self.every_s = bus_id, vendor, every_s
        self.read, self.clock, self.xids = read, clock, xids
        self.last_s = -float("inf")
        self.injected = False

    @classmethod
    def of(cls, devices: Devices) -> HealthCheck:
        """The check of a worker on ``devices``: its GPU's bus id, an XID watch on NVIDIA."""
        bus_id = _bus_id(devices)
        xids = None
        if bus_id is not None and devices.vendor == "nvidia":
            watch = XidWatch.open()
            xids = watch if isinstance(watch, XidWatch) else None
        return cls(bus_id, devices.vendor, xids=xids)

    def inject(self) -> None:
        """From now on, report this worker's GPU as fallen off the bus (the scripted fault)."""
        self.injected = True

    def report(self) -> str:
        """This worker's GPU's inventory as JSON, when a check is due; "" otherwise (on a CPU, or
        when the GPU could not be read: a worker that cannot report is not thereby unhealthy)."""
        if self.injected:
            return json.dumps(_fallen_off_the_bus(self.vendor).to_json())
        now = self.clock()
        if self.bus_id is None or now - self.last_s < self.every_s:
            return ""
        self.last_s = now
        try:
            own = self.read(topology=False, xids=self.xids).for_device(self.bus_id)
        except (KeyError, ValueError):
            return ""
        return json.dumps(own.to_json())

    def close(self) -> None:
        if self.xids is not None:
            self.xids.close()
            self.xids = None


def _bus_id(devices: Devices) -> str | None:
    """The PCI bus id of the worker's GPU (how NVML and amdsmi name it), None on a CPU."""
    if not devices.accelerated:
        return None
    return pci_bus_id(torch.cuda.get_device_properties(devices.device))


def pci_bus_id(props: Any) -> str | None:
    """``domain:bus:device.0`` from torch's device properties (which give the three numbers
    apart), or the string as it is where a build gives one; None when it gives neither."""
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int) and not isinstance(bus, bool):
        domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        return f"{int(domain):04x}:{bus:02x}:{int(device):02x}.0"
    return bus if isinstance(bus, str) and bus else None


def _fallen_off_the_bus(vendor: str) -> NodeInventory:
    """The report of the scripted fault: one GPU with a fatal XID."""
    amd = vendor == "amd"
    gpu = GpuInfo(
        index=0, vendor="amd" if amd else "nvidia", model="injected fault",
        memory_total_bytes=None, memory_used_bytes=None,
        health=GpuHealth(xid_or_ras_events=(INJECTED_EVENT,)),
    )  # fmt: skip
    return NodeInventory(node="fault", source="amdsmi" if amd else "nvml", gpus=(gpu,))


def unhealthy_members(
    reports: Sequence[str], members: Sequence[int], log: Callable[[str], None]
) -> dict[int, tuple[str, ...]]:
    """GPU id → its problems, for every member whose health report (``reports``, in rank order)
    holds an unhealthy GPU. A report that does not decode is logged and ignored."""
    inventories: dict[int, NodeInventory | None] = {}
    for gpu, text in zip(members, reports, strict=True):
        inventories[gpu] = _decode(gpu, text, log) if text else None
    return health_problems(inventories)


def _decode(gpu: int, text: str, log: Callable[[str], None]) -> NodeInventory | None:
    if len(text) > MAX_REPORT_CHARS:
        log(f"health report of GPU {gpu} ignored: longer than {MAX_REPORT_CHARS} characters")
        return None
    try:
        return NodeInventory.from_json(json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:
        log(f"health report of GPU {gpu} ignored: {str(exc)[:200]}")
        return None


def describe(problems: Mapping[int, tuple[str, ...]]) -> list[str]:
    """One log line per condemned GPU."""
    return [f"GPU {g} is unhealthy ({'; '.join(p)}): treated as lost" for g, p in sorted(problems.items())]
