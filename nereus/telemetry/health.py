"""Whether a GPU is healthy: ``GpuHealth`` (what the management library measured, and the
verdict), the fatal XIDs, and the health of a node's or a job's GPUs.

**The health rule** (``GpuHealth`` computes ``healthy`` and ``problems`` from what was measured).
A GPU is unhealthy when any of these holds:

1. ``ecc_uncorrected > 0``: uncorrected ECC errors since the driver loaded (NVML's volatile
   counter ``nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC)``; amdsmi's
   ``amdsmi_get_gpu_total_ecc_count`` ``uncorrectable_count``).
2. ``pages_pending``: a retired page (pre-Ampere) or remapped row (Ampere and later) waits for a
   driver reload or GPU reset to take effect, or an AMD bad page is pending (NVIDIA, "Dynamic Page
   Retirement" and "GPU Memory Error Management: Row Remapping", docs.nvidia.com/deploy).
3. ``page_repair_failed``: row remapping failed (no spare row left in a bank: NVIDIA's RMA
   criterion), or an AMD bad page could not be reserved.
4. ``retired_or_bad_pages >= page_limit`` where the reader knows a limit: ``RETIRED_PAGE_LIMIT``
   (60) for NVIDIA page retirement, which can retire at most 64 pages per board (NVIDIA, "Dynamic
   Page Retirement"), and the amdgpu driver's own ``bad_page_threshold`` on AMD
   (``amdsmi_get_gpu_bad_page_threshold``). Remapped rows have no count limit: their failure is
   rule 3.
5. a fatal XID among ``xid_or_ras_events`` (``FATAL_XIDS``, after NVIDIA's "XID Errors" catalog,
   docs.nvidia.com/deploy/xid-errors: those whose resolution is a GPU reset, a node reboot or a
   hardware check, not an application restart), an AMD RAS block with uncorrectable errors
   (``"ras <block>"``), or ``"lost"``: the library answered that the GPU is lost.

Thermal and power throttling (``throttle_reasons``) is reported, never unhealthy: a throttled
GPU is slow, and the controller sees slowness in its step times.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nereus.telemetry.fields import check_count, check_lines, flag, mapping, opt_int, strings

if TYPE_CHECKING:
    from nereus.telemetry.inventory import NodeInventory

# XIDs treated as fatal: the GPU leaves the pool until someone resets or checks it. The codes and
# their meaning follow NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors); application
# errors (13 graphics engine exception, 31 MMU fault, 43 stopped processing, 45 preemptive
# cleanup, ...) are reported but are not fatal.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded (reset to apply)",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
RETIRED_PAGE_LIMIT = 60  # NVIDIA page retirement: at most 64 pages per board; unhealthy 4 before
_EVENT = re.compile(r"xid (\d{1,5})|ras ([a-z0-9_]{1,32})|lost")
_REASON = re.compile(r"[a-z0-9_]{1,32}")


def fatal_event(event: str) -> str | None:
    """Why ``event`` (an ``xid_or_ras_events`` entry) makes a GPU unhealthy, or None if it does not."""
    m = _EVENT.fullmatch(event)
    if m is None:
        return None
    if m.group(1) is not None:
        xid = int(m.group(1))
        return f"xid {xid}: {FATAL_XIDS[xid]}" if xid in FATAL_XIDS else None
    if m.group(2) is not None:
        return f"RAS uncorrectable errors in block {m.group(2)}"
    return "the GPU is lost (the management library cannot reach it)"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuHealth:
    """What the management library says about one GPU's health; ``healthy`` and ``problems``
    follow from the other fields by the rule in the module docstring. None: not known (not
    supported by this GPU or driver, or the call failed)."""

    ecc_uncorrected: int | None = None
    retired_or_bad_pages: int | None = None
    page_limit: int | None = None
    pages_pending: bool = False
    page_repair_failed: bool = False
    xid_or_ras_events: tuple[str, ...] = ()  # "xid 79", "ras umc", "lost"
    throttle_reasons: tuple[str, ...] = ()  # "hw_thermal", "sw_power_cap", ...
    healthy: bool = field(init=False)
    problems: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("ecc_uncorrected", "retired_or_bad_pages", "page_limit"):
            check_count(self, name, getattr(self, name))
        if self.page_limit == 0:
            raise ValueError("GpuHealth.page_limit must be positive or None")
        for name in ("pages_pending", "page_repair_failed"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GpuHealth.{name} must be a bool")
        check_lines(self, "xid_or_ras_events", self.xid_or_ras_events)
        for event in self.xid_or_ras_events:
            if not _EVENT.fullmatch(event):
                raise ValueError(
                    f"GpuHealth.xid_or_ras_events: {event!r} is not 'xid N', 'ras BLOCK' or 'lost'"
                )
        check_lines(self, "throttle_reasons", self.throttle_reasons)
        for reason in self.throttle_reasons:
            if not _REASON.fullmatch(reason):
                raise ValueError(f"GpuHealth.throttle_reasons: {reason!r} is not a short lowercase name")
        problems = self._judge()
        object.__setattr__(self, "problems", problems)
        object.__setattr__(self, "healthy", not problems)

    def _judge(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.ecc_uncorrected:
            out.append(f"{self.ecc_uncorrected} uncorrected ECC errors since the driver loaded")
        if self.pages_pending:
            out.append("a retired page or remapped row is pending (it needs a GPU reset)")
        if self.page_repair_failed:
            out.append("page retirement or row remapping failed")
        pages, limit = self.retired_or_bad_pages, self.page_limit
        if pages is not None and limit is not None and pages >= limit:
            out.append(f"{pages} retired or bad pages (limit {limit})")
        for event in self.xid_or_ras_events:
            why = fatal_event(event)
            if why is not None and why not in out:
                out.append(why)
        return tuple(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "healthy": self.healthy,
            "problems": list(self.problems),
            "ecc_uncorrected": self.ecc_uncorrected,
            "retired_or_bad_pages": self.retired_or_bad_pages,
            "page_limit": self.page_limit,
            "pages_pending": self.pages_pending,
            "page_repair_failed": self.page_repair_failed,
            "xid_or_ras_events": list(self.xid_or_ras_events),
            "throttle_reasons": list(self.throttle_reasons),
        }

    @classmethod
    def from_json(cls, doc: object) -> GpuHealth:
        """The health in ``doc``; ``healthy`` and ``problems`` in it are ignored (recomputed)."""
        d = mapping(doc, "health")
        return cls(
            ecc_uncorrected=opt_int(d, "ecc_uncorrected"),
            retired_or_bad_pages=opt_int(d, "retired_or_bad_pages"),
            page_limit=opt_int(d, "page_limit"),
            pages_pending=flag(d, "pages_pending"),
            page_repair_failed=flag(d, "page_repair_failed"),
            xid_or_ras_events=strings(d, "xid_or_ras_events"),
            throttle_reasons=strings(d, "throttle_reasons"),
        )


def unhealthy(inventory: NodeInventory) -> tuple[int, ...]:
    """The library indices of ``inventory``'s unhealthy GPUs, ascending."""
    return tuple(sorted(g.index for g in inventory.gpus if not g.health.healthy))


def health_problems(reports: Mapping[int, NodeInventory | None]) -> dict[int, tuple[str, ...]]:
    """Job GPU id → its problems, for the GPUs whose report (``for_device`` of the worker's own
    device, keyed by its GPU id) holds an unhealthy GPU. A missing report (None) says nothing:
    a worker that cannot report is the heartbeat's business, not the health rule's."""
    out: dict[int, tuple[str, ...]] = {}
    for gpu_id, report in sorted(reports.items()):
        if report is None:
            continue
        problems = tuple(p for g in report.gpus for p in g.health.problems)
        if problems:
            out[gpu_id] = problems
    return out
