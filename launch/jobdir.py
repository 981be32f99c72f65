"""The job folder: what ``nereus-launch`` writes for a job, and ``job.json``, its record.

```
JOB/                      mode 0700
  experiment.yaml         the resolved config (array jobs: sweep.yaml)
  job.sbatch              the sbatch script as submitted (not for --local)
  job.json                JobRecord
  secret                  mode 0600, secrets.token_hex(32): the job's rendezvous secret
  logs/                   submitit's folder: pickles, submission scripts, per-task logs
  control/                requests to the running job (shrink-<unix_ms>.json)
  run/                    the runtime's output (metrics.jsonl, checkpoints, report)
  results/                array jobs: one task-<index>.json per task
  grow-<n>.sbatch         the script of each grow job
  error-<job id>.json     bad input only the compute nodes could find (nereus.runtime.joberror)
```
Every file is written whole (temporary file + rename), so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from launch.inputs import check_text, control_error, has_control, shown
from launch.render import DEFAULT_RESTARTS, LAUNCHERS, MAX_RESTARTS, job_name_error
from nereus.errors import ConfigError
from nereus.runtime.pool import ShrinkRequest, refused_shrinks
from nereus.spec.files import parse_json
from nereus.spec.schema import build

RECORD = "job.json"
LOCK = ".job.lock"  # held while a command reads, changes and writes job.json (record_lock)
LOCK_WAIT_S = 120.0  # how long a command waits for another's lock
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")  # a SLURM job id or an array task's (A_i)
STATES_DONE = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "FINISHED",
                         "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"})  # fmt: skip


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class Grow:
    """Nodes added to a running job by ``nereus-launch grow``: one more SLURM job."""

    job_id: str
    nodes: int
    created: str
    sbatch: str = ""  # the script's file name in the job folder ("" for --local)

    def __post_init__(self) -> None:
        if self.nodes <= 0:
            raise ValueError(f"nodes must be positive, got {self.nodes}")


@dataclass(frozen=True, slots=True)
class Shrink:
    """A request to drain ``nodes`` nodes, written to ``control/<file>``."""

    nodes: int
    created: str
    file: str

    def __post_init__(self) -> None:
        if self.nodes <= 0:
            raise ValueError(f"nodes must be positive, got {self.nodes}")


@dataclass(frozen=True, slots=True)
class ArrayTask:
    """One task of an array job: its grid point and where its JSON lands (``results/...``)."""

    index: int
    args: dict[str, str | int | float | bool]
    argv: tuple[str, ...]
    output: str
    job_id: str = ""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be non-negative, got {self.index}")
        if self.job_id and not (self.job_id.isascii() and _JOB_ID.fullmatch(self.job_id)):
            raise ValueError(f"job_id: {self.job_id!r} is not a job id (digits, or A_i of an array)")
        expected = f"results/task-{self.index:04d}.json"  # what status reads: inside the job folder
        if self.output != expected:
            raise ValueError(f"output: expected {expected!r} for task {self.index}, got {self.output!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRecord:
    """``job.json``: what was submitted and how to find it again."""

    version: int = 1
    kind: str = "experiment"  # or "array"
    name: str
    site: str
    executor: str  # "slurm" or "local" (then job ids are process ids of submitit's controller)
    job_ids: tuple[str, ...] = ()
    nodes: int
    tasks_per_node: int
    state: str = "SUBMITTING"
    created: str
    partition: str = ""
    account: str = ""
    time_min: int
    python: str
    grows: tuple[Grow, ...] = ()
    shrinks: tuple[Shrink, ...] = ()
    tasks: tuple[ArrayTask, ...] = ()
    launcher: str = "srun"  # srun: one task per worker; torchrun: one torchrun agent per node
    max_restarts: int = DEFAULT_RESTARTS  # torchrun: how often an agent restarts its node's workers
    earlier: tuple[str, ...] = ()  # the ids of the jobs ``resume`` followed (their logs stay listed)

    def __post_init__(self) -> None:
        if self.kind not in ("experiment", "array"):
            raise ValueError(f"kind must be experiment or array, got {self.kind!r}")
        if self.executor not in ("slurm", "local"):
            raise ValueError(f"executor must be slurm or local, got {self.executor!r}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.launcher == "torchrun" and (self.kind, self.executor) != ("experiment", "slurm"):
            raise ValueError("launcher torchrun: only an experiment on SLURM runs under torchrun")
        if not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ValueError(f"max_restarts must be 0 to {MAX_RESTARTS}, got {self.max_restarts}")
        if self.nodes <= 0 or self.tasks_per_node <= 0 or self.time_min <= 0:
            raise ValueError("nodes, tasks_per_node and time_min must be positive")
        # What a grow job renders into its sbatch script comes from here: checked like the flags.
        if why := job_name_error(self.name):
            raise ValueError(f"name: {why}")
        for name in ("site", "partition", "account", "python"):
            if has_control(getattr(self, name)):
                raise ValueError(control_error(name, getattr(self, name)))
        if self.version != 1:
            raise ValueError(f"version must be 1 (what this nereus-launch writes), got {self.version!r}")
        if self.current_nodes <= 0:  # shrinks never take a job's last node
            raise ValueError(
                f"shrinks: {sum(s.nodes for s in self.shrinks)} node(s) drained of the "
                f"{self.current_nodes + sum(s.nodes for s in self.shrinks)} the job had (at most one fewer)"
            )
        if self.executor == "local":  # process ids: cancel signals them
            bad = [i for i in (*self.all_job_ids, *self.earlier) if not i.isascii() or not i.isdigit()]
            if bad:
                raise ValueError(f"job_ids: a local job's ids are process ids, got {bad[0]!r}")
        else:  # handed to scancel, sacct and squeue: an id, never an option ("--me" cancels all)
            bad = [
                i for i in (*self.all_job_ids, *self.earlier) if not (i.isascii() and _JOB_ID.fullmatch(i))
            ]
            if bad:
                raise ValueError(f"job_ids: {bad[0]!r} is not a SLURM job id (digits, or A_i of an array)")

    @property
    def current_nodes(self) -> int:
        """Nodes the job should hold now: submitted + grown − shrunk."""
        return self.nodes + sum(g.nodes for g in self.grows) - sum(s.nodes for s in self.shrinks)

    @property
    def all_job_ids(self) -> tuple[str, ...]:
        return (*self.job_ids, *(g.job_id for g in self.grows if g.job_id))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` whole: a temporary file in the same folder, then a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def settled(folder: Path, record: JobRecord) -> JobRecord:
    """``record`` without the shrink requests the job refused (``control/.refused-…``,
    ``nereus.runtime.pool.refuse_shrinks``): their nodes are still the job's."""
    refused = refused_shrinks(folder / "control")
    kept = tuple(s for s in record.shrinks if s.file not in refused)
    return record if len(kept) == len(record.shrinks) else replace(record, shrinks=kept)


def write_record(folder: Path, record: JobRecord) -> None:
    atomic_write(folder / RECORD, record.to_json())


def next_script(folder: Path, kind: str) -> str:
    """The next free ``<kind>-<n>.sbatch`` name in the job folder (numbered from the files there,
    so a ``grow`` after a ``resume`` never overwrites an earlier allocation's script)."""
    taken = [
        int(m.group(1))
        for p in folder.glob(f"{kind}-*.sbatch")
        if (m := re.fullmatch(rf"{kind}-(\d+)\.sbatch", p.name))
    ]
    return f"{kind}-{max(taken, default=0) + 1}.sbatch"


@contextlib.contextmanager
def record_lock(folder: Path) -> Iterator[None]:
    """Hold the job folder's lock (``.job.lock``, an advisory ``flock``) while a command reads,
    changes and writes ``job.json``: a ``status`` that refreshes the state while a ``grow`` adds
    its job must not write back the record it read before the grow."""
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"JOB: {folder / LOCK} is held by another nereus-launch command (a grow or resume "
                        f"waiting on SLURM) for over {LOCK_WAIT_S:.0f} s; try again"
                    ) from None
                time.sleep(0.2)
            except OSError as exc:
                if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                    raise
                break  # a file system without flock (Lustre mounted noflock): unlocked, as before
        yield
    finally:
        os.close(fd)  # releases the lock


def update_record(folder: Path, change: Callable[[JobRecord], JobRecord]) -> JobRecord:
    """``change`` applied to the record as it is now (read under the lock), written back."""
    with record_lock(folder):
        record = change(read_record(folder))
        write_record(folder, record)
    return record


def check_owner(folder: Path) -> None:
    """Only the user who owns a job folder changes its job (grow, shrink, cancel): what they write
    there (``job.json``, shrink requests) must stay theirs to read, root included."""
    try:
        owner = folder.stat().st_uid
    except OSError as exc:
        raise ConfigError(f"JOB: cannot read {folder} ({exc.strerror})") from None
    if owner != os.getuid():
        raise ConfigError(f"JOB: {folder} belongs to uid {owner}, not this user (uid {os.getuid()})")


def read_record(folder: Path) -> JobRecord:
    path = folder / RECORD
    if not path.is_file():
        raise ConfigError(f"JOB: {folder} has no {RECORD} (not a nereus-launch job folder)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"JOB: cannot read {path} ({exc})") from None
    data = parse_json(text, f"JOB: {path}")
    if not isinstance(data, dict):
        raise ConfigError(f"JOB: {path} is not a JSON object")
    return build(JobRecord, data, str(path))


def create_folder(root: Path, name: str, stamp: datetime | None = None) -> Path:
    """A new job folder ``root/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3`` … if taken), mode 0700."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--jobs-root: cannot create {root} ({exc.strerror})") from None
    base = f"{name}-{(stamp or datetime.now()).strftime('%Y%m%d-%H%M%S')}"
    for n in range(1, 1000):
        folder = root / (base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ConfigError(f"--jobs-root: cannot create {folder} ({exc.strerror})") from None
        os.chmod(folder, 0o700)
        return folder
    raise ConfigError(f"--jobs-root: too many jobs named {base} under {root}")


def write_secret(folder: Path) -> None:
    """``secret``: 32 random bytes as hex, readable by the owner only."""
    fd = os.open(folder / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(folder / "secret", 0o600)


def find_job(ref: str, root: Path) -> Path:
    """A job folder from a path, or from a SLURM job id (or a grow job's) found under ``root``."""
    check_text("JOB", ref)
    if not ref.strip():
        raise ConfigError("JOB: expected a job folder or a SLURM job id, got an empty value")
    path = Path(ref)
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # a name too long
        raise ConfigError(f"JOB: cannot look at {shown(ref)} ({exc.strerror})") from None
    if is_dir:
        read_record(path)  # a clear error if it is not a job folder
        return path
    if _JOB_ID.fullmatch(ref):
        wanted = ref.split("_", maxsplit=1)[0]
        found = []
        for record_path in sorted(root.glob(f"*/{RECORD}")):
            try:
                record = read_record(record_path.parent)
            except ConfigError:
                continue
            if wanted in (*record.all_job_ids, *record.earlier) or ref in {t.job_id for t in record.tasks}:
                found.append(record_path.parent)
        if len(found) > 1:  # ids repeat across clusters and controller restarts: never guess
            names = ", ".join(str(f) for f in found[:3])
            raise ConfigError(
                f"JOB: job id {ref} is in {len(found)} job folders under {root} ({names}); name the folder"
            )
        if found:
            return found[0]
        raise ConfigError(f"JOB: no job folder at {ref!r} and no job with id {ref} under {root}")
    with contextlib.suppress(OSError):
        if path.exists():
            raise ConfigError(f"JOB: {ref} is a file, not a job folder")
    raise ConfigError(f"JOB: no such job folder: {ref}")


def write_shrink(folder: Path, request: ShrinkRequest) -> Path:
    """Write ``request`` into the job's control folder, where its leader reads it at the next
    step boundary (``nereus.runtime.pool``: the format both sides share)."""
    control = folder / "control"
    control.mkdir(mode=0o700, exist_ok=True)
    path = control / request.file
    atomic_write(path, request.body())
    return path
