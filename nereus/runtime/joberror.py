"""Bad input a launched job's worker met on a compute node, for ``nereus-launch status``.

The job folder's ``error.json`` holds ``{"job_id", "error"}``: the job (SLURM's id, or the
``--local`` controller's) and the one line. Every worker that meets the error writes the same
line, whole (a temporary file, then a rename); a later job's replaces an earlier one's. The
launcher shows it for the job that wrote it only (``read``), and a worker that torchrun restarts
in a job that already wrote one stops with it at once (``this_jobs``) instead of requeueing the
job. Torch-free: the login node reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

ERROR = "error.json"
ERROR_CHARS = 500  # how much of the line ``read`` gives back


def job_id() -> str:
    """This process's job: submitit's ``--local`` controller, else SLURM's job; "" outside both."""
    return os.environ.get("SUBMITIT_LOCAL_JOB_ID") or os.environ.get("SLURM_JOB_ID", "")


def record(folder: Path, line: str) -> None:
    """``line`` as this job's error in job folder ``folder`` (nothing when there is no job id or
    the folder cannot be written: the line still goes to the task's log)."""
    job = job_id()
    if not job:
        return
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{ERROR}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps({"job_id": job, "error": line}) + "\n")
            os.replace(tmp, Path(folder) / ERROR)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def read(folder: Path, job_ids: tuple[str, ...]) -> tuple[str, str]:
    """The job id and error line a worker of one of ``job_ids`` wrote, or ("", "") (none, an
    earlier job's, or unreadable); the line printable and cut to ``ERROR_CHARS``."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((Path(folder) / ERROR).read_text(encoding="utf-8"))
        if isinstance(doc, dict) and str(doc.get("job_id")) in job_ids and isinstance(doc.get("error"), str):
            line = "".join(c if c.isprintable() else " " for c in doc["error"])
            return str(doc["job_id"]), line if len(line) <= ERROR_CHARS else f"{line[: ERROR_CHARS - 1]}…"
    return "", ""


def this_jobs(folder: Path) -> str:
    """The error line this job's workers wrote, or ""."""
    job = job_id()
    return read(folder, (job,))[1] if job else ""
