"""Device selection: one module names devices and backends; a CPU machine runs on the CPU over
gloo; a GPU would run on the one GPU its task sees, else ``cuda:<local rank>``, over NCCL/RCCL with
control over gloo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import nereus
from nereus.devices import CPU, NCCL_ERROR_HANDLING, Devices, choose, gpu_index, launched, node_threads
from nereus.errors import ConfigError

pytestmark = pytest.mark.pure

ROOT = Path(nereus.__file__).parent


def test_a_machine_without_a_gpu_runs_on_the_cpu_over_gloo() -> None:
    d = choose(3, 4, env={})
    assert d.device == CPU and not d.accelerated and d.backend == "gloo" and d.world_backend == "gloo"
    assert d.vendor == "cpu"
    assert choose(0, 1, env={"NEREUS_DEVICE": "cpu"}).device == CPU


def test_asking_for_a_gpu_where_there_is_none_or_for_nonsense_is_one_line() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="NEREUS_DEVICE=cuda: no CUDA or ROCm GPU"):
        choose(0, 1, env={"NEREUS_DEVICE": "cuda"})
    with pytest.raises(ConfigError, match="expected one of auto, cpu, cuda"):
        choose(0, 1, env={"NEREUS_DEVICE": "tpu"})


def test_a_gpu_worker_would_compute_on_its_local_gpu_with_nccl_for_tensors() -> None:
    d = Devices(torch.device("cuda", 1))
    assert d.accelerated and d.backend == "nccl" and d.world_backend == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        Devices(torch.device("meta"))


def test_a_task_bound_to_one_gpu_takes_it_and_sharing_one_is_refused() -> None:
    # srun --gpus-per-task=1 --gpu-bind=closest: every task sees one GPU, device 0 of what it sees
    assert [gpu_index(rank, 8, 1) for rank in range(8)] == [0] * 8
    # every GPU visible to every task: local rank i takes GPU i
    assert [gpu_index(rank, 8, 8) for rank in range(8)] == list(range(8))
    assert gpu_index(3, 4, 8) == 3
    # some GPUs but fewer than the node's tasks (--gpu-bind=closest without --gpus-per-task): refused
    with pytest.raises(ConfigError) as info:
        gpu_index(5, 8, 4)
    message = str(info.value)
    assert "\n" not in message and message.startswith("GPUs: this task sees 4 GPUs (visible devices")
    for part in ("its node runs 8 tasks (tasks per node", "local rank 5", "srun --gpus-per-task=1",
                 "every GPU to every task"):  # fmt: skip
        assert part in message, message
    with pytest.raises(ConfigError, match=r"sees 2 GPUs .* runs 3 tasks"):
        gpu_index(0, 3, 2)


def test_local_workers_see_every_gpu_so_one_gpu_for_several_workers_is_refused() -> None:
    """``nereus run``'s workers all see the machine's GPUs: one visible GPU is not a binding, and
    four workers on it would share it (NCCL refuses a GPU twice in a communicator)."""
    assert [gpu_index(rank, 4, 4, shared=True) for rank in range(4)] == [0, 1, 2, 3]
    assert gpu_index(0, 1, 1, shared=True) == 0
    for visible in (1, 3):
        with pytest.raises(ConfigError) as info:
            gpu_index(2, 4, visible, shared=True)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"workers: 4 local workers but {visible} GPU")
        assert f"allowed: workers up to {visible}, or NEREUS_DEVICE=cpu" in message, message


def test_threads_are_what_the_node_gives_a_worker() -> None:
    assert node_threads({"NEREUS_THREADS": "6"}, 4) == 6
    assert node_threads({"SLURM_CPUS_PER_TASK": "7"}, 4) == 7
    cpus = len(__import__("os").sched_getaffinity(0))
    assert node_threads({}, 1) == cpus and node_threads({}, 10_000) == 1
    assert node_threads({"NEREUS_THREADS": "zero"}, 1) == cpus  # not a count: ignored


def test_only_the_device_module_names_a_backend_or_a_device() -> None:
    """The issue's check, ``grep -rn '"gloo"\\|"nccl"\\|device="cpu"' nereus``, and a little more."""
    pattern = re.compile(r'"gloo"|"nccl"|device="cpu"|"cpu:gloo')
    found = [
        f"{f.relative_to(ROOT.parent)}:{i}"
        for f in sorted(ROOT.rglob("*.py"))
        if f.name != "devices.py"
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_a_launched_worker_takes_its_local_rank_from_torchrun_or_slurm() -> None:
    env = {"NEREUS_DEVICE": "cpu"}
    cpus = len(__import__("os").sched_getaffinity(0))
    # torchrun: LOCAL_RANK of LOCAL_WORLD_SIZE; the threads are the node's CPUs shared among them
    assert launched({**env, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).threads == max(1, cpus // 2)
    # SLURM: SLURM_LOCALID of the node's tasks ("4(x2)": 4 tasks on each of 2 nodes)
    assert launched({**env, "SLURM_LOCALID": "3", "SLURM_TASKS_PER_NODE": "4(x2)"}).threads == max(
        1, cpus // 4
    )
    assert launched({**env, "SLURM_CPUS_PER_TASK": "3"}, local_rank=5).threads == 3  # SLURM's grant wins
    assert launched({**env, "NEREUS_THREADS": "2", "SLURM_CPUS_PER_TASK": "3"}).threads == 2  # then ours
    assert launched(env).device == CPU and launched(env, local_rank=0).threads == cpus


def test_nccl_errors_raise_in_the_waiting_rank_and_keep_the_process() -> None:
    """The value set for TORCH_NCCL_ASYNC_ERROR_HANDLING is, in the installed torch's own header,
    the mode that cleans up (aborts the communicators, so the waiting rank raises) without tearing
    the process down. torch's default, 3 (SkipCleanUp), tears it down: a survivor of a dead or
    frozen peer would lose the state an in-place recovery keeps."""
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"
    if not header.is_file():
        pytest.skip("this torch ships no ProcessGroupNCCL.hpp")
    text = header.read_text()
    modes = dict(re.findall(r"(\w+) = (\d+)", text[text.index("enum ErrorHandlingMode") :][:200]))
    assert modes["CleanUpOnly"] == NCCL_ERROR_HANDLING
    assert "a != CleanUpOnly" in re.search(r"#define SHOULD_TEAR_DOWN\(a\)[^\n]*", text).group(0)  # type: ignore[union-attr]
    assert "a != CleanUpOnly" not in re.search(r"#define SHOULD_CLEAN_UP\(a\)[^\n]*", text).group(0)  # type: ignore[union-attr]
