"""Rendering: a site and a request → submitit's executor parameters and the sbatch script.

Pure. The sbatch text comes from submitit's own ``_make_sbatch_string`` with the same parameters
and the same command the ``SlurmExecutor`` uses, so what ``--dry-run`` prints (and what the job
folder keeps as ``job.sbatch``) is the script that is submitted. submitit ``shlex.quote``s every
``#SBATCH`` value and srun argument, but a quoted newline still ends the ``#SBATCH`` comment line:
a ``Request`` (like a ``Site``) refuses control characters in every text it renders.

Two launchers. ``srun`` (the default): one task per GPU, each running submitit's runner, which
calls ``nereus.runtime.node.main``. ``torchrun``: one task per node, each a torchrun agent
(``python -m torch.distributed.run``, the job's Python) with a node-local rendezvous
(``--standalone``) that starts the node's workers (``python -m nereus.cli node JOB``) and restarts
them (``--max-restarts``) when one fails; the task gets the CPUs of all its workers (each worker
uses the site's ``cpus_per_task``: ``NEREUS_THREADS``), and no MPI plugin (the workers' ranks come
from SLURM's task and torchrun's local rank).

Every launch passes srun the task's CPUs (``--cpus-per-task``: srun reads no ``SLURM_CPUS_PER_TASK``
since Slurm 22.05, and would pin each task to one CPU), asks for a requeueable job (``--requeue``:
a cluster whose ``JobRequeue`` is 0 could not requeue it otherwise) and sets no ``--wckey`` unless
the site's ``sbatch`` does. A site's GPU binding (``--gpus-per-task``, ``--gpu-bind``) applies to
srun's task per GPU only: a torchrun agent's task holds its node's GPUs, an array task none.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from submitit.slurm.slurm import _make_sbatch_string

from launch.inputs import control_error, has_control, shown
from launch.site import Site, gpu_binding

JOB_NAME = re.compile(r"[A-Za-z0-9._+-]{1,200}")
JOB_NAME_RULE = "1 to 200 letters, digits, '.', '_', '+' or '-'"
LAUNCHERS = ("srun", "torchrun")
MAX_RESTARTS = 100  # --max-restarts: 0 to this
DEFAULT_RESTARTS = 3
# The signals a torchrun agent passes on to its workers (then waits for them): torchrun's default
# four, and SIGUSR2, SLURM's warning before the time limit, at which the job checkpoints.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


def job_name_error(name: str) -> str | None:
    """Why ``name`` cannot name a job (it is the SLURM job name and the job folder's prefix), or None."""
    if JOB_NAME.fullmatch(name):
        return None
    return f"expected {JOB_NAME_RULE} (it names the job and its folder), got {shown(name)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """What one submission asks for: a node job (``array == 0``) or a job array of single tasks."""

    job_name: str
    folder: str  # submitit's folder (JOB/logs), absolute: it is written into the script
    python: str  # the shell command that runs Python on the compute nodes
    nodes: int
    tasks_per_node: int
    time_min: int
    partition: str = ""  # "": the cluster's default
    account: str = ""  # "": none
    array: int = 0  # > 0: a job array of this many tasks, one node and one task each
    launcher: str = "srun"  # srun: one task per worker; torchrun: one agent task per node
    max_restarts: int = DEFAULT_RESTARTS  # torchrun: restarts of a node's workers
    join: bool = False  # torchrun: the workers join a running job (a grow job)

    def __post_init__(self) -> None:
        if why := job_name_error(self.job_name):
            raise ValueError(f"job_name: {why}")
        for name in ("folder", "python", "partition", "account"):
            if has_control(getattr(self, name)):
                raise ValueError(control_error(name, getattr(self, name)))
        for name in ("nodes", "tasks_per_node", "time_min"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.array < 0:
            raise ValueError(f"array must be non-negative, got {self.array}")
        if self.array and (self.nodes, self.tasks_per_node) != (1, 1):
            raise ValueError("an array task runs on one node as one task")
        if not self.folder.startswith("/"):
            raise ValueError(f"folder must be absolute, got {self.folder!r}")
        if "%" in self.folder:  # SLURM expands %j, %t … in the log paths submitit derives from it
            raise ValueError(f"folder: '%' is not allowed (SLURM reads %j, %t … in it), got {self.folder!r}")
        for name in ("folder", "partition", "account"):  # sbatch reads it as an escape, quoted or not
            if "\\" in getattr(self, name):
                raise ValueError(
                    f"{name}: a backslash is not allowed in #SBATCH lines, got {getattr(self, name)!r}"
                )
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {shown(self.launcher)}")
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ValueError(f"max_restarts must be 0 to {MAX_RESTARTS}, got {self.max_restarts}")
        if self.launcher == "torchrun" and self.array:
            raise ValueError("an array task runs under srun, not torchrun")

    @property
    def job_dir(self) -> str:
        """The job folder: ``folder``'s parent (submitit's folder is ``JOB/logs``)."""
        return posixpath.dirname(self.folder.rstrip("/"))


@dataclass(frozen=True, slots=True)
class Rendered:
    """Parameters for ``SlurmExecutor.update_parameters`` (SLURM names) and for the
    ``LocalExecutor``, the command srun runs, and the sbatch script they make."""

    params: dict[str, Any]
    local_params: dict[str, Any]
    command: str
    sbatch: str = field(repr=False)


def submitit_command(python: str, folder: str) -> str:
    """The command submitit's executors run on every task (``SlurmExecutor._submitit_command_str``)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(folder)])


def torchrun_command(site: Site, req: Request) -> str:
    """What each node's task runs under ``--launcher torchrun``: a torchrun agent (the job's Python,
    ``-m torch.distributed.run``) with a node-local rendezvous, one worker per GPU of the node
    (``req.tasks_per_node``), each ``python -m nereus.cli node JOB``. It passes SIGUSR2 on to its
    workers and waits for them as long as SLURM's warning leaves (``signal_delay_s``)."""
    args = [
        "-u", "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        f"--nproc-per-node={req.tasks_per_node}", f"--max-restarts={req.max_restarts}",
        f"--signals-to-handle={TORCHRUN_SIGNALS}", f"--shutdown-timeout={site.signal_delay_s}",
        "-m", "nereus.cli", "node", req.job_dir, *(["--join"] if req.join else []),
    ]  # fmt: skip
    return " ".join([req.python, *(shlex.quote(a) for a in args)])


def render(site: Site, req: Request) -> Rendered:
    """The executor parameters and the sbatch script of ``req`` on ``site``."""
    setup = [*site.setup, *site.env_lines()]
    torchrun = req.launcher == "torchrun"
    if torchrun and "NEREUS_THREADS" not in site.env:  # the task has all its workers' CPUs; each, its own
        setup.append(f"export NEREUS_THREADS={site.cpus_per_task}")
    cpus = site.cpus_per_task * (req.tasks_per_node if torchrun else 1)
    # a torchrun agent's task holds all its node's GPUs (its workers pick theirs by local rank), an
    # array task none: the site's one-GPU-per-task binding is for srun's task-per-GPU launch only
    site_args = [a for a in site.srun_args if not ((torchrun or req.array) and gpu_binding(a))]
    # torchrun: no PMI, the ranks are SLURM's task + torchrun's; "none" leaves srun's default
    mpi_args = ["--mpi=none"] if torchrun else site.mpi_flag
    params: dict[str, Any] = {
        "job_name": req.job_name,
        "nodes": req.nodes,
        "ntasks_per_node": 1 if torchrun else req.tasks_per_node,
        "cpus_per_task": cpus,
        "time": req.time_min,
        "signal_delay_s": site.signal_delay_s,
        # srun reads no SLURM_CPUS_PER_TASK since Slurm 22.05: without the flag each task gets 1 CPU
        "srun_args": [f"--cpus-per-task={cpus}", *mpi_args, *site_args],
        "wckey": None,  # submitit's default is "submitit"; a site sets its own through ``sbatch``
    }
    if site.gpus_per_node and not req.array:
        params["gpus_per_node"] = site.gpus_per_node
    if req.partition:
        params["partition"] = req.partition
    if req.account:
        params["account"] = req.account
    if setup:
        params["setup"] = setup
    # always requeueable: on a cluster with JobRequeue=0 a preempted or timed-out job could not be
    # requeued (submitit's and the leader's ``scontrol requeue``) without it
    params["additional_parameters"] = {"requeue": True, **site.sbatch}
    command = torchrun_command(site, req) if torchrun else submitit_command(req.python, req.folder)
    map_count = req.array or None
    sbatch = _make_sbatch_string(command=command, folder=req.folder, map_count=map_count, **params)
    if torchrun:  # for ``TorchrunExecutor``: its srun runs this instead of submitit's runner
        params["command"] = command
    local: dict[str, Any] = {
        "nodes": 1,
        "tasks_per_node": req.nodes * req.tasks_per_node,
        "timeout_min": req.time_min,
        "signal_delay_s": site.signal_delay_s,
    }
    if site.gpus_per_node and not req.array:
        local["gpus_per_node"] = site.gpus_per_node
    if site.env:
        local["setup"] = site.env_lines()  # module loads are the cluster's; the environment is ours
    return Rendered(params, local, command, sbatch)


def describe_local(req: Request, rendered: Rendered) -> str:
    """What ``--local --dry-run`` prints: submitit's LocalExecutor has no script."""
    p = rendered.local_params
    lines = [
        f"# local: submitit LocalExecutor in {req.folder}",
        f"# {p['tasks_per_node']} processes, time limit {p['timeout_min']} min",
        *(f"# setup: {line}" for line in p.get("setup", ())),
        rendered.command,
    ]
    return "\n".join(lines) + "\n"
