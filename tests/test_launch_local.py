"""``nereus-launch --local``: real runs through submitit's LocalExecutor (processes on this machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import submitit
from submitit.local.local import LocalJob

from launch.jobdir import JobRecord, read_record
from launch.monitor import _descendants, local_states, status
from tests.test_launch import launch

pytestmark = pytest.mark.e2e


def test_array_runs_locally(tmp_path: Path, capsys: Any) -> None:
    """A real run through submitit's LocalExecutor: each task plans in its own process."""
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text("command: plan\nargs: {model: tiny-llama, algo: ppo, cluster: local-cpu, seq-len: 8}\n"
                     "grid: {gpus: [4, 8]}\n")  # fmt: skip
    root = tmp_path / "jobs"
    code, _, err = launch(["array", str(sweep), "--local", "--jobs-root", str(root)], capsys)
    assert code == 0, err
    (folder,) = root.iterdir()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(list((folder / "results").glob("*.json"))) < 2:
        time.sleep(0.2)
    doc = status(folder)
    assert [t["exit_code"] for t in doc["tasks"]] == [0, 0], doc
    assert [t["args"]["gpus"] for t in doc["tasks"]] == [4, 8]


def test_cancel_stops_a_local_job(tmp_path: Path, capsys: Any) -> None:
    """``--local`` jobs are submitit's controller process and its tasks: cancel stops them all."""
    folder = tmp_path / "job"
    (folder / "logs").mkdir(parents=True)
    ex = submitit.LocalExecutor(folder=folder / "logs")
    ex.update_parameters(tasks_per_node=2, timeout_min=1, setup=['export OMP_NUM_THREADS="1"'])
    job = ex.submit(time.sleep, 30)
    assert isinstance(job, LocalJob) and job._process is not None
    pid = int(job.job_id)
    try:
        record = JobRecord(name="sleep", site="local", executor="local", job_ids=(job.job_id,), nodes=1,
                           tasks_per_node=2, created="now", time_min=1, python=sys.executable)  # fmt: skip
        (folder / "job.json").write_text(record.to_json())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_descendants(pid)) < 3:
            time.sleep(0.1)
        tasks = _descendants(pid)
        assert len(tasks) >= 3  # the controller (under its shell) and two tasks
        assert local_states([job.job_id], folder / "logs") == {job.job_id: "RUNNING"}
        code, out, err = launch(["cancel", str(folder)], capsys)
        assert code == 0 and job.job_id in out, err
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in tasks):
            time.sleep(0.1)
        job._process.wait(timeout=10)  # reap the controller's shell: this process started it
        assert not [p for p in tasks if Path(f"/proc/{p}").exists()]
        assert read_record(folder).state == "CANCELLED"
    finally:  # never leave the test's processes behind, whatever failed
        for p in (*_descendants(pid), pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        job._process.wait(timeout=10)
