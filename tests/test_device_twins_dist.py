"""The CPU twins of the GPU runner's transition on the device, zero-copy reshard, start-up
collective sweep, silent peer (``tests/gpu/test_runtime_gpu.py``) and vLLM checks
(``tests/gpu/test_vllm_gpu.py``): the same functions (``tests/device_checks.py``,
``tests/vllm_checks.py``) in gloo worlds, the transition's formed in this process (one rank), the
others in spawned ones."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nereus.devices import CPU, Devices
from nereus.plan import sweep
from nereus.plan.opclass import OpClass
from nereus.runtime.sweep import GLOO_MAX_BYTES
from nereus.spec import load_cluster
from tests import device_checks as checks
from tests import vllm_checks

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_a_transition_in_a_world_of_one_on_the_cpu(tmp_path: Path) -> None:
    checks.check_transition_in_a_world_of_one(Devices(CPU), tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make install`")
def test_the_vllm_engine_on_the_cpu(tmp_path: Path) -> None:
    """Generation against the torch-native engine, a weight sync, no sleep on the CPU."""
    vllm_checks.run_isolated(vllm_checks.check_vllm_engine, "cpu", str(tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make install`")
def test_a_sliding_window_in_vllm_on_the_cpu(tmp_path: Path) -> None:
    """vLLM's windowed attention against the torch-native engine's, fp32."""
    vllm_checks.run_isolated(vllm_checks.check_vllm_window, "cpu", str(tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make install`")
def test_a_vllm_replica_in_part_of_the_world_on_the_cpu(tmp_path: Path) -> None:
    """A replica of rank 0 in a world of two: built, generating, synced and generating again while
    rank 1, outside it, waits."""
    vllm_checks.check_vllm_in_part_of_the_world("cpu", str(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make install`")
def test_vllm_builds_its_groups_with_the_worlds_device_set_aside(tmp_path: Path) -> None:
    """A GPU world binds its device, and torch would split each new group off the world's
    communicator (every rank of the world taking part); while vLLM builds, the binding is set aside
    (here a CPU binding, which torch refuses for a new group outright), and restored after."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from nereus.backends.vllm.world import release, replica_world

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        world = c10d._get_default_group()
        world.bound_device_id = torch.device("cpu", 0)
        with replica_world([0], "set-aside"):
            assert world.bound_device_id is None
            group = dist.new_group([0])  # vLLM's call: a group of the replica's, made locally
            assert dist.get_world_size(group) == 1
        assert world.bound_device_id == torch.device("cpu", 0)
        dist.destroy_process_group(group)
        release()
    finally:
        c10d._get_default_group().bound_device_id = None
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_a_zero_copy_reshard_against_bare_messages_on_the_cpu(tmp_path: Path) -> None:
    """The twin of the GPU runner's zero-copy reshard, on gloo: the same bytes as the packed path
    (also with staging cut into batches of 4 KiB a peer);
    times are reported, not held to a bound (two shared cores are too noisy for one)."""
    got = checks.check_reshard_against_raw("gloo", tmp_path, 4, "tiny-llama", repeats=1)
    assert got["ratio"] > 0 and got["messages"] and got["bus_fraction"] > 0, got


@pytest.mark.timeout(120)
def test_a_silent_peer_times_out_on_the_cpu(tmp_path: Path) -> None:
    """The twin of the GPU runner's check: over gloo, rank 0's all-reduce with a rank that stopped
    answering raises a peer failure after the world's 3 s collective timeout."""
    result = checks.check_a_silent_peer_times_out("gloo", tmp_path)
    assert "Timed out" in str(result["error"]), result


@pytest.mark.timeout(180)
def test_the_start_up_collective_sweep_on_the_cpu(tmp_path: Path) -> None:
    """The twin of the GPU runner's sweep: 4 gloo ranks, 2 per node, so every kind is timed inside
    a node and between nodes; sizes stop at gloo's cap; the calibration it gives has a curve by
    size for all-reduce on both links (what the first plan and the controller start from)."""
    timed = checks.check_sweep("gloo", tmp_path, 4, 2, timed_bound=False)  # times reported, not bounded
    assert {p.op_class for p, _ in timed} == set(OpClass) - {
        OpClass.GEMM,
        OpClass.ATTENTION,
        OpClass.MEMORY,
        OpClass.DECODE,
    }
    assert max(p.nbytes for p, _ in timed) <= GLOO_MAX_BYTES
    assert {(p.per_node, p.nodes) for p, _ in timed} == {(2, 1), (1, 2), (2, 2)}
    eff = sweep.calibration(load_cluster("local-cpu"), timed).efficiencies()
    assert {OpClass.ALLREDUCE_INTRA, OpClass.ALLREDUCE_INTER} <= set(eff.curves)
