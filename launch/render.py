"""Rendering: a site and a request → submitit's executor parameters and the sbatch script.

Pure. The sbatch text comes from submitit's own ``_make_sbatch_string`` with the same parameters
and the same command the ``SlurmExecutor`` uses, so what ``--dry-run`` prints (and what the job
folder keeps as ``job.sbatch``) is the script that is submitted. submitit ``shlex.quote``s every
``#SBATCH`` value and srun argument, but a quoted newline still ends the ``#SBATCH`` comment line:
a ``Request`` (like a ``Site``) refuses control characters in every text it renders.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from submitit.slurm.slurm import _make_sbatch_string

from launch.inputs import control_error, has_control, shown
from launch.site import Site

JOB_NAME = re.compile(r"[A-Za-z0-9._+-]{1,200}")
JOB_NAME_RULE = "1 to 200 letters, digits, '.', '_', '+' or '-'"


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


def render(site: Site, req: Request) -> Rendered:
    """The executor parameters and the sbatch script of ``req`` on ``site``."""
    setup = [*site.setup, *site.env_lines()]
    params: dict[str, Any] = {
        "job_name": req.job_name,
        "nodes": req.nodes,
        "ntasks_per_node": req.tasks_per_node,
        "cpus_per_task": site.cpus_per_task,
        "time": req.time_min,
        "signal_delay_s": site.signal_delay_s,
        "srun_args": site.mpi_args,
    }
    if site.gpus_per_node and not req.array:
        params["gpus_per_node"] = site.gpus_per_node
    if req.partition:
        params["partition"] = req.partition
    if req.account:
        params["account"] = req.account
    if setup:
        params["setup"] = setup
    if site.sbatch:
        params["additional_parameters"] = dict(site.sbatch)
    command = submitit_command(req.python, req.folder)
    map_count = req.array or None
    sbatch = _make_sbatch_string(command=command, folder=req.folder, map_count=map_count, **params)
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
