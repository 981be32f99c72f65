"""The RL job on the local SLURM cluster, launched by ``nereus-launch`` (submitit, srun --mpi=pmi2).

- A tiny PPO job on 2 nodes (2 workers each) grows by a node while it runs: the newcomers present
  the job's secret, join at a step boundary and the controller Extends onto them; a stranger
  without the secret is refused and logged; then the grown node is set DOWN: the survivors
  detect it, replan from intact units and finish. The exported actor equals that of the same job
  run without any of it (``nereus run``, 4 local workers).
- SLURM's preemption signal (``scancel --signal=USR2``): the job checkpoints at its next
  boundary, submitit requeues it, and the requeued job resumes to the same final state.
- A job array of 4 planner runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.slurm_cluster import FINAL_STATES, SlurmCluster

pytestmark = [pytest.mark.slurm]

EXPERIMENT = """
name: {name}
workload: ppo-tiny
model: tiny-llama
cluster: local-slurm
workers: 4
steps: {steps}
seed: 5
policy: always
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, critic_lr: 0.01, kl_coef: 0.01}}
checkpoint_every: {every}
"""


def launch(cluster: SlurmCluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return cluster.run(sys.executable, "-m", "launch.cli", *args, check=False, timeout=timeout)


def rows(job: Path) -> list[dict[str, object]]:
    path = job / "run" / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(what: str, test: object, timeout: float, job: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if test():  # type: ignore[operator]
            return
        time.sleep(0.25)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted((job / "logs").glob("*.err"))[-4:])
    raise AssertionError(f"timed out waiting for {what}; metrics: {rows(job)[-2:]}\n{logs}")


def submitted(proc: subprocess.CompletedProcess[str]) -> tuple[str, Path]:
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"job (\d+).*→ (\S+)", proc.stdout)
    assert m, proc.stdout
    return m.group(1), Path(m.group(2))


def reference(tmp: Path, name: str, steps: int, every: int) -> dict[str, torch.Tensor]:
    exp = tmp / f"{name}-ref.yaml"
    exp.write_text(EXPERIMENT.format(name=name, steps=steps, every=every))
    out = tmp / f"{name}-ref"
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "hf" / "actor" / "model.safetensors"))


def assert_same_actor(job: Path, ref: dict[str, torch.Tensor]) -> None:
    got = load_file(str(job / "run" / "hf" / "actor" / "model.safetensors"))
    assert set(got) == set(ref)
    for name in got:
        assert torch.allclose(got[name], ref[name], atol=2e-4, rtol=0), name


@pytest.mark.timeout(420)
def test_grow_stranger_and_node_down_keep_training_on_track(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    for node in slurm_cluster.nodes:  # four free nodes: two for the job, two to grow by
        slurm_cluster.node_resume(node)
    slurm_cluster.wait_idle()
    steps, every = 30, 4
    exp = tmp_path / "elastic.yaml"
    exp.write_text(EXPERIMENT.format(name="elastic", steps=steps, every=every))
    jobid, job = submitted(
        launch(
            slurm_cluster, "submit", str(exp), "--site", "local", "--nodes", "2", "--jobs-root", str(tmp_path)
        )
    )
    assert (job.stat().st_mode & 0o777) == 0o700
    grow = launch(slurm_cluster, "grow", str(job), "--nodes", "2")  # its workers join once both run
    assert grow.returncode == 0, grow.stderr
    grown = re.search(r"job (\d+)", grow.stdout).group(1)  # type: ignore[union-attr]

    wait_for("the job's rendezvous", (job / "rendezvous.json").is_file, 180, job)
    # a stranger: the same rendezvous, the wrong secret
    stranger = tmp_path / "stranger"
    stranger.mkdir(mode=0o700)
    shutil.copy(job / "experiment.yaml", stranger / "experiment.yaml")
    shutil.copy(job / "rendezvous.json", stranger / "rendezvous.json")
    (stranger / "secret").write_text("00" * 32)
    refused = slurm_cluster.run(
        sys.executable, "-m", "nereus.cli", "node", str(stranger), "--join", check=False, timeout=120
    )
    assert refused.returncode == 2 and "join refused" in refused.stderr, refused.stderr[-2000:]

    def joined() -> bool:
        return any(
            t.get("kind") == "membership" and t.get("joined") for r in rows(job) for t in r["transitions"]
        )  # type: ignore[union-attr]

    wait_for("the grown node to join", joined, 180, job)
    nodes = slurm_cluster.run(
        "scontrol", "show", "hostnames", slurm_cluster.job(grown)["NodeList"]
    ).stdout.split()
    node = nodes[-1]
    assert node not in slurm_cluster.job(jobid)["NodeList"], (node, slurm_cluster.job(jobid))
    slurm_cluster.node_down(node, reason="nereus-e2e")
    try:

        def recovered() -> bool:
            return any(t.get("kind") == "recovered" for r in rows(job) for t in r["transitions"])  # type: ignore[union-attr]

        wait_for("the survivors to recover", recovered, 180, job)
        slurm_cluster.wait_state(jobid, {"COMPLETED"}, timeout=240)
    finally:
        slurm_cluster.node_resume(node)
    # the grown job's surviving tasks end with the job (nothing waits on the dead node's ranks)
    wait_for("the grow job to end", lambda: slurm_cluster.state(grown) in FINAL_STATES, 60, job)
    log = (job / "run" / "membership.log").read_text()
    assert "refused join request" in log and "bad secret" in log
    assert "accepted join request" in log and "lost GPUs" in log
    done = rows(job)
    assert [r["step"] for r in done][-1] == steps - 1
    kinds = [t["kind"] for r in done for t in r["transitions"]]  # type: ignore[union-attr]
    assert any("extend" in k for k in kinds), kinds  # onto the newcomers
    assert "recovered" in kinds, kinds  # then in place from intact units, or from the checkpoint
    assert_same_actor(job, reference(tmp_path, "elastic", steps, every))


@pytest.mark.timeout(420)
def test_preemption_checkpoints_requeues_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    steps, every = 12, 4
    exp = tmp_path / "preempted.yaml"
    exp.write_text(EXPERIMENT.format(name="preempted", steps=steps, every=every))
    jobid, job = submitted(
        launch(
            slurm_cluster, "submit", str(exp), "--site", "local", "--nodes", "2", "--jobs-root", str(tmp_path)
        )
    )
    wait_for("step 2", lambda: len(rows(job)) >= 3, 180, job)
    slurm_cluster.run("scancel", "--signal=USR2", jobid)
    wait_for(
        "the preemption checkpoint",
        lambda: any(t.get("kind") == "preempted" for r in rows(job) for t in r["transitions"]),  # type: ignore[union-attr]
        120,
        job,
    )
    slurm_cluster.wait_state(jobid, {"COMPLETED"}, timeout=300)
    assert int(slurm_cluster.job(jobid).get("Restarts", "0")) >= 1
    done = rows(job)
    assert [r["step"] for r in done][-1] == steps - 1
    assert_same_actor(job, reference(tmp_path, "preempted", steps, every))


@pytest.mark.timeout(180)
def test_an_array_of_planner_runs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    proc = launch(
        slurm_cluster, "array", str(repo / "configs" / "sweeps" / "plan-scaling.yaml"), "--site", "local",
        "--jobs-root", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    folder = Path(re.search(r"→ (\S+)", proc.stdout).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and len(list((folder / "results").glob("task-*.json"))) < 4:
        time.sleep(0.5)
    results = [json.loads(p.read_text()) for p in sorted((folder / "results").glob("task-*.json"))]
    assert len(results) == 4, [p.name for p in (folder / "logs").iterdir()]
    assert all(r["exit_code"] == 0 and r["result"] for r in results), results


@pytest.mark.timeout(90)
def test_bootstrap_takes_ranks_from_mpi_under_srun(slurm_cluster: SlurmCluster) -> None:
    code = (
        "from nereus.runtime.bootstrap import bootstrap; b, c = bootstrap(); "
        "print(b.source, b.rank, b.world, c.bcast(b.rank * 10 if b.rank == 0 else None, root=0))"
    )
    env = {**slurm_cluster.env, "NEREUS_BOOTSTRAP": "mpi"}
    proc = subprocess.run(
        ["srun", "--mpi=pmi2", "-N", "2", "-n", "4", sys.executable, "-c", code],
        env=env, capture_output=True, text=True, timeout=80, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("mpi"))
    assert lines == [f"mpi {r} 4 0" for r in range(4)], proc.stdout
