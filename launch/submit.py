"""Submitting: an experiment, a sweep (job array) or more nodes for a running job, through submitit.

Each submission is prepared first (every check, the render, the files' contents) without
touching the disk, so ``--dry-run`` prints exactly what would be submitted and bad input leaves
nothing behind. Then the job folder is written and the job submitted; if submission fails the
folder is removed. The executor comes from a factory (``ExecutorFactory``): submitit's
``SlurmExecutor`` / ``LocalExecutor`` by default (``TorchrunExecutor``, a ``SlurmExecutor`` whose
srun runs the rendered torchrun command, for ``--launcher torchrun``), a fake one in tests.
"""

from __future__ import annotations

import contextlib
import io
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import submitit
import yaml

from launch.experiment import check_node_limit, check_plan, check_site, load_experiment, place
from launch.inputs import check_text, shown
from launch.job import NodeJob, run_cli_task, task_file
from launch.jobdir import (
    STATES_DONE,
    ArrayTask,
    Grow,
    JobRecord,
    Shrink,
    atomic_write,
    check_owner,
    create_folder,
    next_script,
    now_iso,
    read_record,
    record_lock,
    settled,
    write_record,
    write_secret,
    write_shrink,
)
from launch.monitor import Runner, forgotten, run_command, slurm_states
from launch.render import DEFAULT_RESTARTS, LAUNCHERS, MAX_RESTARTS, Rendered, Request, describe_local, render
from launch.site import Site, load_site, site_ref, time_limit
from launch.sweep import check_argv, load_sweep
from nereus.errors import ConfigError
from nereus.runtime.command import preflight
from nereus.runtime.pool import ShrinkRequest


class SubmittedJob(Protocol):
    @property
    def job_id(self) -> str: ...


class Executor(Protocol):
    """What the launcher uses of a submitit executor."""

    def update_parameters(self, **kwargs: Any) -> None: ...
    def submit(self, fn: Callable[..., Any], *args: Any) -> SubmittedJob: ...
    def map_array(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Sequence[SubmittedJob]: ...


# (kind "slurm" | "torchrun" | "local", folder, python)
ExecutorFactory = Callable[[str, Path, str], Executor]


class TorchrunExecutor(submitit.SlurmExecutor):
    """submitit's ``SlurmExecutor`` whose srun runs the rendered torchrun command (one agent task
    per node) instead of submitit's runner: ``update_parameters(command=...)`` sets it (``render``
    puts it in the parameters). The sbatch script is otherwise submitit's, byte for byte; the
    pickle submitit writes next to it is never read."""

    command = ""

    def update_parameters(self, **kwargs: Any) -> None:
        if "command" in kwargs:
            self.command = str(kwargs.pop("command"))
        super().update_parameters(**kwargs)

    @property
    def _submitit_command_str(self) -> str:
        if not self.command:
            raise RuntimeError("TorchrunExecutor: no command to run (update_parameters(command=...))")
        return self.command


def submitit_executor(kind: str, folder: Path, python: str) -> Executor:
    """submitit's own executor: ``SlurmExecutor`` (sbatch), ``TorchrunExecutor`` (sbatch, torchrun on
    the nodes) or ``LocalExecutor`` (local processes)."""
    if kind == "local":
        ex: Executor = submitit.LocalExecutor(folder=folder, python=python)
        return ex
    for tool in ("sbatch", "srun"):
        if shutil.which(tool) is None:
            raise ConfigError(f"{tool}: not found on PATH (not a SLURM login node? --local runs here)")
    if kind == "torchrun":
        torchrun: Executor = TorchrunExecutor(folder=folder, python=python)
        return torchrun
    return submitit.SlurmExecutor(folder=folder, python=python)


def executor_kind(record: JobRecord) -> str:
    """What the factory is asked for: ``local``, ``torchrun`` or ``slurm``."""
    return "torchrun" if record.launcher == "torchrun" and record.executor == "slurm" else record.executor


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The flags shared by ``submit`` and ``array``."""

    site: str = "local"
    site_flag: str = "--site"  # how errors name the site: "$NEREUS_SITE" when it came from there
    local: bool = False
    nodes: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    jobs_root: Path = Path("jobs")
    python: str = shlex.quote(sys.executable)
    launcher: str = "srun"  # submit only: srun (a task per worker) or torchrun (an agent per node)
    max_restarts: int | None = None  # torchrun only (default DEFAULT_RESTARTS)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A checked submission: where it goes, what it writes, what it runs."""

    folder: Path  # planned; created only by ``commit``
    site: Site
    request: Request
    rendered: Rendered
    record: JobRecord
    files: dict[str, str]  # job-folder file name -> text (``commit`` adds job.sbatch)
    warnings: tuple[str, ...] = ()  # what the job will not do as the experiment reads

    def script(self, local: bool) -> str:
        return describe_local(self.request, self.rendered) if local else self.rendered.sbatch


@contextlib.contextmanager
def submitting(what: str = "sbatch") -> Iterator[None]:
    """Turn submitit's failures (sbatch missing or failing) into one ``ConfigError`` line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            yield
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{what}: {exc.filename or what} not found (not a SLURM login node? --local runs here)"
        ) from None
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        lines = (str(exc).strip() or err.getvalue().strip()).splitlines()
        raise ConfigError(f"{what} failed: {lines[-1] if lines else type(exc).__name__}") from None


def job_request(**kwargs: Any) -> Request:
    """A ``Request``; what it refuses (the flags and files were checked before) is one line."""
    try:
        return Request(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"cannot render the sbatch script: {exc}") from None


def check_folder(flag: str, path: Path) -> None:
    """A folder whose path is written into the script: no control characters, no ``%`` (SLURM
    reads ``%j``, ``%t`` … in the log paths submitit puts under it), no ``\\`` (sbatch reads it
    as an escape even inside quotes, and then stops expanding ``%j`` in those paths)."""
    text = str(path.absolute())
    check_text(flag, text)
    for char, why in (("%", "SLURM reads %j, %t … in the log paths under it"),
                      ("\\", "sbatch reads a backslash as an escape in #SBATCH lines")):  # fmt: skip
        if char in text:
            raise ConfigError(f"{flag}: {char!r} is not allowed ({why}), got {shown(text)}")


def _common(opts: Options, site: Site) -> tuple[str, str, int]:
    for flag, value in (("--partition", opts.partition), ("--account", opts.account)):
        if value is not None:
            check_text(flag, value)
            if "\\" in value:
                raise ConfigError(
                    f"{flag}: a backslash is not allowed (sbatch reads it as an escape), got {shown(value)}"
                )
    check_folder("--jobs-root", opts.jobs_root)
    partition = opts.partition if opts.partition is not None else site.partition
    if partition and not opts.local:
        site.check_partition(partition)
    account = opts.account if opts.account is not None else site.account
    text, flag = (opts.time, "--time") if opts.time is not None else (site.time, f"site {site.name}: time")
    time_min = time_limit(text, flag, site.signal_delay_s, site.name)
    return partition, account, time_min


def _launcher(opts: Options) -> tuple[str, int]:
    """The launcher and torchrun's restarts, checked: one line naming the flag."""
    if opts.launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher: expected one of {', '.join(LAUNCHERS)}, got {shown(opts.launcher)}")
    restarts = DEFAULT_RESTARTS if opts.max_restarts is None else opts.max_restarts
    if opts.max_restarts is not None and opts.launcher != "torchrun":
        raise ConfigError("--max-restarts: only with --launcher torchrun (srun restarts no worker)")
    if not 0 <= restarts <= MAX_RESTARTS:
        raise ConfigError(f"--max-restarts: expected an integer from 0 to {MAX_RESTARTS}, got {restarts}")
    if opts.launcher == "torchrun" and opts.local:
        raise ConfigError(
            "--launcher: torchrun runs on SLURM nodes under srun; --local runs local processes without it"
        )
    return opts.launcher, restarts


def prepare_experiment(path: Path, opts: Options) -> Prepared:
    """Every check of ``submit``, and the render, without writing anything."""
    launcher, restarts = _launcher(opts)
    site = load_site(opts.site, opts.site_flag)
    partition, account, time_min = _common(opts, site)
    exp = load_experiment(path)
    placement = place(site, exp.spec.workers, opts.nodes, opts.local)
    check_site(site, exp.spec)  # --local too: its processes get the site's environment
    exp = exp.resolved(placement)
    check_plan(exp.spec, placement.tasks, "--nodes" if opts.nodes is not None else "workers")
    folder = _planned_folder(opts.jobs_root, exp.name)
    if not opts.local:  # local processes run here, where the folder was writable
        site.check_jobs_folder(folder)
    # what a worker would refuse (policy, engines, verifier, init: and tokenizer folders), before
    # the job queues; the checks that import torch run on the compute nodes
    preflight(exp.spec, folder / "run", resume=False, local=False, child=False)
    req = job_request(
        job_name=exp.name, folder=str(folder / "logs"), python=opts.python, nodes=placement.nodes,
        tasks_per_node=placement.tasks_per_node, time_min=time_min, partition=partition, account=account,
        launcher=launcher, max_restarts=restarts,
    )  # fmt: skip
    rendered = render(site, req)
    record = JobRecord(
        name=exp.name, site=site_ref(opts.site), executor="local" if opts.local else "slurm",
        nodes=placement.nodes, tasks_per_node=placement.tasks_per_node, created=now_iso(),
        partition=partition, account=account, time_min=time_min, python=opts.python,
        launcher=launcher, max_restarts=restarts,
    )  # fmt: skip
    gains = sorted({e.step for e in exp.spec.drift if e.gain})
    warnings = (
        (f"drift: the gain at step {gains[0]} starts local processes under nereus run only; a launched "
         "job takes newcomers from nereus-launch grow",) if gains else ()
    )  # fmt: skip
    return Prepared(folder, site, req, rendered, record, {"experiment.yaml": exp.dump()}, warnings)


def prepare_array(path: Path, opts: Options) -> Prepared:
    """Every check of ``array``, and the render, without writing anything."""
    site = load_site(opts.site, opts.site_flag)
    if opts.nodes not in (None, 1):
        raise ConfigError(f"--nodes: an array task runs on one node, got {opts.nodes}")
    partition, account, time_min = _common(opts, site)
    sweep = load_sweep(path)
    check_argv(sweep, path)
    folder = _planned_folder(opts.jobs_root, sweep.name)
    if not opts.local:
        site.check_jobs_folder(folder)
    req = job_request(
        job_name=sweep.name, folder=str(folder / "logs"), python=opts.python, nodes=1, tasks_per_node=1,
        time_min=time_min, partition=partition, account=account, array=sweep.size,
    )  # fmt: skip
    rendered = render(site, req)
    tasks = tuple(
        ArrayTask(i, point, tuple(sweep.argv(point)), f"results/{task_file(i)}")
        for i, point in enumerate(sweep.points())
    )
    record = JobRecord(
        kind="array", name=sweep.name, site=site_ref(opts.site), executor="local" if opts.local else "slurm",
        nodes=1, tasks_per_node=1, created=now_iso(), partition=partition, account=account,
        time_min=time_min, python=opts.python, tasks=tasks,
    )  # fmt: skip
    doc = {"name": sweep.name, "description": sweep.description, "command": sweep.command,
           "args": sweep.args, "grid": {k: list(v) for k, v in sweep.grid.items()}}  # fmt: skip
    return Prepared(folder, site, req, rendered, record, {"sweep.yaml": yaml.safe_dump(doc, sort_keys=False)})


def _planned_folder(root: Path, name: str) -> Path:
    """Where the job folder will be (``commit`` creates it, with the time of creation)."""
    return root.absolute() / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def commit(prep: Prepared, factory: ExecutorFactory = submitit_executor) -> tuple[Path, JobRecord]:
    """Write the job folder and submit. On any failure before the job is queued the folder is removed."""
    root = prep.folder.parent
    made = [d for d in (root, *root.parents) if not d.exists()]  # removed again on failure
    folder = create_folder(root, prep.record.name)
    local = prep.record.executor == "local"
    try:
        logs = folder / "logs"
        rendered = render(prep.site, replace(prep.request, folder=str(logs)))  # the folder's real name
        files = dict(prep.files) if local else {**prep.files, "job.sbatch": rendered.sbatch}
        for sub in ("logs", "control", *(("results",) if prep.record.kind == "array" else ())):
            (folder / sub).mkdir(mode=0o700)
        for name, text in files.items():
            atomic_write(folder / name, text)
        write_secret(folder)
        write_record(folder, prep.record)
        with submitting("submitit" if local else "sbatch"):
            ex = factory(executor_kind(prep.record), logs, prep.request.python)
            ex.update_parameters(**(rendered.local_params if local else rendered.params))
            if prep.record.kind == "array":
                tasks = prep.record.tasks
                jobs = ex.map_array(
                    run_cli_task,
                    [str(folder)] * len(tasks),
                    [t.index for t in tasks],
                    [list(t.argv) for t in tasks],
                )
            else:
                jobs = [ex.submit(NodeJob(), str(folder))]
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()  # only if still empty
        if isinstance(exc, OSError):
            raise ConfigError(f"--jobs-root: cannot write {folder} ({exc})") from None
        raise
    ids = [str(j.job_id) for j in jobs]
    main_ids = tuple(dict.fromkeys(i.split("_", maxsplit=1)[0] for i in ids))  # an array's id, once
    record = replace(prep.record, state="SUBMITTED", job_ids=main_ids)
    if record.kind == "array":
        tasks = tuple(replace(t, job_id=i) for t, i in zip(record.tasks, ids, strict=True))
        record = replace(record, tasks=tasks)
    write_record(folder, record)
    return folder, record


def submit_node_job(
    folder: Path, site: Site, record: JobRecord, req: Request, kind: str, factory: ExecutorFactory,
    join: bool = False,
) -> tuple[str, str]:  # fmt: skip
    """Submit the node entry of the job in ``folder`` as ``req`` (``join``: newcomers to the
    running job) with its sbatch script written as the next ``<kind>-N.sbatch`` (none for a
    ``--local`` job, removed again when the submission fails); (job id, script name)."""
    local = record.executor == "local"
    rendered = render(site, req)
    script = "" if local else next_script(folder, kind)
    try:
        if script:
            atomic_write(folder / script, rendered.sbatch)
        with submitting("submitit" if local else "sbatch"):
            ex = factory(executor_kind(record), Path(req.folder), record.python)
            ex.update_parameters(**(rendered.local_params if local else rendered.params))
            job = ex.submit(NodeJob(), str(folder.absolute()), *((True,) if join else ()))
    except BaseException:
        if script:
            (folder / script).unlink(missing_ok=True)
        raise
    return str(job.job_id), script


_ENDED = "is {state}; only a running job {verb} (nereus-launch resume JOB submits it again)"


def _check_running(record: JobRecord, verb: str, run: Runner) -> None:
    """The job has not ended: its record's state, what SLURM says of its main job, and whether
    SLURM still knows it at all (a job that ended long ago without accounting)."""
    state = record.state
    if state not in STATES_DONE and record.executor == "slurm":
        now = slurm_states(record.job_ids, run)
        ended = [s for s in now.values() if s in STATES_DONE]
        if ended:
            state = ended[0]
        elif all(s == "UNKNOWN" for s in now.values()) and forgotten(record.job_ids, run):
            state = "ended (SLURM no longer knows it)"
    if state in STATES_DONE or state.startswith("ended ("):  # ours, beside SLURM's states
        raise ConfigError(f"JOB: {record.name} {_ENDED.format(state=state, verb=verb)}")


def grow(
    folder: Path, nodes: int, factory: ExecutorFactory = submitit_executor, run: Runner = run_command
) -> tuple[Grow, JobRecord]:
    """Submit ``nodes`` more nodes as a new job whose tasks run the node entry with ``join=True``."""
    check_owner(folder)
    with record_lock(folder):  # no status or other command writes job.json meanwhile
        record = settled(folder, read_record(folder))  # a refused shrink's nodes are still the job's
        if record.kind != "experiment":
            raise ConfigError(f"JOB: {folder} is an {record.kind} job; only an experiment grows")
        if nodes <= 0:
            raise ConfigError(f"--nodes: expected a positive integer, got {nodes}")
        _check_running(record, "grows", run)
        site = load_site(record.site)
        total = record.current_nodes + nodes
        local = record.executor == "local"
        if not local:
            check_node_limit(site, total)
        exp = load_experiment(folder / "experiment.yaml")
        check_plan(exp.spec, total * record.tasks_per_node)
        check_folder("JOB", folder)
        req = job_request(
            job_name=f"{record.name}-grow", folder=str(folder.absolute() / "logs"), python=record.python,
            nodes=nodes, tasks_per_node=record.tasks_per_node, time_min=record.time_min,
            partition=record.partition, account=record.account, launcher=record.launcher,
            max_restarts=record.max_restarts, join=True,
        )  # fmt: skip
        job_id, script = submit_node_job(folder, site, record, req, "grow", factory, join=True)
        added = Grow(job_id, nodes, now_iso(), script)
        record = replace(record, grows=(*record.grows, added))
        write_record(folder, record)
        return added, record


def shrink(folder: Path, nodes: int, run: Runner = run_command) -> tuple[Path, JobRecord]:
    """Ask the running job to drain ``nodes`` nodes (``control/shrink-<unix_ms>.json``)."""
    check_owner(folder)
    with record_lock(folder):  # no status or other command writes job.json meanwhile
        record = settled(folder, read_record(folder))
        if record.kind != "experiment":
            raise ConfigError(f"JOB: {folder} is an {record.kind} job; only an experiment shrinks")
        current = record.current_nodes
        if nodes <= 0 or nodes >= current:
            allowed = f"1 to {current - 1}" if current > 1 else "none: it has one node"
            raise ConfigError(
                f"--nodes: must be below the job's {current} node(s) (allowed: {allowed}), got {nodes}"
            )
        _check_running(record, "shrinks", run)
        exp = load_experiment(
            folder / "experiment.yaml"
        )  # what is left must still hold a plan, as grow checks
        check_plan(exp.spec, (current - nodes) * record.tasks_per_node)
        request = ShrinkRequest(nodes)
        path = write_shrink(folder, request)
        record = replace(record, shrinks=(*record.shrinks, Shrink(nodes, now_iso(), request.file)))
        write_record(folder, record)
        return path, record
