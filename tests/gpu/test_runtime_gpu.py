"""The runtime's device paths on a GPU (CUDA or ROCm); skipped cleanly elsewhere; run by
``tests/gpu/run.sh``. Every check is a function of ``tests/device_checks.py`` whose CPU twin runs
in ``tests/test_device_twins.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nereus.devices import Devices
from tests import device_checks as checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


@pytest.fixture
def gpu() -> Devices:
    torch.cuda.set_device(0)
    return Devices(torch.device("cuda", 0))


def test_snapshot_to_pinned_memory_and_back(gpu: Devices) -> None:
    checks.check_snapshot(gpu)


def test_stage_memory_is_the_allocators_peak(gpu: Devices) -> None:
    checks.check_stage_memory(gpu)


def test_a_real_out_of_memory_error_is_named_after_its_stage(gpu: Devices) -> None:
    checks.check_out_of_memory(gpu)


@pytest.mark.timeout(300)
def test_a_transition_runs_on_the_device(gpu: Devices, tmp_path: Path) -> None:
    checks.check_transition_in_a_world_of_one(gpu, tmp_path)


def test_the_health_check_reads_this_gpu(gpu: Devices) -> None:
    checks.check_health(gpu)


def test_describe_node_sees_the_gpus() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "describe", "node", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["gpus"]) == torch.cuda.device_count(), doc


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a job's workers need one GPU each: needs 2 GPUs")
@pytest.mark.timeout(600)
def test_a_short_run_on_the_gpus(tmp_path: Path) -> None:
    exp = tmp_path / "gpu.yaml"
    workers = min(4, torch.cuda.device_count())
    exp.write_text(
        f"name: gpu\nworkload: grpo-tiny\nmodel: tiny-llama\nworkers: {workers}\nsteps: 3\n"
        "task: {kind: copy, n: 64, difficulty: 2, length: 2}\nmax_new_tokens: 2\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=540, check=False, env={**os.environ, "NEREUS_DEVICE": "cuda"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3


@pytest.mark.timeout(300)
def test_more_workers_than_gpus_is_refused_with_one_line(tmp_path: Path) -> None:
    """A GPU runs one worker: ``nereus run`` with one worker more than the visible GPUs exits 2
    naming ``workers``, and leaves no run folder (CPU twin: ``test_devices.py``'s ``shared``)."""
    exp, out = tmp_path / "over.yaml", tmp_path / "out"
    exp.write_text(
        f"name: over\nworkload: grpo-tiny\nmodel: tiny-llama\nworkers: {torch.cuda.device_count() + 1}\n"
        "steps: 2\ntask: {kind: copy, n: 64, difficulty: 2, length: 2}\nmax_new_tokens: 2\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: workers: " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


BUS_FRACTION = 0.5  # the reshard's bytes per second against one bare message per GPU pair


@pytest.fixture(scope="module")
def reshard(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A zero-copy reshard of a ~125M-parameter trainer (fp32 Adam, 1.4 GiB) over NCCL, timed
    against its messages sent bare and against the bus (run once for the tests below)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: needs 2 GPUs")
    world = 4 if torch.cuda.device_count() >= 4 else 2
    got = checks.check_reshard_against_raw("nccl", tmp_path_factory.mktemp("reshard"), world, "llama-125m", 3)
    print(f"reshard on {world} GPUs: {got}")
    return got


@pytest.mark.timeout(600)
def test_a_zero_copy_reshard_runs_at_the_wires_speed(reshard: dict[str, Any]) -> None:
    """Issue 21: byte for byte the packed path's state, within 1.3× of the same messages sent bare
    (its process group's setup left out: every transition makes a fresh one)."""
    assert reshard["ratio"] <= 1.3, reshard


@pytest.mark.timeout(600)
def test_a_zero_copy_reshard_reaches_the_nccl_bus_bandwidth(reshard: dict[str, Any]) -> None:
    """Issue 21: the reshard's waves move its bytes at ≥ BUS_FRACTION of NCCL's point-to-point
    bandwidth for the same traffic (the same bytes between the same GPU pairs as one preallocated
    message per pair): what its many chunk messages and staging copies may cost on a GPU."""
    assert reshard["bus_fraction"] >= BUS_FRACTION, reshard


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: needs 2 GPUs")
@pytest.mark.timeout(180)
def test_a_silent_peer_times_out_over_nccl_and_the_waiting_rank_lives(tmp_path: Path) -> None:
    """A rank that stops answering: NCCL's watchdog aborts the waiting rank's communicators after
    the world's collective timeout (3 s here) and that rank raises and lives on (error handling
    2, as workers set it; torch's default, 3, would have torn it down)."""
    print(checks.check_a_silent_peer_times_out("nccl", tmp_path))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: needs 2 GPUs")
@pytest.mark.timeout(600)
def test_the_start_up_collective_sweep_over_nccl(tmp_path: Path) -> None:
    """The sweep's probes over NCCL, the whole size range (4 KiB-1 GiB): every rank agrees, and
    the largest all-reduce inside a node moves its bytes at NVLink / Infinity Fabric speed (over
    10 GB/s of bus bandwidth: not a CPU path)."""
    world = 4 if torch.cuda.device_count() >= 4 else 2
    timed = checks.check_sweep("nccl", tmp_path, world, 2)
    largest = max((p for p, _ in timed if p.op_class.value == "allreduce.intra"), key=lambda p: p.nbytes)
    seconds = dict(timed)[largest]
    busbw = 2 * (len(largest.gpus) - 1) / len(largest.gpus) * largest.nbytes / seconds
    print(f"sweep over {world} GPUs: {len(timed)} probes, 1 GiB all-reduce at {busbw / 1e9:.0f} GB/s")
    assert largest.nbytes == 2**30 and busbw > 10e9, busbw
