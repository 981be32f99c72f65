"""What runs on the compute nodes: the RL job's node entry and an array task.

Both are pickled by submitit on the login node and called in every task on the compute nodes.
Nothing here imports torch at import time: the runtime is imported inside the call.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import submitit

from launch.jobdir import atomic_write
from nereus.errors import NereusError
from nereus.runtime import joberror


class NodeJob(submitit.helpers.Checkpointable):
    """The node entry of an RL job: every task runs ``nereus.runtime.node.main(job_dir, join=join)``.

    ``join=True`` for the tasks of a grow job: they join the running job's rendezvous. On
    preemption or timeout submitit calls ``checkpoint`` and requeues the same call; the runtime
    resumes from the job folder's latest checkpoint by itself.

    Bad input only a compute node can find (weights that are NaN, a checkpoint that does not
    verify, a broken vLLM install there), a refused join and any other error the runtime words
    (a full disk) end the task with its one line on stderr and in the job folder's
    ``error-<job id>.json`` (``nereus.runtime.joberror``; ``status`` shows it) and its exit code
    (2 for bad input), not a traceback.
    """

    def __init__(self) -> None:  # typed: submitit's ``Checkpointable.__new__`` is not
        super().__init__()

    def __call__(self, job_dir: str, join: bool = False) -> None:
        # Imported here, on the compute node: the runtime imports torch; the launcher must not.
        from nereus.runtime.joins import JoinRefusedError
        from nereus.runtime.node import main

        try:
            main(job_dir, join=join)
        except (NereusError, JoinRefusedError) as exc:
            code = joberror.record_failure(Path(job_dir), exc, newcomer=join)
            print(f"nereus node: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(code) from None

    def checkpoint(self, job_dir: str, join: bool = False) -> submitit.helpers.DelayedSubmission:
        return submitit.helpers.DelayedSubmission(NodeJob(), job_dir, join)


def run_cli_task(job_dir: str, index: int, argv: list[str]) -> int:
    """One array task: ``nereus.cli.main(argv)`` in-process (the planner needs no torch); its JSON
    (stdout) goes to ``results/task-<index>.json`` with the exit code and the error line, if any."""
    from nereus.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    result = None
    if code == 0:
        try:
            result = json.loads(out.getvalue())
        except ValueError:
            code = 1
            err.write(f"output is not JSON: {out.getvalue()[:200]!r}")
    lines = err.getvalue().strip().splitlines()
    doc = {"index": index, "argv": argv, "exit_code": code, "result": result,
           "error": lines[-1] if lines else ""}  # fmt: skip
    results = Path(job_dir) / "results"
    results.mkdir(mode=0o700, exist_ok=True)
    atomic_write(results / task_file(index), json.dumps(doc) + "\n")
    return code


def task_file(index: int) -> str:
    return f"task-{index:04d}.json"
