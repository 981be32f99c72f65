"""The RL job on the local SLURM cluster, launched by ``nereus-launch`` (submitit, srun --mpi=pmi2).

- A tiny PPO job on 2 nodes (2 workers each) grows by a node while it runs: the newcomers present
  the job's secret, join at a step boundary and the controller Extends onto them; a stranger
  without the secret is refused and logged; then the grown node is set DOWN: the survivors
  detect it, replan from intact units and finish. The job's own nodes are reserved and the grown
  ones revocable (``reserved_nodes: 2``, rate unknown), so the lost node is a revocation: the
  job learns a rate from it and prices the decision that answers it with that. The exported
  actor equals that of the same job run without any of it (``nereus run``, 4 local workers).
- SLURM's preemption signal (``scancel --signal=USR2``): the job checkpoints at its next
  boundary, submitit requeues it, and the requeued job resumes to the same final state.
- A job array of 4 planner runs.
- ``--launcher torchrun`` (one torchrun agent per node, 1 worker each on 4 nodes): a worker
  SIGKILLed inside the job is restarted by its node's agent and rejoins through the signed join
  path; the leader SIGKILLed is restarted too, finds its store gone and requeues the job, which
  resumes from its checkpoint; SIGUSR2 checkpoints, and the leader requeues. Each time the
  exported actor equals that of the same job run untouched (``nereus run``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from nereus.backends.optim import AdamWConfig
from nereus.spec.registry import config_root
from tests.slurm_cluster import FINAL_STATES, SlurmCluster

pytestmark = [pytest.mark.slurm]

EXPERIMENT = """
name: {name}
workload: ppo-tiny
model: tiny-llama
cluster: {cluster}
workers: 4
steps: {steps}
seed: 5
policy: always
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, critic_lr: 0.01, kl_coef: 0.01}}
checkpoint_every: {every}
"""


def experiment(name: str, steps: int, every: int, cluster: str = "local-slurm") -> str:
    return EXPERIMENT.format(name=name, steps=steps, every=every, cluster=cluster)


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


_running: list[subprocess.Popen[bytes]] = []


@pytest.fixture(scope="module", autouse=True)
def _no_reference_left() -> Iterator[None]:
    """A reference a failed test started and never waited for ends with the module."""
    yield
    for proc in _running:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the run and its workers
            proc.wait()


class Reference:
    """The same experiment run untouched (``nereus run``, 4 local workers). A test starts it in the
    background once its SLURM job is past the events it checks (the job's remaining steps and
    SLURM's requeue hold leave the cores idle part of the time), and waits for it at the end."""

    def __init__(self, tmp: Path, name: str, steps: int, every: int, cluster: str = "local-slurm") -> None:
        self.exp, self.out = tmp / f"{name}-ref.yaml", tmp / f"{name}-ref"
        self.err = tmp / f"{name}-ref.err"
        self.exp.write_text(experiment(name, steps, every, cluster))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Reference:
        if self.proc is None:
            with self.err.open("wb") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "nereus.cli", "run", str(self.exp), "--out", str(self.out)],
                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                )  # fmt: skip
            _running.append(self.proc)
        return self

    def actor(self) -> Actor:
        proc = self.start().proc
        assert proc is not None
        try:
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 0, self.err.read_text()[-3000:]
        return Actor.of(self.out)


class Stranger:
    """``nereus node --join`` with the job's rendezvous and the wrong secret, started in the
    background as soon as the job is submitted: it waits for the job's rendezvous (a link to the
    job's own file, which the leader writes once it runs), so its start-up overlaps the job's and
    its request reaches the leader while the job has most of its steps ahead. Once the leader
    notes that the request does not verify, the stranger waits ``UNVERIFIED_GRACE_S`` for an
    authentic answer before it gives up; started after the rendezvous appeared, on a loaded
    machine, a 30-step job of 0.3-s steps could end inside that wait."""

    def __init__(self, cluster: SlurmCluster, job: Path, folder: Path) -> None:
        folder.mkdir(mode=0o700)
        shutil.copy(job / "experiment.yaml", folder / "experiment.yaml")
        (folder / "rendezvous.json").symlink_to(job / "rendezvous.json")
        (folder / "secret").write_text("00" * 32)
        self.err = folder / "stderr"
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nereus.cli", "node", str(folder), "--join"],
                env=cluster.env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            )  # fmt: skip
        _running.append(self.proc)

    def result(self, timeout_s: float = 120) -> tuple[int, str]:
        """Its exit code and standard error."""
        self.proc.wait(timeout=timeout_s)
        return self.proc.returncode, self.err.read_text()


@dataclass(frozen=True)
class Actor:
    """A run's exported actor, and the RMS of each weight's gradients over the run: the square
    root of AdamW's second moment in the run's last checkpoint (the run's final step)."""

    weights: dict[str, torch.Tensor]
    grad_rms: dict[str, torch.Tensor]

    @staticmethod
    def of(run: Path) -> Actor:
        weights = load_file(str(run / "hf" / "actor" / "model.safetensors"))
        last = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        flat = run.parent / f"{run.parent.name}-{run.name}-{last.name}.pt"
        dcp_to_torch_save(last, flat)
        state = torch.load(flat, weights_only=True)
        flat.unlink()
        return Actor(weights, {n: state[f"actor.train/exp_avg_sq/{n}"].sqrt() for n in weights})


def assert_same_actor(job: Path, ref: Actor) -> None:
    """The job's actor equals the untouched run's to 2e-4 wherever a gradient moved it.

    A weight whose gradient stayed below AdamW's eps in both runs (RMS < eps) moves by rounding
    residue: its gradient cancels in exact arithmetic (e.g. through advantages that sum to zero)
    and what fp32 leaves of it depends on the reduction order, which another DP layout changes;
    AdamW divides that residue by eps, so such a weight can move by a fraction of the learning
    rate either way. Measured: 1 weight of 250,432, gradient RMS 2.5e-11, differed by 3.2e-4,
    the next largest difference anywhere was 3.5e-5. Those weights are exempt only while they
    are a sliver of the model (≤ 0.1%), and a gradient lost or doubled in the job fails here
    since it leaves the other run's RMS above eps."""
    got = Actor.of(job / "run")
    assert set(got.weights) == set(ref.weights)
    eps, noise, total = AdamWConfig().eps, 0, 0
    for name, weight in got.weights.items():
        rms = torch.maximum(got.grad_rms[name], ref.grad_rms[name])
        residue = (rms > 0) & (rms < eps)
        noise += int(residue.sum())
        total += weight.numel()
        off = (weight - ref.weights[name]).abs().masked_fill(residue, 0)
        assert float(off.max()) <= 2e-4, (name, float(off.max()), [int(i) for i in _where_max(off)])
    assert noise <= total // 1000, (noise, total)


def _where_max(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.unravel_index(t.argmax(), t.shape)


@pytest.mark.timeout(420)
def test_grow_stranger_and_node_down_keep_training_on_track(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    for node in slurm_cluster.nodes:  # four free nodes: two for the job, two to grow by
        slurm_cluster.node_resume(node)
    slurm_cluster.wait_idle()
    steps, every = 30, 4
    # the job's own two nodes are reserved, the two it grows by revocable (rate unknown): losing
    # one without a drain is a revocation the job learns its rate from
    spot = tmp_path / "local-slurm-spot.yaml"
    spot.write_text((config_root() / "clusters" / "local-slurm.yaml").read_text() + "reserved_nodes: 2\n")
    exp = tmp_path / "elastic.yaml"
    exp.write_text(experiment("elastic", steps, every, str(spot)))
    ref = Reference(tmp_path, "elastic", steps, every, str(spot))
    jobid, job = submitted(
        launch(
            slurm_cluster, "submit", str(exp), "--site", "local", "--nodes", "2", "--jobs-root", str(tmp_path)
        )
    )
    assert (job.stat().st_mode & 0o777) == 0o700
    grow = launch(slurm_cluster, "grow", str(job), "--nodes", "2")  # its workers join once both run
    assert grow.returncode == 0, grow.stderr
    grown = re.search(r"job (\d+)", grow.stdout).group(1)  # type: ignore[union-attr]
    refused = Stranger(slurm_cluster, job, tmp_path / "stranger")  # started now, beside the job's start

    def joined() -> bool:  # every worker of both grown nodes (they may come in two rounds)
        return any(r.get("gpus") == 8 for r in rows(job))

    # The node goes down once all four have joined, so the loss is a step's (a node lost while a
    # generation forms is the roll call's case: tests/test_membership.py and test_runtime_e2e.py).
    wait_for("the grown nodes to join", joined, 180, job)
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
        ref.start()  # past the events: the reference runs alongside the job's last steps
        slurm_cluster.wait_state(jobid, {"COMPLETED"}, timeout=240)
    finally:
        slurm_cluster.node_resume(node)
    # the grown job's surviving tasks end with the job (nothing waits on the dead node's ranks)
    wait_for("the grow job to end", lambda: slurm_cluster.state(grown) in FINAL_STATES, 60, job)
    code, err = refused.result()
    assert code == 2 and "join refused" in err, err[-2000:]
    log = (job / "run" / "membership.log").read_text()
    assert "refused join request" in log and "bad secret" in log
    assert "accepted join request" in log and "lost GPUs" in log
    done = rows(job)
    assert [r["step"] for r in done][-1] == steps - 1
    kinds = [t["kind"] for r in done for t in r["transitions"]]  # type: ignore[union-attr]
    assert any("extend" in k for k in kinds), kinds  # onto the newcomers
    assert "recovered" in kinds, kinds  # then in place from intact units, or from the checkpoint
    decisions = [r["decision"] for r in done if r.get("decision")]
    lost = [d for d in decisions if any(t.startswith("gpu-loss") for t in d["triggers"])]  # type: ignore[index]
    assert lost and 0 < lost[0]["revocation_rate"] <= 1 / 24 + 1e-9, decisions  # type: ignore[index, operator]
    assert_same_actor(job, ref.actor())


@pytest.mark.timeout(420)
def test_preemption_checkpoints_requeues_and_resumes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    steps, every = 20, 4  # the signal comes at step 2: steps left over for a loaded machine
    exp = tmp_path / "preempted.yaml"
    exp.write_text(experiment("preempted", steps, every))
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
    ref = Reference(tmp_path, "preempted", steps, every).start()  # alongside the requeue and resume
    slurm_cluster.wait_state(jobid, {"COMPLETED"}, timeout=300)
    assert int(slurm_cluster.job(jobid).get("Restarts", "0")) >= 1
    done = rows(job)
    assert [r["step"] for r in done][-1] == steps - 1
    assert_same_actor(job, ref.actor())


@pytest.mark.timeout(300)
def test_cancel_ends_a_running_job_for_good(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """``nereus-launch cancel`` (scancel: SIGTERM to every task) mid-run: the job checkpoints at its
    next boundary and ends; unlike SIGUSR2 (a preemption) it is not requeued."""
    exp = tmp_path / "cancelled.yaml"
    exp.write_text(experiment("cancelled", 40, 0))
    jobid, job = submitted(
        launch(
            slurm_cluster, "submit", str(exp), "--site", "local", "--nodes", "2", "--jobs-root", str(tmp_path)
        )
    )
    wait_for("step 2", lambda: len(rows(job)) >= 3, 180, job)
    proc = launch(slurm_cluster, "cancel", str(job))
    assert proc.returncode == 0 and f"cancelled {jobid}" in proc.stdout, proc.stderr
    slurm_cluster.wait_state(jobid, {"CANCELLED"}, timeout=120)
    time.sleep(10)  # long enough for a requeue to have shown
    info = slurm_cluster.job(jobid)
    assert info.get("JobState") == "CANCELLED" and info.get("Restarts", "0") == "0", info
    assert len(rows(job)) < 40


@pytest.mark.timeout(240)
def test_bad_input_only_the_nodes_find_is_one_line_in_status(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """NaN in the actor's init weights: the login node reads headers only, the workers read the
    tensors. Every task exits 2 with the one line (no traceback), and ``status`` shows it."""
    import safetensors.torch

    from tests.test_runtime_e2e import _hf_checkpoint

    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    tensors = safetensors.torch.load_file(actor / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, actor / "model.safetensors")
    exp = tmp_path / "naninit.yaml"
    exp.write_text(experiment("naninit", 4, 0) + f"init: {{actor: {actor}}}\n")
    jobid, job = submitted(
        launch(
            slurm_cluster, "submit", str(exp), "--site", "local", "--nodes", "2", "--jobs-root", str(tmp_path)
        )
    )
    assert slurm_cluster.wait_state(jobid, FINAL_STATES, timeout=180) == "FAILED"
    line = f"init.actor: {actor}/model.safetensors: tensor '{name}' holds NaN or Infinity"
    proc = launch(slurm_cluster, "status", str(job), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["state"], doc["error"]) == ("FAILED", line), doc
    assert slurm_cluster.job(jobid)["ExitCode"].startswith("2:"), slurm_cluster.job(jobid)
    logs = [p.read_text() for p in (job / "logs").glob("*_log.err")]
    assert len(logs) == 4 and all(f"nereus node: error: {line}" in log for log in logs), logs
    assert not any("Traceback" in log for log in logs), logs


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


# ------------------------------------------------------------------ --launcher torchrun
TORCHRUN_STEPS, TORCHRUN_EVERY = 60, 4
_references: dict[tuple[int, int], Reference] = {}
_actors: dict[tuple[int, int], Actor] = {}


def torchrun_reference(tmp: Path) -> Reference:
    """The untouched run of the torchrun jobs' experiment (run once for the three tests; the
    first test to get past its events starts it)."""
    key = (TORCHRUN_STEPS, TORCHRUN_EVERY)
    if key not in _references:
        _references[key] = Reference(tmp, "torchrun", *key)
    return _references[key].start()


def _proc(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in _proc(pid, "environ").decode(errors="replace").split("\0"))
    return {kv[0]: kv[1] for kv in pairs if len(kv) == 2}


def _parent(pid: int) -> int:
    stat = _proc(pid, "stat").decode(errors="replace")
    return int(stat.rsplit(")", 1)[1].split()[1]) if ")" in stat else -1


def torchrun_worker(job: Path, task: int) -> tuple[int, int, dict[str, str]]:
    """(agent pid, worker pid, the worker's environment) of SLURM task ``task``'s torchrun agent and
    the one worker it runs (1 per node): the worker is the agent's child ``nereus.cli node JOB``."""
    procs = [int(p.name) for p in Path("/proc").glob("[0-9]*")]

    def is_agent(pid: int) -> bool:  # python -u -m torch.distributed.run … JOB (not the srun that runs it)
        argv = _proc(pid, "cmdline").split(b"\0")
        return argv[1:4] == [b"-u", b"-m", b"torch.distributed.run"] and str(job).encode() in argv

    agents = [pid for pid in procs if is_agent(pid) and _environ(pid).get("SLURM_PROCID") == str(task)]
    assert len(agents) == 1, agents
    workers = [pid for pid in procs if _parent(pid) == agents[0] and b"nereus.cli" in _proc(pid, "cmdline")]
    assert len(workers) == 1, workers
    return agents[0], workers[0], _environ(workers[0])


@pytest.fixture
def torchrun_job(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[Callable[[str], tuple[str, Path]]]:
    """Submit the experiment under ``--launcher torchrun`` on the 4 nodes and wait past its first
    checkpoint (after step 3: whatever a loss costs, there is one to fall back on). A job the test
    leaves running is cancelled."""
    ids: list[str] = []

    def submit(name: str) -> tuple[str, Path]:
        for node in slurm_cluster.nodes:  # four free nodes: one torchrun agent, one worker on each
            slurm_cluster.node_resume(node)
        slurm_cluster.wait_idle()
        exp = tmp_path / f"{name}.yaml"
        exp.write_text(experiment(name, TORCHRUN_STEPS, TORCHRUN_EVERY))
        jobid, job = submitted(
            launch(
                slurm_cluster, "submit", str(exp), "--site", "local", "--nodes", "4", "--launcher",
                "torchrun", "--max-restarts", "2", "--jobs-root", str(tmp_path),
            )
        )  # fmt: skip
        ids.append(jobid)
        script = (job / "job.sbatch").read_text()
        assert "--ntasks-per-node=1" in script and "-m torch.distributed.run --standalone" in script
        wait_for("step 5", lambda: len(rows(job)) >= 6, 180, job)
        return jobid, job

    yield submit
    for jobid in ids:
        if slurm_cluster.state(jobid) not in FINAL_STATES:
            slurm_cluster.run("scancel", jobid, check=False)


def transitions(job: Path, kind: str) -> list[dict[str, object]]:
    return [t for r in rows(job) for t in r["transitions"] if t.get("kind") == kind]  # type: ignore[union-attr]


def finished(cluster: SlurmCluster, jobid: str, job: Path, tmp: Path) -> None:
    ref = torchrun_reference(tmp)  # started now at the latest: alongside the job's last steps
    cluster.wait_state(jobid, {"COMPLETED"}, timeout=300)
    assert [r["step"] for r in rows(job)][-1] == TORCHRUN_STEPS - 1
    key = (TORCHRUN_STEPS, TORCHRUN_EVERY)
    if key not in _actors:
        _actors[key] = ref.actor()
    assert_same_actor(job, _actors[key])


@pytest.mark.timeout(420)
def test_torchrun_restarts_a_killed_worker_which_rejoins(
    slurm_cluster: SlurmCluster, tmp_path: Path, torchrun_job: Callable[[str], tuple[str, Path]]
) -> None:
    jobid, job = torchrun_job("torchrun-worker")
    agent, worker, env = torchrun_worker(job, 2)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"]) == ("0", "1", "0")
    os.kill(worker, signal.SIGKILL)  # GPU 2 = node 2 × 1 + local rank 0: not the leader

    def rejoined() -> bool:
        return any(2 in t.get("joined", ()) for t in transitions(job, "membership"))  # type: ignore[operator]

    wait_for("GPU 2 to rejoin", rejoined, 180, job)
    again, restarted, env = torchrun_worker(job, 2)
    assert again == agent and restarted != worker and env["TORCHELASTIC_RESTART_COUNT"] == "1"
    log = (job / "run" / "membership.log").read_text()
    assert "lost GPUs [2]" in log and "as GPU 2" in log, log
    torchrun_reference(tmp_path)  # past the events: alongside the job's last steps
    finished(slurm_cluster, jobid, job, tmp_path)
    assert slurm_cluster.job(jobid).get("Restarts", "0") == "0"  # in place: never requeued
    assert transitions(job, "recovered")


@pytest.mark.timeout(420)
def test_torchrun_leader_killed_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path, torchrun_job: Callable[[str], tuple[str, Path]]
) -> None:
    jobid, job = torchrun_job("torchrun-leader")
    _, leader, _ = torchrun_worker(job, 0)
    os.kill(leader, signal.SIGKILL)  # GPU 0: the job's store and controller die with it
    wait_for("the requeue", lambda: int(slurm_cluster.job(jobid).get("Restarts", "0")) >= 1, 120, job)
    torchrun_reference(tmp_path)  # alongside the requeue hold and the resume
    finished(slurm_cluster, jobid, job, tmp_path)
    err = "".join(p.read_text() for p in (job / "logs").glob(f"{jobid}_0_log.err"))
    assert "the job's store died with the leader: requeueing the job" in err


@pytest.mark.timeout(420)
def test_torchrun_preemption_checkpoints_and_requeues(
    slurm_cluster: SlurmCluster, tmp_path: Path, torchrun_job: Callable[[str], tuple[str, Path]]
) -> None:
    jobid, job = torchrun_job("torchrun-preempted")
    slurm_cluster.run("scancel", "--signal=USR2", jobid)  # every agent passes it on to its worker
    wait_for("the preemption checkpoint", lambda: bool(transitions(job, "preempted")), 120, job)
    torchrun_reference(tmp_path)  # alongside the requeue hold and the resume
    finished(slurm_cluster, jobid, job, tmp_path)
    assert int(slurm_cluster.job(jobid).get("Restarts", "0")) >= 1
