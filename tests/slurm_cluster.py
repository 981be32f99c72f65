"""The local SLURM test cluster as a pytest fixture (``slurm_cluster``) for the ``slurm`` layer.

``slurm/local/start.sh`` starts slurmctld and four slurmd (n1..n4) on this host; see that script and
docs/architecture.md §4/§6. The fixture is session-scoped: it reuses a cluster that is already up in
``$NEREUS_SLURM_DIR`` (default /tmp/nereus-slurm) and leaves it running; one it started itself it
stops after the session. It skips (never fails) when the cluster cannot be installed or started,
and always when ``NEREUS_SLURM=skip``. ``NEREUS_SLURM_ACCOUNTING=1`` starts it with slurmdbd.

Registered as a plugin by tests/conftest.py (``pytest_plugins``); the marker is in setup.cfg.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "slurm" / "local"
NODES = ("n1", "n2", "n3", "n4")
START_TIMEOUT_S = 240
# Node states (sinfo %t) in which a node takes jobs; with a flag such as "*" (not responding) it does not.
UP_STATES = frozenset({"idle", "mix", "alloc"})
# Job states after which a job never runs again (scontrol's JobState).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


def slurm_dir() -> Path:
    return Path(os.environ.get("NEREUS_SLURM_DIR", "/tmp/nereus-slurm"))


def cluster_env(conf: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for SLURM commands and the jobs they start (sbatch/srun export it by default).

    SLURM_CONF points at the cluster; PATH starts with this interpreter's bin directory (the venv: its
    python, and mpich's binaries) so that jobs run the same Python; PYTHONPATH has the repository so
    jobs can unpickle functions defined in the tests. SLURM_* variables of an enclosing allocation (a
    pytest run inside a SLURM job) would steer sbatch/srun into that job, so they are dropped.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    # dirname of sys.executable, not its resolved path: the venv's bin, not the base interpreter's.
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(
        [bindir, *(p for p in env.get("PATH", "").split(os.pathsep) if p != bindir)]
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _pid_alive(pidfile: Path) -> bool:
    """The daemon the pid file is named after (slurmd.n1.pid: slurmd) runs with that pid."""
    try:
        comm = Path(f"/proc/{int(pidfile.read_text().strip())}/comm").read_text().strip()
    except (OSError, ValueError):
        return False
    return comm.startswith(pidfile.name.split(".")[0])


def daemons_alive(directory: Path) -> bool:
    """Every daemon of the cluster in ``directory`` (munged, slurmctld, four slurmd) is running."""
    files = ["munged.pid", "slurmctld.pid", *(f"slurmd.{n}.pid" for n in NODES)]
    return (directory / "slurm.conf").exists() and all(_pid_alive(directory / f) for f in files)


@dataclass
class SlurmCluster:
    """A running local cluster: its config, the environment to reach it, and test helpers."""

    dir: Path
    conf: Path
    env: dict[str, str]
    nodes: list[str] = field(default_factory=lambda: list(NODES))
    accounting: bool = False
    started_here: bool = False

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60, cwd: str | Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with the cluster's environment; text output captured."""
        proc = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def sbatch(self, *args: str, cwd: str | Path | None = None) -> str:
        """Submit with sbatch (``--parsable`` added); returns the job id."""
        out = self.run("sbatch", "--parsable", *args, cwd=cwd).stdout.strip()
        return out.split(";")[0]

    def job(self, jobid: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, Restarts, Reason, ...); {} once purged.

        Works without slurmdbd: finished jobs stay visible for MinJobAge (300 s).
        """
        proc = self.run("scontrol", "-o", "show", "job", jobid, check=False)
        if proc.returncode != 0:
            return {}
        return dict(re.findall(r"(\S+?)=(\S*)", proc.stdout))

    def state(self, jobid: str) -> str:
        return self.job(jobid).get("JobState", "UNKNOWN")

    def wait_state(self, jobid: str, states: str | Iterable[str], timeout: float = 30) -> str:
        """Wait until the job is in one of ``states`` (e.g. "RUNNING" or {"COMPLETED"}); returns it.

        Fails early once the job has sat for 3 s in a final state that was not asked for (a job being
        requeued can pass through NODE_FAIL/CANCELLED-like states for a moment).
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        state, final_since = "", None
        while time.monotonic() < deadline:
            state = self.state(jobid)
            if state in wanted:
                return state
            if state not in FINAL_STATES:
                final_since = None
            elif final_since is None:
                final_since = time.monotonic()
            elif time.monotonic() - final_since > 3:
                raise AssertionError(
                    f"job {jobid} ended {state}, waited for {sorted(wanted)}: {self.job(jobid)}"
                )
            time.sleep(0.2)
        raise AssertionError(f"job {jobid} still {state} after {timeout}s, waited for {sorted(wanted)}")

    def diagnose(self, jobid: str) -> str:
        """What the cluster knows of a job, for a failure message: its scontrol record, the nodes'
        states, and the controller's log lines that name it."""
        log = self.dir / "log" / "slurmctld.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        named = [line for line in lines if re.search(rf"\bJobId={jobid}\b|\bjob {jobid}\b", line)]
        nodes = self.run("sinfo", "-h", "-N", "-o", "%N %t %E", check=False).stdout.strip()
        return f"job {jobid}: {self.job(jobid)}\nnodes: {nodes!r}\nslurmctld.log:\n" + "\n".join(named[-20:])

    def wait_submitit(self, job: Any, timeout: float) -> Any:
        """``job.result()`` of a submitit job, bounded and explained.

        Without slurmdbd submitit cannot read a job's state (sacct fails), so its own wait never ends
        for a job that ended without a result. This one reads the state from scontrol: a job that sat
        3 s in a final state with no result, or one still not done after ``timeout``, fails the test
        with :meth:`diagnose`'s account and the job's stderr.
        """
        deadline = time.monotonic() + timeout
        final_since = None
        while not job.done():
            state = self.state(job.job_id)
            if state not in FINAL_STATES or state == "COMPLETED":  # a requeue passes through NODE_FAIL
                final_since = None
            elif final_since is None:
                final_since = time.monotonic()
            ended = final_since is not None and time.monotonic() - final_since > 3
            if ended or time.monotonic() > deadline:
                what = f"ended {state}" if ended else f"still {state} after {timeout}s"
                raise AssertionError(
                    f"submitit job {what}, with no result\n"
                    f"{self.diagnose(job.job_id)}\nstderr: {job.stderr()}"
                )
            time.sleep(0.5)
        return job.result()

    def node_state(self, name: str) -> str:
        """sinfo's short state of a node (idle, mix, alloc, down, drain, ...) with its flags: a trailing
        ``*`` means not responding (e.g. just resumed, before the next ping)."""
        out = self.run("sinfo", "-h", "-N", "-n", name, "-o", "%t").stdout.split()
        return out[0] if out else ""

    def wait_node(self, name: str, states: Iterable[str], timeout: float = 20) -> str:
        """Wait until the node is in one of ``states`` and responding; returns the state."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.node_state(name)
            if state in wanted:
                return state
            time.sleep(0.2)
        raise AssertionError(f"node {name} is {state!r} after {timeout}s, waited for {sorted(wanted)}")

    def node_down(self, name: str, reason: str = "test") -> None:
        """Mark a node DOWN: its jobs end NODE_FAIL, or are requeued (JobRequeue=1, --requeue)."""
        self.run("scontrol", "update", f"nodename={name}", "state=down", f"reason={reason}")
        self.wait_node(name, {"down"}, timeout=10)

    def node_resume(self, name: str, timeout: float = 20) -> None:
        """Bring a DOWN (or drained) node back and wait until it takes jobs again."""
        if self.node_state(name).rstrip("*~#!%$@^-") in {"down", "drain", "drng", "fail", "failg"}:
            self.run("scontrol", "update", f"nodename={name}", "state=resume")
        self.wait_node(name, UP_STATES, timeout=timeout)

    def wait_idle(self, timeout: float = 30) -> None:
        """Every node up, no job running or pending (e.g. between tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
            states = self.run("sinfo", "-h", "-N", "-o", "%t").stdout.split()
            if not jobs and len(states) == len(self.nodes) and all(s == "idle" for s in states):
                return
            time.sleep(0.2)
        raise AssertionError("the cluster did not become idle")

    def patch_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process at the cluster (for in-process submitters such as submitit)."""
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            monkeypatch.delenv(key)
        for key in ("SLURM_CONF", "PATH", "PYTHONPATH"):
            monkeypatch.setenv(key, self.env[key])


def _reason(stderr: str) -> str:
    """One line for a skip: start.sh's ERROR line (it names the failing part), else the stderr tail."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line]
    return errors[-1] if errors else " | ".join(lines[-3:])


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """The local 4-node SLURM cluster: reused if up, else started (and then stopped at the end)."""
    if os.environ.get("NEREUS_SLURM", "").lower() == "skip":
        pytest.skip("NEREUS_SLURM=skip")
    directory = slurm_dir()
    conf = directory / "slurm.conf"
    started = False
    if not daemons_alive(directory):
        args = [str(SCRIPTS / "start.sh")]
        if os.environ.get("NEREUS_SLURM_ACCOUNTING", "") not in ("", "0"):
            args.append("--accounting")
        try:
            proc = subprocess.run(
                args,
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT_S,
                env=cluster_env(conf),
                check=False,
            )
        except subprocess.TimeoutExpired:
            subprocess.run([str(SCRIPTS / "stop.sh")], capture_output=True, timeout=60, check=False)
            pytest.skip(f"local SLURM cluster: start.sh took over {START_TIMEOUT_S}s")
        if proc.returncode != 0:
            pytest.skip(f"local SLURM cluster unavailable: {_reason(proc.stderr) or proc.returncode}")
        started = True
    cluster = SlurmCluster(
        dir=directory,
        conf=conf,
        env=cluster_env(conf),
        accounting=(directory / "accounting").exists(),
        started_here=started,
    )
    try:
        yield cluster
    finally:
        if started:
            subprocess.run([str(SCRIPTS / "stop.sh")], capture_output=True, timeout=120, check=False)
