"""``nereus-launch status``, ``cancel`` and ``logs`` against fake ``sacct``/``squeue`` answers:
the job's state from its jobs', the record it learns, and a worker's one-line error
(``error-<job id>.json``) shown for the job that wrote it."""

from __future__ import annotations

import io
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from launch.job import NodeJob
from launch.jobdir import read_record, write_record
from launch.monitor import UNKNOWN_CHECKS, Follower, follow, slurm_states, status
from nereus.errors import ConfigError
from tests.test_launch import executors, factory, launch, runner, submitted  # noqa: F401 - fixtures

pytestmark = pytest.mark.pure


def test_status_without_accounting_is_unknown(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
) -> None:
    folder = submitted(tmp_path, factory, capsys)
    calls: list[list[str]] = []
    no_db = runner({"sacct": (1, "", "Slurm accounting storage is disabled"),
                    "squeue": (1, "", "slurm_load_jobs error: Invalid job id specified")}, calls)  # fmt: skip
    code, out, err = launch(["status", str(folder), "--json"], capsys, runner=no_db)
    assert code == 0, err
    doc = json.loads(out)
    assert (
        doc["state"] == "UNKNOWN"
        and doc["progress"] is None
        and [c[0] for c in calls] == ["sacct", "squeue", "scontrol"]
    )
    (folder / "run").mkdir()
    steps = [{"step": 0, "reward": 0.1, "gpus": 4, "plan": {"actor.gen": "tp1·pp1·dp2 @ 0-1"}},
             {"step": 1, "reward": 0.25, "gpus": 4, "plan": {"actor.gen": "tp1·pp1·dp4 @ 0-3"}}]  # fmt: skip
    (folder / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in steps) + '{"step": 2, "rew'
    )
    job_id = read_record(folder).job_ids[0]
    queue = runner({"sacct": (1, "", ""), "squeue": (0, f"{job_id}|RUNNING\n", "")}, [])
    code, out, _ = launch(["status", job_id, "--jobs-root", str(tmp_path / "jobs")], capsys, runner=queue)
    assert (
        code == 0 and "RUNNING" in out and "step 1" in out and "reward 0.250" in out and "tp1·pp1·dp4" in out
    )
    assert read_record(folder).state == "RUNNING"
    shutil.copytree(folder, folder.with_name(folder.name + "-copy"))  # the same id in two folders
    code, _, err = launch(["status", job_id, "--jobs-root", str(tmp_path / "jobs")], capsys, runner=queue)
    assert code == 2 and f"job id {job_id} is in 2 job folders under" in err and "name the folder" in err


def test_a_job_cancelled_with_its_grows_is_cancelled_not_mixed(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
) -> None:
    """Once none is active, an experiment's state is its own job's: a grow job that ended
    COMPLETED beside a cancelled job does not make it MIXED."""
    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    assert launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)[0] == 0
    main, grown = read_record(folder).all_job_ids
    ended = runner({"sacct": (0, f"JobID|State\n{main}|CANCELLED by 0\n{grown}|COMPLETED\n", "")}, [])
    assert status(folder, ended)["state"] == "CANCELLED"
    live = runner({"sacct": (0, f"JobID|State\n{main}|CANCELLED\n{grown}|RUNNING\n", "")}, [])
    assert status(folder, live)["state"] == "RUNNING"  # a grow still running: the job is not over


def test_a_late_grows_error_is_shown_without_failing_the_job(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A grow SLURM started after the job completed leaves with a line: shown, named by its job,
    while the job stays COMPLETED."""
    from nereus.runtime import joberror

    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    assert launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)[0] == 0
    main, grown = read_record(folder).all_job_ids
    monkeypatch.delenv("SUBMITIT_LOCAL_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", grown)
    joberror.record(folder, "cannot join: the job's store at n1:29500 did not answer for 120 s")
    done = runner({"sacct": (0, f"JobID|State\n{main}|COMPLETED\n{grown}|FAILED\n", "")}, [])
    doc = status(folder, done)
    assert (doc["state"], doc["error_job"]) == ("COMPLETED", grown) and "did not answer" in doc["error"]
    monkeypatch.setenv("SLURM_JOB_ID", main)  # the job's own error, written before the grow's: shown first
    joberror.record(folder, "init.actor: w.safetensors: tensor 'x' holds NaN or Infinity")
    failed = runner({"sacct": (0, f"JobID|State\n{main}|FAILED\n{grown}|FAILED\n", "")}, [])
    doc = status(folder, failed)
    assert (doc["state"], doc["error_job"]) == ("FAILED", main) and "holds NaN" in doc["error"]


def test_slurm_states_parse_sacct_and_squeue_arrays() -> None:
    sacct = "JobID|State\n77_0|COMPLETED\n77_1|CANCELLED by 0\n77_[2-3]|PENDING\n"
    states = slurm_states(["77_0", "77_1", "77_2", "77_3"], runner({"sacct": (0, sacct, "")}, []))
    assert states == {"77_0": "COMPLETED", "77_1": "CANCELLED", "77_2": "PENDING", "77_3": "PENDING"}
    queue = runner({"sacct": (1, "", ""), "squeue": (0, "78_[1-2%4]|PENDING\n78_0|RUNNING\n", "")}, [])
    assert slurm_states(["78_0", "78_1", "78_2"], queue) == {
        "78_0": "RUNNING",
        "78_1": "PENDING",
        "78_2": "PENDING",
    }


def test_cancel(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
) -> None:
    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    assert launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)[0] == 0
    calls: list[list[str]] = []
    code, out, _ = launch(["cancel", str(folder)], capsys, runner=runner({"scancel": (0, "", "")}, calls))
    assert (
        code == 0
        and out.startswith("cancelled")
        and calls[-1] == ["scancel", *read_record(folder).all_job_ids]
    )
    assert read_record(folder).state == "CANCELLED"
    ended = tmp_path / "ended"  # a job that already completed: nothing cancelled, its record says so
    folder = submitted(ended, factory, capsys)
    calls = []
    scontrol = (0, "JobId=1 JobName=x JobState=COMPLETED Reason=None\n", "")
    done = runner(
        {"sacct": (1, "", ""), "squeue": (1, "", ""), "scancel": (0, "", ""), "scontrol": scontrol}, calls
    )
    code, out, _ = launch(["cancel", str(folder)], capsys, runner=done)
    assert (
        code == 0 and "nothing (the job had already ended)" in out and all(c[0] != "scancel" for c in calls)
    )
    assert read_record(folder).state == "COMPLETED"
    code, _, err = launch(["cancel", str(folder)], capsys, runner=runner({}, []))
    assert code == 2 and "scancel not found" in err


def test_logs_follow(tmp_path: Path) -> None:
    out_file, err_file = tmp_path / "7_0_log.out", tmp_path / "7_0_log.err"
    out_file.write_text("hello\n")
    states = iter(["RUNNING", "COMPLETED"])
    written = io.StringIO()

    def sleep(_: float) -> None:
        if not err_file.exists():
            err_file.write_text("warning\n")
        out_file.write_text(out_file.read_text() + "more\n")

    last = follow(lambda: sorted(tmp_path.glob("7_*")), lambda: next(states), written, sleep=sleep)
    text = written.getvalue()
    assert last == "COMPLETED" and "==> 7_0_log.out <==\nhello\n" in text and "warning" in text
    assert text.count("more\n") == 5  # every append, once
    f = Follower(io.StringIO())
    assert f.poll([out_file]) and not f.poll([out_file])
    # a job that ended before the follow began, without accounting: UNKNOWN from the start
    checks: list[str] = []
    last = follow(lambda: [], lambda: checks.append("?") or "UNKNOWN", io.StringIO(), sleep=lambda _: None)
    assert last == "UNKNOWN" and len(checks) == UNKNOWN_CHECKS  # it ends instead of following forever


def test_bad_input_a_node_finds_exits_2_with_one_line_that_status_shows(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's ConfigError (NaN weights, say): one line on stderr and in ``error-<job id>.json``, exit
    2; ``status`` shows it for the job that failed, never for a later one (a resume)."""
    folder = submitted(tmp_path, factory, capsys)
    job_id = read_record(folder).job_ids[0]
    module = type(sys)("nereus.runtime.node")

    def refuse(job_dir: str, join: bool = False) -> None:
        raise ConfigError("init.actor: w.safetensors: tensor 'x' holds NaN\x1b[31m")

    module.main = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nereus.runtime.node", module)
    monkeypatch.delenv("SUBMITIT_LOCAL_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", job_id)
    with pytest.raises(SystemExit) as exit_:
        NodeJob()(str(folder))
    assert exit_.value.code == 2
    line = "init.actor: w.safetensors: tensor 'x' holds NaN\x1b[31m"
    assert capsys.readouterr().err == f"nereus node: error: {line}\n"
    failed = runner({"sacct": (0, f"JobID|State\n{job_id}|FAILED\n", "")}, [])
    code, out, _ = launch(["status", str(folder), "--json"], capsys, runner=failed)
    doc = json.loads(out)
    assert code == 0 and doc["state"] == "FAILED"
    assert doc["error"] == "init.actor: w.safetensors: tensor 'x' holds NaN [31m"  # printable
    code, out, _ = launch(["status", str(folder)], capsys, runner=failed)
    assert f"error (job {job_id}): init.actor: w.safetensors" in out
    later = runner({"sacct": (0, "JobID|State\n999|RUNNING\n", "")}, [])
    write_record(folder, replace(read_record(folder), job_ids=("999",), earlier=(job_id,)))
    code, out, _ = launch(["status", str(folder), "--json"], capsys, runner=later)
    assert code == 0 and "error" not in json.loads(out) and json.loads(out)["state"] == "RUNNING"
