"""GPU inventory and health (``nereus.telemetry``): the value types and their validation, the
health rule, the comparison with the shipped cluster specs, the leader's start-up check and
health hook, ``nereus describe node``, and the real path on this CPU machine (no GPUs, and why)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from nereus.cli import main
from nereus.errors import ConfigError
from nereus.runtime.leader import Leader
from nereus.spec import load_cluster
from nereus.spec.cluster import GIB
from nereus.telemetry import (
    FATAL_XIDS,
    GpuHealth,
    GpuInfo,
    Link,
    NodeInventory,
    compare,
    fatal_event,
    health_problems,
    read_node,
    reconcile,
    unhealthy,
)

pytestmark = pytest.mark.pure

MIB = 1024**2


def gpu(index: int, vendor: str = "nvidia", model: str = "NVIDIA H200", total: int | None = 143_771 * MIB,
        health: GpuHealth | None = None) -> GpuInfo:  # fmt: skip
    return GpuInfo(
        index=index,
        vendor=vendor,  # type: ignore[arg-type]
        model=model,
        memory_total_bytes=total,
        memory_used_bytes=None if total is None else 0,
        health=health or GpuHealth(ecc_uncorrected=0),
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
    )


def node(n: int = 8, *, source: str = "nvml", model: str = "NVIDIA H200", total: int | None = 143_771 * MIB,
         bad: dict[int, GpuHealth] | None = None) -> NodeInventory:  # fmt: skip
    vendor = "amd" if source == "amdsmi" else "nvidia"
    bad = bad or {}
    return NodeInventory(
        node="gpu-a07",
        source=source,  # type: ignore[arg-type]
        gpus=tuple(gpu(i, vendor, model, total, bad.get(i)) for i in range(n)),
        links=tuple(Link(a, b, "nvlink") for a in range(n) for b in range(a + 1, n)),
    )


# ------------------------------------------------------------------ the health rule
@pytest.mark.parametrize(
    ("health", "problems"),
    [
        (GpuHealth(), ()),
        (GpuHealth(ecc_uncorrected=0, retired_or_bad_pages=3, page_limit=60), ()),
        (GpuHealth(throttle_reasons=("hw_thermal", "sw_power_cap")), ()),  # slow, not broken
        (GpuHealth(xid_or_ras_events=("xid 13", "xid 31", "xid 43", "xid 45")), ()),  # applications' faults
        (GpuHealth(ecc_uncorrected=1), ("1 uncorrected ECC errors since the driver loaded",)),
        (
            GpuHealth(pages_pending=True),
            ("a retired page or remapped row is pending (it needs a GPU reset)",),
        ),
        (GpuHealth(page_repair_failed=True), ("page retirement or row remapping failed",)),
        (GpuHealth(retired_or_bad_pages=60, page_limit=60), ("60 retired or bad pages (limit 60)",)),
        (GpuHealth(retired_or_bad_pages=500), ()),  # remapped rows: no count limit
        (GpuHealth(xid_or_ras_events=("xid 79", "xid 79")), ("xid 79: GPU has fallen off the bus",)),
        (GpuHealth(xid_or_ras_events=("ras umc",)), ("RAS uncorrectable errors in block umc",)),
        (
            GpuHealth(xid_or_ras_events=("lost",)),
            ("the GPU is lost (the management library cannot reach it)",),
        ),
    ],
)
def test_health_rule(health: GpuHealth, problems: tuple[str, ...]) -> None:
    assert health.problems == problems and health.healthy is (not problems)


def test_fatal_xids_follow_the_catalog() -> None:
    assert set(FATAL_XIDS) >= {48, 63, 64, 74, 79, 92, 94, 95}
    for xid, why in FATAL_XIDS.items():
        assert fatal_event(f"xid {xid}") == f"xid {xid}: {why}"
        assert not GpuHealth(xid_or_ras_events=(f"xid {xid}",)).healthy
    for xid in (13, 31, 43, 45, 68):
        assert fatal_event(f"xid {xid}") is None
    assert fatal_event("something else") is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ecc_uncorrected": -1},
        {"ecc_uncorrected": True},
        {"retired_or_bad_pages": 1.5},
        {"page_limit": 0},
        {"pages_pending": 1},
        {"xid_or_ras_events": ("xid79",)},
        {"xid_or_ras_events": ["xid 79"]},
        {"xid_or_ras_events": ("ras UMC",)},
        {"throttle_reasons": ("Thermal Slowdown",)},
        {"throttle_reasons": tuple(f"r{i}" for i in range(65))},
    ],
)
def test_health_refuses_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="GpuHealth"):
        GpuHealth(**kwargs)


def test_value_types_refuse_bad_values() -> None:
    with pytest.raises(ValueError, match="index"):
        gpu(-1)
    with pytest.raises(ValueError, match="vendor"):
        gpu(0, vendor="intel")
    with pytest.raises(ValueError, match="model"):
        gpu(0, model="")
    with pytest.raises(ValueError, match="exceeds"):
        replace(gpu(0), memory_used_bytes=10**12)
    with pytest.raises(ValueError, match="a < b"):
        Link(3, 3, "nvlink")
    with pytest.raises(ValueError, match="kind"):
        Link(0, 1, "infiniband")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source 'none'"):
        NodeInventory(node="n", source="none", gpus=(gpu(0),))
    with pytest.raises(ValueError, match="vendor amd"):
        NodeInventory(node="n", source="nvml", gpus=(gpu(0, vendor="amd"),))
    with pytest.raises(ValueError, match="repeats"):
        NodeInventory(node="n", source="nvml", gpus=(gpu(0), gpu(0)))
    with pytest.raises(ValueError, match="does not hold"):
        NodeInventory(node="n", source="nvml", gpus=(gpu(0),), links=(Link(0, 1, "pcie"),))
    with pytest.raises(ValueError, match="twice"):
        NodeInventory(node="n", source="nvml", gpus=(gpu(0), gpu(1)), links=(Link(0, 1, "pcie"),) * 2)
    with pytest.raises(ValueError, match="node"):
        NodeInventory(node="a\nb", source="none")


def test_json_round_trip_recomputes_the_verdicts() -> None:
    inv = node(bad={5: GpuHealth(xid_or_ras_events=("xid 79",)), 2: GpuHealth(ecc_uncorrected=4)})
    doc = json.loads(json.dumps(inv.to_json()))
    assert doc["unhealthy"] == [2, 5] and doc["gpu_count"] == 8 and len(doc["links"]) == 28
    assert doc["gpus"][5]["health"]["problems"] == ["xid 79: GPU has fallen off the bus"]
    assert NodeInventory.from_json(doc) == inv
    doc["gpus"][5]["health"]["healthy"] = True  # a report cannot vote itself healthy
    doc["gpus"][5]["health"]["problems"] = []
    assert unhealthy(NodeInventory.from_json(doc)) == (2, 5)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(gpus="x"),
        lambda d: d["gpus"][0].update(index="0"),
        lambda d: d["gpus"][0].update(memory_total_bytes=1.5),
        lambda d: d["gpus"][0]["health"].update(pages_pending="yes"),
        lambda d: d["gpus"][0]["health"].update(xid_or_ras_events="xid 79"),
        lambda d: d["links"][0].update(a=True),
        lambda d: d.update(source="nvidia-smi"),
        lambda d: d.update(tried=[1]),
        lambda d: d.update(node=None),
    ],
)
def test_from_json_refuses_malformed_reports(mutate: Any) -> None:
    doc = node(2).to_json()
    mutate(doc)
    with pytest.raises(ValueError):
        NodeInventory.from_json(doc)


def test_derived_facts() -> None:
    inv = node(bad={3: GpuHealth(ecc_uncorrected=1)})
    two = replace(inv, links=tuple(k for k in inv.links if (k.a < 4) == (k.b < 4)))
    assert two.islands("nvlink") == ((0, 1, 2, 3), (4, 5, 6, 7)) and two.islands("xgmi") == tuple(
        (i,) for i in range(8)
    )
    assert two.link(6, 4) == "nvlink" and two.link(0, 7) is None
    mine = inv.for_device("0000:1b:00.0")  # torch's spelling of NVML's 00000000:1B:00.0
    assert [g.index for g in mine.gpus] == [3] and mine.links == () and unhealthy(mine) == (3,)
    assert inv.for_device(5).gpus == (inv.gpu(5),)
    with pytest.raises(KeyError):
        inv.for_device("0000:99:00.0")
    assert inv.summary() == "gpu-a07: 8 × NVIDIA H200, 140.4 GiB each (via nvml), unhealthy: [3]"
    mixed = replace(inv, gpus=(*inv.gpus[:7], gpu(7, model="NVIDIA H100", total=81_559 * MIB)))
    assert mixed.model is None and mixed.memory_per_gpu_bytes == 81_559 * MIB


# ------------------------------------------------------------------ the cluster spec
def test_compare_with_the_h200_cluster() -> None:
    h200 = load_cluster("h200-ib")
    assert compare(node(), h200) == []
    assert reconcile(node(), h200) == (h200, None)
    measured = node(4, model="NVIDIA H100 80GB HBM3", total=81_559 * MIB)
    assert compare(measured, h200) == [
        "gpus_per_node 8 → 4",
        "gpu_memory_gib 140 → 79.6",
        "gpu_model H200-SXM-141GB → NVIDIA H100 80GB HBM3",
    ]
    fixed, line = reconcile(measured, h200)
    assert fixed == replace(h200, gpus_per_node=4, gpu_memory_gib=79.6, gpu_model="NVIDIA H100 80GB HBM3")
    assert line == (
        "node gpu-a07: cluster h200-ib differs from the GPUs measured by nvml (gpus_per_node 8 → 4; "
        "gpu_memory_gib 140 → 79.6; gpu_model H200-SXM-141GB → NVIDIA H100 80GB HBM3); "
        "the measured values are used"
    )
    # within 5% of the spec's memory is the same GPU (drivers keep some for themselves)
    assert compare(node(total=134 * GIB), h200) == []
    assert compare(node(total=132 * GIB), h200) == ["gpu_memory_gib 140 → 132"]
    # the same product under NVML's name, whatever the form factor
    assert compare(node(model="NVIDIA H200 NVL"), h200) == []
    # a GPU memory the model cannot say is not compared
    assert compare(node(total=None), h200) == []


def test_compare_with_the_mi250x_cluster() -> None:
    mi250x = load_cluster("mi250x-slingshot")
    gcds = node(source="amdsmi", model="AMD Instinct MI250X", total=64 * GIB)
    assert compare(gcds, mi250x) == []
    assert (
        compare(
            replace(gcds, gpus=tuple(replace(g, model="AMD Instinct MI250X / MI250") for g in gcds.gpus)),
            mi250x,
        )
        == []
    )
    mi300 = node(source="amdsmi", model="AMD Instinct MI300X", total=192 * GIB)
    assert compare(mi300, mi250x) == ["gpu_memory_gib 64 → 192", "gpu_model MI250X GCD → AMD Instinct MI300X"]
    fixed, line = reconcile(mi300, mi250x)
    assert (fixed.gpus_per_node, fixed.gpu_memory_gib, fixed.gpu_model) == (8, 192, "AMD Instinct MI300X")
    assert fixed.vendor == mi250x.vendor and fixed.nodes == 128 and line is not None and "\n" not in line


def test_nothing_measured_nothing_compared_and_impossible_values_refused() -> None:
    h200 = load_cluster("h200-ib")
    cpu = NodeInventory(node="vm", source="none", tried=("pynvml: not installed",))
    assert compare(cpu, h200) == [] and reconcile(cpu, h200) == (h200, None)
    tiny = node(total=1 * GIB)  # below the spec's 2 GiB runtime reserve
    with pytest.raises(ConfigError, match="no valid cluster: runtime_reserved_gib"):
        reconcile(tiny, h200)


# ------------------------------------------------------------------ the leader's hooks
@dataclass
class FakeMembership:
    members: tuple[int, ...]
    lines: list[str] = field(default_factory=list)
    gpu: int = 0

    def log(self, line: str, kind: str = "") -> None:
        self.lines.append(line)


def leader(cluster: str = "h200-ib", members: tuple[int, ...] = tuple(range(16))) -> Leader:
    """A leader with only what these methods use (a real one needs a running job)."""
    obj = Leader.__new__(Leader)
    obj.m = FakeMembership(members)  # type: ignore[assignment]
    obj.cluster = load_cluster(cluster)
    return obj


def test_leader_check_inventory(capsys: pytest.CaptureFixture[str]) -> None:
    lead = leader()
    assert lead.check_inventory(node()) == lead.cluster
    assert lead.m.lines == [] and capsys.readouterr().err == ""  # type: ignore[attr-defined]
    fixed = lead.check_inventory(node(4))
    assert fixed.gpus_per_node == 4 and lead.cluster.gpus_per_node == 8
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nereus: warning: node gpu-a07: cluster h200-ib differs")
    assert lead.m.lines == [f"inventory: {err.removeprefix('nereus: warning: ').strip()}"]  # type: ignore[attr-defined]
    cpu = NodeInventory(node="vm", source="none", tried=("pynvml: not installed",))
    assert leader("local-cpu").check_inventory(cpu) == load_cluster("local-cpu")
    assert capsys.readouterr().err == ""


def test_unhealthy_is_a_gpu_loss() -> None:
    inv = node(bad={5: GpuHealth(xid_or_ras_events=("xid 79",)), 2: GpuHealth(ecc_uncorrected=4)})
    assert unhealthy(inv) == (2, 5) and unhealthy(node()) == ()
    # each worker reports its own device, keyed by its job GPU id (worker 13 drives local GPU 5)
    reports: dict[int, NodeInventory | None] = {
        8: inv.for_device(0),
        10: inv.for_device(2),
        13: inv.for_device(5),
        14: None,  # no library on that worker: says nothing
    }
    assert health_problems(reports) == {
        10: ("4 uncorrected ECC errors since the driver loaded",),
        13: ("xid 79: GPU has fallen off the bus",),
    }
    # what the leader receives: every rank's report as JSON, in rank order
    members = (0, 8, 10, 13, 14, 15)
    wire = ["", *(json.dumps(r.to_json()) if r else "" for r in reports.values()), '{"node": 1}']
    lead = leader(members=members)
    assert lead.condemned(wire) == (10, 13)
    lines = lead.m.lines  # type: ignore[attr-defined]
    assert any(line.startswith("health report of GPU 15 ignored") for line in lines)  # garbage: ignored
    assert "GPU 13 is unhealthy (xid 79: GPU has fallen off the bus): treated as lost" in lines
    assert lead.condemned([]) == ()  # nothing reported: nothing judged
    # the leader's own GPU is named in the log but never dropped (it hosts the controller)
    own = leader(members=(13, 14))
    own.m.gpu = 13  # type: ignore[misc]
    assert own.condemned([json.dumps(inv.for_device(5).to_json()), ""]) == ()
    assert any("hosts the job's controller" in line for line in own.m.lines)  # type: ignore[attr-defined]


# ------------------------------------------------------------------ this machine, the CLI
def test_read_node_on_this_machine() -> None:
    inv = read_node()
    if inv.source != "none":
        pytest.skip(f"this machine has GPUs ({inv.summary()})")
    assert inv.gpus == () and inv.links == () and unhealthy(inv) == ()
    assert [t.split(":")[0] for t in inv.tried] == ["pynvml", "amdsmi"]
    assert "no GPUs found" in inv.summary()


def test_describe_node_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    if read_node().source != "none":
        pytest.skip("this machine has GPUs")
    assert main(["describe", "node"]) == 0
    out = capsys.readouterr().out
    assert "no GPUs found" in out and "tried pynvml: " in out and "tried amdsmi: " in out
    assert main(["describe", "node", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["source"], doc["gpus"], doc["gpu_count"]) == ("none", [], 0) and len(doc["tried"]) == 2


def test_describe_node_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    inv = node(
        bad={
            4: GpuHealth(xid_or_ras_events=("xid 13",)),
            5: GpuHealth(xid_or_ras_events=("xid 79",)),
            6: GpuHealth(throttle_reasons=("hw_thermal",)),
        }
    )
    inv = replace(
        inv,
        links=tuple(
            Link(a, b, "nvlink" if (a < 4) == (b < 4) else "smp") for a in range(8) for b in range(a + 1, 8)
        ),
        errors=("gpu 3 memory: NVMLError: Unknown Error",),
    )
    monkeypatch.setattr("nereus.cli.read_node", lambda: inv)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["describe", "node"]) == 0
    out = capsys.readouterr().out
    assert "node gpu-a07: 8 GPUs via nvml" in out and out.count("NVIDIA H200") == 8
    assert (
        "UNHEALTHY" in out and "xid 79: GPU has fallen off the bus" in out and "throttled: hw_thermal" in out
    )
    assert "NV islands: 0-3  4-7" in out and "SMP" in out and "events: xid 13" in out
    assert "failed call: gpu 3 memory: NVMLError: Unknown Error" in out
    assert main(["describe", "node", "--json"]) == 0
    assert NodeInventory.from_json(json.loads(capsys.readouterr().out)) == inv


def test_describe_node_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["describe", "node", "gpu-a07"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "nereus describe: error: describe node takes no name (it reads the node it runs on), got 'gpu-a07' "
        "(see nereus describe --help)\n"
    )
    with pytest.raises(SystemExit) as exc:
        main(["describe", "cluster"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "nereus describe: error: the following arguments are required: name (see nereus describe --help)\n"
    )


def test_the_package_imports_no_torch_and_no_gpu_library() -> None:
    code = (
        "import sys, nereus.telemetry, nereus.telemetry.nvml, nereus.telemetry.amd; "
        "loaded = [m for m in ('torch', 'pynvml', 'amdsmi') if m in sys.modules]; "
        "nereus.telemetry.read_node(); "
        "print(loaded, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "[] False", out.stderr
