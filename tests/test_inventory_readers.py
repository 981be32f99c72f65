"""The NVML and amdsmi readers against fake ``pynvml`` and ``amdsmi`` modules put in
``sys.modules``: an 8-GPU NVIDIA node (two NVLink islands, an uncorrected ECC error, an XID 79,
a thermally throttled GPU, a failing call) and an 8-GCD MI250X node (xGMI, a RAS error, a pending
bad page). The fakes follow the libraries' real signatures and error types (nvidia-ml-py 13,
amdsmi 7)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from nereus.telemetry import GpuHealth, NodeInventory, read_node, unhealthy
from nereus.telemetry import amd as amd_reader
from nereus.telemetry import nvml as nvml_reader
from nereus.telemetry.nvml import XidWatch

pytestmark = pytest.mark.pure

MIB = 1024**2
H200_BYTES = 143_771 * MIB  # what NVML reports for an H200 (141 GB)
GCD_BYTES = 64 * 1024**3  # one MI250X GCD


# ------------------------------------------------------------------ a fake pynvml
class NVMLError(Exception):
    """pynvml's error: ``.value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            3: "Not Supported",
            10: "Timeout",
            12: "NVML Shared Library Not Found",
            15: "GPU is lost",
        }.get(self.value, "Unknown Error")


@dataclass
class FakeNvGpu:
    name: str = "NVIDIA H200 NVL"
    total: int = H200_BYTES
    used: int = 2_048 * MIB
    island: int = 0  # GPUs of one island share NVLink (an NVLink bridge)
    numa: int = 0
    ecc_uncorrected: int = 0
    rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # None: no row remapping (pre-Ampere)
    retired: tuple[int, int] = (0, 0)  # pages retired for (multiple SBE, DBE)
    retired_pending: int = 0
    reasons: int = 0x1  # GpuIdle


@dataclass
class FakeNvml:
    gpus: list[FakeNvGpu]
    fail: dict[tuple[str, int], int] = field(default_factory=dict)  # (function, gpu) → NVML code
    events: list[tuple[int, int]] = field(default_factory=list)  # (gpu, xid) waiting in the set
    missing: tuple[str, ...] = ()  # functions this "driver" lacks
    init_error: int | None = None
    inits: int = 0
    shutdowns: int = 0
    registered: dict[int, int] = field(default_factory=dict)

    def handle(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(i=i)

    def check(self, fn: str, i: int) -> None:
        code = self.fail.get((fn, i))
        if code is not None:
            raise NVMLError(code)

    def module(self) -> ModuleType:
        m = ModuleType("pynvml")
        m.NVMLError = NVMLError  # type: ignore[attr-defined]
        consts = {
            "NVML_ERROR_NOT_SUPPORTED": 3,
            "NVML_ERROR_TIMEOUT": 10,
            "NVML_ERROR_GPU_IS_LOST": 15,
            "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
            "NVML_VOLATILE_ECC": 0,
            "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
            "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
            "NVML_FEATURE_ENABLED": 1,
            "NVML_P2P_CAPS_INDEX_NVLINK": 2,
            "NVML_P2P_STATUS_OK": 0,
            "NVML_NVLINK_MAX_LINKS": 18,
            "nvmlEventTypeXidCriticalError": 0x8,
            "nvmlEventTypeDoubleBitEccError": 0x2,
            "nvmlClocksEventReasonGpuIdle": 0x1,
            "nvmlClocksEventReasonSwPowerCap": 0x4,
            "nvmlClocksEventReasonSwThermalSlowdown": 0x20,
            "nvmlClocksEventReasonHwThermalSlowdown": 0x40,
        }
        for k, v in consts.items():
            setattr(m, k, v)
        functions: dict[str, Callable[..., Any]] = {
            "nvmlInit": self.init,
            "nvmlShutdown": self.shutdown,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": self.get_handle,
            "nvmlDeviceGetIndex": lambda h: h.i,
            "nvmlDeviceGetName": lambda h: self.g("nvmlDeviceGetName", h).name,
            "nvmlDeviceGetMemoryInfo": self.memory,
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=f"00000000:{0x18 + 0x10 * h.i:02X}:00.0"),
            "nvmlDeviceGetTotalEccErrors": self.ecc,
            "nvmlDeviceGetRemappedRows": self.rows,
            "nvmlDeviceGetRetiredPages": self.retired,
            "nvmlDeviceGetRetiredPagesPendingStatus": self.pending,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: self.g("reasons", h).reasons,
            "nvmlDeviceGetP2PStatus": self.p2p,
            "nvmlDeviceGetTopologyCommonAncestor": self.ancestor,
            "nvmlDeviceGetNvLinkState": self.nvlink_state,
            "nvmlDeviceGetNvLinkRemotePciInfo": self.nvlink_remote,
            "nvmlEventSetCreate": lambda: "event-set",
            "nvmlDeviceGetSupportedEventTypes": lambda h: 0x8 | 0x2,
            "nvmlDeviceRegisterEvents": self.register,
            "nvmlEventSetWait": self.wait,
            "nvmlEventSetFree": lambda s: None,
        }
        for name, fn in functions.items():
            if name not in self.missing:
                setattr(m, name, fn)
        return m

    def init(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.inits += 1

    def shutdown(self) -> None:
        self.shutdowns += 1

    def get_handle(self, i: int) -> SimpleNamespace:
        self.check("nvmlDeviceGetHandleByIndex", i)
        return self.handle(i)

    def g(self, fn: str, h: SimpleNamespace) -> FakeNvGpu:
        self.check(fn, h.i)
        return self.gpus[int(h.i)]

    def memory(self, h: SimpleNamespace) -> SimpleNamespace:
        g = self.g("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=g.total, free=g.total - g.used, used=g.used)

    def ecc(self, h: SimpleNamespace, error_type: int, counter: int) -> int:
        assert (error_type, counter) == (1, 0)  # uncorrected, volatile (since the driver loaded)
        return self.g("nvmlDeviceGetTotalEccErrors", h).ecc_uncorrected

    def rows(self, h: SimpleNamespace) -> tuple[int, int, int, int]:
        g = self.g("nvmlDeviceGetRemappedRows", h)
        if g.rows is None:
            raise NVMLError(3)
        return g.rows

    def retired(self, h: SimpleNamespace, cause: int) -> list[int]:
        g = self.g("nvmlDeviceGetRetiredPages", h)
        if g.rows is not None:
            raise NVMLError(3)  # Ampere and later remap rows instead
        return [0x1000 * k for k in range(g.retired[cause])]

    def pending(self, h: SimpleNamespace) -> int:
        g = self.g("pending", h)
        if g.rows is not None:
            raise NVMLError(3)
        return g.retired_pending

    def p2p(self, a: SimpleNamespace, b: SimpleNamespace, index: int) -> int:
        assert index == 2  # NVML_P2P_CAPS_INDEX_NVLINK
        return 0 if self.gpus[a.i].island == self.gpus[b.i].island else 5

    def ancestor(self, a: SimpleNamespace, b: SimpleNamespace) -> int:
        return 40 if self.gpus[a.i].numa == self.gpus[b.i].numa else 50  # NODE / SYSTEM

    def nvlink_state(self, h: SimpleNamespace, link: int) -> int:
        peers = [j for j, g in enumerate(self.gpus) if g.island == self.gpus[h.i].island and j != h.i]
        if link >= 2 * len(peers):
            raise NVMLError(3)
        return 1

    def nvlink_remote(self, h: SimpleNamespace, link: int) -> SimpleNamespace:
        peers = [j for j, g in enumerate(self.gpus) if g.island == self.gpus[h.i].island and j != h.i]
        j = peers[link // 2]  # two links to each peer
        return SimpleNamespace(busId=f"00000000:{0x18 + 0x10 * j:02X}:00.0")

    def register(self, h: SimpleNamespace, mask: int, event_set: object) -> None:
        assert event_set == "event-set"
        self.registered[h.i] = mask

    def wait(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        if not self.events:
            raise NVMLError(10)
        gpu, xid = self.events.pop(0)
        return SimpleNamespace(device=self.handle(gpu), eventType=0x8, eventData=xid, gpuInstanceId=0)


def hgx_node() -> FakeNvml:
    """Eight H200 NVL in two 4-GPU NVLink islands, one per socket. GPU 1 has remapped rows (healthy),
    GPU 2 uncorrected ECC errors, GPU 3's memory query fails, GPU 4 saw the application XID 13,
    GPU 5 the fatal XID 79, GPU 6 runs thermally throttled, GPU 0 is capped by power."""
    gpus = [FakeNvGpu(island=i // 4, numa=i // 4) for i in range(8)]
    gpus[0].reasons = 0x4
    gpus[1].rows = (2, 0, 0, 0)
    gpus[2].ecc_uncorrected = 4
    gpus[6].reasons = 0x20 | 0x40
    return FakeNvml(gpus, fail={("nvmlDeviceGetMemoryInfo", 3): 999}, events=[(4, 13), (5, 79)])


@pytest.fixture
def nv(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNvml]:
    fake = hgx_node()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # never reached
    yield fake


def install(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())


# ------------------------------------------------------------------ NVIDIA
def test_nvml_node_every_field(nv: FakeNvml) -> None:
    watch = XidWatch.open()
    assert isinstance(watch, XidWatch) and nv.registered == dict.fromkeys(range(8), 0x8)
    inv = read_node("gpu-a07", xids=watch)
    watch.close()
    assert nv.inits == nv.shutdowns == 2  # the read and the watch each close what they open
    assert (inv.node, inv.source, inv.tried, inv.gpu_count) == ("gpu-a07", "nvml", (), 8)
    assert inv.model == "NVIDIA H200 NVL" and inv.memory_per_gpu_bytes == H200_BYTES
    for g in inv.gpus:
        assert g.vendor == "nvidia" and g.model == "NVIDIA H200 NVL"
        assert g.pci_bus_id == f"00000000:{0x18 + 0x10 * g.index:02X}:00.0"
        if g.index != 3:
            assert (g.memory_total_bytes, g.memory_used_bytes) == (H200_BYTES, 2_048 * MIB)
    # the failing call cost GPU 3 its memory, nothing else
    g3 = inv.gpu(3)
    assert (g3.memory_total_bytes, g3.memory_used_bytes) == (None, None)
    assert g3.model == "NVIDIA H200 NVL" and g3.health.healthy and g3.health.ecc_uncorrected == 0
    assert inv.errors == ("gpu 3 memory: NVMLError: Unknown Error",)

    health = {g.index: g.health for g in inv.gpus}
    assert health[0] == GpuHealth(
        ecc_uncorrected=0, retired_or_bad_pages=0, throttle_reasons=("sw_power_cap",)
    )
    assert health[1].retired_or_bad_pages == 2 and health[1].healthy and health[1].page_limit is None
    assert health[2].ecc_uncorrected == 4 and not health[2].healthy
    assert health[2].problems == ("4 uncorrected ECC errors since the driver loaded",)
    assert health[4].xid_or_ras_events == ("xid 13",) and health[4].healthy  # an application's error
    assert health[5].xid_or_ras_events == ("xid 79",) and not health[5].healthy
    assert health[5].problems == ("xid 79: GPU has fallen off the bus",)
    assert health[6].throttle_reasons == ("sw_thermal", "hw_thermal") and health[6].healthy
    assert health[7].throttle_reasons == () and health[7].healthy  # idle is no throttling
    assert unhealthy(inv) == (2, 5)

    # topology: NVLink inside each island, across the sockets through the SMP interconnect
    assert inv.islands("nvlink") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert len(inv.links) == 28
    assert inv.link(0, 3) == "nvlink" and inv.link(5, 4) == "nvlink" and inv.link(3, 4) == "smp"
    assert NodeInventory.from_json(inv.to_json()) == inv


def test_the_watch_keeps_xids_seen_earlier(nv: FakeNvml) -> None:
    watch = XidWatch.open()
    assert isinstance(watch, XidWatch)
    assert watch.poll() == {4: (13,), 5: (79,)}
    nv.events.append((5, 48))
    assert watch.poll() == {4: (13,), 5: (48, 79)}  # cumulative since open
    watch.close()
    watch.close()
    assert watch.poll() == {4: (13,), 5: (48, 79)}
    assert nv.inits == nv.shutdowns == 1


def test_without_a_watch_no_xids_and_no_topology_on_request(nv: FakeNvml) -> None:
    inv = read_node("n", topology=False)
    assert inv.links == () and unhealthy(inv) == (2,)
    assert all(not g.health.xid_or_ras_events for g in inv.gpus)


@pytest.mark.parametrize(
    ("fn", "field_name", "expect"),
    [
        ("nvmlDeviceGetName", "model", None),
        ("nvmlDeviceGetTotalEccErrors", "ecc", None),
        ("nvmlDeviceGetRemappedRows", "pages", None),
        ("reasons", "throttle", ()),
    ],
)
def test_one_failing_call_loses_only_its_field(
    monkeypatch: pytest.MonkeyPatch, fn: str, field_name: str, expect: object
) -> None:
    fake = hgx_node()
    fake.fail = {(fn, 6): 999}
    install(monkeypatch, fake)
    inv = read_node("n")
    g = inv.gpu(6)
    got = {
        "model": g.model,
        "ecc": g.health.ecc_uncorrected,
        "pages": g.health.retired_or_bad_pages,
        "throttle": g.health.throttle_reasons,
    }
    assert got.pop(field_name) == expect
    # every other field of GPU 6 is there, and every other GPU is whole
    assert g.memory_total_bytes == H200_BYTES and g.pci_bus_id is not None
    full = {"model": "NVIDIA H200 NVL", "ecc": 0, "pages": 0, "throttle": ("sw_thermal", "hw_thermal")}
    assert got == {k: v for k, v in full.items() if k != field_name}
    assert len(inv.errors) == 1 and inv.errors[0].startswith("gpu 6 ")
    assert inv.gpu(2).health.ecc_uncorrected == 4 and len(inv.links) == 28


def test_not_supported_is_silent_and_missing_functions_are_tolerated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A V100-era driver: no row remapping (page retirement instead), no clock-event API (the
    older throttle-reasons call is absent too), no P2P status call (links from NVLink state)."""
    fake = hgx_node()
    for g in fake.gpus:
        g.rows = None
    fake.gpus[7].retired = (59, 1)  # 60 retired pages: the limit
    fake.gpus[1].retired_pending = 1
    fake.missing = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetP2PStatus")
    install(monkeypatch, fake)
    inv = read_node("v100-node")
    assert inv.errors == ("gpu 3 memory: NVMLError: Unknown Error",)  # NOT_SUPPORTED is silent
    assert inv.gpu(0).health.retired_or_bad_pages == 0 and inv.gpu(0).health.page_limit == 60
    assert inv.gpu(1).health.pages_pending and not inv.gpu(1).health.healthy
    assert inv.gpu(7).health.retired_or_bad_pages == 60
    assert inv.gpu(7).health.problems == ("60 retired or bad pages (limit 60)",)
    assert all(g.health.throttle_reasons == () for g in inv.gpus)
    assert inv.islands("nvlink") == ((0, 1, 2, 3), (4, 5, 6, 7)) and inv.link(0, 7) == "smp"
    assert unhealthy(inv) == (1, 2, 7)


def test_a_lost_gpu_is_unhealthy_and_keeps_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = hgx_node()
    fake.fail = {("nvmlDeviceGetHandleByIndex", 4): 15}
    install(monkeypatch, fake)
    inv = read_node("n")
    g = inv.gpu(4)
    assert (g.model, g.memory_total_bytes, g.health.xid_or_ras_events) == (None, None, ("lost",))
    assert g.health.problems == ("the GPU is lost (the management library cannot reach it)",)
    assert unhealthy(inv) == (2, 4) and inv.link(3, 4) is None and inv.link(5, 6) == "nvlink"
    assert inv.errors == ("gpu 4 handle: NVMLError: GPU is lost",)


def test_nvml_without_driver_or_gpus_falls_through(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([], init_error=12)
    install(monkeypatch, fake)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    inv = read_node("cpu-node")
    assert inv.source == "none" and inv.tried == (
        "pynvml: nvmlInit failed: NVML Shared Library Not Found (no NVIDIA driver on this node)",
        "amdsmi: not installed (pip install 'nereus[rocm]')",
    )
    assert XidWatch.open() == "nvmlInit failed: NVML Shared Library Not Found"
    install(monkeypatch, FakeNvml([]))
    assert read_node("n").tried[0] == "pynvml: no NVIDIA GPU"
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert nvml_reader.read("n") == "not installed (pip install 'nereus[nvidia]')"


# ------------------------------------------------------------------ a fake amdsmi
class AmdSmiLibraryException(Exception):  # noqa: N818 (amdsmi's own name)
    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = err_code

    def __str__(self) -> str:
        status = "NOT_SUPPORTED" if self.err_code == 2 else "API_FAILED"
        return f"Error code:\n\t{self.err_code} | AMDSMI_STATUS_{status}"


class AmdSmiGpuBlock(IntEnum):  # amdsmi 7's blocks (a subset), values as in amdsmi_wrapper
    INVALID = 0
    UMC = 1
    SDMA = 2
    GFX = 4
    MMHUB = 8
    XGMI_WAFL = 0x80
    MPIO = 0x200000
    RESERVED = 0x8000000000000000


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiLinkType(IntEnum):
    AMDSMI_LINK_TYPE_INTERNAL = 0
    AMDSMI_LINK_TYPE_PCIE = 1
    AMDSMI_LINK_TYPE_XGMI = 2
    AMDSMI_LINK_TYPE_NOT_APPLICABLE = 3
    AMDSMI_LINK_TYPE_UNKNOWN = 4


class AmdSmiMemoryPageStatus(IntEnum):
    RESERVED = 0
    PENDING = 1
    UNRESERVABLE = 2


class AmdSmiInitFlags(IntEnum):
    INIT_AMD_GPUS = 2


@dataclass
class FakeGcd:
    umc_uncorrectable: int = 0
    bad_pages: list[int] = field(default_factory=list)  # statuses
    thermal: bool = False


@dataclass
class FakeAmd:
    gcds: list[FakeGcd]
    fail: dict[tuple[str, int], int] = field(default_factory=dict)
    shut: int = 0

    def module(self) -> ModuleType:
        m = ModuleType("amdsmi")
        for cls in (
            AmdSmiLibraryException,
            AmdSmiGpuBlock,
            AmdSmiMemoryType,
            AmdSmiLinkType,
            AmdSmiMemoryPageStatus,
            AmdSmiInitFlags,
        ):
            setattr(m, cls.__name__, cls)
        functions: dict[str, Callable[..., Any]] = {
            "amdsmi_init": self.init,
            "amdsmi_shut_down": self.shut_down,
            "amdsmi_get_processor_handles": lambda: [SimpleNamespace(i=i) for i in range(len(self.gcds))],
            "amdsmi_get_gpu_asic_info": lambda h: (
                self.c("asic", h)
                and {
                    "market_name": "AMD Instinct MI250X",
                    "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
                }
            ),
            "amdsmi_get_gpu_memory_total": lambda h, t: self.c("total", h) and GCD_BYTES,
            "amdsmi_get_gpu_memory_usage": lambda h, t: self.c("usage", h) and 12 * MIB,
            "amdsmi_get_gpu_device_bdf": lambda h: self.c("bdf", h) and f"0000:{0xC1 + 8 * h.i:02x}:00.0",
            "amdsmi_get_gpu_total_ecc_count": lambda h: {
                "correctable_count": 7,
                "uncorrectable_count": self.g("ecc", h).umc_uncorrectable,
                "deferred_count": 0,
            },
            "amdsmi_get_gpu_ras_block_features_enabled": lambda h: [
                {
                    "block": b.name,
                    "status": "ENABLED" if b in {AmdSmiGpuBlock.UMC, AmdSmiGpuBlock.GFX} else "DISABLED",
                }
                for b in AmdSmiGpuBlock
                if b.name not in {"INVALID", "RESERVED"}
            ],
            "amdsmi_get_gpu_ecc_count": self.ecc_count,
            "amdsmi_get_gpu_bad_page_info": lambda h: [
                {"value": k, "page_address": 0x1000 * k, "page_size": 4096, "status": s}
                for k, s in enumerate(self.g("pages", h).bad_pages)
            ],
            "amdsmi_get_gpu_bad_page_threshold": lambda h: 64,
            "amdsmi_get_violation_status": lambda h: {
                "active_ppt_pwr": False,
                "active_socket_thrm": self.g("violation", h).thermal,
                "active_hbm_thrm": "N/A",
            },
            "amdsmi_topo_get_link_type": lambda a, b: (
                self.c("link", a) and {"hops": 1, "type": AmdSmiLinkType.AMDSMI_LINK_TYPE_XGMI}
            ),
        }
        for name, fn in functions.items():
            setattr(m, name, fn)
        return m

    def init(self, flags: AmdSmiInitFlags) -> None:
        assert flags is AmdSmiInitFlags.INIT_AMD_GPUS

    def shut_down(self) -> None:
        self.shut += 1

    def c(self, fn: str, h: SimpleNamespace) -> bool:
        code = self.fail.get((fn, h.i))
        if code is not None:
            raise AmdSmiLibraryException(code)
        return True

    def g(self, fn: str, h: SimpleNamespace) -> FakeGcd:
        self.c(fn, h)
        return self.gcds[int(h.i)]

    def ecc_count(self, h: SimpleNamespace, block: AmdSmiGpuBlock) -> dict[str, int]:
        assert isinstance(block, AmdSmiGpuBlock) and block in {AmdSmiGpuBlock.UMC, AmdSmiGpuBlock.GFX}
        bad = self.gcds[h.i].umc_uncorrectable if block is AmdSmiGpuBlock.UMC else 0
        return {"correctable_count": 0, "uncorrectable_count": bad, "deferred_count": 0}


def frontier_node() -> FakeAmd:
    """Four MI250X, eight GCDs, all joined by Infinity Fabric: GCD 3 has uncorrectable UMC (HBM)
    errors, GCD 6 a bad page waiting to be retired, GCD 1 runs thermally throttled, and GCD 4's
    memory-usage query fails."""
    gcds = [FakeGcd() for _ in range(8)]
    gcds[3].umc_uncorrectable = 2
    gcds[3].bad_pages = [0]
    gcds[6].bad_pages = [0, 1]
    gcds[1].thermal = True
    return FakeAmd(gcds, fail={("usage", 4): 8})


def test_amd_node_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = frontier_node()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", fake.module())
    inv = read_node("frontier00001")
    assert fake.shut == 1
    assert (inv.source, inv.gpu_count, inv.model) == ("amdsmi", 8, "AMD Instinct MI250X")
    assert inv.tried == ("pynvml: not installed (pip install 'nereus[nvidia]')",)
    assert inv.memory_per_gpu_bytes == GCD_BYTES
    for g in inv.gpus:
        assert g.vendor == "amd" and g.pci_bus_id == f"0000:{0xC1 + 8 * g.index:02x}:00.0"
        assert g.memory_total_bytes == GCD_BYTES
        assert g.memory_used_bytes == (None if g.index == 4 else 12 * MIB)
        assert g.health.page_limit == 64
    assert inv.errors == (
        "gpu 4 memory usage: AmdSmiLibraryException: Error code: 8 | AMDSMI_STATUS_API_FAILED",
    )
    h3, h6, h1 = inv.gpu(3).health, inv.gpu(6).health, inv.gpu(1).health
    assert (h3.ecc_uncorrected, h3.xid_or_ras_events, h3.retired_or_bad_pages) == (2, ("ras umc",), 1)
    assert h3.problems == (
        "2 uncorrected ECC errors since the driver loaded",
        "RAS uncorrectable errors in block umc",
    )
    assert h6.pages_pending and not h6.page_repair_failed and h6.retired_or_bad_pages == 2
    assert h6.problems == ("a retired page or remapped row is pending (it needs a GPU reset)",)
    assert h1.throttle_reasons == ("thermal",) and h1.healthy
    assert unhealthy(inv) == (3, 6)
    assert inv.islands("xgmi") == (tuple(range(8)),) and {k.kind for k in inv.links} == {"xgmi"}
    assert NodeInventory.from_json(inv.to_json()) == inv


def test_amd_failing_link_and_asic_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = frontier_node()
    fake.fail = {("asic", 0): 2, ("link", 2): 8}  # NOT_SUPPORTED is silent; the link error is not
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", fake.module())
    inv = read_node("n")
    assert inv.gpu(0).model is None and inv.gpu(1).model == "AMD Instinct MI250X" and inv.model is None
    assert inv.link(2, 3) is None and inv.link(1, 2) == "xgmi" and len(inv.links) == 28 - 5
    assert len(inv.errors) == 5 and all(e.startswith("gpu 2 link type with ") for e in inv.errors)


def test_amdsmi_without_its_library_stays_quiet(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real amdsmi prints to stdout and raises KeyError at import when libamd_smi.so is absent."""
    pkg = tmp_path / "amdsmi"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent("""
        print("Could not load libamd_smi.so")
        print("Unable to find libamd_smi.so library try installing amd-smi-lib from your package manager")
        _libraries = {}
        amdsmi_init = _libraries["libamd_smi.so"].amdsmi_init
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    inv = read_node("n")
    assert inv.tried[1] == f"amdsmi: {amd_reader.NO_LIBRARY}"
    assert capsys.readouterr().out == ""
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
