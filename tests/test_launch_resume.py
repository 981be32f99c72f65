"""``nereus-launch resume JOB``: a job that ended (cancelled, past its requeues) is submitted again
into its own folder, where its workers resume from the latest checkpoint; a running job, a job
without a checkpoint and a sweep are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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
    code, out, err = launch(["resume", str(folder), "--time", "45"], capsys, factory=factory, runner=ended)
    assert code == 0, err
    ((fn, args),) = executors[-1].calls
    assert isinstance(fn, NodeJob) and args == (str(folder.absolute()),)  # not a newcomer: the job itself
    assert executors[-1].params["nodes"] == 2 and executors[-1].params["time"] == 45
    record = read_record(folder)
    assert record.job_ids != before.job_ids and record.earlier == ids and record.state == "SUBMITTED"
    assert record.grows == () and record.shrinks == () and record.current_nodes == 2 and record.time_min == 45
    assert f"resume: job {record.job_ids[0]} continues" in out and (folder / "resume-1.sbatch").is_file()
    (void,) = (folder / "control").iterdir()  # the old allocation's drain request, not the new job's
    assert void.name.startswith(".void-shrink-") and json.loads(void.read_text()) == {"nodes": 1}
    code, _, err = launch(["resume", str(folder), "--time", "0:10"], capsys, factory=factory, runner=ended)
    assert code == 2 and "--time:" in err and "signal_delay_s" in err
