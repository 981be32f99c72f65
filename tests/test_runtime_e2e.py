"""``nereus run`` end to end on 4 local worker processes (gloo).

- The run writes one metrics object per step with the promised keys, TensorBoard events, a
  checkpoint and the report, and exports the actor in Hugging Face format.
- Transition equivalence: the same seeded PPO job with a worker lost and regained (a restart from
  the checkpoint, then an in-place Extend/Merge) ends with the actor and metrics of the run that
  never changed its plan. fp32; the bound is 2e-4 on weights after 6 steps of lr 2e-3 (only
  summation order differs between layouts; Adam magnifies it where gradients are near zero).
- ``--resume`` continues from the latest checkpoint; bad experiment files exit 2.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nereus.cli import main
from tests.preempt import stop_after_rows

pytestmark = pytest.mark.e2e

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
BASE = """
name: {name}
workload: ppo-tiny
model: tiny-llama
workers: 4
steps: {steps}
seed: 3
policy: always
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, critic_lr: 0.01, kl_coef: 0.01}}
checkpoint_every: 1
"""
DRIFT = """drift:
  - {step: 2, lose: [3]}
  - {step: 4, gain: [3]}
"""
KEYS = {"step", "reward", "kl", "step_time_s", "seq_len_mean", "gpus", "plan", "transitions"}


def nereus_run(
    tmp: Path, name: str, steps: int, drift: bool | str, *extra: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    exp = tmp / f"{name}.yaml"
    script = drift if isinstance(drift, str) else DRIFT if drift else ""
    exp.write_text(BASE.format(name=name, steps=steps) + script)
    out = tmp / "runs" / name
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    return out, proc


def cli_run(exp: Path, out: Path, timeout: int) -> subprocess.CompletedProcess[str]:
    """``nereus run EXP --out OUT`` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def metrics(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def ends_as(out: Path, still: Path) -> None:
    """``out``'s run ended as the untouched one: its actor within 2e-4, its rewards within 1e-6."""
    a = load_file(str(out / "hf" / "actor" / "model.safetensors"))
    b = load_file(str(still / "hf" / "actor" / "model.safetensors"))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-4, rtol=0), name
    for r, s in zip(metrics(out), metrics(still), strict=True):
        assert r["reward"] == pytest.approx(s["reward"], abs=1e-6)


@pytest.fixture(scope="module")
def untouched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same seeded 6-step job, never moved, killed or preempted."""
    out, proc = nereus_run(tmp_path_factory.mktemp("still"), "still", 6, drift=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.timeout(400)
def test_adaptive_run_equals_the_static_run(drifted_ppo_run: Path, untouched: Path) -> None:
    moved, still = drifted_ppo_run, untouched  # the drifted run: nereus_run(..., 6, drift=True)

    rows = metrics(moved)
    assert [r["step"] for r in rows] == list(range(6))
    assert all(set(r) >= KEYS for r in rows)
    kinds = [t["kind"] for r in rows for t in r["transitions"]]  # type: ignore[union-attr]
    assert kinds, "the drift moved nothing"
    assert [r["gpus"] for r in rows][2:4] == [3, 3] and rows[-1]["gpus"] == 4
    for r in rows:  # deciding a boundary's transition is its own planning, not monitoring
        assert (r["plan_s"] > 0) == bool(r["transitions"]) and r["monitor_s"] > 0, r  # type: ignore[operator]
        # the engine generates with the weights actor.inf scores with, after every move too
        assert r["rollout_probs_diff"]["max"] < 1e-4, r  # type: ignore[index]
        assert 0 <= r["truncated"] <= 1 and 0 <= r["accuracy"] <= 1, r  # type: ignore[operator]
    assert all(r["plan_s"] == 0 for r in metrics(still))
    assert (moved / "report.png").stat().st_size > 0
    assert any((moved / "tensorboard").iterdir())
    assert (moved / "checkpoints" / "latest").is_file()
    log = (moved / "membership.log").read_text()  # every pool change, in one line each
    assert "before step 2: GPUs 3 leave (scripted); generation 1 has GPUs 0-2" in log, log
    assert "before step 4: GPUs 3 join; generation 2 has GPUs 0-3" in log, log

    for model in ("actor", "critic"):  # PPO exports its critic too (a value head: score.weight)
        a = load_file(str(moved / "hf" / model / "model.safetensors"))
        b = load_file(str(still / "hf" / model / "model.safetensors"))
        assert set(a) == set(b) and ("score.weight" in a) == (model == "critic")
        for name in a:
            assert torch.allclose(a[name], b[name], atol=2e-4, rtol=0), (model, name)
    for r, s in zip(rows, metrics(still), strict=True):
        assert r["reward"] == pytest.approx(s["reward"], abs=1e-6)
        assert r["kl"] == pytest.approx(s["kl"], abs=1e-4)


@pytest.mark.timeout(400)
def test_a_killed_worker_is_survived_and_training_stays_on_track(tmp_path: Path, untouched: Path) -> None:
    """A worker process killed (SIGKILL) in the middle of step 3: the survivors roll the step
    back, form a new world, replan from intact units (or restart from the checkpoint when a last
    copy died) and run the step again; the ending equals the run nobody killed."""
    killed, proc = nereus_run(tmp_path, "killed", 6, "drift:\n  - {step: 3, kill: [2]}\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    still = untouched
    rows = metrics(killed)
    assert [r["step"] for r in rows] == list(range(6))
    recovered = [t for t in rows[3]["transitions"] if t["kind"] == "recovered"]  # type: ignore[union-attr]
    assert recovered and recovered[0]["lost"] == [2], rows[3]["transitions"]
    assert "lost GPUs [2]" in (killed / "membership.log").read_text()
    assert all(r["gpus"] <= 3 for r in rows[3:])
    ends_as(killed, still)


@pytest.mark.timeout(400)
def test_a_last_copy_lost_before_the_first_checkpoint_restarts_from_the_start(
    tmp_path: Path, untouched: Path
) -> None:
    """Worker 2 is killed in step 2 and the first checkpoint comes after step 3: when the
    controller restarts (a trainer's last copy died), it restarts from the job's start (the
    seed's weights), every step runs again, and the ending equals the run nobody killed. It used
    to end the job with a traceback from every worker ("no checkpoint to restart from")."""
    exp = tmp_path / "early.yaml"
    text = BASE.format(name="early", steps=6).replace("checkpoint_every: 1", "checkpoint_every: 4")
    exp.write_text(text + "drift:\n  - {step: 2, kill: [2]}\n")
    proc = cli_run(exp, tmp_path / "early", 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rows = metrics(tmp_path / "early")
    assert [r["step"] for r in rows] == list(range(6))
    restarts = [t for r in rows for t in r["transitions"] if t["kind"] == "restart"]  # type: ignore[union-attr]
    assert restarts and restarts[0]["from_step"] == -1, [r["transitions"] for r in rows]
    ends_as(tmp_path / "early", untouched)


@pytest.mark.timeout(400)
def test_a_newcomer_lost_as_it_joins_fails_its_formation_and_training_stays_on_track(
    tmp_path: Path, untouched: Path
) -> None:
    """Worker 3 leaves before step 2 and comes back before step 4, but is killed once the leader
    has accepted it, before the new generation forms (a node lost as it joins). The leader's roll
    call finds its heartbeat stale within seconds (not gloo's 30-minute rendezvous wait); the
    others recover without it, step 3 runs again, and the ending equals the run nobody moved."""
    drift = "drift:\n  - {step: 2, lose: [3]}\n  - {step: 4, gain: [3], kill: [3]}\n"
    out, proc = nereus_run(tmp_path, "newcomer-lost", 6, drift)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["gpus"] for r in rows][2:] == [3, 3, 3, 3]
    recovered = [t for t in rows[3]["transitions"] if t["kind"] == "recovered"]  # type: ignore[union-attr]
    assert recovered and recovered[0]["lost"] == [3], rows[3]["transitions"]
    log = (out / "membership.log").read_text()
    assert re.search(r"generation \d+ did not form: GPUs \[3\]", log), log[-2000:]
    ends_as(out, untouched)


@pytest.mark.timeout(400)
def test_a_worker_that_hangs_through_a_recovery_rejoins_the_job(tmp_path: Path) -> None:
    """Worker 4 of five is killed in step 3 and worker 3 hangs in the recovery (SIGSTOP for 10 s,
    its heartbeat too, before it checks in). The job recovers on the three that answered and goes
    on; when worker 3 wakes, it finds itself left behind, asks to rejoin as GPU 3 through the
    signed join path a newcomer takes, and is admitted at a boundary: the job ends on four GPUs,
    every step once. (Before, a left-behind local worker left the job.)"""
    text = BASE.format(name="hung", steps=2000).replace("workers: 4", "workers: 5")
    rejoins_after(
        tmp_path, "hung", text + "drift:\n  - {step: 3, kill: [4], hang: [3], hang_s: 10}\n", "3, 4"
    )


@pytest.mark.timeout(400)
def test_a_worker_that_freezes_mid_step_is_timed_out_recovered_without_and_rejoins(tmp_path: Path) -> None:
    """Worker 3 of four freezes in the middle of step 3 (SIGSTOP for 20 s, every thread, holding
    its connections: a node that stopped answering). The others' collectives wait for it only the
    experiment's ``collective_timeout_s`` (5 s here; torch's own default is 30 min), then the job
    recovers on the three that answer, the step runs again, and the frozen worker, once it wakes,
    finds itself left behind and rejoins as GPU 3: the job trains on four GPUs again, every step
    once."""
    text = BASE.format(name="frozen", steps=2000) + "collective_timeout_s: 5\n"
    started = time.monotonic()
    rows = rejoins_after(tmp_path, "frozen", text + "drift:\n  - {step: 3, freeze: [3], hang_s: 20}\n", "3")
    recovered = [t for t in rows[3]["transitions"] if t["kind"] == "recovered"]  # type: ignore[union-attr]
    assert recovered and recovered[0]["lost"] == [3], rows[3]["transitions"]
    assert time.monotonic() - started < 300  # not the 30 minutes a frozen peer held the job before


def rejoins_after(tmp: Path, name: str, text: str, lost: str) -> list[dict[str, object]]:
    """Run ``text`` until a row after row 4 trains on four GPUs again (steps take 0.2–2 s here),
    then stop the job with SIGUSR2 at its next boundary. Step 3 lost GPUs ``lost`` and ran on
    three; GPU 3 found itself left behind and rejoined. The metrics rows."""
    exp = tmp / f"{name}.yaml"
    exp.write_text(text)
    out = tmp / "runs" / name
    cmd = [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").is_file() else []
        if any('"gpus": 4' in line for line in lines[4:]):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR2)  # stop at the next boundary, with a checkpoint
    _, err = proc.communicate(timeout=200)
    assert proc.returncode == 144, err[-3000:]  # stopped by SIGUSR2, as asked
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(len(rows)))
    log = (out / "membership.log").read_text()
    assert f"lost GPUs [{lost}]" in log, log[-2000:]
    assert "GPU 3: left behind by a recovery; asking to rejoin the job" in err, err[-3000:]
    assert re.search(r"accepted join request from .* as GPU 3", log), log[-2000:]
    assert rows[3]["gpus"] == 3 and rows[-1]["gpus"] == 4, [r["gpus"] for r in rows]
    return rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["kill", "lose"])
def test_a_loss_that_leaves_too_few_gpus_ends_the_job_and_keeps_its_checkpoint(
    tmp_path: Path, how: str
) -> None:
    """Two of four workers killed at once in step 3 (or lost at the boundary before it): PPO's three
    inference model-stages cannot run on the two left. The leader says so in one line and the job
    ends (it used to crash on the planner's error, and a loss at the boundary lost step 2's row);
    its checkpoints and metrics up to the loss stay, to resume from on more GPUs."""
    out, proc = nereus_run(tmp_path, "short", 6, f"drift:\n  - {{step: 3, {how}: [2, 3]}}\n")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "nereus run: error: the 2 GPUs left [0, 1] cannot run the job (stage inf needs ≥ 3 GPUs"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "its latest checkpoint stays: resume from it on more GPUs" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"


@pytest.mark.timeout(400)
def test_shrink_drains_a_worker_in_place_and_preemption_resumes_on_track(
    tmp_path: Path, untouched: Path
) -> None:
    """A shrink request (as ``nereus-launch shrink`` writes it) waiting in the control folder:
    at the first boundary the plan moves off one worker while it still holds its state, then
    it leaves. A SIGUSR2 (SLURM's preemption signal) later checkpoints at the next boundary
    and stops (exit 144, one line); ``--resume`` finishes the job. Both end where the untouched
    run ends. (The control folder may exist before the first run: it is the run's input.)"""
    out = tmp_path / "runs" / "drained"
    (out / "control").mkdir(parents=True)
    (out / "control" / "shrink-1.json").write_text('{"nodes": 1}')
    exp = tmp_path / "drained.yaml"
    exp.write_text(BASE.format(name="drained", steps=6))
    cmd = [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)]
    code, err = stop_after_rows(cmd, out / "metrics.jsonl", 2)
    assert code == 144, err[-3000:]  # stopped by SIGUSR2: submitit's requeue code
    rows = metrics(out)
    assert err.splitlines() == [
        f"nereus run: stopped by SIGUSR2 after step {rows[-1]['step']}, with a checkpoint; "
        "resume with --resume"
    ]
    assert rows[-1]["transitions"][-1]["kind"] == "preempted" and len(rows) < 6, rows[-1]  # type: ignore[index]
    first = rows[0]["transitions"]
    assert [t["kind"] for t in first][-1] == "membership" and first[-1]["left"] == [3], first  # type: ignore[index]
    assert all(r["gpus"] <= 3 for r in rows[1:])
    assert (out / "control" / ".done-shrink-1.json").is_file()
    proc2 = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300, check=False)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert [r["step"] for r in metrics(out)][-1] == 5
    still = untouched
    a = load_file(str(out / "hf" / "actor" / "model.safetensors"))
    b = load_file(str(still / "hf" / "actor" / "model.safetensors"))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-4, rtol=0), name


def _hf_checkpoint(folder: Path, head: str, seed: int, head_scale: float = 1.0) -> Path:
    from nereus.backends import hf
    from nereus.plan.layout import Layout
    from nereus.runtime.weights import init_tensor
    from nereus.spec import load_model
    from nereus.spec.model import Head
    from nereus.state.buffers import BufferKind
    from nereus.state.geometry import shards

    model = load_model("tiny-llama").with_head(Head(head))
    tensors = {
        s.source: init_tensor(model, seed, BufferKind.PARAM, s.source)
        * (head_scale if s.source == "score.weight" else 1)
        for s in shards(model, Layout(1, 1), 0, 0)
    }
    hf.save(folder, model, tensors)
    return folder


@pytest.mark.timeout(300)
def test_resume_continues_from_the_latest_checkpoint(tmp_path: Path, finished_ppo_run: Path) -> None:
    """A finished 2-step run of the same job (``conftest.finished_ppo_run``: ``BASE`` with 2 steps;
    a copy of it) resumed with 5 steps runs steps 2-4."""
    shutil.copytree(finished_ppo_run, tmp_path / "runs" / "resume", symlinks=True)
    assert [r["step"] for r in metrics(tmp_path / "runs" / "resume")] == [0, 1]
    out, proc = nereus_run(tmp_path, "resume", 5, False, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [0, 1, 2, 3, 4]
    meta = json.loads((out / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["logical_state"]["actor.train"]["updates"] == 5 * 2  # two updates of 8 per step


def test_resuming_a_run_that_trained_every_step_starts_nothing(
    tmp_path: Path, finished_ppo_run: Path
) -> None:
    """Its latest checkpoint is after its last step: one line, exit 0, no worker, no file touched."""
    run_dir = tmp_path / "runs" / "resume"
    shutil.copytree(finished_ppo_run, run_dir, symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    _, proc = nereus_run(tmp_path, "resume", 2, False, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "nothing to resume" in proc.stdout and "after step 1, and the experiment has 2 steps" in proc.stdout
    )
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: x\nworkload: ppo-tiny\nmodel: tiny-llama\nworkers: 0\n", "workers must be positive"),
        ("name: x\nworkload: ppo-tiny\nmodel: tiny-llama\nbogus: 1\n", "unknown key 'bogus'"),
        (
            "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\ndrift: [{step: 1, lose: [7]}]\n",
            "worker 7 outside",
        ),
        ("name: x\nworkload: ppo-tiny\nmodel: tiny-llama\ntask: {kind: nope}\n", "kind must be one of"),
        ("name: x\nworkload: ppo-tiny\nmodel: no-such-model\n", "no-such-model"),
        (
            "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\ndataset: missing.jsonl\n",
            "dataset: missing.jsonl: dataset",
        ),
        (
            "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\ndata: {train: missing.parquet, layout: verl}\n",
            "data.train: missing.parquet: dataset file does not exist",
        ),
        (
            "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\nverifier: exactanswer\n",
            "verifier: unknown verifier",
        ),
        ("name: x\nworkload: ppo-tiny\nmodel: tiny-llama\npolicy: sometimes\n", "unknown policy"),
        ("name: x\nworkload: ppo-tiny\nmodel: tiny-llama\nworkers: 64\n", "exceeds the 8 GPUs"),
        (
            "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\nengines: {actor.gen: warp}\n",
            "engines.actor.gen: engine: expected one of torch_native, vllm, got 'warp'",
        ),
        (
            "name: x\nworkload: grpo-tiny\nmodel: tiny-llama\nengines: {critic.train: torch_native}\n",
            "engines.critic.train: not a model-stage of grpo-tiny",
        ),
        (
            "name: x\nworkload: grpo-tiny\nmodel: tiny-llama\ntokenizer: /no/such/folder\n",
            "tokenizer: /no/such/folder holds no Hugging Face tokenizer",
        ),
    ],
)
def test_bad_experiment_exits_2(tmp_path: Path, text: str, message: str) -> None:
    exp = tmp_path / "bad.yaml"
    exp.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_resume_without_a_checkpoint_exits_2(tmp_path: Path) -> None:
    exp = tmp_path / "x.yaml"
    exp.write_text(BASE.format(name="x", steps=2))
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(tmp_path / "out"), "--resume"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--resume: no checkpoint" in proc.stderr, proc.stderr


@pytest.mark.timeout(400)
def test_out_of_memory_takes_the_urgent_path_and_training_stays_on_track(
    tmp_path: Path, untouched: Path
) -> None:
    """A model-stage that runs out of memory (the real ``torch.OutOfMemoryError``, raised by a
    fault hook from inside actor.train on worker 1 at step 3) is not a crash: the step rolls back,
    the controller raises that stage's memory correction and moves to another plan, the step runs
    again, and the run ends with the actor of the run that never ran out of memory."""
    drift = "drift:\n  - {step: 3, oom: [1], oom_stage: actor.train}\n"
    out, proc = nereus_run(tmp_path, "oom", 6, drift)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(6))
    moved = [t for r in rows for t in r["transitions"]]  # type: ignore[union-attr]
    recovered = [t for t in moved if t["kind"] == "recovered"]
    assert recovered and recovered[0]["oom"] == "actor.train" and recovered[0]["lost"] == []
    after = [t for t in moved if t["kind"] not in ("recovered", "membership")]
    assert after, "the controller kept the plan that ran out of memory"
    decision = rows[3]["decision"]
    assert decision["verdict"] == "admit" and any("oom" in t for t in decision["triggers"])
    a = load_file(str(out / "hf" / "actor" / "model.safetensors"))
    b = load_file(str(untouched / "hf" / "actor" / "model.safetensors"))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-4, rtol=0), name


def test_a_gpu_that_turns_unhealthy_is_a_gpu_loss(tmp_path: Path, untouched: Path) -> None:
    """Worker 2's health check reports its GPU fallen off the bus (XID 79, the scripted fault in
    ``runtime/health.py``) at the boundary before step 3: the leader decodes the report, the
    health rule condemns the GPU, and it leaves the pool like a lost worker. Training stays on
    track: the run ends with the actor of the run that never lost a GPU."""
    out, proc = nereus_run(tmp_path, "sick", 6, "drift:\n  - {step: 3, unhealthy: [2]}\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["gpus"] for r in rows] == [4, 4, 4, 3, 3, 3]
    changes = [t for r in rows for t in r["transitions"] if t["kind"] == "membership"]  # type: ignore[union-attr]
    assert changes and changes[0]["left"] == [2]
    log = (out / "membership.log").read_text()
    assert "GPU 2 is unhealthy (xid 79: GPU has fallen off the bus): treated as lost" in log
    a = load_file(str(out / "hf" / "actor" / "model.safetensors"))
    b = load_file(str(untouched / "hf" / "actor" / "model.safetensors"))
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-4, rtol=0), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_job_from_a_users_model_folder_and_verl_data(tmp_path: Path, family: str) -> None:
    """GRPO as a user brings it: ``model:`` a Hugging Face folder (config.json, safetensors, a BPE
    tokenizer with its chat template) of Llama, Qwen2 (q/k/v biases) or Qwen3 (QK-norm, a tied
    head), a verl-layout Parquet file (chat messages, ground truths, data sources) scored by each
    row's source. The actor starts from the folder's weights."""
    import transformers

    from nereus.rl.assets import write_parquet
    from tests.test_hf_tokenizer import build
    from tests.test_rl_layouts import VERL

    folder = tmp_path / f"tiny-user-{family}"
    shape = {
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    }  # fmt: skip
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, False),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, False),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, True),
    }
    config_cls, model_cls, tied = classes[family]
    torch.manual_seed(0)
    model_cls(config_cls(**shape, tie_word_embeddings=tied)).save_pretrained(folder)
    build(folder)  # the tokenizer next to the weights, as on the hub
    rows = [{**r, "data_source": "openai/gsm8k" if i % 2 else "math"} for i, r in enumerate(VERL * 4)]
    rows = [{**r, "extra_info": {"index": i}} for i, r in enumerate(rows)]
    data = write_parquet(rows, tmp_path / "train.parquet")
    held_out = write_parquet(rows, tmp_path / "val.parquet")  # llama: validated after each step
    val = f", val: {held_out}}}\nval_every: 1\n" if family == "llama" else "}\n"
    exp = tmp_path / "hf.yaml"
    exp.write_text(
        f"name: hf\nworkload: grpo-tiny\nmodel: {folder}\nworkers: 4\nsteps: 2\nseed: 1\n"
        f"verifier: by_source\nmax_new_tokens: 3\ndata: {{train: {data}, layout: verl{val}"
    )
    out = tmp_path / "out"
    proc = cli_run(exp, out, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = metrics(out)
    assert [r["step"] for r in got] == [0, 1]
    assert all(0 < float(r["seq_len_mean"]) <= 3 for r in got)  # type: ignore[arg-type]
    exported = load_file(str(out / "hf" / "actor" / "model.safetensors"))
    assert exported["model.embed_tokens.weight"].shape == (320, 64)
    if family != "llama":
        assert all(r["validation"] is None for r in got)
        return
    for r in got:  # greedy answers to the 20 held-out prompts (a step's 16 at a time), scored by source
        v = r["validation"]
        assert isinstance(v, dict) and v["prompts"] == 20 and 0 <= v["reward"] <= 1, v
        assert set(v) == {"reward", "accuracy", "prompts", "seconds", "reward/math", "reward/openai/gsm8k"}
    assert "validation: reward" in proc.stdout
    from nereus.runtime.engines import describe_engines, job_engines
    from nereus.runtime.experiment import ExperimentSpec

    assert describe_engines(job_engines(ExperimentSpec.load(exp))) in proc.stdout  # the run's header
    exp.write_text(
        exp.read_text().replace(f", val: {held_out}}}\nval_every: 1", "}")
    )  # the same job unvalidated
    plain = tmp_path / "plain"
    proc = cli_run(exp, plain, 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(got, metrics(plain), strict=True):  # validation leaves the training and its telemetry be
        assert b["validation"] is None
        for key in ("reward", "actor_loss", "kl", "seq_len_mean", "plan"):
            assert a[key] == b[key], key
        for name, stats in a["generation"].items():  # the step's generation alone: validation's left out
            assert stats["tokens"] == b["generation"][name]["tokens"], name  # type: ignore[index]
        assert a["stage_times"].keys() == b["stage_times"].keys()  # type: ignore[union-attr]


@pytest.mark.timeout(300)
def test_a_calibrating_job_times_its_collectives_before_its_first_plan(tmp_path: Path) -> None:
    """``calibrate: true``: before the first plan the workers run the start-up collective sweep
    (``nereus.runtime.sweep``) over the world's gloo groups; the first plan and the controller start
    from its calibration, and the job runs on."""
    out, proc = nereus_run(tmp_path, "swept", 2, "calibrate: true\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [0, 1]
    log = (out / "membership.log").read_text()
    found = re.search(r"start-up collective sweep: (\d+) probes in [\d.]+ s", log)
    assert found is not None and int(found.group(1)) > 0, log
    # what it measured, saved for nereus plan/price --calibration (keyed by the cluster's name)
    assert main(["price", "--model", "tiny-llama", "--cluster", "local-cpu", "--stage", "train", "--tp", "1",
                 "--pp", "1", "--dp", "1", "--sequences", "8", "--prompt-len", "8", "--seq-len", "8",
                 "--calibration", str(out / "calibration.json")]) == 0  # fmt: skip
