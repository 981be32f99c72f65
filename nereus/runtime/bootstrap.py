"""Who this process is when a launcher started it: rank, world size, local rank, node.

Under ``srun --mpi=pmi2`` with ``NEREUS_BOOTSTRAP=mpi``, mpi4py (over the ``mpich`` wheel) gives
the rank and size, and rank 0 broadcasts the rendezvous address over MPI; without MPI the same
comes from SLURM's variables (``SLURM_PROCID``…), submitit's local executor
(``SUBMITIT_LOCAL_*``) or torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), and the other
ranks read the address the leader wrote to the job folder.

``nereus-launch submit --launcher torchrun`` runs one SLURM task per node, a torchrun agent with a
node-local rendezvous that starts the node's workers: source ``torchrun-slurm``. A worker's rank
(its GPU id) is then ``node × workers per node + local rank``: the node is the agent's task
(``SLURM_PROCID`` of ``SLURM_NTASKS``), the rest is torchrun's (``LOCAL_RANK`` of
``LOCAL_WORLD_SIZE``; torchrun's own ``RANK`` and ``WORLD_SIZE`` only count the node). torchrun's
``TORCHELASTIC_RESTART_COUNT`` says whether the agent restarted the worker (``restart`` > 0): its
state is gone and it rejoins the running job instead of starting it. Such a worker never takes
part in MPI (the agent's task may carry PMI variables that are not its own). Edge module (MPI).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SOURCES = ("mpi", "slurm", "submitit-local", "torchrun", "torchrun-slurm", "single")
# What torchrun's agent sets in every worker it starts (and SLURM never does).
TORCHRUN_KEYS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")


@dataclass(frozen=True, slots=True)
class Bootstrap:
    rank: int
    world: int
    local_rank: int
    node: str
    source: str
    launch_id: str  # the same on every rank of one launch, different after a requeue
    # torchrun-slurm: TORCHELASTIC_RESTART_COUNT; > 0: its node's agent restarted it (its state is
    # lost). Plain torchrun restarts the whole world, which then starts over from its checkpoint: 0.
    restart: int = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if not 0 <= self.rank < self.world or not 0 <= self.local_rank < self.world:
            raise ValueError(f"bootstrap: rank {self.rank} / local rank {self.local_rank} of {self.world}")
        if self.restart < 0:
            raise ValueError(f"bootstrap: restart count {self.restart} is negative")


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}: expected an integer, got {env[key]!r}") from None


def from_environment(env: Mapping[str, str] | None = None) -> Bootstrap:
    """Rank and size from the launcher's environment variables (no MPI)."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    if torchrun_on_slurm(env):
        return _torchrun_slurm(env, node)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        launch = f"slurm-{env.get('SLURM_JOB_ID', '?')}-{env.get('SLURM_RESTART_COUNT', '0')}"
        return Bootstrap(
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID"),
            node,
            "slurm",
            launch,
        )
    if "SUBMITIT_LOCAL_GLOBALID" in env:
        return Bootstrap(
            _int(env, "SUBMITIT_LOCAL_GLOBALID"), _int(env, "SUBMITIT_LOCAL_NTASKS"),
            _int(env, "SUBMITIT_LOCAL_LOCALID"), node, "submitit-local",
            f"local-{env.get('SUBMITIT_LOCAL_JOB_ID', '?')}",
        )  # fmt: skip
    if "RANK" in env and "WORLD_SIZE" in env:
        return Bootstrap(
            _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            node, "torchrun", f"torchrun-{env.get('TORCHELASTIC_RUN_ID', env.get('MASTER_PORT', '?'))}",
        )  # fmt: skip
    return Bootstrap(0, 1, 0, node, "single", f"single-{os.getpid()}")


def torchrun_on_slurm(env: Mapping[str, str]) -> bool:
    """A worker of a torchrun agent with a node-local rendezvous, the agent one task of a SLURM step
    (``nereus-launch --launcher torchrun``). A torchrun whose rendezvous spans nodes
    (``GROUP_WORLD_SIZE`` > 1) numbers its workers itself: that is source ``torchrun``."""
    if not all(k in env for k in (*TORCHRUN_KEYS, "SLURM_PROCID", "SLURM_NTASKS")):
        return False
    return env.get("GROUP_WORLD_SIZE", "1").strip() == "1"


def _torchrun_slurm(env: Mapping[str, str], node: str) -> Bootstrap:
    """Rank = node × workers per node + local rank, of nodes × workers per node."""
    task, tasks = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local, per_node = _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")
    if not 0 <= task < tasks or not 0 <= local < per_node:
        raise ValueError(
            f"bootstrap: SLURM task {task} of {tasks}, torchrun local rank {local} of {per_node}"
        )
    launch = f"slurm-{env.get('SLURM_JOB_ID', '?')}-{env.get('SLURM_RESTART_COUNT', '0')}"
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT")
    rank, world = task * per_node + local, tasks * per_node
    return Bootstrap(rank, world, local, node, "torchrun-slurm", launch, restart)


def mpi_world() -> Any:
    """mpi4py's COMM_WORLD when this process was started by an MPI launcher (PMI/PMI2 under
    srun, or mpiexec) and mpi4py imports; otherwise None."""
    if not any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE")):
        return None
    try:
        import mpi4py

        # No MPI_Finalize at exit: under PMI it can wait for ranks that died or left the job
        # early (a lost node, a drained one), and nothing needs MPI after the bootstrap.
        mpi4py.rc.finalize = False
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm if comm.Get_size() > 1 else None


def bootstrap() -> tuple[Bootstrap, Any]:
    """This process's place in the launch, and the MPI communicator when ``NEREUS_BOOTSTRAP=mpi``
    (the GPU site templates set it). Elsewhere the launcher's variables suffice: on the local test
    cluster, whose four nodes are one host, MPICH's UCX address exchange was seen to fail
    intermittently when ranks of two jobs started at once."""
    env = from_environment()
    if env.source == "torchrun-slurm":  # the agent's task is SLURM's (and MPI's) rank, not this worker
        return env, None
    comm = mpi_world() if os.environ.get("NEREUS_BOOTSTRAP", "env") == "mpi" else None
    if comm is None:
        return env, None
    local = env.local_rank if env.source == "slurm" else 0
    boot = Bootstrap(comm.Get_rank(), comm.Get_size(), local, env.node, "mpi", env.launch_id)
    return boot, comm
