"""AMD GPUs through AMD SMI: the ``amdsmi`` package (``pip install 'nereus[rocm]'``; it needs
ROCm's ``libamd_smi.so``), imported when a read starts, its import-time complaints about a
missing library kept off stdout. Every per-GPU call is guarded: a failing call (an
``AmdSmiException``, a function this version lacks) costs only its own field, named in
``NodeInventory.errors``.

Calls used: ``amdsmi_init``/``amdsmi_shut_down``, ``amdsmi_get_processor_handles``,
``amdsmi_get_gpu_asic_info`` (``market_name``), ``amdsmi_get_gpu_memory_total``/``_usage``
(VRAM), ``amdsmi_get_gpu_device_bdf``, ``amdsmi_get_gpu_total_ecc_count``,
``amdsmi_get_gpu_ras_block_features_enabled`` and ``amdsmi_get_gpu_ecc_count`` per RAS block,
``amdsmi_get_gpu_bad_page_info`` and ``amdsmi_get_gpu_bad_page_threshold``,
``amdsmi_get_violation_status`` (MI300) or ``amdsmi_get_gpu_metrics_info``'s
``throttle_status``, and ``amdsmi_topo_get_link_type`` between GPUs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nereus.telemetry.fields import clip_lines, nonneg, printable, say
from nereus.telemetry.health import GpuHealth
from nereus.telemetry.inventory import GpuInfo, Link, LinkKind, NodeInventory

INSTALL = "not installed (pip install 'nereus[rocm]')"
NO_LIBRARY = "libamd_smi.so not found (install ROCm's amd-smi-lib of the amdsmi package's release)"
NOT_SUPPORTED = 2  # AMDSMI_STATUS_NOT_SUPPORTED
# amdsmi_get_violation_status's active_* flags (MI300 and later) → the names we report
VIOLATIONS: tuple[tuple[str, str], ...] = (
    ("active_ppt_pwr", "power_cap"),
    ("active_socket_thrm", "thermal"),
    ("active_hbm_thrm", "hbm_thermal"),
    ("active_vr_thrm", "vr_thermal"),
    ("active_prochot_thrm", "prochot"),
)
PAGE_PENDING, PAGE_UNRESERVABLE = 1, 2  # AmdSmiMemoryPageStatus PENDING, UNRESERVABLE
LINK_XGMI, LINK_PCIE = 2, 1  # AmdSmiLinkType
SKIP_BLOCKS = {"INVALID", "RESERVED", "LAST"}


def load() -> ModuleType | str:
    """The ``amdsmi`` module, or why not. Its import loads ``libamd_smi.so`` and prints to stdout
    when that fails; the print is swallowed and the failure reported."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return importlib.import_module("amdsmi")
    except ModuleNotFoundError as exc:
        if exc.name == "amdsmi":
            return INSTALL
        return f"import failed: {say(exc)}"
    except Exception as exc:
        if "libamd_smi" in printed.getvalue() + str(exc):
            return NO_LIBRARY
        return f"import failed: {say(exc)}"


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "err_code", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Calls:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def __call__(
        self, gpu: int, what: str, fn: Callable[..., Any] | None, *args: Any, quiet: bool = False
    ) -> Any:
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if not quiet and _code(exc) != NOT_SUPPORTED:
                self.errors.append(f"gpu {gpu} {what}: {type(exc).__name__}: {say(exc)}")
            return None


def read(node: str, *, topology: bool = True) -> NodeInventory | str:
    """This node's AMD GPUs, or why amdsmi cannot say (not installed, no library, no GPU)."""
    am = load()
    if isinstance(am, str):
        return am
    try:
        flags = getattr(am, "AmdSmiInitFlags", None)
        if flags is not None and hasattr(flags, "INIT_AMD_GPUS"):
            am.amdsmi_init(flags.INIT_AMD_GPUS)
        else:
            am.amdsmi_init()
    except Exception as exc:
        return f"amdsmi_init failed: {say(exc)} (no amdgpu driver on this node?)"
    try:
        try:
            handles = list(am.amdsmi_get_processor_handles())
        except Exception as exc:
            return f"amdsmi_get_processor_handles failed: {say(exc)}"
        if not handles:
            return "no AMD GPU"
        return _read(am, node, handles[:1024], topology)
    finally:
        with contextlib.suppress(Exception):
            am.amdsmi_shut_down()


def _read(am: ModuleType, node: str, handles: list[Any], topology: bool) -> NodeInventory:
    call = _Calls()
    gpus = tuple(_gpu(am, call, i, h) for i, h in enumerate(handles))
    links = _links(am, call, handles) if topology and len(handles) > 1 else ()
    return NodeInventory(node=node, source="amdsmi", gpus=gpus, links=links, errors=clip_lines(call.errors))


def _gpu(am: ModuleType, call: _Calls, i: int, h: Any) -> GpuInfo:
    fn = getattr  # fn(am, "name", None) is None when this amdsmi lacks the function
    asic = call(i, "asic info", fn(am, "amdsmi_get_gpu_asic_info", None), h)
    model = printable(asic.get("market_name")) if isinstance(asic, dict) else None
    vram = getattr(getattr(am, "AmdSmiMemoryType", None), "VRAM", None)
    total = used = None
    if vram is not None:
        total = nonneg(call(i, "memory total", fn(am, "amdsmi_get_gpu_memory_total", None), h, vram))
        used = nonneg(call(i, "memory usage", fn(am, "amdsmi_get_gpu_memory_usage", None), h, vram))
    if total is not None and used is not None and used > total:
        used = None
    bus = printable(call(i, "bdf", fn(am, "amdsmi_get_gpu_device_bdf", None), h))

    ecc = call(i, "total ECC count", fn(am, "amdsmi_get_gpu_total_ecc_count", None), h)
    uncorrected = nonneg(ecc.get("uncorrectable_count")) if isinstance(ecc, dict) else None
    events = _ras_events(am, call, i, h)
    pages, limit, pending, failed = _pages(am, call, i, h)
    health = GpuHealth(
        ecc_uncorrected=uncorrected,
        retired_or_bad_pages=pages,
        page_limit=limit,
        pages_pending=pending,
        page_repair_failed=failed,
        xid_or_ras_events=events,
        throttle_reasons=_throttle(am, call, i, h),
    )
    return GpuInfo(
        index=i,
        vendor="amd",
        model=model,
        memory_total_bytes=total,
        memory_used_bytes=used,
        health=health,
        pci_bus_id=bus,
    )


def _ras_events(am: ModuleType, call: _Calls, i: int, h: Any) -> tuple[str, ...]:
    """``ras <block>`` for each RAS block with uncorrectable errors (only blocks whose RAS
    feature is on, when the library can say which are)."""
    blocks = getattr(am, "AmdSmiGpuBlock", None)
    count_fn = getattr(am, "amdsmi_get_gpu_ecc_count", None)
    if blocks is None or count_fn is None:
        return ()
    features = call(
        i, "RAS features", getattr(am, "amdsmi_get_gpu_ras_block_features_enabled", None), h, quiet=True
    )
    enabled = None
    if isinstance(features, list):
        enabled = {f.get("block") for f in features if isinstance(f, dict) and f.get("status") == "ENABLED"}
    out = []
    for block in blocks:
        name = str(getattr(block, "name", ""))
        if not name or name in SKIP_BLOCKS or (enabled is not None and name not in enabled):
            continue
        counts = call(i, f"ECC count {name}", count_fn, h, block, quiet=True)
        if isinstance(counts, dict) and (nonneg(counts.get("uncorrectable_count")) or 0) > 0:
            out.append(f"ras {name.lower()}")
    return tuple(out[:32])


def _pages(am: ModuleType, call: _Calls, i: int, h: Any) -> tuple[int | None, int | None, bool, bool]:
    """(bad pages, the driver's bad-page threshold, any pending, any unreservable)."""
    info = call(i, "bad pages", getattr(am, "amdsmi_get_gpu_bad_page_info", None), h)
    limit = nonneg(
        call(i, "bad page threshold", getattr(am, "amdsmi_get_gpu_bad_page_threshold", None), h, quiet=True)
    )
    if not isinstance(info, list):
        return None, limit or None, False, False
    status = getattr(am, "AmdSmiMemoryPageStatus", None)
    pending_value = int(getattr(status, "PENDING", PAGE_PENDING))
    failed_value = int(getattr(status, "UNRESERVABLE", PAGE_UNRESERVABLE))
    states = [p.get("status") for p in info if isinstance(p, dict)]
    pending = any(s == pending_value for s in states)
    failed = any(s == failed_value for s in states)
    return len(info), limit or None, pending, failed


def _throttle(am: ModuleType, call: _Calls, i: int, h: Any) -> tuple[str, ...]:
    violation = call(i, "violation status", getattr(am, "amdsmi_get_violation_status", None), h, quiet=True)
    if isinstance(violation, dict):
        return tuple(name for key, name in VIOLATIONS if violation.get(key) is True)
    metrics = call(i, "gpu metrics", getattr(am, "amdsmi_get_gpu_metrics_info", None), h, quiet=True)
    if isinstance(metrics, dict) and metrics.get("throttle_status") is True:
        return ("throttled",)
    return ()


def _links(am: ModuleType, call: _Calls, handles: list[Any]) -> tuple[Link, ...]:
    link_type = getattr(am, "amdsmi_topo_get_link_type", None)
    kinds = getattr(am, "AmdSmiLinkType", None)
    xgmi = int(getattr(kinds, "AMDSMI_LINK_TYPE_XGMI", LINK_XGMI))
    pcie = int(getattr(kinds, "AMDSMI_LINK_TYPE_PCIE", LINK_PCIE))
    out = []
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            got = call(a, f"link type with {b}", link_type, handles[a], handles[b])
            value = got.get("type") if isinstance(got, dict) else None
            kind: LinkKind | None = None
            if value == xgmi:
                kind = "xgmi"
            elif value == pcie:
                kind = "pcie"
            if kind is not None:
                out.append(Link(a, b, kind))
    return tuple(out)
