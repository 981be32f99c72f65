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
  the CPU, or where no management library is installed);
- a zero-copy reshard (tp2·pp2 → tp4 on 4 ranks, tp2 → pp2 on 2) against the same messages sent
  bare (NCCL with one GPU per rank, gloo on the CPU): byte for byte the packed path's state, and
  its waves' time against the bare messages' time (issue 21);
- the start-up collective sweep (``nereus.runtime.sweep``) over the world's backend for the
  device (NCCL with one GPU per rank, gloo on the CPU): every probe timed on every rank alike, and
  the calibration it gives;
- a peer that stops answering (it never enters the collective): the rank waiting on it raises a
  peer failure after the world's collective timeout and lives on to report it (NCCL's error
  handling as ``activate`` sets it: the communicators aborted, the process kept).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.devices import (
    Devices,
    StageMemory,
    StageOutOfMemoryError,
    abort_world,
    activate,
    init_world,
    set_world_timeout,
    synchronize,
)
from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Candidate, Layout, Plan
from nereus.plan.opclass import Collective, OpClass
from nereus.plan.sweep import Probe
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


# ------------------------------------------------------------------ a reshard against bare messages
def _reshard_move(world: int, model: str) -> StageMove:
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    a, b = (Layout(2, 2), Layout(4, 1)) if world == 4 else (Layout(2, 1), Layout(1, 2))
    gpus = (tuple(range(world)),)
    return StageMove.between("actor.train", load_model(model), policy, a, gpus, b, gpus)


def _bare(
    messages: list[tuple[int, int, int, int]], rank: int, device: torch.device, sends: dict[int, torch.Tensor]
) -> None:
    """The same messages, node by node, as bare sends and receives: sent from tensors that exist
    (``sends``, by index in ``messages``), received into fresh ones."""
    for node in sorted({m[0] for m in messages}):
        ops = [
            dist.P2POp(
                dist.isend if src == rank else dist.irecv,
                sends[i] if src == rank else torch.empty(n, dtype=torch.uint8, device=device),
                dst if src == rank else src,
                tag=node,
            )
            for i, (at, src, dst, n) in enumerate(messages)
            if at == node and rank in (src, dst)
        ]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()


def _sends(
    messages: list[tuple[int, int, int, int]], rank: int, device: torch.device
) -> dict[int, torch.Tensor]:
    return {
        i: torch.ones(m[3], dtype=torch.uint8, device=device) for i, m in enumerate(messages) if m[1] == rank
    }


def _pairs(messages: list[tuple[int, int, int, int]]) -> dict[tuple[int, int], int]:
    """Bytes per (from rank, to rank): the reshard's traffic matrix."""
    out: dict[tuple[int, int], int] = {}
    for _, src, dst, n in messages:
        out[src, dst] = out.get((src, dst), 0) + n
    return out


def _bus(pairs: dict[tuple[int, int], int], rank: int, bufs: dict[tuple[int, int], torch.Tensor]) -> None:
    """The bus's speed for the reshard's traffic: one message per pair, the same bytes, into and
    out of buffers allocated beforehand (``bufs``): what NCCL's point-to-point bandwidth allows."""
    ops = [
        dist.P2POp(dist.isend if src == rank else dist.irecv, bufs[src, dst], dst if src == rank else src)
        for src, dst in pairs
        if rank in (src, dst)
    ]
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()


def _reshard_worker(rank: int, world: int, backend: str, model: str, repeats: int, tmp: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        move = _reshard_move(world, model)
        links = LinkModel(load_cluster("local-cpu"), Efficiencies())
        dag = build_dag([move], {"actor.train": 2}, links, 2**42)

        def start() -> StateHolder:
            holder = StateHolder(rank, device)
            t, p = move.current[0].position(rank)
            rs = RankState.empty(
                "actor.train", move.model, move.current_layout, t, p, move.policy, None, device
            )
            for j, buf in enumerate(rs.buffers.values()):  # distinct content per rank, kind, element
                buf.copy_((torch.arange(buf.numel(), device=device) * 7 + rank * 13 + j) % 1021)
            holder.units["actor.train"] = rs
            return holder

        def timed(fn):  # type: ignore[no-untyped-def]
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            sync()
            dist.barrier()
            return time.perf_counter() - t0, out

        times: dict[str, list[float]] = {"nereus": [], "waves": [], "raw": [], "packed": [], "bus": []}
        for r in range(repeats + 1):  # the first round warms up (communicators, staging)
            zc = Executor(dag, [move], start(), {g: g for g in range(world)})
            run_s, _ = timed(zc.run)
            got = zc.holder.by_stage()["actor.train"]
            gathered: list[object] = [None] * world
            dist.all_gather_object(gathered, zc.messages)
            messages = [m for ms in gathered for m in ms]  # type: ignore[attr-defined]
            sends = _sends(messages, rank, device)
            raw_s, _ = timed(lambda msgs=messages, b=sends: _bare(msgs, rank, device, b))
            del sends
            pairs = _pairs(messages)
            bufs = {
                (a, b): torch.ones(n, dtype=torch.uint8, device=device)
                for (a, b), n in pairs.items()
                if rank in (a, b)
            }
            bus_s, _ = timed(lambda p=pairs, b=bufs: _bus(p, rank, b))
            del bufs
            packed = Executor(dag, [move], start(), {g: g for g in range(world)}, zero_copy=False)
            packed_s, _ = timed(packed.run)
            want = packed.holder.by_stage()["actor.train"]
            for k, buf in want.buffers.items():
                assert torch.equal(got.buffers[k], buf), f"rank {rank} {k.value}: zero-copy != packed"
            assert got.state == want.state
            if r == 0:  # staging bounded to 4 KiB a peer: the staged chunks go out in many batches
                batched = Executor(dag, [move], start(), {g: g for g in range(world)}, staging_budget=4096)
                batched.run()
                small = batched.holder.by_stage()["actor.train"]
                for k, buf in want.buffers.items():
                    assert torch.equal(small.buffers[k], buf), f"rank {rank} {k.value}: batched != packed"
                assert small.state == want.state
            if r:
                waves = torch.tensor([sum(zc.wave_seconds)], dtype=torch.float64, device=device)
                dist.all_reduce(waves, op=dist.ReduceOp.MAX)
                times["nereus"].append(run_s)
                times["waves"].append(float(waves.item()))
                times["raw"].append(raw_s)
                times["packed"].append(packed_s)
                times["bus"].append(bus_s)
        if rank == 0:
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            doc = {"seconds": med, "bytes": sum(m[3] for m in messages), "messages": len(messages)}
            Path(tmp, "result.json").write_text(json.dumps(doc))
    finally:
        dist.destroy_process_group()


def check_reshard_against_raw(
    backend: str, tmp: Path, world: int, model: str, repeats: int
) -> dict[str, object]:
    """Spawn ``world`` ranks (one GPU each under NCCL) that reshard one trainer replica of ``model``
    (fp32 Adam) zero-copy, check it against the packed path byte for byte, and time it against its
    messages sent bare. Returns the medians and ``ratio``: the waves' time (the transition less
    its process group's setup) over the bare messages'; ``bus_gbps``: bytes over the waves' time;
    ``bus_fraction``: that against ``bus_ref_gbps``, the same bytes between the same pairs as one
    preallocated message per pair (the backend's point-to-point bandwidth for this traffic)."""
    mp.spawn(_reshard_worker, args=(world, backend, model, repeats, str(tmp)), nprocs=world, join=True)
    doc = json.loads((tmp / "result.json").read_text())
    s = doc["seconds"]
    doc["ratio"] = s["waves"] / s["raw"]
    doc["run_ratio"] = s["nereus"] / s["raw"]
    doc["packed_ratio"] = s["packed"] / s["raw"]
    doc["bus_gbps"] = doc["bytes"] / s["waves"] / 1e9
    doc["bus_ref_gbps"] = doc["bytes"] / s["bus"] / 1e9
    doc["bus_fraction"] = s["bus"] / s["waves"]
    return doc


def _sweep_worker(rank: int, world: int, backend: str, gpus_per_node: int, tmp: str) -> None:
    from nereus.runtime.sweep import sweep_world

    devices = Devices(torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu"))
    if devices.accelerated:
        torch.cuda.set_device(devices.device)
    store = dist.FileStore(f"{tmp}/store", world)
    init_world(devices, store, rank, world, timedelta(seconds=120))
    try:
        timed = sweep_world(tuple(range(world)), rank, gpus_per_node, devices)
        rows = [[p.kind.value, list(p.gpus), p.per_node, p.nodes, p.nbytes, t] for p, t in timed]
        Path(tmp, f"sweep-{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def check_sweep(
    backend: str, tmp: Path, world: int, gpus_per_node: int, timed_bound: bool = True
) -> list[tuple[Probe, float]]:
    """Spawn ``world`` ranks (``gpus_per_node`` per node: nodes are GPU-id ranges) that run the
    start-up sweep; every rank must return the same probes and times, every time positive, and
    (``timed_bound``; not on two shared CPU cores, where a 4 KiB call can stall for milliseconds)
    a 1 MiB all-reduce inside a node must take longer than a 4 KiB one. Returns the probes and
    their seconds per call."""
    mp.spawn(_sweep_worker, args=(world, backend, gpus_per_node, str(tmp)), nprocs=world, join=True)
    rows = [json.loads((tmp / f"sweep-{r}.json").read_text()) for r in range(world)]
    assert all(r == rows[0] for r in rows), "ranks disagree on the sweep"
    timed = [(Probe(Collective(k), tuple(g), n, m, b), t) for k, g, n, m, b, t in rows[0]]
    assert timed and all(t > 0 for _, t in timed), timed
    inside = {p.nbytes: t for p, t in timed if p.op_class is OpClass.ALLREDUCE_INTRA and len(p.gpus) == 2}
    assert not timed_bound or inside[2**20] > inside[4096], inside
    return timed


def _silent_peer_worker(rank: int, backend: str, timeout_s: float, tmp: str) -> None:
    from nereus.runtime.comm import is_peer_failure

    devices = Devices(torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu"))
    activate(devices)  # NCCL's error handling too, as a worker sets it
    init_world(devices, dist.FileStore(f"{tmp}/store", 2), rank, 2, timedelta(seconds=120))
    set_world_timeout(timedelta(seconds=timeout_s))
    t = torch.ones(1024, device=devices.device)
    dist.all_reduce(t)  # both ranks: the communicators exist
    synchronize(devices)
    if rank == 1:  # stops answering: never enters the next collective, keeps its connections
        time.sleep(timeout_s + (15 if devices.accelerated else 4))  # NCCL's watchdog polls: it lags
        os._exit(0)
    started, result = time.monotonic(), {"raised": False}
    try:
        dist.all_reduce(t)
        synchronize(devices)
        dist.all_reduce(t)  # NCCL: a communicator the watchdog aborted refuses the next one
        synchronize(devices)
    except Exception as exc:
        result = {"raised": True, "peer_failure": is_peer_failure(exc), "error": str(exc)[:300]}
    result["seconds"] = time.monotonic() - started
    Path(tmp, "silent.json").write_text(json.dumps(result))
    abort_world()
    os._exit(0)  # alive to report: the error did not tear this process down


def check_a_silent_peer_times_out(backend: str, tmp: Path, timeout_s: float = 3.0) -> dict[str, object]:
    """Two ranks; rank 1 stops answering. Rank 0's collective raises a peer failure after the
    world's ``timeout_s`` (not torch's 30 minutes), and rank 0 is still alive to write so."""
    mp.spawn(_silent_peer_worker, args=(backend, timeout_s, str(tmp)), nprocs=2, join=True)
    result = json.loads((tmp / "silent.json").read_text())
    assert result["raised"] and result["peer_failure"], result
    assert 0.8 * timeout_s <= result["seconds"] <= timeout_s + 60, result
    return result
