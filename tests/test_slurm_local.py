"""The local SLURM test cluster (slurm/local/start.sh) does what the launcher relies on.

Four nodes on one host: batch jobs spread over distinct nodes, mpi4py ranks under ``srun --mpi=pmi2``,
a node going down fails or requeues its job and comes back on resume, and submitit submits, returns
results and checkpoints/requeues on USR2. All nodes share the host's ``hostname``; a task's node is
``$SLURMD_NODENAME``. Skipped when the cluster cannot be started (see tests/slurm_cluster.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import submitit

from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm]


def _wait_for_text(path: Path, needle: str, timeout: float = 20) -> str:
    """Wait until ``needle`` appears in the file (job output is written by slurmstepd, asynchronously)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not in {path} after {timeout}s: {text!r}")


@pytest.mark.timeout(60)
def test_batch_job_runs_on_four_distinct_nodes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "hostname.out"
    jobid = slurm_cluster.sbatch(
        "-N4",
        "-n4",
        f"--output={out}",
        "--wrap",
        "srun bash -c 'echo \"$SLURMD_NODENAME $(hostname)\"'",
    )
    assert slurm_cluster.wait_state(jobid, "COMPLETED", timeout=30) == "COMPLETED"
    lines = [line.split() for line in out.read_text().splitlines() if line.strip()]
    # Four distinct node names, all on this one host: `hostname` cannot tell them apart.
    assert sorted(name for name, _ in lines) == slurm_cluster.nodes, lines
    assert len({host for _, host in lines}) == 1


MPI_PROBE = """
import json, os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank())
print(json.dumps({"rank": comm.Get_rank(), "size": comm.Get_size(), "node": os.environ["SLURMD_NODENAME"],
                  "sum": total, "prefix": sys.prefix}), flush=True)
"""


@pytest.mark.timeout(60)
def test_srun_pmi2_launches_mpi4py_ranks_across_nodes(slurm_cluster: SlurmCluster) -> None:
    assert "pmi2" in slurm_cluster.run("srun", "--mpi=list").stdout
    # `python` resolves through the exported PATH to this venv's interpreter (mpi4py over the mpich wheel).
    proc = slurm_cluster.run("srun", "--mpi=pmi2", "-N4", "-n4", "python", "-c", MPI_PROBE, timeout=45)
    ranks = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3], proc.stdout + proc.stderr
    assert all(r["size"] == 4 and r["sum"] == 6 for r in ranks)
    assert sorted(r["node"] for r in ranks) == slurm_cluster.nodes
    assert {r["prefix"] for r in ranks} == {sys.prefix}  # the tasks ran this venv's python


@pytest.mark.timeout(60)
def test_node_down_fails_the_job_and_resume_brings_the_node_back(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    jobid = slurm_cluster.sbatch(
        "--no-requeue",
        "-N2",
        "-n2",
        "-w",
        "n1,n2",
        f"--output={tmp_path / 'down.out'}",
        "--wrap",
        "srun sleep 300",
    )
    try:
        slurm_cluster.wait_state(jobid, "RUNNING", timeout=20)
        slurm_cluster.node_down("n2")
        assert slurm_cluster.wait_state(jobid, "NODE_FAIL", timeout=15) == "NODE_FAIL"
        assert slurm_cluster.node_state("n2").startswith(
            "down"
        )  # stays down (ReturnToService=1) until resumed
    finally:
        slurm_cluster.run("scancel", jobid, check=False)
        slurm_cluster.node_resume("n2")
    assert slurm_cluster.node_state("n2") == "idle"


@pytest.mark.timeout(90)
def test_node_down_requeues_a_requeueable_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "requeue.out"
    jobid = slurm_cluster.sbatch(
        "--requeue",
        "-N2",
        "-n2",
        "-w",
        "n1,n2",
        "--open-mode=append",
        f"--output={out}",
        "--wrap",
        'echo "run restarts=${SLURM_RESTART_COUNT:-0}"; srun sleep 300',
    )
    try:
        slurm_cluster.wait_state(jobid, "RUNNING", timeout=20)
        _wait_for_text(out, "run restarts=0")
        slurm_cluster.node_down("n2")
        t0 = time.monotonic()
        deadline = t0 + 15
        while slurm_cluster.job(jobid).get("Restarts") != "1":
            assert time.monotonic() < deadline, slurm_cluster.job(jobid)
            time.sleep(0.2)
        slurm_cluster.node_resume("n2")
        # Held ~cred_expire (10 s) after the requeue, then it runs again on the same two nodes.
        slurm_cluster.wait_state(jobid, "RUNNING", timeout=30)
        _wait_for_text(out, "run restarts=1")
        assert time.monotonic() - t0 < 30
    finally:
        slurm_cluster.run("scancel", jobid, check=False)
        slurm_cluster.node_resume("n2")


@pytest.mark.timeout(150)
def test_submitit_returns_a_result(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm_cluster.patch_environ(monkeypatch)  # submitit calls sbatch/sacct from this process
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit")
    assert executor.cluster == "slurm"
    executor.update_parameters(timeout_min=2, slurm_partition="debug")
    job = executor.submit(os.getenv, "SLURMD_NODENAME")
    # A few seconds on an idle host; the bound is wide because `make test` runs this layer beside
    # two busy pytest processes on two cores.
    assert slurm_cluster.wait_submitit(job, timeout=120) in slurm_cluster.nodes
    # Without slurmdbd `sacct` fails and submitit cannot tell the state; the result comes back anyway.
    expected = "COMPLETED" if slurm_cluster.accounting else "UNKNOWN"
    deadline = time.monotonic() + 10  # slurmdbd may record the end a moment after the result file
    while (
        state := job.watcher.get_state(job.job_id, mode="force")
    ) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert state == expected


class ResumableSleeper(submitit.helpers.Checkpointable):
    """A submitit Checkpointable: sleeps until preempted; its requeued run returns what it checkpointed."""

    def __init__(self) -> None:
        self.checkpointed: str | None = None

    def __call__(self, started: str) -> dict[str, str | None]:
        if self.checkpointed is None:
            Path(started).write_text(os.environ.get("SLURM_JOB_ID", ""))
            time.sleep(300)  # until USR2: submitit's handler calls checkpoint() and requeues the job
        return {"checkpointed": self.checkpointed, "restarts": os.environ.get("SLURM_RESTART_COUNT")}

    def checkpoint(self, started: str) -> submitit.helpers.DelayedSubmission:
        self.checkpointed = f"checkpoint of job {os.environ.get('SLURM_JOB_ID')}"
        return submitit.helpers.DelayedSubmission(self, started)


@pytest.mark.timeout(120)
def test_submitit_checkpoints_and_resumes_on_usr2(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slurm_cluster.patch_environ(monkeypatch)
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(timeout_min=3, slurm_partition="debug")
    started = tmp_path / "started"
    job = executor.submit(ResumableSleeper(), str(started))
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, job.stderr()
        time.sleep(0.2)
    t0 = time.monotonic()
    # Signal the job's steps (not --full: the batch shell would die of USR2).
    slurm_cluster.run("scancel", "--signal=USR2", job.job_id)
    result = slurm_cluster.wait_submitit(job, timeout=60)
    assert result == {"checkpointed": f"checkpoint of job {job.job_id}", "restarts": "1"}
    assert time.monotonic() - t0 < 40  # requeue is held ~cred_expire (10 s)
