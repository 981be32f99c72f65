"""A worker's GPU health check and the leader's reading of it (``nereus/runtime/health.py``): the
CPU twin of the health path. The end-to-end loss is in ``test_runtime_e2e.py``; on a GPU the
check reads the real device (``tests/gpu/test_runtime_gpu.py``)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from nereus.devices import CPU, Devices
from nereus.runtime.health import MAX_REPORT_CHARS, HealthCheck, pci_bus_id, unhealthy_members
from nereus.telemetry import GpuHealth, GpuInfo, NodeInventory

pytestmark = pytest.mark.pure


def node(bad: GpuHealth | None = None) -> NodeInventory:
    """Two NVIDIA GPUs as NVML names them (8-digit domains); the second one ``bad``."""
    gpus = tuple(
        GpuInfo(
            index=i,
            vendor="nvidia",
            model="NVIDIA H200",
            memory_total_bytes=141 << 30,
            memory_used_bytes=1 << 30,
            pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
            health=bad if (bad is not None and i == 1) else GpuHealth(),
        )
        for i in range(2)
    )
    return NodeInventory(node="gpu-a07", source="nvml", gpus=gpus)


class Reader:
    def __init__(self, inventory: NodeInventory) -> None:
        self.inventory, self.calls = inventory, 0
        self.kwargs: dict[str, Any] = {}

    def __call__(self, **kwargs: Any) -> NodeInventory:
        self.calls += 1
        self.kwargs = kwargs
        return self.inventory


def test_a_cpu_worker_has_nothing_to_report() -> None:
    check = HealthCheck.of(Devices(CPU))
    assert check.bus_id is None and check.xids is None
    assert check.report() == "" and check.report() == ""


def test_the_check_reads_its_own_gpu_at_most_every_interval() -> None:
    now = [0.0]
    read = Reader(node(GpuHealth(ecc_uncorrected=3)))
    check = HealthCheck("0000:19:00.0", every_s=30.0, read=read, clock=lambda: now[0])
    first = NodeInventory.from_json(json.loads(check.report()))
    assert [g.index for g in first.gpus] == [1] and not first.gpus[0].health.healthy  # its own only
    assert read.kwargs == {"topology": False, "xids": None}  # no N² topology calls per step
    now[0] = 29.0
    assert check.report() == "" and read.calls == 1
    now[0] = 30.0
    assert check.report() != "" and read.calls == 2


def test_a_gpu_the_library_does_not_list_reports_nothing() -> None:
    check = HealthCheck("0000:99:00.0", read=Reader(node()))
    assert check.report() == ""
    none = NodeInventory(node="vm", source="none", tried=("pynvml: not installed",))
    assert HealthCheck("0000:18:00.0", read=Reader(none)).report() == ""


def test_the_scripted_fault_reports_xid_79() -> None:
    for vendor in ("nvidia", "amd"):
        check = HealthCheck(None, vendor)
        check.inject()
        problems = unhealthy_members([check.report()], [5], lambda line: None)
        assert problems == {5: ("xid 79: GPU has fallen off the bus",)}


def test_reports_that_do_not_decode_are_logged_and_say_nothing() -> None:
    lines: list[str] = []
    good = json.dumps(node(GpuHealth(xid_or_ras_events=("xid 48",))).for_device(1).to_json())
    reports = [good, "not json", '{"node": "x", "source": "nvml", "gpus": [{"index": -1}]}',
               "[" * 10_000, " " * (MAX_REPORT_CHARS + 1), ""]  # fmt: skip
    got = unhealthy_members(reports, [0, 1, 2, 3, 4, 5], lines.append)
    assert list(got) == [0] and "xid 48" in got[0][0]
    assert len(lines) == 4 and all(line.startswith("health report of GPU ") for line in lines)
    assert all("\n" not in line and len(line) < 300 for line in lines)
    with pytest.raises(ValueError):  # one report per member, or the caller is wrong
        unhealthy_members(["", ""], [0], lines.append)


def test_pci_bus_id_from_torch_properties() -> None:
    props = SimpleNamespace(pci_bus_id=0x18, pci_domain_id=0, pci_device_id=0)
    assert pci_bus_id(props) == "0000:18:00.0"
    assert node().for_device(pci_bus_id(props) or "").gpus[0].index == 0  # NVML's form matches
    assert pci_bus_id(SimpleNamespace(pci_bus_id="0000:c1:00.0")) == "0000:c1:00.0"
    assert pci_bus_id(SimpleNamespace()) is None
