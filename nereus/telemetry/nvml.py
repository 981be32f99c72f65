"""NVIDIA GPUs through NVML: ``pynvml`` from ``nvidia-ml-py`` (``pip install 'nereus[nvidia]'``),
imported when a read starts. Every per-GPU call is guarded: a failing call (an ``NVMLError``, a
function this driver lacks) costs only its own field, named in ``NodeInventory.errors``;
"not supported" (ECC off, page retirement on an Ampere GPU) is silent.

Calls used: ``nvmlInit``/``nvmlShutdown``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetHandleByIndex``,
``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo``, ``nvmlDeviceGetPciInfo``,
``nvmlDeviceGetTotalEccErrors`` (uncorrected, volatile), ``nvmlDeviceGetRemappedRows`` (Ampere
and later) or ``nvmlDeviceGetRetiredPages`` + ``nvmlDeviceGetRetiredPagesPendingStatus``,
``nvmlDeviceGetCurrentClocksEventReasons`` (or the older ``...ThrottleReasons``); for links
``nvmlDeviceGetP2PStatus(NVLINK)`` (NVLink and NVSwitch alike), else each active
``nvmlDeviceGetNvLinkState`` link's ``nvmlDeviceGetNvLinkRemotePciInfo``, and
``nvmlDeviceGetTopologyCommonAncestor`` for the PCIe path; XIDs through ``XidWatch``
(``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents``, ``nvmlEventSetWait``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

from nereus.telemetry.fields import clip_lines, nonneg, printable, say
from nereus.telemetry.health import RETIRED_PAGE_LIMIT, GpuHealth
from nereus.telemetry.inventory import GpuInfo, Link, LinkKind, NodeInventory, bus_key

INSTALL = "not installed (pip install 'nereus[nvidia]')"
# NVML return codes (nvml.h; pynvml's NVML_ERROR_* constants), used when the module lacks them
NOT_SUPPORTED, FUNCTION_NOT_FOUND, GPU_IS_LOST = 3, 13, 15
QUIET = {NOT_SUPPORTED, FUNCTION_NOT_FOUND}
P2P_CAPS_INDEX_NVLINK, P2P_STATUS_OK = 2, 0
FEATURE_ENABLED = 1
MAX_NVLINKS = 18  # NVLink links per GPU in use today (NVML_NVLINK_MAX_LINKS is larger)
# nvmlClocksEventReason* / nvmlClocksThrottleReason* bits (nvml.h) and the names we report;
# GpuIdle (0x1) is not throttling and is left out.
THROTTLE_BITS: tuple[tuple[str, int, str], ...] = (
    ("ApplicationsClocksSetting", 0x2, "applications_clocks"),
    ("SwPowerCap", 0x4, "sw_power_cap"),
    ("HwSlowdown", 0x8, "hw_slowdown"),
    ("SyncBoost", 0x10, "sync_boost"),
    ("SwThermalSlowdown", 0x20, "sw_thermal"),
    ("HwThermalSlowdown", 0x40, "hw_thermal"),
    ("HwPowerBrakeSlowdown", 0x80, "hw_power_brake"),
    ("DisplayClockSetting", 0x100, "display_clock"),
)
# nvmlDeviceGetTopologyCommonAncestor levels → link kinds (nvidia-smi topo: PIX/PXB/PHB, NODE, SYS)
TOPOLOGY_KINDS: tuple[tuple[int, LinkKind], ...] = ((30, "pcie"), (40, "numa"), (50, "smp"))
XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
MAX_EVENTS = 1024  # events drained per poll


def load() -> ModuleType | str:
    """The ``pynvml`` module, or why not."""
    try:
        return importlib.import_module("pynvml")
    except ModuleNotFoundError as exc:
        if exc.name == "pynvml":
            return INSTALL
        return f"import failed: {say(exc)}"
    except Exception as exc:
        return f"import failed: {say(exc)}"


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _const(nv: ModuleType, name: str, default: int) -> int:
    value = getattr(nv, name, default)
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class _Calls:
    """Guarded library calls: a failure records ``what: error`` (unless quiet or not supported)
    and returns ``None``; a GPU-is-lost answer marks the GPU lost."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.lost: set[int] = set()
        self.failed: int | None = None  # the last call's NVML error code (-1: not NVML's), None: it worked

    def __call__(
        self, gpu: int | None, what: str, fn: Callable[..., Any] | None, *args: Any, quiet: bool = False
    ) -> Any:
        self.failed = FUNCTION_NOT_FOUND
        if fn is None:
            return None
        try:
            out = fn(*args)
            self.failed = None
            return out
        except Exception as exc:
            code = _code(exc)
            self.failed = -1 if code is None else code
            if code == GPU_IS_LOST and gpu is not None:
                self.lost.add(gpu)
            if not quiet and code not in QUIET:
                where = f"gpu {gpu} " if gpu is not None else ""
                self.errors.append(f"{where}{what}: {type(exc).__name__}: {say(exc)}")
            return None


def read(node: str, *, topology: bool = True, xids: XidWatch | None = None) -> NodeInventory | str:
    """This node's NVIDIA GPUs, or why NVML cannot say (not installed, no driver, no GPU)."""
    nv = load()
    if isinstance(nv, str):
        return nv
    try:
        nv.nvmlInit()
    except Exception as exc:
        hint = " (no NVIDIA driver on this node)" if _code(exc) in {9, 12} else ""
        return f"nvmlInit failed: {say(exc)}{hint}"
    try:
        try:
            count = int(nv.nvmlDeviceGetCount())
        except Exception as exc:
            return f"nvmlDeviceGetCount failed: {say(exc)}"
        if count <= 0:
            return "no NVIDIA GPU"
        return _read(nv, node, count, topology, xids)
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


def _read(nv: ModuleType, node: str, count: int, topology: bool, xids: XidWatch | None) -> NodeInventory:
    call = _Calls()
    handles: dict[int, Any] = {}
    for i in range(min(count, 1024)):
        h = call(i, "handle", getattr(nv, "nvmlDeviceGetHandleByIndex", None), i)
        if h is not None:
            handles[i] = h
    seen = xids.poll() if xids is not None else {}
    gpus = []
    for i in range(min(count, 1024)):
        h = handles.get(i)
        gpus.append(_gpu(nv, call, i, h, seen.get(i, ())) if h is not None else None)
    links = _links(nv, call, handles) if topology and len(handles) > 1 else ()
    infos = []
    for i, read_gpu in enumerate(gpus):
        g = read_gpu or GpuInfo(
            index=i, vendor="nvidia", model=None, memory_total_bytes=None, memory_used_bytes=None
        )
        if i in call.lost and "lost" not in g.health.xid_or_ras_events:
            g = _with_health(g, events=(*g.health.xid_or_ras_events, "lost"))
        infos.append(g)
    return NodeInventory(
        node=node, source="nvml", gpus=tuple(infos), links=links, errors=clip_lines(call.errors)
    )


def _with_health(g: GpuInfo, *, events: tuple[str, ...]) -> GpuInfo:
    """``g`` with ``events`` as its XID events (its health's verdict recomputed)."""
    return replace(g, health=replace(g.health, xid_or_ras_events=events))


def _gpu(nv: ModuleType, call: _Calls, i: int, h: Any, xids: tuple[int, ...]) -> GpuInfo:
    fn = getattr  # fn(nv, "name", None) is None when this pynvml lacks the function
    model = printable(call(i, "name", fn(nv, "nvmlDeviceGetName", None), h))
    mem = call(i, "memory", fn(nv, "nvmlDeviceGetMemoryInfo", None), h)
    total = nonneg(getattr(mem, "total", None))
    used = nonneg(getattr(mem, "used", None))
    if total is not None and used is not None and used > total:
        used = None
    pci = call(i, "pci info", fn(nv, "nvmlDeviceGetPciInfo", None), h)
    bus = printable(getattr(pci, "busId", None))

    ecc = nonneg(
        call(
            i,
            "uncorrected ECC errors",
            fn(nv, "nvmlDeviceGetTotalEccErrors", None),
            h,
            _const(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            _const(nv, "NVML_VOLATILE_ECC", 0),
        )
    )
    pages, limit, pending, failed = _pages(nv, call, i, h)
    reasons = _throttle(nv, call, i, h)
    events = tuple(f"xid {x}" for x in sorted(set(xids)) if 0 <= x < 100_000)
    health = GpuHealth(
        ecc_uncorrected=ecc,
        retired_or_bad_pages=pages,
        page_limit=limit,
        pages_pending=pending,
        page_repair_failed=failed,
        xid_or_ras_events=events[:63],
        throttle_reasons=reasons,
    )
    return GpuInfo(
        index=i,
        vendor="nvidia",
        model=model,
        memory_total_bytes=total,
        memory_used_bytes=used,
        health=health,
        pci_bus_id=bus,
    )


def _pages(nv: ModuleType, call: _Calls, i: int, h: Any) -> tuple[int | None, int | None, bool, bool]:
    """(retired or remapped count, its limit, pending, failed): row remapping on Ampere and
    later, page retirement before."""
    rows = call(i, "remapped rows", getattr(nv, "nvmlDeviceGetRemappedRows", None), h)
    if isinstance(rows, (tuple, list)) and len(rows) >= 4:
        corr, unc = nonneg(rows[0]), nonneg(rows[1])
        count = None if corr is None or unc is None else corr + unc
        return count, None, bool(rows[2]), bool(rows[3])
    if call.failed not in QUIET:  # row remapping exists here but could not be read
        return None, None, False, False
    retired = getattr(nv, "nvmlDeviceGetRetiredPages", None)
    causes = (
        _const(nv, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
        _const(nv, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1),
    )
    counts = [call(i, "retired pages", retired, h, cause) for cause in causes]
    count = sum(len(c) for c in counts) if all(isinstance(c, list) for c in counts) else None
    status = call(i, "retired pages pending", getattr(nv, "nvmlDeviceGetRetiredPagesPendingStatus", None), h)
    pending = status == _const(nv, "NVML_FEATURE_ENABLED", FEATURE_ENABLED)
    return count, (RETIRED_PAGE_LIMIT if count is not None else None), pending, False


def _throttle(nv: ModuleType, call: _Calls, i: int, h: Any) -> tuple[str, ...]:
    reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
    prefix = "nvmlClocksEventReason"
    if reasons_fn is None:
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        prefix = "nvmlClocksThrottleReason"
    mask = nonneg(call(i, "clock event reasons", reasons_fn, h))
    if mask is None:
        return ()
    return tuple(name for const, bit, name in THROTTLE_BITS if mask & _const(nv, prefix + const, bit))


def _links(nv: ModuleType, call: _Calls, handles: dict[int, Any]) -> tuple[Link, ...]:
    p2p = getattr(nv, "nvmlDeviceGetP2PStatus", None)
    ancestor = getattr(nv, "nvmlDeviceGetTopologyCommonAncestor", None)
    nvlink_index = _const(nv, "NVML_P2P_CAPS_INDEX_NVLINK", P2P_CAPS_INDEX_NVLINK)
    ok = _const(nv, "NVML_P2P_STATUS_OK", P2P_STATUS_OK)
    peers: dict[int, set[tuple[int, str]]] | None = None  # the fallback, computed once if needed
    buses: dict[int, tuple[int, str]] = {}
    out = []
    ids = sorted(handles)
    for x, a in enumerate(ids):
        for b in ids[x + 1 :]:
            ha, hb = handles[a], handles[b]
            status = call(a, f"P2P status with {b}", p2p, ha, hb, nvlink_index, quiet=True)
            if status is not None:
                is_nvlink = status == ok
            else:
                if peers is None:
                    peers, buses = _nvlink_peers(nv, call, handles)
                is_nvlink = b in buses and buses[b] in peers.get(a, set())
            kind: LinkKind | None = "nvlink" if is_nvlink else None
            if kind is None:
                level = call(a, f"topology with {b}", ancestor, ha, hb)
                if isinstance(level, int) and not isinstance(level, bool):
                    kind = next((k for limit, k in TOPOLOGY_KINDS if level <= limit), None)
            if kind is not None:
                out.append(Link(a, b, kind))
    return tuple(out)


def _nvlink_peers(
    nv: ModuleType, call: _Calls, handles: dict[int, Any]
) -> tuple[dict[int, set[tuple[int, str]]], dict[int, tuple[int, str]]]:
    """Per GPU, the PCI bus ids at the far end of its active NVLinks; and each GPU's own bus id."""
    state = getattr(nv, "nvmlDeviceGetNvLinkState", None)
    remote = getattr(nv, "nvmlDeviceGetNvLinkRemotePciInfo", None)
    pci = getattr(nv, "nvmlDeviceGetPciInfo", None)
    links = min(_const(nv, "NVML_NVLINK_MAX_LINKS", MAX_NVLINKS), MAX_NVLINKS)
    peers: dict[int, set[tuple[int, str]]] = {}
    buses: dict[int, tuple[int, str]] = {}
    for i, h in handles.items():
        own = printable(getattr(call(i, "pci info", pci, h, quiet=True), "busId", None))
        if own is not None:
            buses[i] = bus_key(own)
        for link in range(links):
            if call(i, f"nvlink {link} state", state, h, link, quiet=True) != FEATURE_ENABLED:
                continue
            far = printable(
                getattr(call(i, f"nvlink {link} remote", remote, h, link, quiet=True), "busId", None)
            )
            if far is not None:
                peers.setdefault(i, set()).add(bus_key(far))
    return peers, buses


class XidWatch:
    """XID critical-error events of this node's NVIDIA GPUs, from the moment ``open`` registers
    for them: NVML delivers events only to an event set that was registered when they happened,
    so a job opens one at start-up, keeps it, and passes it to every ``read_node``. ``poll``
    drains what arrived and returns every XID seen since ``open``, by NVML index."""

    def __init__(self, nv: ModuleType, event_set: Any, handles: dict[int, Any]) -> None:
        self.nv, self.event_set, self.handles = nv, event_set, handles
        self.seen: dict[int, set[int]] = {}
        self.closed = False

    @classmethod
    def open(cls) -> XidWatch | str:
        """A watch on every GPU that supports XID events, or why there is none."""
        nv = load()
        if isinstance(nv, str):
            return nv
        try:
            nv.nvmlInit()
        except Exception as exc:
            return f"nvmlInit failed: {say(exc)}"
        try:
            event_set = nv.nvmlEventSetCreate()
            handles: dict[int, Any] = {}
            for i in range(min(int(nv.nvmlDeviceGetCount()), 1024)):
                try:
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    mask = _const(nv, "nvmlEventTypeXidCriticalError", XID_CRITICAL)
                    supported = getattr(nv, "nvmlDeviceGetSupportedEventTypes", None)
                    if supported is not None:
                        mask &= int(supported(h))
                    if mask:
                        nv.nvmlDeviceRegisterEvents(h, mask, event_set)
                        handles[i] = h
                except Exception:
                    continue  # this GPU's XIDs stay unseen; the others are watched
        except Exception as exc:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
            return f"no XID events: {say(exc)}"
        return cls(nv, event_set, handles)

    def poll(self) -> dict[int, tuple[int, ...]]:
        """Every XID seen since ``open``, by NVML index (drains the events waiting now)."""
        if not self.closed:
            xid_bit = _const(self.nv, "nvmlEventTypeXidCriticalError", XID_CRITICAL)
            for _ in range(MAX_EVENTS):
                try:
                    data = self.nv.nvmlEventSetWait(self.event_set, 0)
                except Exception:
                    break  # NVML_ERROR_TIMEOUT: nothing waiting (any other error ends this poll too)
                if not int(getattr(data, "eventType", 0)) & xid_bit:
                    continue
                index = self._index_of(getattr(data, "device", None))
                xid = nonneg(getattr(data, "eventData", None))
                if index is not None and xid is not None:
                    self.seen.setdefault(index, set()).add(xid)
        return {i: tuple(sorted(x)) for i, x in sorted(self.seen.items())}

    def _index_of(self, device: Any) -> int | None:
        try:
            index = self.nv.nvmlDeviceGetIndex(device)
            if isinstance(index, int) and not isinstance(index, bool):
                return index
        except Exception:
            pass
        for i, h in self.handles.items():
            if h is device:
                return i
        return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.nv.nvmlEventSetFree(self.event_set)
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()
