"""Bad input a launched job's worker met on a compute node, for ``nereus-launch status``.

The job folder's ``error-<job id>.json`` holds ``{"job_id", "error"}``: the job (SLURM's id, or
the ``--local`` controller's) and the one line; one file per job, so a grow job's refusal never
hides its job's own error. Every worker that meets the error writes the same line, whole (a
temporary file, then a rename). The launcher shows the line of the job's own ids first, then its
grows' (``read``), and a worker that torchrun restarts in a job that already wrote one stops
with it at once (``this_jobs``) instead of requeueing the job. Torch-free: the login node reads
it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path

from nereus.errors import ConfigError, NereusError

ERROR_CHARS = 500  # how much of the line ``read`` gives back
_JOB = re.compile(r"[0-9A-Za-z_.-]{1,64}")  # a job id that may name a file


def error_file(folder: Path, job: str) -> Path | None:
    """Job ``job``'s error file in ``folder`` (None for an id that cannot name one)."""
    return Path(folder) / f"error-{job}.json" if _JOB.fullmatch(job) and job not in (".", "..") else None


def job_id() -> str:
    """This process's job: submitit's ``--local`` controller, else SLURM's job; "" outside both."""
    return os.environ.get("SUBMITIT_LOCAL_JOB_ID") or os.environ.get("SLURM_JOB_ID", "")


def record(folder: Path, line: str, code: int = 2) -> None:
    """``line`` (of exit code ``code``: 2 for bad input) as this job's error in job folder
    ``folder`` (nothing when there is no job id or the folder cannot be written: the line still
    goes to the task's log)."""
    job = job_id()
    path = error_file(folder, job)
    if path is None:
        return
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps({"job_id": job, "error": line, "exit_code": code}) + "\n")
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def record_failure(folder: Path, exc: Exception, newcomer: bool) -> int:
    """A worker's end on ``exc`` (a worded ``NereusError``, or a refused join) recorded for
    ``status``, and its exit code. A refused join is the job's only for a newcomer of a grow: a
    job's own worker refused a rejoin is not the job's end."""
    code = exc.exit_code if isinstance(exc, NereusError) else ConfigError.exit_code
    if newcomer or isinstance(exc, NereusError):
        record(folder, str(exc), code)
    return code


def read(folder: Path, job_ids: tuple[str, ...]) -> tuple[str, str]:
    """The job id and error line of the first of ``job_ids`` whose workers wrote one, or ("", "")
    (none, or unreadable); the line printable and cut to ``ERROR_CHARS``."""
    for job in job_ids:
        path = error_file(folder, job)
        if path is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(doc, dict) and str(doc.get("job_id")) == job and isinstance(doc.get("error"), str):
                line = "".join(c if c.isprintable() else " " for c in doc["error"])
                return job, line if len(line) <= ERROR_CHARS else f"{line[: ERROR_CHARS - 1]}…"
    return "", ""


def this_jobs(folder: Path) -> str:
    """The bad-input line (exit code 2) this job's workers wrote, or ""."""
    path = error_file(folder, job_id())
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if path is not None and json.loads(path.read_text(encoding="utf-8")).get("exit_code", 2) == 2:
            return read(folder, (job_id(),))[1]
    return ""
