"""``nereus-launch``: renders (golden files), the job-folder contract, one-line errors, no torch.

No SLURM is needed: submission goes through a fake executor, or through submitit's real
``SlurmExecutor`` with stand-in ``sbatch``/``srun`` scripts on PATH. Regenerate the golden sbatch
files with ``NEREUS_REGEN_GOLDEN=1 pytest tests/test_launch.py``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import submitit
import yaml

from launch.cli import main
from launch.job import NodeJob, run_cli_task
from launch.jobdir import read_record
from launch.monitor import status
from launch.render import Request, render
from launch.site import load_site, parse_time

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
PPO_TINY = ROOT / "configs" / "experiments" / "ppo-tiny.yaml"
SWEEP = ROOT / "configs" / "sweeps" / "plan-scaling.yaml"
FOLDER = "/scratch/nereus/jobs/ppo-tiny-20250101-000000/logs"
PYTHON = "/opt/nereus/.venv/bin/python"
GOLDEN_REQUESTS: dict[str, dict[str, Any]] = {
    "frontier": dict(job_name="ppo-8b", nodes=2, tasks_per_node=8, time_min=120, partition="batch",
                     account="ABC123"),
    "nvidia": dict(job_name="ppo-8b", nodes=4, tasks_per_node=8, time_min=240),
    "local": dict(job_name="ppo-tiny", nodes=4, tasks_per_node=1, time_min=30, partition="debug"),
    "local-array": dict(job_name="plan-scaling", nodes=1, tasks_per_node=1, time_min=30, partition="debug",
                        array=4),
}  # fmt: skip


# ------------------------------------------------------------------ fakes
class FakeJob:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id


class FakeExecutor:
    """Records what the launcher asks of submitit; ``fail`` makes submission raise."""

    next_id = 1000

    def __init__(self, kind: str, folder: Path, python: str, fail: Exception | None = None) -> None:
        self.kind, self.folder, self.python, self.fail = kind, folder, python, fail
        self.params: dict[str, Any] = {}
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def update_parameters(self, **kwargs: Any) -> None:
        self.params = kwargs

    def _id(self) -> str:
        if self.fail is not None:
            raise self.fail
        FakeExecutor.next_id += 1
        return str(FakeExecutor.next_id)

    def submit(self, fn: Callable[..., Any], *args: Any) -> FakeJob:
        job = FakeJob(self._id())
        self.calls.append((fn, args))
        return job

    def map_array(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> list[FakeJob]:
        main_id = self._id()
        rows = list(zip(*iterables, strict=True))
        self.calls += [(fn, row) for row in rows]
        return [FakeJob(f"{main_id}_{i}") for i in range(len(rows))]


@pytest.fixture
def executors() -> list[FakeExecutor]:
    return []


@pytest.fixture
def factory(executors: list[FakeExecutor]) -> Callable[[str, Path, str], FakeExecutor]:
    def make(kind: str, folder: Path, python: str) -> FakeExecutor:
        executors.append(FakeExecutor(kind, folder, python))
        return executors[-1]

    return make


def launch(args: list[str], capsys: pytest.CaptureFixture[str], **seams: Any) -> tuple[int, str, str]:
    code = main(args, **seams)
    out, err = capsys.readouterr()
    return code, out, err


def experiment(tmp_path: Path, **changes: Any) -> Path:
    data = {**yaml.safe_load(PPO_TINY.read_text()), **changes}
    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def submitted(tmp_path: Path, factory: Any, capsys: pytest.CaptureFixture[str], *extra: str) -> Path:
    root = tmp_path / "jobs"
    code, _, err = launch(
        ["submit", str(PPO_TINY), "--jobs-root", str(root), *extra], capsys, factory=factory
    )
    assert code == 0, err
    (folder,) = root.iterdir()
    return folder


def runner(
    replies: dict[str, tuple[int, str, str]], log: list[list[str]]
) -> Callable[..., tuple[int, str, str]]:
    def run(argv: list[str]) -> tuple[int, str, str]:
        log.append(list(argv))
        return replies.get(argv[0], (127, "", f"{argv[0]}: command not found"))

    return run


# ------------------------------------------------------------------ rendering
def golden_request(name: str) -> Request:
    return Request(folder=FOLDER, python=PYTHON, **GOLDEN_REQUESTS[name])


@pytest.mark.parametrize("name", sorted(GOLDEN_REQUESTS))
def test_render_matches_golden(name: str) -> None:
    site = load_site(name.removesuffix("-array"))
    text = render(site, golden_request(name)).sbatch
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("NEREUS_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs: NEREUS_REGEN_GOLDEN=1 regenerates it"


@pytest.mark.parametrize("name", sorted(GOLDEN_REQUESTS))
def test_render_equals_what_submitit_submits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    req = golden_request(name)
    rendered = render(load_site(name.removesuffix("-array")), req)
    ex = submitit.SlurmExecutor(folder=FOLDER, python=PYTHON)
    ex.update_parameters(**rendered.params)
    if req.array:
        ex.parameters["map_count"] = req.array  # what map_array sets on its copy
    assert ex._make_submission_file_text(ex._submitit_command_str, "uid") == rendered.sbatch


def test_site_contents() -> None:
    frontier = render(load_site("frontier"), golden_request("frontier"))
    for line in ("#SBATCH --gpus-per-node=8", "#SBATCH --account=ABC123", "export NCCL_SOCKET_IFNAME=hsn0",
                 "export FI_PROVIDER=cxi", "module load rocm", "--mpi=pmi2"):  # fmt: skip
        assert line in frontier.sbatch
    assert frontier.params["ntasks_per_node"] == 8 and frontier.params["srun_args"] == [
        "--cpus-per-task=7",
        "--mpi=pmi2",
        "--no-kill",
        "--gpus-per-task=1",
        "--gpu-bind=closest",
    ]
    nvidia = load_site("nvidia")
    assert nvidia.env["NCCL_SOCKET_IFNAME"] == "ib0" and "NCCL_IB_HCA" in nvidia.env
    local = load_site("local")
    assert (local.gpus_per_node, local.partitions, local.max_nodes) == (0, ("debug",), 4)


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("30", 30), ("90:30", 91), ("02:00:00", 120), ("1-00", 1440), ("1-02:03", 1563), ("0-00:00:01", 1)],
)
def test_parse_time(text: str, minutes: int) -> None:
    assert parse_time(text) == minutes


@pytest.mark.parametrize("text", ["", "abc", "1:60:00", "0", "1-24", "-5", "1:2:3:4"])
def test_parse_time_rejects(text: str) -> None:
    with pytest.raises(Exception, match="--time: expected a positive time limit"):
        parse_time(text)


# ------------------------------------------------------------------ login node: no torch
def test_launcher_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys, launch.cli, launch.submit, launch.job, launch.monitor, launch.jobdir, launch.render, "
        "launch.site, launch.sweep, launch.experiment\n"
        "from launch.cli import main\n"
        f"assert main(['submit', {str(PPO_TINY)!r}, '--nodes', '4', '--dry-run']) == 0\n"
        f"assert main(['array', {str(SWEEP)!r}, '--dry-run']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=False, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.iterdir()), "a dry run created files"


# ------------------------------------------------------------------ bad input: one line, exit 2, nothing left
BAD = [
    (["--site", "mars"], "--site: unknown site 'mars' (allowed: frontier, local, nvidia"),
    (["--partition", "gpu"], "--partition: 'gpu' is not a partition of site local (allowed: debug)"),
    (["--time", "1:99:00"], "--time: expected a positive time limit as MM, MM:SS, HH:MM:SS"),
    (["--nodes", "0"], "argument --nodes: expected a positive integer, got 0"),
    (["--nodes", "3"], "--nodes: 3 does not divide the experiment's 4 workers (allowed: 1, 2, 4)"),
    (["--site", "frontier"], "--site: site frontier runs amd workers but the experiment's cluster local-cpu"),
    (["--local", "--nodes", "2"], "--nodes: --local runs on this one machine"),
]


@pytest.mark.parametrize(("flags", "message"), BAD)
def test_bad_flags(flags: list[str], message: str, tmp_path: Path, capsys: Any, factory: Any) -> None:
    code, out, err = launch(["submit", str(PPO_TINY), "--jobs-root", str(tmp_path / "jobs"), *flags], capsys,
                            factory=factory)  # fmt: skip
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "jobs").exists()


def test_a_drift_gain_is_warned_about(tmp_path: Path, capsys: Any, factory: Any) -> None:
    """A launched job takes newcomers from ``grow``: the experiment's scripted gain would do nothing."""
    code, _, err = launch(["submit", str(PPO_TINY), "--nodes", "4", "--dry-run"], capsys, factory=factory)
    assert code == 0 and "warning: drift: the gain at step 10 starts local processes under nereus run" in err
    path = experiment(tmp_path, name="steady", drift=[])
    code, _, err = launch(["submit", str(path), "--dry-run"], capsys, factory=factory)
    assert code == 0 and "warning" not in err


def test_node_count_the_planner_cannot_use(tmp_path: Path, capsys: Any, factory: Any) -> None:
    path = experiment(tmp_path, name="one", workers=1, drift=[])
    code, _, err = launch(["submit", str(path), "--dry-run"], capsys, factory=factory)
    assert (
        code == 2
        and "workers: the planner cannot use 1 GPUs for ppo-tiny on tiny-llama-h32: stage inf" in err
    )
    amd = experiment(tmp_path, name="amd", cluster="mi250x-slingshot", drift=[])
    code, out, err = launch(["submit", str(amd), "--site", "frontier", "--dry-run"], capsys)
    assert code == 0 and "#SBATCH --gpus-per-node=8" in out and "#SBATCH --nodes=1" in out, err
    code, _, err = launch(["submit", str(amd), "--site", "frontier", "--nodes", "200", "--dry-run"], capsys)
    assert (
        code == 2 and "--nodes: 1600 GPUs exceed the 1024 of the experiment's cluster mi250x-slingshot" in err
    )


def test_bad_site_file(tmp_path: Path, capsys: Any) -> None:
    site = tmp_path / "mine.yaml"
    site.write_text((ROOT / "slurm/templates/local.yaml").read_text() + "gpus: 4\n")
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(site), "--dry-run"], capsys)
    assert code == 2 and "unknown key 'gpus' (allowed: account, cpus_per_task, description, env," in err
    # wrap: replaces the script; out, part, arr: sbatch reads an abbreviation as the flag
    for flag in ("nodes", "wrap", "ntasks", "chdir", "export", "dependency", "out", "part", "arr", "wra"):
        site.write_text(f"vendor: cpu\nsbatch: {{{flag}: x}}\n")
        code, _, err = launch(["submit", str(PPO_TINY), "--site", str(site), "--dry-run"], capsys)
        assert code == 2 and f"sbatch: '{flag}' is not a flag the site may set" in err, err
    for arg in ("-o/tmp/x", "-e/tmp/y", "--out=z", "--mp=pmi2"):  # srun: the short forms, abbreviations
        site.write_text(f"vendor: cpu\nsrun_args: ['{arg}']\n")
        code, _, err = launch(["submit", str(PPO_TINY), "--site", str(site), "--dry-run"], capsys)
        assert code == 2 and f"srun_args: '{arg}' is not an srun flag the site may set" in err, err
    site.write_text("vendor: cpu\nsbatch: {gpus: 4, no-kill: true}\nsrun_args: [--overlap]\n")  # their own
    assert launch(["submit", str(PPO_TINY), "--site", str(site), "--dry-run"], capsys)[0] == 0
    for flag, value in (("--account", "a\\b"), ("--jobs-root", str(tmp_path / "x\\y"))):
        code, _, err = launch(["submit", str(PPO_TINY), flag, value, "--dry-run"], capsys)
        assert (
            code == 2 and err.startswith(f"nereus-launch submit: error: {flag}: ") and "backslash" in err
        ), err


def test_missing_experiment_and_job_folders(tmp_path: Path, capsys: Any) -> None:
    code, _, err = launch(["submit", str(tmp_path / "nope.yaml")], capsys)
    assert code == 2 and "EXPERIMENT: no such file" in err
    code, _, err = launch(["status", str(tmp_path / "gone")], capsys)
    assert code == 2 and "JOB: no such job folder" in err
    (tmp_path / "afile").write_text("x")
    code, _, err = launch(["status", str(tmp_path / "afile")], capsys)
    assert code == 2 and "is a file, not a job folder" in err, err
    (tmp_path / "empty").mkdir()
    code, _, err = launch(["logs", str(tmp_path / "empty")], capsys)
    assert code == 2 and "has no job.json (not a nereus-launch job folder)" in err
    code, _, err = launch(["cancel", "424242", "--jobs-root", str(tmp_path)], capsys)
    assert code == 2 and "no job with id 424242" in err
    for command in ("status", "logs", "cancel"):  # "" would be the current folder
        code, _, err = launch([command, ""], capsys)
        assert code == 2 and "JOB: expected a job folder or a SLURM job id, got an empty value" in err, err


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sbatch: str) -> None:
    """``sbatch`` and ``srun`` stand-ins on PATH (submitit's real SlurmExecutor runs them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", sbatch), ("srun", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_sbatch_failing_or_missing_leaves_nothing(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    root = tmp_path / "jobs"
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    code, _, err = launch(["submit", str(PPO_TINY), "--jobs-root", str(root)], capsys)
    assert code == 2 and err.strip() == (
        "nereus-launch submit: error: sbatch: not found on PATH (not a SLURM login node? --local runs here)"
    )
    monkeypatch.undo()
    fake_slurm(
        tmp_path,
        monkeypatch,
        "echo 'sbatch: error: Batch job submission failed: Invalid account' >&2\nexit 1",
    )
    code, _, err = launch(["submit", str(PPO_TINY), "--jobs-root", str(root)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "sbatch failed: sbatch: error: Batch job submission failed: Invalid account" in err
    assert not root.exists()


# ------------------------------------------------------------------ submitting: the job folder
def test_submit_through_submitit_writes_the_job_folder(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    fake_slurm(tmp_path, monkeypatch, "echo 'Submitted batch job 4242'")
    root = tmp_path / "jobs"
    code, dry, _ = launch(
        ["submit", str(PPO_TINY), "--nodes", "2", "--jobs-root", str(root), "--dry-run"], capsys
    )
    assert code == 0 and not root.exists()
    code, out, err = launch(["submit", str(PPO_TINY), "--nodes", "2", "--jobs-root", str(root)], capsys)
    assert code == 0, err
    (folder,) = root.iterdir()
    assert "job 4242" in out and str(folder) in out
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    secret = folder / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_text().strip()) == 64
    script = (folder / "job.sbatch").read_text()
    assert (folder / "logs" / "4242_submission.sh").read_text() == script  # what sbatch got
    assert script == dry.replace(dry.split("/logs")[0].split("=")[-1], str(folder))  # dry run, same folder
    record = read_record(folder)
    assert (record.name, record.site, record.job_ids, record.nodes, record.tasks_per_node, record.state) == (
        "ppo-tiny", "local", ("4242",), 2, 2, "SUBMITTED")  # fmt: skip
    resolved = yaml.safe_load((folder / "experiment.yaml").read_text())
    assert resolved == {**yaml.safe_load(PPO_TINY.read_text()), "name": "ppo-tiny", "workers": 4}
    assert {p.name for p in folder.iterdir()} >= {"logs", "control", "job.json", "job.sbatch", "secret"}


def test_submit_with_a_fake_executor(tmp_path: Path, capsys: Any, factory: Any, executors: Any) -> None:
    folder = submitted(tmp_path, factory, capsys, "--nodes", "4", "--time", "10")
    (ex,) = executors
    assert ex.kind == "slurm" and ex.folder == folder / "logs"
    assert ex.params["nodes"] == 4 and ex.params["ntasks_per_node"] == 1 and ex.params["time"] == 10
    assert ex.params["srun_args"] == ["--cpus-per-task=1", "--mpi=pmi2", "--no-kill"]
    assert ex.params["partition"] == "debug"
    ((fn, args),) = ex.calls
    assert isinstance(fn, NodeJob) and args == (str(folder),)
    local = submitted(tmp_path / "l", factory, capsys, "--local")
    assert executors[-1].kind == "local" and executors[-1].params["tasks_per_node"] == 4
    assert not (local / "job.sbatch").exists() and read_record(local).executor == "local"


def test_node_job_runs_the_runtime_lazily_and_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    module = type(sys)("nereus.runtime.node")
    module.main = lambda job_dir, join=False: calls.append((job_dir, join))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nereus.runtime.node", module)
    NodeJob()("/jobs/x", join=True)
    assert calls == [("/jobs/x", True)]
    again = NodeJob().checkpoint("/jobs/x", True)
    assert isinstance(again, submitit.helpers.DelayedSubmission)
    assert isinstance(again.function, NodeJob) and again.args == ("/jobs/x", True)


# ------------------------------------------------------------------ grow and shrink
def test_grow_and_shrink(tmp_path: Path, capsys: Any, factory: Any, executors: Any) -> None:
    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    code, out, err = launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)
    assert code == 0, err
    ((fn, args),) = executors[-1].calls
    assert isinstance(fn, NodeJob) and args == (str(folder), True)
    assert executors[-1].params["nodes"] == 1 and executors[-1].params["job_name"] == "ppo-tiny-grow"
    record = read_record(folder)
    assert len(record.grows) == 1 and record.grows[0].nodes == 1 and record.current_nodes == 3
    assert "#SBATCH --nodes=1" in (folder / "grow-1.sbatch").read_text()
    code, _, err = launch(["grow", str(folder), "--nodes", "2"], capsys, factory=factory)
    assert code == 2 and "--nodes: 5 nodes exceed site local's 4" in err

    code, out, err = launch(["shrink", str(folder), "--nodes", "1"], capsys)
    assert code == 0 and "drain 1 node(s)" in out, err
    (request,) = (folder / "control").iterdir()
    assert request.name.startswith("shrink-") and json.loads(request.read_text()) == {"nodes": 1}
    assert int(request.stem.removeprefix("shrink-")) > 1_600_000_000_000  # unix ms
    assert read_record(folder).current_nodes == 2
    code, _, err = launch(["shrink", str(folder), "--nodes", "2"], capsys)
    assert code == 2 and "--nodes: must be below the job's 2 node(s) (allowed: 1 to 1), got 2" in err
    code, _, err = launch(["shrink", str(folder), "--nodes", "1"], capsys)  # one node cannot hold a plan
    assert code == 2 and "--nodes: the planner cannot use 2 GPUs for ppo-tiny" in err, err
    assert len(list((folder / "control").iterdir())) == 1


def test_a_shrink_the_job_refused_gives_its_nodes_back_to_the_record(
    tmp_path: Path, capsys: Any, factory: Any
) -> None:
    """The leader could not drain (what is left holds no plan): its refusal (``.refused-…``) puts
    the nodes back in the record, so ``status``, ``grow`` and ``shrink`` count them again."""
    from nereus.runtime.pool import read_shrink_requests, refuse_shrinks

    folder = submitted(tmp_path, factory, capsys, "--nodes", "4")
    assert launch(["shrink", str(folder), "--nodes", "1"], capsys)[0] == 0
    assert read_record(folder).current_nodes == 3
    _, done = read_shrink_requests(folder / "control", print)  # the job's leader, at a boundary
    refuse_shrinks(done, "the job does not fit on GPUs [0, 1]")
    job_id = read_record(folder).job_ids[0]
    running = runner({"sacct": (0, f"JobID|State\n{job_id}|RUNNING\n", "")}, [])
    code, out, _ = launch(["status", str(folder), "--json"], capsys, runner=running)
    doc = json.loads(out)
    assert code == 0 and doc["nodes"] == 4 and doc["shrinks"] == []
    assert doc["refused_shrinks"] == [{"file": done[0].name.removeprefix(".done-"),
                                       "reason": "the job does not fit on GPUs [0, 1]"}]  # fmt: skip
    assert read_record(folder).current_nodes == 4
    code, out, _ = launch(["status", str(folder)], capsys, runner=running)
    assert "shrink refused by the job" in out and "does not fit on GPUs [0, 1]" in out
    code, out, err = launch(["shrink", str(folder), "--nodes", "1"], capsys, runner=running)
    assert code == 0 and "3 left" in out, err


# ------------------------------------------------------------------ arrays
def test_array_with_a_fake_executor(tmp_path: Path, capsys: Any, factory: Any, executors: Any) -> None:
    root = tmp_path / "jobs"
    code, out, err = launch(["array", str(SWEEP), "--jobs-root", str(root)], capsys, factory=factory)
    assert code == 0 and "submitted plan-scaling" in out, err
    (folder,) = root.iterdir()
    (ex,) = executors
    assert [row[1] for _, row in ex.calls] == [0, 1, 2, 3]
    assert ex.calls[2][1][2][-3:] == ["--gpus", "32", "--json"] and ex.calls[0][0] is run_cli_task
    record = read_record(folder)
    assert record.kind == "array" and len(record.job_ids) == 1 and record.tasks[3].job_id.endswith("_3")
    assert "#SBATCH --array=0-3%4" in (folder / "job.sbatch").read_text()
    assert run_cli_task(str(folder), 1, list(record.tasks[1].argv)) == 0
    sacct = f"JobID|State\n{record.job_ids[0]}_[0-3]|RUNNING\n"
    doc = status(folder, runner({"sacct": (0, sacct, "")}, []))
    assert [t["state"] for t in doc["tasks"]] == ["RUNNING"] * 4
    assert doc["tasks"][1]["exit_code"] == 0 and doc["tasks"][1]["step_latency_s"] > 0
    assert doc["tasks"][0]["exit_code"] is None


def test_bad_sweep(tmp_path: Path, capsys: Any) -> None:
    sweep = tmp_path / "s.yaml"
    sweep.write_text("command: plan\nargs: {model: tiny-llama, algo: ppo, cluster: local-cpu, seq-len: 8}\n"
                     "grid: {gpus: [2, 0]}\n")  # fmt: skip
    code, _, err = launch(["array", str(sweep), "--dry-run"], capsys)
    assert code == 2 and "task 1 {'gpus': 0}: nereus plan: error: argument --gpus: must be a positive" in err
    sweep.write_text("command: simulate\ngrid: {gpus: [2]}\n")
    code, _, err = launch(["array", str(sweep), "--dry-run"], capsys)
    assert code == 2 and "command must be one of plan, got 'simulate'" in err
    # what every task would refuse on a compute node: an unknown model, more GPUs than the cluster
    sweep.write_text("command: plan\nargs: {model: nonexistent, algo: ppo, cluster: local-cpu, seq-len: 8}\n"
                     "grid: {gpus: [2]}\n")  # fmt: skip
    code, _, err = launch(["array", str(sweep), "--dry-run"], capsys)
    assert code == 2 and "task 0 {'gpus': 2}: " in err and "unknown model 'nonexistent'" in err, err
    sweep.write_text("command: plan\nargs: {model: tiny-llama, algo: ppo, cluster: local-cpu, seq-len: 8}\n"
                     "grid: {gpus: [2, 100000]}\n")  # fmt: skip
    code, _, err = launch(["array", str(sweep), "--dry-run"], capsys)
    assert code == 2 and "task 1 {'gpus': 100000}: --gpus 100000 exceeds cluster local-cpu" in err, err
