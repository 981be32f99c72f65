"""``nereus-launch resume JOB``: submit a job that ended (cancelled, past its requeues after time
limits, a node failure) again into its own folder. Its workers resume from the run's latest
checkpoint (``nereus.runtime.node`` resumes whenever one is there), verified with the job's own
secret, on the nodes it was submitted with: grown nodes belonged to the allocation that ended, and
shrink requests it had not read yet are set aside (``.void-<name>``) so the new job does not
drain nodes it never had. ``job.json`` then names the new job; the earlier ids stay listed for
``logs``."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from launch.experiment import check_node_limit, check_plan, load_experiment
from launch.jobdir import (
    STATES_DONE,
    JobRecord,
    check_owner,
    read_record,
    record_lock,
    write_record,
)
from launch.monitor import Runner, forgotten, job_states, run_command
from launch.site import load_site, time_limit
from launch.submit import (
    ExecutorFactory,
    check_folder,
    job_request,
    submit_node_job,
    submitit_executor,
)
from nereus.errors import ConfigError
from nereus.runtime import signing
from nereus.runtime.export import exported
from nereus.runtime.pool import REFUSED, SHRINK_GLOB


def resume(
    folder: Path, time: str | None = None, factory: ExecutorFactory = submitit_executor,
    run: Runner = run_command,
) -> JobRecord:  # fmt: skip
    """Submit the ended job in ``folder`` again (``time``: another time limit); its record."""
    check_owner(folder)
    with record_lock(folder):  # no status or other command writes job.json meanwhile
        record = read_record(folder)
        if record.kind != "experiment":
            raise ConfigError(f"JOB: {folder} is an {record.kind} job; only an experiment resumes")
        _check_ended(folder, record, run)
        checkpoints = folder / "run" / "checkpoints"
        try:
            latest = signing.latest(checkpoints)
        except ConfigError as exc:
            raise ConfigError(f"JOB: {exc}") from None
        if latest is None:
            raise ConfigError(
                f"JOB: {folder} has no checkpoint to resume from ({checkpoints}); submit its experiment "
                "again to start over"
            )
        site = load_site(record.site)
        time_min = (
            record.time_min if time is None else time_limit(time, "--time", site.signal_delay_s, site.name)
        )
        local = record.executor == "local"
        if not local:
            check_node_limit(site, record.nodes)
        spec = load_experiment(folder / "experiment.yaml").spec
        step = int(latest.name.removeprefix("step_"))
        if step + 1 > spec.steps or (step + 1 == spec.steps and exported(folder / "run", spec.steps)):
            raise ConfigError(  # (trained but not exported: the job writes the export, training nothing)
                f"JOB: {record.name} checkpointed its last step ({step} of {spec.steps}) and exported it: "
                "nothing to resume"
            )
        check_plan(spec, record.nodes * record.tasks_per_node, "JOB")
        check_folder("JOB", folder)
        req = job_request(
            job_name=record.name, folder=str(folder.absolute() / "logs"), python=record.python,
            nodes=record.nodes, tasks_per_node=record.tasks_per_node, time_min=time_min,
            partition=record.partition, account=record.account, launcher=record.launcher,
            max_restarts=record.max_restarts,
        )  # fmt: skip
        job_id, _ = submit_node_job(folder, site, record, req, "resume", factory)
        control = folder / "control"  # the old allocation's requests, and its refusals
        for pending in sorted([*control.glob(SHRINK_GLOB), *control.glob(f"{REFUSED}{SHRINK_GLOB}")]):
            os.replace(pending, pending.with_name(f".void-{pending.name}"))
        record = replace(
            record, job_ids=(job_id,), earlier=(*record.earlier, *record.all_job_ids), grows=(),
            shrinks=(), state="SUBMITTED", time_min=time_min,
        )  # fmt: skip
        write_record(folder, record)
        return record


def _check_ended(folder: Path, record: JobRecord, run: Runner) -> None:
    """Every job of the record has ended: SLURM says so, or (without accounting, after
    ``MinJobAge``) no longer knows it; a ``--local`` job's controller is gone. Else one line: a
    second job must never write the same checkpoints."""
    states = job_states(folder, record, run)
    active = [i for i, state in states.items() if state not in STATES_DONE and state != "UNKNOWN"]
    if active:
        raise ConfigError(
            f"JOB: {record.name} is still {states[active[0]]} (job {active[0]}); it resumes once it has "
            "ended (nereus-launch cancel, which checkpoints first)"
        )
    unknown = [i for i, state in states.items() if state == "UNKNOWN"]
    if unknown and record.executor == "slurm" and not forgotten(unknown, run):
        raise ConfigError(
            f"JOB: SLURM could not say whether job {unknown[0]} of {record.name} ended (sacct and squeue "
            "gave no answer); try again when they do"
        )
