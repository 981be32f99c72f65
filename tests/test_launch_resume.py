"""``nereus-launch resume JOB``: a job that ended (cancelled, past its requeues) is submitted again
into its own folder, where its workers resume from the latest checkpoint; a running job, a job
without a checkpoint and a sweep are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.job import NodeJob
from launch.jobdir import read_record
from tests.test_launch import executors, factory, launch, runner, submitted  # noqa: F401 - fixtures

pytestmark = pytest.mark.pure


def _states(record_ids: tuple[str, ...], state: str) -> Any:
    rows = "".join(f"{i}|{state}\n" for i in record_ids)
    return runner({"sacct": (0, f"JobID|State\n{rows}", "")}, [])


def test_an_ended_job_resumes_from_its_checkpoint_in_its_folder(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
    executors: Any,  # noqa: F811 - the fixture
) -> None:
    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    assert launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)[0] == 0
    assert launch(["shrink", str(folder), "--nodes", "1"], capsys)[0] == 0
    before = read_record(folder)
    ids = before.all_job_ids
    running = _states(ids, "RUNNING")
    code, _, err = launch(["resume", str(folder)], capsys, factory=factory, runner=running)
    assert code == 2 and f"is still RUNNING (job {ids[0]}); it resumes once it has ended" in err, err
    ended = _states(ids, "CANCELLED")
    code, _, err = launch(["resume", str(folder)], capsys, factory=factory, runner=ended)
    assert code == 2 and "has no checkpoint to resume from" in err and "submit its experiment again" in err
    checkpoints = folder / "run" / "checkpoints"
    (checkpoints / "step_000007").mkdir(parents=True)
    (checkpoints / "latest").write_text("step_000007\n")
    (folder / "control" / ".refused-shrink-1.json").write_text('{"nodes": 1, "refused": "no plan"}\n')
    code, out, err = launch(["resume", str(folder), "--time", "45"], capsys, factory=factory, runner=ended)
    assert code == 0, err
    ((fn, args),) = executors[-1].calls
    assert isinstance(fn, NodeJob) and args == (str(folder.absolute()),)  # not a newcomer: the job itself
    assert executors[-1].params["nodes"] == 2 and executors[-1].params["time"] == 45
    record = read_record(folder)
    assert record.job_ids != before.job_ids and record.earlier == ids and record.state == "SUBMITTED"
    assert record.grows == () and record.shrinks == () and record.current_nodes == 2 and record.time_min == 45
    assert f"resume: job {record.job_ids[0]} continues" in out and (folder / "resume-1.sbatch").is_file()
    refusal, void = sorted((folder / "control").iterdir())  # the old allocation's, not the new job's
    assert void.name.startswith(".void-shrink-") and json.loads(void.read_text()) == {"nodes": 1}
    assert refusal.name == ".void-.refused-shrink-1.json"  # its refusals are not shown any more
    code, out, err = launch(["status", ids[0], "--jobs-root", str(tmp_path / "jobs"), "--json"], capsys,
                            runner=ended)  # fmt: skip
    assert code == 0 and json.loads(out)["folder"] == str(folder), err  # an earlier id still finds it
    again = _states(record.all_job_ids, "CANCELLED")  # the resumed job ended too
    code, _, err = launch(["resume", str(folder), "--time", "0:10"], capsys, factory=factory, runner=again)
    assert code == 2 and "--time:" in err and "signal_delay_s" in err
    assert launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)[0] == 0
    assert (folder / "grow-2.sbatch").is_file()  # the ended allocation's grow-1.sbatch stays as it was
    silent = runner({"sacct": (124, "", "sacct: timed out"), "squeue": (124, "", "squeue: timed out")}, [])
    code, _, err = launch(["resume", str(folder)], capsys, factory=factory, runner=silent)
    assert code == 2 and "SLURM could not say whether job" in err, err  # never two jobs on one folder
    (checkpoints / "step_000015").mkdir()
    (checkpoints / "latest").write_text("step_000015\n")
    done = _states(read_record(folder).all_job_ids, "CANCELLED")  # the grow job's too
    (folder / "run" / "hf").mkdir()
    (folder / "run" / "hf" / ".exported").write_text("16\n")
    code, _, err = launch(["resume", str(folder)], capsys, factory=factory, runner=done)
    assert code == 2 and "checkpointed its last step (15 of 16) and exported it: nothing to resume" in err, (
        err
    )
    (folder / "run" / "hf" / ".exported").unlink()  # trained, not exported: the job writes the export
    code, _, err = launch(["resume", str(folder)], capsys, factory=factory, runner=done)
    assert code == 0, err


def test_a_job_slurm_forgot_is_not_grown_cancelled_or_shown_unknown(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
) -> None:
    """Without accounting SLURM forgets an ended job after ``MinJobAge``: grow and shrink refuse it
    (a grow job would wait on a dead store), cancel cancels nothing and keeps its record's state,
    and status shows how the record saw it end instead of UNKNOWN."""
    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    invalid = (1, "", "slurm_load_jobs error: Invalid job id specified")
    gone = runner(
        {
            "sacct": (1, "", "accounting disabled"),
            "squeue": invalid,
            "scontrol": invalid,
            "scancel": (0, "", ""),
        },
        [],
    )
    for command in ("grow", "shrink"):
        code, _, err = launch([command, str(folder), "--nodes", "1"], capsys, factory=factory, runner=gone)
        assert code == 2 and "is ended (SLURM no longer knows it); only a running job" in err, err
        assert "nereus-launch resume JOB" in err
    assert read_record(folder).grows == () and read_record(folder).state == "SUBMITTED"
    code, out, _ = launch(["cancel", str(folder)], capsys, runner=gone)
    assert code == 0 and "nothing (the job had already ended)" in out
    assert read_record(folder).state == "SUBMITTED"  # not CANCELLED: nobody knows how it ended
    done = _states(read_record(folder).job_ids, "COMPLETED")
    assert launch(["status", str(folder), "--json"], capsys, runner=done)[0] == 0
    code, out, _ = launch(["status", str(folder), "--json"], capsys, runner=gone)
    assert code == 0 and json.loads(out)["state"] == "COMPLETED"  # what the record learned
    code, _, err = launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory, runner=gone)
    assert code == 2 and "is COMPLETED; only a running job grows" in err


def test_a_missing_prompt_file_is_refused_at_submit(tmp_path: Path, capsys: Any) -> None:
    """The records are read on the compute nodes (torch), but a file that is not there at all is
    found on the login node, before the job queues."""
    from tests.test_launch import experiment

    for changes, key in (
        ({"dataset": str(tmp_path / "none.jsonl")}, "dataset"),
        ({"data": {"train": str(tmp_path / "none.parquet"), "layout": "verl"}}, "data.train"),
    ):
        path = experiment(tmp_path, **changes)
        doc = yaml.safe_load(path.read_text())
        del doc["task"]  # a prompt file in place of the generated task
        path.write_text(yaml.safe_dump(doc))
        code, out, err = launch(
            ["submit", str(path), "--dry-run", "--jobs-root", str(tmp_path / "j")], capsys
        )
        assert code == 2 and not out and err.count("\n") == 1, err
        assert f"{key}: {tmp_path}/none." in err and "dataset file does not exist" in err
        assert not (tmp_path / "j").exists()


def test_a_grow_while_status_asks_slurm_is_kept(
    tmp_path: Path,
    capsys: Any,
    factory: Any,  # noqa: F811 - the fixture
) -> None:
    """``status`` reads job.json, asks SLURM (seconds, at times), then writes the state it learned:
    a grow made meanwhile stays in the record (it was lost)."""
    from launch import submit
    from launch.monitor import status

    folder = submitted(tmp_path, factory, capsys, "--nodes", "2")
    job_id = read_record(folder).job_ids[0]

    def slow_sacct(argv: list[str]) -> tuple[int, str, str]:
        if argv[0] == "sacct" and not read_record(folder).grows:
            submit.grow(folder, 1, factory, lambda _: (127, "", ""))  # the user's grow, meanwhile
        return (0, f"JobID|State\n{job_id}|RUNNING\n", "") if argv[0] == "sacct" else (127, "", "")

    status(folder, slow_sacct)
    record = read_record(folder)
    assert record.state == "RUNNING" and len(record.grows) == 1 and record.current_nodes == 3


def test_a_bad_model_or_cluster_names_its_key_at_submit(tmp_path: Path, capsys: Any) -> None:
    from tests.test_launch import experiment

    for key, what in (("model", "model"), ("cluster", "cluster"), ("workload", "algorithm")):
        path = experiment(tmp_path, drift=[], **{key: "nosuch"})
        code, _, err = launch(["submit", str(path), "--dry-run", "--jobs-root", str(tmp_path / "j")], capsys)
        assert code == 2 and f"error: {key}: unknown {what} 'nosuch'" in err, err
