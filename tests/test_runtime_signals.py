"""``nereus run`` stops cleanly, keeps one metrics row per step, and never overwrites a run
unasked (4 local workers, tiny PPO jobs of a few steps, through the CLI).

- SIGINT, SIGTERM or SIGUSR2, to the supervisor alone or to the whole process group: every
  worker stops at the next step boundary after a checkpoint; the run exits 130, 143 or 144
  with one line on stderr, no traceback, and no process of the run left.
- A resume after a stop, or after the whole run was killed between checkpoints, ends with
  exactly one metrics row per step.
- A second run into a used folder exits 2 and changes nothing; with ``--force`` it replaces the
  run's files (and leaves the user's). An infeasible worker count and ``init:`` folders without
  weights exit 2 before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BASE = """
name: {name}
workload: ppo-tiny
model: tiny-llama
workers: {workers}
steps: {steps}
seed: 3
policy: always
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, critic_lr: 0.01, kl_coef: 0.01}}
checkpoint_every: {every}
"""
CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGUSR2: 144}


def experiment(tmp: Path, name: str, steps: int, every: int = 1, workers: int = 4, extra: str = "") -> Path:
    exp = tmp / f"{name}.yaml"
    exp.write_text(BASE.format(name=name, steps=steps, every=every, workers=workers) + extra)
    return exp


def cli(exp: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out), *flags]


def run(exp: Path, out: Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(exp, out, *flags), capture_output=True, text=True, timeout=timeout, check=False)


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def group_left(pgid: int, wait_s: float = 15.0) -> list[str]:
    """Live (not zombie) processes of process group ``pgid`` once ``wait_s`` passed or none is left."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                left.append(f"{entry}: {cmd}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def stop_after(
    exp: Path, out: Path, after_rows: int, signum: int, group: bool, *flags: str
) -> tuple[subprocess.Popen[str], str, str]:
    """Start the run in a session of its own; once ``after_rows`` rows are written, send
    ``signum`` to the supervisor or to the whole group; wait for the end."""
    proc = subprocess.Popen(
        cli(exp, out, *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if rows(out) >= after_rows:
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
            break
        time.sleep(0.05)
    try:
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, stdout, stderr


@pytest.fixture(scope="module")
def sigint_to_the_group(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int, str, str]:
    """A 7-step run (checkpoint every 3) stopped by SIGINT to its process group once 2 rows are
    written: (experiment, out, exit code, stdout, stderr). The stop test checks how it stopped;
    the resume test resumes a copy of it (one run serves both)."""
    tmp = tmp_path_factory.mktemp("sigint")
    exp, out = experiment(tmp, "again", steps=7, every=3), tmp / "out"
    proc, stdout, stderr = stop_after(exp, out, 2, signal.SIGINT, True)
    assert proc.returncode is not None
    assert not group_left(proc.pid)
    return exp, out, proc.returncode, stdout, stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("signum", "group"),
    [
        (signal.SIGINT, True),
        (signal.SIGINT, False),
        (signal.SIGTERM, False),
        (signal.SIGTERM, True),
        (signal.SIGUSR2, True),
        (signal.SIGUSR2, False),
    ],
    ids=["SIGINT-group", "SIGINT-supervisor", "SIGTERM-supervisor", "SIGTERM-group", "SIGUSR2-group",
         "SIGUSR2-supervisor"],
)  # fmt: skip
def test_a_stop_signal_checkpoints_and_exits_with_its_code(
    tmp_path: Path, signum: int, group: bool, request: pytest.FixtureRequest
) -> None:
    if (signum, group) == (signal.SIGINT, True):  # the run test_a_resume_after_sigint resumes
        _, out, code, stdout, stderr = request.getfixturevalue("sigint_to_the_group")
        total = 7
    else:
        out, total = tmp_path / "out", 30
        proc, stdout, stderr = stop_after(
            experiment(tmp_path, "stop", steps=total, every=5), out, 2, signum, group
        )
        code = proc.returncode
        assert not group_left(proc.pid)
    name = signal.Signals(signum).name
    assert code == CODES[signum], stderr[-3000:]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    last = steps(out)[-1]
    assert 2 <= last < total - 1 and steps(out) == list(range(last + 1))
    assert stderr.splitlines() == [
        f"nereus run: stopped by {name} after step {last}, with a checkpoint; resume with --resume"
    ]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["transitions"][-1]["kind"] == "preempted"


@pytest.mark.timeout(150)
def test_workers_whose_supervisor_is_killed_stop_at_a_checkpoint(tmp_path: Path) -> None:
    """The supervisor alone killed outright (SIGKILL, the OOM killer): its workers do not run on
    headless. Each gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``, set as it starts), and
    the job stops as a SIGTERM stops it: at the next boundary, after a checkpoint, with no
    process of the run left."""
    out, total = tmp_path / "out", 30
    proc, _, stderr = stop_after(
        experiment(tmp_path, "orphans", steps=total, every=5), out, 2, signal.SIGKILL, False
    )
    assert proc.returncode == -signal.SIGKILL
    assert not group_left(proc.pid, 60.0)
    last = steps(out)[-1]
    assert 2 <= last < total - 1 and steps(out) == list(range(last + 1)), stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["transitions"][-1]["kind"] == "preempted"


@pytest.mark.timeout(150)
def test_a_resume_after_sigint_writes_one_row_per_step(
    tmp_path: Path, sigint_to_the_group: tuple[Path, Path, int, str, str]
) -> None:
    exp, stopped, code, _, stderr = sigint_to_the_group
    assert code == 130, stderr[-3000:]
    out = tmp_path / "out"
    shutil.copytree(stopped, out, symlinks=True)
    assert len(steps(out)) < 7
    done = run(exp, out, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps(out) == list(range(7))


@pytest.mark.timeout(150)
def test_a_resume_after_a_kill_drops_the_rows_after_the_checkpoint(tmp_path: Path) -> None:
    """The whole run killed (SIGKILL) between checkpoints: ``metrics.jsonl`` has rows after the
    latest checkpoint's step; the resume drops them before it writes its own."""
    out = tmp_path / "out"
    exp = experiment(tmp_path, "killed", steps=8, every=3)
    proc, _, _ = stop_after(exp, out, 5, signal.SIGKILL, True)
    assert proc.returncode == -signal.SIGKILL
    assert not group_left(proc.pid)
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert json.loads((latest / "meta.json").read_text())["step"] < steps(out)[-1], "no rows to drop"
    done = run(exp, out, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert steps(out) == list(range(8))


@pytest.mark.timeout(150)
def test_a_used_folder_needs_force(tmp_path: Path, finished_ppo_run: Path) -> None:
    """The used folder: a copy of a finished 2-step run of this job (``conftest.finished_ppo_run``,
    ``BASE`` with 2 steps, every 1)."""
    out = tmp_path / "out"
    exp = experiment(tmp_path, "twice", steps=2)
    shutil.copytree(finished_ppo_run, out, symlinks=True)
    assert steps(out) == [0, 1]
    (out / "notes.txt").write_text("mine")
    before = {
        str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()
    }
    second = run(exp, out)
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.splitlines() == [
        f"nereus run: error: --out: {out} holds a previous run; pass --resume to continue it or --force "
        "to replace it"
    ]
    after = {
        str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in out.rglob("*") if p.is_file()
    }
    assert after == before
    key = (out / "checkpoint.key").read_text()
    forced = run(experiment(tmp_path, "twice", steps=3), out, "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert steps(out) == [0, 1, 2]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "checkpoint.key").read_text() != key  # the previous run's key went with its checkpoints
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]


def test_an_infeasible_worker_count_exits_2_before_writing_anything(tmp_path: Path) -> None:
    """PPO's inference stage needs 3 GPUs at once: 2 workers have no plan."""
    out = tmp_path / "out"
    proc = run(experiment(tmp_path, "two", steps=1, workers=2), out)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "nereus run: error: workers: no plan of ppo-tiny for tiny-llama fits 2 workers (stage inf needs ≥ 3 "
        "GPUs for its concurrent model-stages; the pool has 2); allowed on local-cpu: 3-8"
    ]
    assert not out.exists()
    out.mkdir()
    (out / ".nereus-output").write_text("run\n")  # a previous run's folder: --force would replace its files
    (out / "metrics.jsonl").write_text("{}\n")
    forced = run(experiment(tmp_path, "two", steps=1, workers=2), out, "--force")
    assert forced.returncode == 2 and "workers: no plan" in forced.stderr
    assert sorted(p.name for p in out.iterdir()) == [".nereus-output", "metrics.jsonl"]  # every check first
    (out / ".nereus-output").unlink()  # not a run's folder: its metrics.jsonl is the user's, never replaced
    forced = run(experiment(tmp_path, "two", steps=1, workers=2), out, "--force")
    assert (
        forced.returncode == 2 and "metrics.jsonl is there and nereus run did not write it" in forced.stderr
    )
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]


def _refused_init(tmp_path: Path, actor: Path) -> str:
    """``nereus run`` with ``actor`` as the actor's ``init:`` folder: its one error line (exit 2,
    nothing written)."""
    out = tmp_path / "out"
    proc = run(experiment(tmp_path, "init", steps=1, extra=f"init: {{actor: {actor}}}\n"), out)
    assert proc.returncode == 2
    assert not out.exists()
    [line] = proc.stderr.splitlines()
    return line


def test_init_folders_without_weights_exit_2(tmp_path: Path) -> None:
    from tests.test_runtime_e2e import _hf_checkpoint

    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    (actor / "model.safetensors").unlink()
    assert _refused_init(tmp_path, actor) == (
        f"nereus run: error: init.actor: {actor} has no weights ({actor}: no model.safetensors or "
        "model.safetensors.index.json)"
    )


def test_nan_init_weights_the_workers_find_leave_nothing_behind(tmp_path: Path) -> None:
    """NaN is found where the weights are read (preflight reads headers only): the run's folder,
    made before the workers started, is removed again, as for any refusal before it starts."""
    import safetensors.torch

    from tests.test_runtime_e2e import _hf_checkpoint

    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    tensors = safetensors.torch.load_file(actor / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, actor / "model.safetensors")
    line = _refused_init(tmp_path, actor)
    assert line == (
        f"nereus run: error: init.actor: {actor}/model.safetensors: tensor '{name}' holds NaN or Infinity"
    ), line


@pytest.mark.timeout(150)
def test_force_over_a_finished_run_with_bad_input_the_workers_find_keeps_the_run(
    tmp_path: Path, finished_ppo_run: Path
) -> None:
    """``--force`` sets the previous run's files aside; a new run the workers refuse (NaN init
    weights, which only they read) gets them back, byte for byte."""
    import safetensors.torch

    from tests.test_runtime_e2e import _hf_checkpoint

    out = tmp_path / "out"
    shutil.copytree(finished_ppo_run, out, symlinks=True)
    (out / ".nereus-lock").unlink(missing_ok=True)

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    before = files()
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    tensors = safetensors.torch.load_file(actor / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    safetensors.torch.save_file(tensors, actor / "model.safetensors")
    exp = experiment(tmp_path, "init", steps=3, extra=f"init: {{actor: {actor}}}\n")
    proc = run(exp, out, "--force")
    assert proc.returncode == 2 and "holds NaN or Infinity" in proc.stderr, proc.stderr[-3000:]
    assert f"the previous run's files in {out} are back as they were" in proc.stderr
    after = files()
    after.pop(".nereus-lock", None)
    assert after == before


def test_an_init_index_naming_a_folder_calls_it_not_a_file(tmp_path: Path) -> None:
    import json

    import safetensors.torch

    from tests.test_runtime_e2e import _hf_checkpoint

    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    names = list(safetensors.torch.load_file(actor / "model.safetensors"))
    (actor / "model.safetensors").unlink()
    (actor / "shards").mkdir()
    index = {"weight_map": dict.fromkeys(names, "shards")}
    (actor / "model.safetensors.index.json").write_text(json.dumps(index))
    assert _refused_init(tmp_path, actor) == (
        f"nereus run: error: init.actor: {actor}: the weights index names {actor}/shards, which is not a file"
    )


def test_an_init_folder_with_weights_the_model_does_not_have_exits_2(tmp_path: Path) -> None:
    """MLP biases (a config that hid its ``mlp_bias``): another architecture, never dropped."""
    import safetensors.torch
    import torch

    from tests.test_runtime_e2e import _hf_checkpoint

    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    tensors = safetensors.torch.load_file(actor / "model.safetensors")
    for i in (0, 1):
        tensors[f"model.layers.{i}.mlp.down_proj.bias"] = torch.zeros(tensors["model.norm.weight"].shape)
    safetensors.torch.save_file(tensors, actor / "model.safetensors")
    assert _refused_init(tmp_path, actor) == (
        f"nereus run: error: init.actor: {actor} holds model.layers.0.mlp.down_proj.bias and 1 more, which "
        "tiny-llama does not have (another architecture: its config.json does not describe these weights)"
    )


def test_an_init_tensor_of_the_wrong_shape_or_dtype_exits_2_before_the_workers(tmp_path: Path) -> None:
    """Read from the safetensors header in preflight: no output folder is left (the workers used
    to find it, after the run's folder was made)."""
    import safetensors.torch
    import torch

    from tests.test_runtime_e2e import _hf_checkpoint

    name = "model.layers.0.mlp.up_proj.weight"
    for change, detail in (
        (lambda t: torch.zeros(3, 3), "has shape (3, 3), the model needs"),
        (lambda t: t.to(torch.int32), "is I32; expected bf16, fp16 or fp32 weights"),
    ):
        actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
        tensors = safetensors.torch.load_file(actor / "model.safetensors")
        tensors[name] = change(tensors[name])
        safetensors.torch.save_file(tensors, actor / "model.safetensors")
        line = _refused_init(tmp_path, actor)
        assert line.startswith(f"nereus run: error: init.actor: {actor}/model.safetensors: tensor '{name}' ")
        assert detail in line, line


@pytest.mark.timeout(120)
def test_a_second_sigint_kills_the_workers_at_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    exp = experiment(tmp_path, "twice", steps=30, every=50)
    proc = subprocess.Popen(
        cli(exp, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and rows(out) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.25)  # later than a copy of the first (local.SAME_STOP_S): a second Ctrl-C
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    # The first SIGINT's stop checkpoint may land within the 0.25 s (a tiny model on an idle machine):
    # the line names what is on disk either way.
    latest = out / "checkpoints" / "latest"
    if latest.is_file():
        step = int(latest.read_text().strip().removeprefix("step_"))
        expected = (
            "nereus run: stopped by a second SIGINT without waiting for a checkpoint; resume with --resume "
            f"(from the checkpoint after step {step})"
        )
    else:
        expected = (
            "nereus run: stopped by a second SIGINT before the first checkpoint; run again with --force to "
            "start over"
        )
    assert stderr.splitlines() == [expected]
    assert not group_left(proc.pid)


@pytest.mark.timeout(240)
def test_a_resume_after_the_last_checkpoint_writes_the_missing_export(tmp_path: Path) -> None:
    """A run that ended after its last checkpoint and before its Hugging Face export (a full
    disk, a kill): ``--resume`` trains nothing and writes the export from the checkpoint, the
    same bytes; once it is there, there is nothing to resume."""
    out = tmp_path / "out"
    exp = experiment(tmp_path, "export", steps=2, every=1, extra="checkpoint_keep: 1\n")
    done = run(exp, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_000001"]  # the newest one
    weights = (out / "hf" / "actor" / "model.safetensors").read_bytes()
    trained = steps(out)
    shutil.rmtree(out / "hf")
    again = run(exp, out, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "every step is trained; writing the Hugging Face export from the checkpoint" in again.stdout
    assert (out / "hf" / "actor" / "model.safetensors").read_bytes() == weights
    assert steps(out) == trained and (out / "hf" / ".exported").read_text() == "2\n"
    third = run(exp, out, "--resume")
    assert third.returncode == 0 and "nothing to resume" in third.stdout, third.stdout
