"""Checks that run the same code on any device: the GPU runner (``tests/gpu/``) calls them with a
GPU, their CPU twins (``tests/test_device_twins.py``) with the CPU.

- a transition executed on the device in a world of one (a weight sync's restore: the trainer's
  state becomes the generation copy, every byte checked);
- the boundary snapshots: two taken, the trainer changed after each, each restored exactly,
  twice; the older dropped once they settle;
- a model-stage's peak memory (the allocator's on a GPU; none on the CPU);
- an out-of-memory error inside a model-stage's work, named after it (a real one on a GPU under a
  small memory fraction; the same exception type raised from inside the stage on the CPU);
- a worker's health check: its own GPU's inventory, decoded as the leader decodes it (nothing on
  the CPU, or where no management library is installed).
"""

from __future__ import annotations

import json
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.devices import Devices, StageMemory, StageOutOfMemoryError, abort_world, init_world
from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Candidate, Layout, Plan
from nereus.runtime.health import HealthCheck, unhealthy_members
from nereus.runtime.snapshot import Snapshot
from nereus.spec import load_cluster, load_model, load_workload
from nereus.spec.workload import STAGE_ORDER, Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.telemetry import NodeInventory, read_node
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.execute import Executor

MODEL = "tiny-qwen3"
OUT = r"actor\.gen ran out of memory"


def full(kind: BufferKind, name: str) -> torch.Tensor:
    """The whole tensor ``name`` of buffer ``kind``, deterministic (fp32, on the CPU)."""
    shape = {s.source: s.full_shape for s in shards(load_model(MODEL), Layout(1, 1), 0, 0)}[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind.value}/{name}".encode()))
    return torch.randn(shape, generator=g)


def trainer(devices: Devices) -> RankState:
    policy = StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED)
    return RankState.from_full(
        "actor.train", load_model(MODEL), Layout(1, 1), 0, 0, policy, full, None, devices.device
    )


def check_transition_in_a_world_of_one(devices: Devices, tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), 1)
    init_world(devices, store, 0, 1, timedelta(seconds=60))
    try:
        model, one = load_model(MODEL), Layout(1, 1)
        holder = StateHolder(0, devices.device)
        holder.units["actor.train"] = trainer(devices)
        train = StageMove.between(
            "actor.train", model, holder.units["actor.train"].policy, one, [(0,)], one, [(0,)]
        )
        gen_policy = StatePolicy.of(Stage.GEN, Precision.BF16_MIXED)
        gen = StageMove.between("actor.gen", model, gen_policy, one, (), one, [(0,)], "actor.train", (0,))
        links = LinkModel(load_cluster("local-cpu"), Efficiencies())
        dag = build_dag([gen, train], {"actor.gen": 0, "actor.train": 2}, links, 2**40)
        Executor(dag, [gen, train], holder, {0: 0}).run()
        got = holder.by_stage()["actor.gen"]
        assert got.device == devices.device
        want = RankState.from_full("actor.gen", model, one, 0, 0, gen_policy, full)
        assert torch.equal(got.buffers[BufferKind.PARAM].cpu(), want.buffers[BufferKind.PARAM])
        assert got.state == holder.by_stage()["actor.train"].state
    finally:
        abort_world()


def small_plan(workload: str = "grpo") -> Plan:
    """A plan that tags the snapshots: the first model-stage of every stage on GPU 0, concurrent
    ones on GPUs 1, 2, … (one GPU each)."""
    wf = load_workload(workload).workflow()
    cands = [
        Candidate(ms.name, Layout(1, 1), 1, (i,))
        for stage in STAGE_ORDER
        for i, ms in enumerate(wf.by_stage(stage))
    ]
    return Plan(wf, tuple(cands), tuple(range(max(c.gpus[0] for c in cands) + 1)))


def check_snapshot(devices: Devices) -> None:
    kept = trainer(devices)
    plan = small_plan()
    snap = Snapshot(devices.device)
    first = snap.take(3, 7, plan, {"actor.train": kept}, {"actor.train"})
    snap.fence()
    original = {k: b.clone() for k, b in kept.buffers.items()}
    for b in kept.buffers.values():
        b.add_(1)  # the step changes the trainer in place
    second = snap.take(3, 8, plan, {"actor.train": kept}, {"actor.train"})  # the next boundary
    snap.fence()
    for b in kept.buffers.values():
        b.add_(1)
    assert snap.marks() == (first, second) and snap.steps() == (7, 8)
    for _ in range(2):  # a second failure finds each snapshot intact
        for mark, plus in ((first, 0), (second, 1)):
            back = snap.restore(mark)["actor.train"]
            assert back.device == devices.device
            assert all(torch.equal(back.buffers[k], original[k] + plus) for k in original)
            back.buffers[BufferKind.PARAM].add_(1)
    snap.settle()  # every rank took the second: the first is gone
    assert snap.marks() == (second,)
    with pytest.raises(LookupError, match=r"no snapshot \(3, 0\)"):
        snap.restore(first)
    back = snap.back_to(second)["actor.train"]
    assert all(torch.equal(back.buffers[k], original[k] + 1) for k in original)


def check_stage_memory(devices: Devices) -> None:
    memory = StageMemory(devices)
    size = 64 << 20
    with memory.measure("actor.train", own_bytes=1 << 20):
        x = torch.empty(size, dtype=torch.uint8, device=devices.device)
        del x
    if not devices.accelerated:
        assert memory.peaks == {} and memory.reserved == {}  # no allocator to ask
        return
    peak = memory.peaks["actor.train"]
    assert size + (1 << 20) <= peak <= size + (1 << 20) + (8 << 20), peak
    assert memory.reserved["actor.train"] >= size  # the allocator reserved at least the tensor
    memory.clear()
    assert memory.peaks == {} and memory.reserved == {}


def check_out_of_memory(devices: Devices) -> None:
    memory = StageMemory(devices)
    if devices.accelerated:
        total = torch.cuda.get_device_properties(devices.device).total_memory
        torch.cuda.set_per_process_memory_fraction(0.01, devices.device)
        try:
            with (
                pytest.raises(StageOutOfMemoryError, match=r"actor\.gen ran out of memory"),
                memory.measure("actor.gen", 0),
            ):
                torch.empty(total // 10, dtype=torch.uint8, device=devices.device)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, devices.device)
            torch.cuda.empty_cache()
        return
    with (
        pytest.raises(StageOutOfMemoryError, match=r"actor\.gen ran out of memory"),
        memory.measure("actor.gen", 0),
    ):
        raise torch.OutOfMemoryError("an injected out-of-memory error")


def check_health(devices: Devices) -> None:
    check = HealthCheck.of(devices)
    try:
        text = check.report()
        if not devices.accelerated or read_node(topology=False).source == "none":
            assert text == "", text
            return
        assert check.bus_id is not None and text, "a GPU worker reports its GPU's health"
        own = NodeInventory.from_json(json.loads(text))
        assert len(own.gpus) == 1 and own.gpus[0].pci_bus_id is not None
        assert own.for_device(check.bus_id).gpus == own.gpus  # the worker's own device
        lines: list[str] = []
        problems = unhealthy_members([text], [0], lines.append)
        assert lines == [] and problems == ({0: own.gpus[0].health.problems} if problems else {})
        assert check.report() == ""  # not due again yet
    finally:
        check.close()
