"""``nereus-launch submit --launcher torchrun`` (issue 16), without SLURM: the sbatch script
(golden files, and what submitit's executor submits), the flags' checks, the job record, a grow,
each worker's identity from torchrun's and SLURM's variables, and what a worker its agent
restarted does (rejoin, or requeue when it was the leader). The job on the local SLURM cluster is
in test_slurm_e2e.py. Regenerate the golden files with ``NEREUS_REGEN_GOLDEN=1``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from launch.jobdir import read_record
from launch.render import Request, render, torchrun_command
from launch.site import load_site
from launch.submit import TorchrunExecutor, grow
from nereus.runtime.bootstrap import bootstrap, from_environment
from tests.test_launch import FOLDER, PPO_TINY, PYTHON, FakeExecutor, fake_slurm, launch

pytestmark = pytest.mark.pure

GOLDEN = Path(__file__).parent / "golden"
JOB = FOLDER.removesuffix("/logs")
TORCHRUN_REQUESTS: dict[str, dict[str, Any]] = {
    "nvidia": dict(job_name="ppo-8b", nodes=4, tasks_per_node=8, time_min=240),
    "local": dict(job_name="ppo-tiny", nodes=4, tasks_per_node=1, time_min=30, partition="debug"),
}
COMMAND = (
    f"{PYTHON} -u -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=8 --max-restarts=3 "
    "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2 --shutdown-timeout=600 "
    f"-m nereus.cli node {JOB}"
)


def torchrun_request(name: str, **changes: Any) -> Request:
    fields = {"launcher": "torchrun", **TORCHRUN_REQUESTS[name], **changes}
    return Request(folder=FOLDER, python=PYTHON, **fields)


@pytest.fixture
def executors() -> list[FakeExecutor]:
    return []


@pytest.fixture
def factory(executors: list[FakeExecutor]) -> Callable[[str, Path, str], FakeExecutor]:
    def make(kind: str, folder: Path, python: str) -> FakeExecutor:
        executors.append(FakeExecutor(kind, folder, python))
        return executors[-1]

    return make


# ------------------------------------------------------------------ the sbatch script
@pytest.mark.parametrize("name", sorted(TORCHRUN_REQUESTS))
def test_torchrun_render_matches_golden(name: str) -> None:
    text = render(load_site(name), torchrun_request(name)).sbatch
    path = GOLDEN / f"{name}-torchrun.sbatch"
    if os.environ.get("NEREUS_REGEN_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs: NEREUS_REGEN_GOLDEN=1 regenerates it"


@pytest.mark.parametrize("name", sorted(TORCHRUN_REQUESTS))
def test_torchrun_render_equals_what_submitit_submits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TorchrunExecutor, "affinity", classmethod(lambda cls: 2))
    rendered = render(load_site(name), torchrun_request(name))
    ex = TorchrunExecutor(folder=FOLDER, python=PYTHON)
    ex.update_parameters(**rendered.params)
    assert ex._submitit_command_str == rendered.command
    assert ex._make_submission_file_text(ex._submitit_command_str, "uid") == rendered.sbatch


def test_one_agent_task_per_node_running_torchrun() -> None:
    rendered = render(load_site("nvidia"), torchrun_request("nvidia"))
    assert rendered.command == COMMAND
    p = rendered.params
    assert (p["nodes"], p["ntasks_per_node"], p["gpus_per_node"], p["cpus_per_task"]) == (4, 1, 8, 64)
    # the agent's CPUs on srun's line too; no PMI: the ranks are SLURM's task + torchrun's; no GPU
    # binding: the agent's task holds its node's 8 GPUs
    assert p["srun_args"] == ["--cpus-per-task=64", "--mpi=none", "--no-kill"]
    srun = rendered.sbatch.splitlines()[-1]
    assert srun.startswith("srun --unbuffered ") and srun.endswith(COMMAND)
    assert "export NEREUS_BOOTSTRAP=mpi" in rendered.sbatch  # the site's; a torchrun worker ignores it
    assert rendered.sbatch.count("export NEREUS_THREADS=") == 1
    assert "export NEREUS_THREADS=8\n" in rendered.sbatch  # each worker: the site's CPUs per GPU
    own = replace(load_site("nvidia"), env={"NEREUS_THREADS": "4"})  # the site's own share wins
    assert render(own, torchrun_request("nvidia")).sbatch.count("export NEREUS_THREADS=") == 1
    local = render(load_site("local"), torchrun_request("local", max_restarts=0)).command
    assert "--nproc-per-node=1 --max-restarts=0" in local and "--shutdown-timeout=30" in local
    grown = torchrun_command(load_site("local"), torchrun_request("local", join=True))
    assert grown.endswith(f"-m nereus.cli node {JOB} --join")


def test_the_command_quotes_the_job_folder() -> None:
    folder = "/scratch/my jobs/$(touch x);`id`/ppo-tiny-1/logs"
    req = Request(folder=folder, python=PYTHON, launcher="torchrun", **TORCHRUN_REQUESTS["local"])
    command = render(load_site("local"), req).command
    argv = shlex.split(command)  # what the shell hands srun
    assert argv[-3:] == ["nereus.cli", "node", folder.removesuffix("/logs")]  # one argument, literally
    with pytest.raises(ValueError, match="control character"):
        Request(folder="/jobs/a\nb/logs", python=PYTHON, launcher="torchrun", **TORCHRUN_REQUESTS["local"])


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"launcher": "mpirun"}, "launcher must be one of srun, torchrun"),
        ({"max_restarts": -1}, "max_restarts must be 0 to 100"),
        ({"max_restarts": 101}, "max_restarts must be 0 to 100"),
        ({"array": 4, "nodes": 1}, "an array task runs under srun"),
    ],
)
def test_request_refuses(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        torchrun_request("local", **changes)


# ------------------------------------------------------------------ the flags
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--launcher", "torchrun", "--max-restarts", "101"],
         "argument --max-restarts: expected an integer from 0 to 100, got '101'"),
        (["--launcher", "torchrun", "--max-restarts", "-1"],
         "argument --max-restarts: expected an integer from 0 to 100, got '-1'"),
        (["--launcher", "torchrun", "--max-restarts", "x"],
         "argument --max-restarts: expected an integer from 0 to 100, got 'x'"),
        (["--launcher", "torchrun", "--max-restarts", "\u0663"],
         "argument --max-restarts: expected an integer from 0 to 100, got '\u0663'"),
        (["--max-restarts", "2"], "--max-restarts: only with --launcher torchrun (srun restarts no worker)"),
        (["--launcher", "torchrun", "--local"],
         "--launcher: torchrun runs on SLURM nodes under srun; --local runs local processes without it"),
        (["--launcher", "mpirun"], "argument --launcher: invalid choice: 'mpirun'"),
    ],
)  # fmt: skip
def test_flags_are_checked_in_one_line(
    flags: list[str], message: str, tmp_path: Path, capsys: Any, factory: Any, executors: Any
) -> None:
    root = tmp_path / "jobs"
    code, out, err = launch(
        ["submit", str(PPO_TINY), "--jobs-root", str(root), *flags], capsys, factory=factory
    )
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("nereus-launch submit: error: ") and message in err, err
    assert not root.exists() and not executors


def test_dry_run_prints_the_torchrun_script(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "jobs"
    args = ["submit", str(PPO_TINY), "--nodes", "4", "--launcher", "torchrun", "--max-restarts", "5"]
    code, out, err = launch([*args, "--jobs-root", str(root), "--dry-run"], capsys)
    assert code == 0, err
    assert not root.exists()
    assert "#SBATCH --ntasks-per-node=1" in out and "--mpi=none --no-kill" in out
    assert "-m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 --max-restarts=5" in out
    assert re.search(
        rf"-m nereus\.cli node {re.escape(str(root.absolute()))}/ppo-tiny-[0-9-]+$", out.rstrip()
    )


# ------------------------------------------------------------------ submitting and growing
def test_submit_and_grow_under_torchrun(tmp_path: Path, capsys: Any, factory: Any, executors: Any) -> None:
    root = tmp_path / "jobs"
    code, out, err = launch(
        ["submit", str(PPO_TINY), "--nodes", "2", "--launcher", "torchrun", "--jobs-root", str(root)],
        capsys, factory=factory,
    )  # fmt: skip
    assert code == 0, err
    assert "2 node(s) × 2 task(s), torchrun, 3 restart(s)" in out
    (folder,) = root.iterdir()
    (ex,) = executors
    assert ex.kind == "torchrun" and ex.params["ntasks_per_node"] == 1
    assert "--nproc-per-node=2 --max-restarts=3" in ex.params["command"]
    assert ex.params["command"].endswith(f"-m nereus.cli node {folder}")
    assert (folder / "job.sbatch").read_text().splitlines()[-1].endswith(ex.params["command"])
    record = read_record(folder)
    assert (record.launcher, record.max_restarts, record.tasks_per_node) == ("torchrun", 3, 2)
    added, record = grow(folder, 1, factory)
    assert executors[-1].kind == "torchrun"
    assert executors[-1].params["command"].endswith(f"-m nereus.cli node {folder} --join")
    assert (folder / added.sbatch).read_text().splitlines()[-1].endswith(executors[-1].params["command"])
    assert record.current_nodes == 3


def test_submit_through_submitit_runs_torchrun(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    fake_slurm(tmp_path, monkeypatch, "echo 'Submitted batch job 4343'")
    root = tmp_path / "jobs"
    code, _, err = launch(
        ["submit", str(PPO_TINY), "--nodes", "4", "--launcher", "torchrun", "--jobs-root", str(root)], capsys
    )
    assert code == 0, err
    (folder,) = root.iterdir()
    script = (folder / "job.sbatch").read_text()
    assert (folder / "logs" / "4343_submission.sh").read_text() == script  # what sbatch got
    assert script.splitlines()[-1].endswith(f"-m nereus.cli node {folder}")
    assert "submitit.core._submit" not in script


def test_an_old_record_is_an_srun_job(tmp_path: Path, capsys: Any, factory: Any) -> None:
    root = tmp_path / "jobs"
    code, _, err = launch(["submit", str(PPO_TINY), "--jobs-root", str(root)], capsys, factory=factory)
    assert code == 0, err
    (folder,) = root.iterdir()
    doc = json.loads((folder / "job.json").read_text())
    del doc["launcher"], doc["max_restarts"]  # a job.json written before issue 16
    (folder / "job.json").write_text(json.dumps(doc))
    record = read_record(folder)
    assert (record.launcher, record.max_restarts) == ("srun", 3)
    doc.update(launcher="torchrun", executor="local", job_ids=[])
    (folder / "job.json").write_text(json.dumps(doc))
    code, _, err = launch(["status", str(folder), "--json"], capsys)
    assert code == 2 and "only an experiment on SLURM runs under torchrun" in err


# ------------------------------------------------------------------ a worker's identity
SLURM_AGENT = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_NODEID": "2",
               "SLURM_LOCALID": "0", "SLURMD_NODENAME": "n3", "SLURM_RESTART_COUNT": "1"}  # fmt: skip
TORCHRUN = {"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "RANK": "5", "WORLD_SIZE": "8", "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_RUN_ID": "abc"}  # fmt: skip


def test_bootstrap_from_torchrun_on_slurm() -> None:
    b = from_environment({**SLURM_AGENT, **TORCHRUN})
    assert (b.source, b.rank, b.world, b.local_rank, b.node, b.restart) == (
        "torchrun-slurm",
        21,
        32,
        5,
        "n3",
        0,
    )
    assert b.launch_id == "slurm-77-1"  # the same for every worker of a launch, restarted or not
    again = from_environment({**SLURM_AGENT, **TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (again.rank, again.restart, again.launch_id) == (21, 2, b.launch_id)
    one = from_environment({**SLURM_AGENT, **TORCHRUN, "SLURM_PROCID": "0", "LOCAL_RANK": "0",
                            "LOCAL_WORLD_SIZE": "1", "SLURM_NTASKS": "4"})  # fmt: skip
    assert (one.rank, one.world, one.local_rank) == (0, 4, 0)  # the local cluster: 1 per node


def test_bootstrap_keeps_every_other_source() -> None:
    slurm = from_environment({**SLURM_AGENT})
    assert (slurm.source, slurm.rank, slurm.world, slurm.restart) == ("slurm", 2, 4, 0)
    spanning = from_environment({**SLURM_AGENT, **TORCHRUN, "GROUP_WORLD_SIZE": "4"})
    assert spanning.source == "slurm"  # a rendezvous across nodes is not the launcher's node-local one
    plain = from_environment({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (plain.source, plain.rank, plain.world, plain.restart) == ("torchrun", 5, 8, 0)
    local = from_environment({"SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2",
                              "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_JOB_ID": "9"})  # fmt: skip
    assert (local.source, local.rank, local.world) == ("submitit-local", 1, 2)
    assert from_environment({}).source == "single"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"LOCAL_RANK": "8"}, "torchrun local rank 8 of 8"),
        ({"SLURM_PROCID": "4"}, "SLURM task 4 of 4"),
        ({"LOCAL_WORLD_SIZE": "eight"}, "LOCAL_WORLD_SIZE: expected an integer"),
        ({"TORCHELASTIC_RESTART_COUNT": "-1"}, "restart count -1"),
    ],
)
def test_bootstrap_refuses_bad_variables(changes: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_environment({**SLURM_AGENT, **TORCHRUN, **changes})


def test_a_torchrun_worker_never_bootstraps_over_mpi(monkeypatch: pytest.MonkeyPatch) -> None:
    import nereus.runtime.bootstrap as boot

    for k, v in {
        **SLURM_AGENT,
        **TORCHRUN,
        "NEREUS_BOOTSTRAP": "mpi",
        "PMI_RANK": "2",
        "PMI_SIZE": "4",
    }.items():
        monkeypatch.setenv(k, v)

    def no_mpi() -> None:
        raise AssertionError("MPI must not be initialised in a torchrun worker")

    monkeypatch.setattr(boot, "mpi_world", no_mpi)
    b, comm = bootstrap()
    assert comm is None and (b.source, b.rank) == ("torchrun-slurm", 21)


# ------------------------------------------------------------------ a restarted worker
@pytest.fixture
def job_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "job"
    folder.mkdir(mode=0o700)
    (folder / "experiment.yaml").write_text(PPO_TINY.read_text())
    (folder / "secret").write_text("ab" * 32)
    return folder


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``scontrol`` stand-in that records its arguments."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def restarted(monkeypatch: pytest.MonkeyPatch, procid: str, **more: str) -> None:
    """The environment of a worker its agent restarted; ``node.main``'s process-wide settings
    (the device and torch's threads, the checkpoint key) are left alone in this test process."""
    from nereus.runtime import node

    monkeypatch.setattr(node, "activate", lambda devices: None)
    monkeypatch.setattr(node.ckpt, "use_key", lambda key: None)
    env = {**SLURM_AGENT, **TORCHRUN, "SLURM_PROCID": procid, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "TORCHELASTIC_RESTART_COUNT": "1", "SLURM_RESTART_COUNT": "0", **more}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_a_restarted_worker_rejoins_and_gives_up_on_a_dead_store(
    job_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nereus.runtime import node
    from nereus.runtime.membership import JoinRefusedError
    from nereus.runtime.rendezvous import Rendezvous

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: the leader is gone
    Rendezvous("127.0.0.1", port, "slurm-77-0").write(job_folder / node.RDZV)
    restarted(monkeypatch, "2")
    joins: list[Any] = []
    monkeypatch.setattr(node, "_join", lambda *args: joins.append(args))
    monkeypatch.setattr(node, "STORE_PROBE_S", 0.3)
    with pytest.raises(
        JoinRefusedError, match=r"GPU 2 cannot rejoin: the job's store at 127\.0\.0\.1:\d+ does not answer"
    ):
        node.main(str(job_folder))
    assert not joins
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen(1)
        port = live.getsockname()[1]
        Rendezvous("127.0.0.1", port, "slurm-77-0").write(job_folder / node.RDZV)
        node.main(str(job_folder))
    ((_, _, _, rdzv, gpu, signals, devices),) = joins
    assert (rdzv.port, gpu, signals) == (port, 2, (signal.SIGUSR2,))  # its own GPU id
    assert devices.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_a_restarted_leader_requeues_the_job_a_bounded_number_of_times(
    job_folder: Path, monkeypatch: pytest.MonkeyPatch, scontrol: Path
) -> None:
    from nereus.control.action import Outcome
    from nereus.errors import NereusError
    from nereus.runtime import node

    restarted(monkeypatch, "0", SLURM_RESTART_COUNT="2")
    assert node.main(str(job_folder)) is Outcome.PREEMPTED
    assert scontrol.read_text() == "requeue 77\n"
    restarted(monkeypatch, "0", SLURM_RESTART_COUNT="3")
    with pytest.raises(NereusError, match=r"requeued 3 time\(s\) already \(--max-restarts 3\): not again"):
        node.main(str(job_folder))
    assert scontrol.read_text() == "requeue 77\n"


def test_a_restart_after_bad_input_stops_at_once_without_a_requeue(
    job_folder: Path, monkeypatch: pytest.MonkeyPatch, scontrol: Path
) -> None:
    """Every worker of a job that met bad input (NaN init weights) exits 2 and its agent restarts
    it: the restart finds the job's line in ``error-<job id>.json`` and stops with it, the leader too,
    instead of requeueing the job as for a crash. An earlier job's line is not this job's."""
    from nereus.control.action import Outcome
    from nereus.errors import ConfigError
    from nereus.runtime import joberror, node

    line = "init.actor: w.safetensors: tensor 'x' holds NaN or Infinity"
    restarted(monkeypatch, "0", SLURM_RESTART_COUNT="2")
    monkeypatch.setenv("SLURM_JOB_ID", "76")
    joberror.record(job_folder, line)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert node.main(str(job_folder)) is Outcome.PREEMPTED  # another job's line: a crash's restart
    assert scontrol.read_text() == "requeue 77\n"
    scontrol.unlink()
    joberror.record(job_folder, line)  # this job's
    for procid in ("0", "2"):
        restarted(monkeypatch, procid)
        with pytest.raises(ConfigError, match=r"^init\.actor: w\.safetensors: tensor 'x' holds NaN"):
            node.main(str(job_folder))
    assert not scontrol.exists()  # never requeued


def test_a_grow_that_starts_after_its_job_ended_leaves_in_one_line(
    job_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SLURM ran the grow late: the job's store is gone. The newcomer waits a bounded time (a
    requeue writes a new rendezvous) and is refused, not left for 30 minutes on its nodes."""
    from nereus.runtime import node
    from nereus.runtime.membership import JoinRefusedError
    from nereus.runtime.rendezvous import Rendezvous

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: the job is over
    Rendezvous("127.0.0.1", port, "slurm-77-0").write(job_folder / node.RDZV)
    monkeypatch.setattr(node, "STORE_PROBE_S", 0.2)
    with pytest.raises(
        JoinRefusedError, match=r"^cannot join: the job's store at 127\.0\.0\.1:\d+ did not answer"
    ):
        node._live_rendezvous(node.JobFolder(job_folder), wait_s=0.5)
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen(1)
        Rendezvous("127.0.0.1", live.getsockname()[1], "slurm-77-1").write(job_folder / node.RDZV)
        assert node._live_rendezvous(node.JobFolder(job_folder), wait_s=0.5).launch_id == "slurm-77-1"


def test_a_worker_left_behind_by_a_recovery_asks_to_rejoin_while_the_job_runs(
    job_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Healthy but late to a recovery (held in a connect to a dead peer): it rejoins as its own
    GPU through the signed join path while the job's store answers, and leaves when it does not
    (the job is over) or when the leader refuses it."""
    from nereus.control.action import Outcome
    from nereus.devices import launched
    from nereus.runtime import node
    from nereus.runtime.membership import JoinRefusedError, Rendezvous

    joins: list[Any] = []
    monkeypatch.setattr(node, "_enter", lambda *args: joins.append(args) or (Outcome.DONE, None))
    monkeypatch.setattr(node, "STORE_PROBE_S", 0.3)
    folder = node.JobFolder(job_folder)
    spec, devices = folder.spec(), launched()

    def rejoin(rdzv: Rendezvous) -> Outcome:
        return node._rejoin_left_behind(folder, spec, b"k", rdzv, 3, (), devices)

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    gone = Rendezvous("127.0.0.1", s.getsockname()[1], "slurm-77-0")
    s.close()  # nothing listens there: the job is over
    assert rejoin(gone) is Outcome.LEFT and not joins
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen(1)
        rdzv = Rendezvous("127.0.0.1", live.getsockname()[1], "slurm-77-0")
        assert rejoin(rdzv) is Outcome.DONE
        ((_, _, _, at, gpu, _, _),) = joins
        assert (at, gpu) == (rdzv, 3)  # its own GPU id

        def refused(*args: Any) -> tuple[Outcome, int | None]:
            raise JoinRefusedError("join refused: the job is ending")

        monkeypatch.setattr(node, "_enter", refused)
        assert rejoin(rdzv) is Outcome.LEFT


def test_a_worker_left_behind_again_asks_again(capsys: pytest.CaptureFixture[str]) -> None:
    """The loop both launchers share (``nereus.runtime.rejoin``): a worker a later recovery leaves
    behind again asks again, until a run ends with it in the job; it leaves once the job's store
    stops answering between two tries."""
    from nereus.control.action import Outcome
    from nereus.runtime.rejoin import rejoin

    runs = iter([(Outcome.DONE, True), (Outcome.DONE, True), (Outcome.PREEMPTED, False)])
    assert rejoin(3, lambda: True, lambda: next(runs)) is Outcome.PREEMPTED
    assert next(runs, None) is None  # all three runs entered
    assert capsys.readouterr().err.count("GPU 3: left behind by a recovery; asking to rejoin the job") == 3
    answers, runs = iter([True, False]), iter([(Outcome.DONE, True)])
    assert rejoin(3, lambda: next(answers), lambda: next(runs)) is Outcome.LEFT
    assert next(answers, None) is None and next(runs, None) is None


def test_a_leader_short_of_gpus_after_a_loss_requeues_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch, scontrol: Path
) -> None:
    """The GPUs a loss left cannot run the job: under SLURM the leader requeues it (it resumes
    from its checkpoint), at most three times; outside SLURM the one-line error stands."""
    from nereus.control.action import Outcome
    from nereus.errors import TooFewGpusError
    from nereus.runtime import node

    short = TooFewGpusError("the 2 GPUs left [0, 2] cannot run the job (stage inf needs ≥ 3 GPUs)")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(TooFewGpusError, match=r"^the 2 GPUs left \[0, 2\] cannot run the job"):
        node._requeue_short_of_gpus(short)
    assert not scontrol.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert node._requeue_short_of_gpus(short) is Outcome.PREEMPTED
    assert scontrol.read_text() == "requeue 77\n"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    with pytest.raises(TooFewGpusError, match=r"requeued 3 time\(s\) already: not again"):
        node._requeue_short_of_gpus(short)
    assert scontrol.read_text() == "requeue 77\n"


def test_only_sigusr2_stops_a_torchrun_worker_at_a_boundary() -> None:
    from nereus.runtime import node

    assert node.stop_signals("torchrun-slurm") == (signal.SIGUSR2,)
    assert node.stop_signals("slurm") == (signal.SIGUSR2, signal.SIGTERM)


def test_the_job_folder_stays_private(tmp_path: Path, capsys: Any, factory: Any) -> None:
    root = tmp_path / "jobs"
    code, _, err = launch(
        ["submit", str(PPO_TINY), "--launcher", "torchrun", "--jobs-root", str(root)], capsys, factory=factory
    )
    assert code == 0, err
    (folder,) = root.iterdir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "secret").stat().st_mode) == 0o600
