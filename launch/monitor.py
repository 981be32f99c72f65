"""Following a job: its scheduler state, its progress, its logs, and cancelling it.

SLURM states come from ``sacct`` (parsed by submitit's own ``SlurmInfoWatcher``), then ``squeue``
for jobs that ``sacct`` does not know (a cluster without accounting), then ``scontrol show job``
(an ended job, for the controller's MinJobAge); a job none knows is ``UNKNOWN``, never an error.
``--local`` jobs are submitit's local controller processes: running while that process lives,
``FINISHED`` once submitit has written the result. Commands run through a ``Runner`` so tests
need no SLURM. submitit writes one ``<job id>_<task>_log.out`` and ``.err`` per task in
``JOB/logs`` (array tasks: ``<array id>_<index>_<task>_log.*``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from submitit.slurm.slurm import SlurmInfoWatcher, read_job_id

from launch.jobdir import STATES_DONE, JobRecord, check_owner, read_record, settled, update_record
from nereus.errors import ConfigError
from nereus.runtime import joberror
from nereus.runtime.pool import refused_shrinks

Runner = Callable[[Sequence[str]], tuple[int, str, str]]  # argv -> (exit code, stdout, stderr)
ACTIVE = ("RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "CONFIGURING", "PENDING")
LOCAL_CONTROLLER = b"submitit.local._local"
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})  # what submitit may start the controller under


def run_command(argv: Sequence[str]) -> tuple[int, str, str]:
    """Run a SLURM client command; 127 when it is not installed."""
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]}: timed out"
    return p.returncode, p.stdout, p.stderr


def slurm_states(ids: Sequence[str], run: Runner = run_command) -> dict[str, str]:
    """The state of each job id (``A`` or array task ``A_i``), ``UNKNOWN`` where nobody knows."""
    mains = sorted({i.split("_", maxsplit=1)[0] for i in ids})
    known: dict[str, str] = {}
    if mains:
        code, out, _ = run(["sacct", "-X", "--parsable2", "-o", "JobID,State", "-j", ",".join(mains)])
        if code == 0:
            for job_id, stats in SlurmInfoWatcher().read_info(out).items():
                known[job_id] = (stats.get("State") or "UNKNOWN").split()[0]  # "CANCELLED by 0"
    for main in mains:
        if any(i.split("_", maxsplit=1)[0] == main and i in known for i in ids):
            continue
        code, out, _ = run(["squeue", "-h", "-o", "%i|%T", "-j", main])
        if code != 0:
            continue  # finished and no accounting: squeue says "Invalid job id"
        for line in out.splitlines():
            job, _, state = line.strip().partition("|")
            for parts in read_job_id(job):
                first, *rest = parts
                if len(rest) == 2:
                    for k in range(int(rest[0]), int(rest[1]) + 1):
                        known[f"{first}_{k}"] = state
                known["_".join(parts[:2])] = state
    for i in ids:  # ended, and no accounting: the controller still knows it for MinJobAge (300 s)
        if i not in known:
            code, out, _ = run(["scontrol", "-o", "show", "job", i])
            found = re.findall(r"(?:^|\s)JobState=(\S+)", out) if code == 0 else []
            if found:  # an array id: a line per task, one state for them all
                known[i] = aggregate(found)
    return {i: known.get(i, "UNKNOWN") for i in ids}


def forgotten(ids: Sequence[str], run: Runner = run_command) -> bool:
    """Whether SLURM no longer knows any of the jobs ``ids`` (``squeue`` answers "Invalid job id"
    for each): they ended before the controller's ``MinJobAge``, without accounting to say how.
    False when SLURM cannot be asked."""
    for job_id in ids:
        code, _, err = run(["squeue", "-h", "-j", job_id.split("_", maxsplit=1)[0]])
        if code == 0 or "invalid job id" not in err.lower():
            return False
    return bool(ids)


def shown_state(record: JobRecord, states: dict[str, str]) -> str:
    """The job's state from its jobs' ``states``: SLURM's (``aggregate``; once none is active, an
    experiment's is its own job's, which its grow jobs end with), else the state its record
    learned when it ended (SLURM forgets ended jobs), else ``UNKNOWN``."""
    own = [states[i] for i in record.job_ids if i in states] if record.kind == "experiment" else []
    ended = not any(s in ACTIVE for s in states.values())
    main = aggregate(own if own and ended else list(states.values())) if states else record.state
    return record.state if main == "UNKNOWN" and record.state in STATES_DONE else main


def ended_state(folder: Path, record: JobRecord, run: Runner = run_command) -> str:
    """``shown_state`` of the job as SLURM (or, ``--local``, this machine) sees it now."""
    return shown_state(record, job_states(folder, record, run))


def _proc_cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def local_states(ids: Sequence[str], logs: Path) -> dict[str, str]:
    """``--local`` jobs: RUNNING while submitit's controller lives, FINISHED once it wrote a result."""
    states = {}
    for pid in ids:
        if LOCAL_CONTROLLER in _proc_cmdline(pid):
            states[pid] = "RUNNING"
        elif any(logs.glob(f"{pid}_*_result.pkl")):  # exists() only: no pickle is read
            states[pid] = "FINISHED"
        else:
            states[pid] = "UNKNOWN"
    return states


def aggregate(states: Sequence[str]) -> str:
    """One state for several (an array's tasks): the most active one, else the common one."""
    for state in ACTIVE:
        if state in states:
            return state
    distinct = set(states)
    if len(distinct) == 1:
        return states[0]
    return "FAILED" if distinct & {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"} else "MIXED"


def job_states(folder: Path, record: JobRecord, run: Runner = run_command) -> dict[str, str]:
    ids = [t.job_id for t in record.tasks if t.job_id] if record.kind == "array" else record.all_job_ids
    if record.executor == "local":
        return local_states(ids, folder / "logs")
    return slurm_states(ids, run)


def progress(folder: Path) -> dict[str, Any] | None:
    """The runtime's last complete step record (``run/metrics.jsonl``), or None."""
    path = folder / "run" / "metrics.jsonl"
    try:
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            doc = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(doc, dict):
            return doc
    return None


def _owned(folder: Path) -> bool:
    """Whether this user owns ``folder`` (a record written there stays readable by its owner)."""
    try:
        return folder.stat().st_uid == os.getuid()
    except OSError:
        return False


def status(folder: Path, run: Runner = run_command) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able mapping; the record's state is refreshed."""
    read = read_record(folder)
    record = settled(folder, read)  # a shrink the job refused: its nodes are still the job's
    states = job_states(folder, record, run)
    main = shown_state(record, states)
    failed, error = joberror.read(folder, record.all_job_ids)
    if states.get(failed) in ACTIVE:  # a rank's exit 2 while its job's other tasks still end
        error = ""
    if error and failed in record.job_ids and main in ("UNKNOWN", "FINISHED", "COMPLETED"):
        main = "FAILED"  # --local: no result pickle (a grow's error leaves the job's state alone)
    learned = main not in ("UNKNOWN", record.state)
    if learned:
        record = replace(record, state=main)
    if (learned or record.shrinks != read.shrinks) and _owned(folder):  # never someone else's folder
        with contextlib.suppress(OSError):  # the record as it is now (a grow meanwhile kept)
            update_record(
                folder, lambda now: settled(folder, _learned(now, record, main) if learned else now)
            )
    doc: dict[str, Any] = {
        "folder": str(folder), "name": record.name, "kind": record.kind, "site": record.site,
        "executor": record.executor, "launcher": record.launcher, "state": main,
        "nodes": record.current_nodes, "tasks_per_node": record.tasks_per_node, "jobs": states,
        "created": record.created,
        "grows": [{"job_id": g.job_id, "nodes": g.nodes} for g in record.grows],
        "shrinks": [{"nodes": s.nodes, "file": s.file} for s in record.shrinks],
        "refused_shrinks": [{"file": f, "reason": r} for f, r in refused_shrinks(folder / "control").items()],
    }  # fmt: skip
    if record.kind == "array":
        doc["tasks"] = [_task_status(folder, t.index, t.args, t.output, states.get(t.job_id, "UNKNOWN"))
                        for t in record.tasks]  # fmt: skip
    else:
        doc["progress"] = progress(folder)
        if error:
            doc["error"], doc["error_job"] = error, failed
    return doc


def _task_status(folder: Path, index: int, args: dict[str, Any], output: str, state: str) -> dict[str, Any]:
    task: dict[str, Any] = {"index": index, "args": args, "state": state, "output": output, "exit_code": None}
    with contextlib.suppress(OSError, ValueError):
        result = json.loads((folder / output).read_text(encoding="utf-8"))
        if not isinstance(result, dict):
            return task
        task["exit_code"] = result.get("exit_code")
        task["error"] = result.get("error", "")
        if isinstance(result.get("result"), dict) and "step_latency_s" in result["result"]:
            task["step_latency_s"] = result["result"]["step_latency_s"]
    return task


def _descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (Linux ``/proc``): submitit's controller and its tasks."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _controllers(pid: int) -> list[int]:
    """submitit's controller process: ``pid`` itself, or the Python process under the shell
    submitit started as ``pid`` (a job with setup lines); the shell would die of SIGTERM and
    leave the controller running."""
    found = []
    for p in (pid, *_descendants(pid)):
        argv = _proc_cmdline(str(p)).split(b"\0")
        shell = Path(argv[0].decode(errors="replace")).name in SHELLS
        if LOCAL_CONTROLLER in b" ".join(argv) and not shell:
            found.append(p)
    return found


def _learned(now: JobRecord, read: JobRecord, state: str) -> JobRecord:
    """``now`` (the record under the lock) with ``state``, learned of the jobs of ``read``: kept
    as it is when a ``resume`` has since put another job in it."""
    return replace(now, state=state) if now.job_ids == read.job_ids else now


def cancel(folder: Path, run: Runner = run_command) -> list[str]:
    """Cancel the job and its grow jobs (SLURM: ``scancel``, whose SIGTERM makes the job
    checkpoint and end without a requeue; local: SIGTERM to submitit's controller, which passes
    it on to its tasks: they checkpoint likewise). Returns the ids cancelled; none for a job that
    had already ended, whose record then keeps (or learns) how it ended."""
    check_owner(folder)
    record = read_record(folder)
    ids = list(record.all_job_ids)
    if not ids:
        raise ConfigError(f"JOB: {record.name} has no job id (never submitted)")
    if record.executor != "local" and record.kind != "array":  # an array: scancel, whatever its tasks
        states = slurm_states(ids, run)
        ended = [s for s in states.values() if s in STATES_DONE]
        if len(ended) == len(ids):  # every one of them ended: nothing to cancel, the record learns it
            if record.state != (main := aggregate(ended)):
                update_record(folder, lambda now: _learned(now, record, main))
            return []
        ids = [i for i in ids if states[i] not in STATES_DONE]
        if all(states[i] == "UNKNOWN" for i in ids) and forgotten(ids, run):  # ended long ago
            return []
    if record.executor == "local":
        ids = [pid for pid in ids if LOCAL_CONTROLLER in _proc_cmdline(pid)]
        if not ids:  # every controller is gone: it ended, how is not known here
            return []
        for pid in ids:  # the controller passes SIGTERM on to its tasks, which checkpoint at their
            for target in _controllers(int(pid)):  # next boundary and end, as under scancel
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(target, signal.SIGTERM)
    else:
        code, _, err = run(["scancel", *ids])
        if code == 127:
            raise ConfigError("scancel not found (not a SLURM login node?)")
        if code != 0:
            lines = err.strip().splitlines()
            raise ConfigError(f"scancel failed: {lines[-1] if lines else f'exit {code}'}")
    if record.state not in STATES_DONE:
        update_record(folder, lambda now: _learned(now, record, "CANCELLED"))
    return ids


# ------------------------------------------------------------------ logs
def log_files(folder: Path, record: JobRecord) -> list[Path]:
    """The job's (and its grow jobs') log files, in job, task, out-before-err order."""
    ids = (*record.earlier, *record.all_job_ids)
    logs = folder / "logs"
    found = {p for job_id in ids for p in logs.glob(f"{job_id}_*_log.*")}
    return sorted(found, key=lambda p: (p.name.split("_")[:-1], p.suffix != ".out"))


class Follower:
    """Prints what each file gained since the last poll, with a ``==> name <==`` header whenever
    the file being printed changes (as ``tail -f`` does)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.last: Path | None = None

    def poll(self, files: list[Path]) -> bool:
        """Print new text; True if there was any."""
        printed = False
        for path in files:
            try:
                with path.open("rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            if path != self.last:
                self.out.write(f"{'' if self.last is None else chr(10)}==> {path.name} <==\n")
                self.last = path
            self.out.write(data.decode("utf-8", errors="replace"))
            self.out.flush()
            printed = True
        return printed


UNKNOWN_CHECKS = 12  # state checks that read UNKNOWN in a row before a follow ends (~1 minute)


def follow(
    files: Callable[[], list[Path]],
    state: Callable[[], str],
    out: TextIO,
    interval_s: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Print the logs as they grow until the job is no longer active; returns its last state.
    The state is asked every few polls (sacct is not free). Without accounting a finished job
    reads UNKNOWN: after an active state, that counts as the end too, and so do
    ``UNKNOWN_CHECKS`` UNKNOWN answers in a row (a job that ended before the follow began, or
    squeue and sacct that cannot answer), which would otherwise be followed forever."""
    follower = Follower(out)
    polls = unknown = 0
    seen_active = False
    while True:
        follower.poll(files())
        if polls % 5 == 0:
            current = state()
            unknown = unknown + 1 if current == "UNKNOWN" else 0
            if current in ACTIVE:
                seen_active = True
            elif current != "UNKNOWN" or seen_active or unknown >= UNKNOWN_CHECKS:
                follower.poll(files())
                return current
        polls += 1
        sleep(interval_s)
