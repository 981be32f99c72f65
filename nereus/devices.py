"""Which device a worker computes on and which torch.distributed backends carry its messages.

The one place in Nereus that names a device or a backend. A worker with a visible GPU (CUDA, or
ROCm, which torch exposes through the same ``torch.cuda`` API) computes on the one GPU it sees (one
bound to each task), else on ``cuda:<local rank>`` (``gpu_index``); otherwise on the CPU
(``NEREUS_DEVICE=cpu`` forces the CPU, ``=cuda`` requires a GPU). Tensors on GPUs move over NCCL
(RCCL on ROCm, under the same ``nccl`` name), small control messages and CPU tensors over gloo in
both cases: the world is one process group with a backend per device type (``cpu:gloo,cuda:nccl``),
so each collective takes the backend of its tensors' device. NCCL is told to surface a failed or
timed-out collective as an error in the waiting rank, aborting its communicators but keeping the
process and its state (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` = 2, CleanUpOnly; torch's default, 3,
tears the process down), and a broken world's communicators are aborted before it is destroyed
(``abort_world``). A step's collectives time out after the job's collective timeout
(``set_world_timeout``): a peer that froze surfaces then.
A worker uses as many CPU threads as its node gives it: the CPUs it may run on, shared among the
node's workers.
Edge module (torch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nereus.errors import ConfigError

CPU = torch.device("cpu")
CHOICES = ("auto", "cpu", "cuda")
TENSORS_ON_CPU = "gloo"
TENSORS_ON_GPU = "nccl"  # NCCL on NVIDIA, RCCL on ROCm
CONTROL = "gloo"
# torch's ErrorHandlingMode (ProcessGroupNCCL.hpp): 2 is CleanUpOnly, which aborts the failed
# collective's communicators and raises in the rank that waits on it; 1 and 3 tear the process
# down, and with it the state an in-place recovery keeps
NCCL_ERROR_HANDLING = "2"


@dataclass(frozen=True, slots=True)
class Devices:
    """A worker's device and backends."""

    device: torch.device
    threads: int = 1

    def __post_init__(self) -> None:
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: expected cpu or cuda, got {self.device}")
        if self.threads < 1:
            raise ValueError(f"threads must be positive, got {self.threads}")

    @property
    def accelerated(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        """The backend of the tensors this worker computes with."""
        return TENSORS_ON_GPU if self.accelerated else TENSORS_ON_CPU

    @property
    def world_backend(self) -> str:
        """The world's backend string: control messages over gloo, GPU tensors over NCCL/RCCL."""
        return f"cpu:{CONTROL},cuda:{TENSORS_ON_GPU}" if self.accelerated else CONTROL

    @property
    def vendor(self) -> str:
        if not self.accelerated:
            return "cpu"
        return "amd" if getattr(torch.version, "hip", None) else "nvidia"


def node_threads(env: Mapping[str, str], local_workers: int) -> int:
    """The CPU threads a worker may use: ``NEREUS_THREADS``, else SLURM's CPUs per task, else the
    CPUs this process may run on shared among the node's ``local_workers``."""
    for key in ("NEREUS_THREADS", "SLURM_CPUS_PER_TASK"):
        if env.get(key, "").isdigit() and int(env[key]) > 0:
            return int(env[key])
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, local_workers))


def choose(
    local_rank: int, local_workers: int, env: Mapping[str, str] | None = None, shared: bool = False
) -> Devices:
    """The device and threads of the worker with node-local rank ``local_rank`` of ``local_workers``
    (``shared``: every worker sees the node's GPUs, as ``nereus run``'s do; ``gpu_index``)."""
    env = os.environ if env is None else env
    want = env.get("NEREUS_DEVICE", "auto")
    if want not in CHOICES:
        raise ConfigError(f"NEREUS_DEVICE: expected one of {', '.join(CHOICES)}, got {want[:40]!r}")
    threads = node_threads(env, local_workers)
    visible = torch.cuda.device_count() if want != "cpu" and torch.cuda.is_available() else 0
    if visible == 0:
        if want == "cuda":
            raise ConfigError("NEREUS_DEVICE=cuda: no CUDA or ROCm GPU is visible to this process")
        return Devices(CPU, threads)
    return Devices(torch.device("cuda", gpu_index(local_rank, local_workers, visible, shared)), threads)


def gpu_index(local_rank: int, local_workers: int, visible: int, shared: bool = False) -> int:
    """The visible GPU of the worker with node-local rank ``local_rank`` of ``local_workers``: the
    one GPU it sees (a launcher bound one to each task: ``srun --gpus-per-task=1``), else GPU
    ``local_rank`` (every GPU visible to every task). A task that sees several GPUs but fewer than
    its node's workers would share one with another task: refused, one line. ``shared``: every
    worker sees the same GPUs (``nereus run``'s local workers), so one GPU is no binding either."""
    if visible == 1 and not shared:
        return 0
    if visible < local_workers and shared:
        raise ConfigError(
            f"workers: {local_workers} local workers but {visible} GPU{'s' * (visible != 1)} visible "
            "(CUDA/HIP/ROCR_VISIBLE_DEVICES), and a GPU runs one worker (allowed: workers up to "
            f"{visible}, or NEREUS_DEVICE=cpu to run every worker on the CPU)"
        )
    if visible < local_workers:
        raise ConfigError(
            f"GPUs: this task sees {visible} GPUs (visible devices: CUDA/HIP/ROCR_VISIBLE_DEVICES) but "
            f"its node runs {local_workers} tasks (tasks per node; this is local rank {local_rank}), so "
            "two tasks would share a GPU: give each task one GPU (srun --gpus-per-task=1) or every GPU to "
            "every task (nereus run: no more workers than GPUs, or NEREUS_DEVICE=cpu)"
        )
    return local_rank


def launched(env: Mapping[str, str] | None = None, local_rank: int | None = None) -> Devices:
    """The devices of a worker a launcher started: its node-local rank (``local_rank``, else
    ``LOCAL_RANK`` from torchrun, else ``SLURM_LOCALID``, else 0) among the node's workers
    (``LOCAL_WORLD_SIZE``, else SLURM's tasks on this node, else its GPUs, else 1)."""
    env = os.environ if env is None else env
    if local_rank is None:
        local_rank = next(
            (int(env[k]) for k in ("LOCAL_RANK", "SLURM_LOCALID") if env.get(k, "").isdigit()), 0
        )
    workers = 1
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        lead = env.get(key, "").split("(")[0].split(",")[0]  # SLURM writes "4(x2),2"
        if lead.isdigit() and int(lead) > 0:
            workers = int(lead)
            break
    return choose(local_rank, max(workers, local_rank + 1), env)


def activate(devices: Devices) -> None:
    """Make ``devices`` this process's: the current GPU, NCCL's error handling, the CPU threads."""
    torch.set_num_threads(devices.threads)
    if devices.accelerated:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
        torch.cuda.set_device(devices.device)


def set_world_timeout(timeout: timedelta) -> None:
    """Every later collective of the world (each backend of it) fails after ``timeout``; forming it
    had its own, longer one (members arrive when they are ready)."""
    dist.group.WORLD.set_timeout(timeout)  # type: ignore[union-attr]


def init_world(devices: Devices, store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """Form the world (one process group, a backend per device type) over ``store``."""
    dist.init_process_group(
        devices.world_backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
        device_id=devices.device if devices.accelerated else None,
    )  # fmt: skip


def abort_world() -> None:
    """Let go of a (possibly broken) world at once: abort its communicators where the backend can
    (NCCL: a collective stuck on a dead peer returns), then destroy it."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend() != CONTROL:
        with contextlib.suppress(Exception):
            abort()
    with contextlib.suppress(Exception):  # a broken world still has to go
        dist.destroy_process_group()


def synchronize(devices: Devices) -> None:
    """Wait for the device's queued work (timings on a GPU measure work, not its launch)."""
    synchronize_device(devices.device)


def synchronize_device(device: torch.device) -> None:
    """``synchronize`` for code that holds a tensor's device: a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StageOutOfMemoryError(RuntimeError):
    """A model-stage's work ran out of device memory on this rank (``torch.OutOfMemoryError``)."""

    def __init__(self, model_stage: str, detail: str) -> None:
        super().__init__(f"{model_stage} ran out of memory: {detail[:200]}")
        self.model_stage = model_stage


class StageMemory:
    """What one model-stage's work took on this rank's device: its own state plus its peak working
    memory (the allocator's peak during the work, less what was allocated before it: the state of
    every model-stage resident on the device). On the CPU there is no allocator to ask: None."""

    def __init__(self, devices: Devices) -> None:
        self.devices = devices
        self.peaks: dict[str, int] = {}  # model-stage → bytes, the largest this step
        self.reserved: dict[str, int] = {}  # model-stage → the allocator's peak reserved bytes

    def clear(self) -> None:
        self.peaks.clear()
        self.reserved.clear()

    @contextlib.contextmanager
    def measure(self, model_stage: str, own_bytes: int) -> Iterator[None]:
        """Around a model-stage's work: record its peak (GPU); turn an out-of-memory error into a
        ``StageOutOfMemoryError`` naming the model-stage. Also the allocator's peak reserved
        bytes (its cached segments: what the device actually gave up to this process)."""
        device = self.devices.device
        base = 0
        if self.devices.accelerated:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)  # allocated and reserved peaks
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise StageOutOfMemoryError(model_stage, str(exc)) from exc
        if self.devices.accelerated:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base + own_bytes
            self.peaks[model_stage] = max(self.peaks.get(model_stage, 0), peak)
            reserved = torch.cuda.max_memory_reserved(device)
            self.reserved[model_stage] = max(self.reserved.get(model_stage, 0), reserved)
