"""``nereus run``'s output folder: written only when it is new, empty, or this run's own (torch-free).

A run writes into a folder that does not exist yet (it is created 0700), that is empty (a
``control/`` folder of shrink requests may wait there), or — with ``--resume`` — that holds the
checkpoint it continues. The folder then carries a marker (``.nereus-output``, holding ``run``).
Any other folder, a previous run's included, needs ``--force``; then a previous run's files
(``RUN_FILES``, in a folder with the marker) are replaced, and nothing else in the folder is
touched. Replaced safely: ``prepare`` moves them aside into ``.nereus-replaced`` (renames, no
copy); they are removed once the new run has written its first checkpoint (``drop_replaced``) or
a metrics row, and a new run that ends before that (bad input a worker found, a crash, a stop)
gets them back (``settle``; also at the next ``prepare`` when ``nereus run`` was killed). In a
folder without the marker ``--force`` removes nothing: a name a run would write that is already
there (a user's own ``checkpoints/``) is refused. ``check`` writes nothing;
``prepare`` writes only after every check passed.

One run at a time: ``nereus.runtime.outlock``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

from nereus.errors import ConfigError
from nereus.runtime.outlock import LOCKS, WORKERS, probe, release, take, workers_alive
from nereus.runtime.signing import KEY_FILE, checkpoints, create_key, read_key

MARKER = ".nereus-output"
MARK = "run"
REPLACED = ".nereus-replaced"  # a previous run's files, while the run that replaces them starts
INPUTS = frozenset({"control"})  # shrink requests (nereus-launch shrink) may wait before the run
RUN_FILES = (
    "metrics.jsonl", ".metrics.jsonl.tmp", "report.png", "report.tmp.png", "membership.log", "tensorboard",
    "checkpoints", "hf", "tasks.jsonl", "rendezvous.json", "vllm", "calibration.json", KEY_FILE, MARKER,
)  # fmt: skip


# what a resumed run reads or writes into, by kind (a file where a folder belongs, or the
# reverse, fails in the workers, some only after training: at export)
RUN_FOLDERS = ("tensorboard", "checkpoints", "hf")
RUN_TEXT = ("metrics.jsonl", "tasks.jsonl", "membership.log")


def _resumable(path: Path) -> None:
    """A previous run's files are of the kind a resume needs: its folders folders, its text
    files readable UTF-8 files."""
    for name in RUN_FOLDERS:
        if (path / name).exists() and not (path / name).is_dir():
            raise ConfigError(
                f"--out: {path / name} is not a folder; --resume needs the run's own (move it away)"
            )
    for name in RUN_TEXT:
        if not (path / name).exists():
            continue
        try:
            (path / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError(
                f"--out: {path / name} cannot be read ({why}); --resume needs the run's own (move it away)"
            ) from None


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def is_ours(path: Path) -> bool:
    """``path`` carries the marker a run leaves (its first line names the command, as
    ``nereus.spec.files`` writes it for the other commands)."""
    try:
        lines = (Path(path) / MARKER).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(lines) and lines[0].strip() == MARK


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check(path: Path, resume: bool, force: bool) -> None:
    """Whether ``nereus run`` may write into ``path``; a ``ConfigError`` naming ``--out`` (or the
    flag to pass) if not. Writes nothing."""
    path = Path(path)
    if resume and force:
        raise ConfigError("--force and --resume: pass one (--resume continues the run, --force replaces it)")
    if path.is_dir():
        probe(path)
    found = _existing_ancestor(path)
    if not found.is_dir():
        what = "is a file" if found == path.absolute() else f"is inside {found}, a file"
        raise ConfigError(f"--out: {path} {what}; expected a folder")
    if not os.access(found, os.W_OK | os.X_OK):
        why = "is on a read-only file system" if _read_only(found) else "does not let this user write"
        raise ConfigError(f"--out: {path} is not writable ({found} {why})")
    if force and path.is_dir() and not is_ours(path):
        clash = [n for n in RUN_FILES if (path / n).exists() or (path / n).is_symlink()]
        if clash:
            raise ConfigError(
                f"--out: {path / clash[0]} is there and nereus run did not write it; --force replaces a "
                "previous run's files only (move it away, or choose another --out)"
            )
    if resume and path.is_dir():
        _resumable(path)
    if resume or force or not path.exists():
        return
    entries = sorted(e.name for e in path.iterdir() if e.name not in INPUTS and e.name not in LOCKS)
    if not entries:
        return
    if is_ours(path):
        raise ConfigError(
            f"--out: {path} holds a previous run; pass --resume to continue it or --force to replace it"
        )
    shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
    raise ConfigError(
        f"--out: {path} is not empty ({shown}) and nereus run did not create it; pass --force to write "
        "the run's files beside what is there (nothing of yours is replaced)"
    )


def prepare(path: Path, resume: bool, force: bool) -> bytes:
    """Check again, then make ``path`` the run's folder: created 0700 if new, the previous run's
    files removed with ``force``, the marker written. Returns the checkpoint key (a resume's
    existing one, else a new one in ``<path>/checkpoint.key``, 0600)."""
    path = Path(path)
    check(path, resume, force)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # a place no folder can be made (/proc, a read-only mount)
        raise ConfigError(f"--out: {path} cannot be created ({exc.strerror or type(exc).__name__})") from None
    take(path)
    _remove_leftovers(path)
    settle(path)  # a replacing run that was killed before its first checkpoint: the old files back
    check(path, resume, force)  # again under the lock: a run that ended meanwhile left its files
    if resume:
        _writable(path)
    if force and is_ours(path):  # a previous run's files; a folder not ours holds none (``check``)
        _set_aside(path)
    marker = path / f"{MARKER}.tmp"
    marker.write_text(MARK + "\n")
    os.replace(marker, path / MARKER)
    key_file = path / KEY_FILE
    if resume or key_file.exists():
        return read_key(key_file)
    return create_key(key_file)


def _writable(path: Path) -> None:
    """A resume writes into the run's folders: each there takes a file (a write probe, not the
    permission bits, which root and immutable folders make say otherwise), or one line says not."""
    for name in RUN_FOLDERS:
        folder = path / name
        if not folder.is_dir():
            continue
        probe = folder / ".nereus-probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"--out: {folder} is not writable ({exc.strerror or type(exc).__name__}); --resume "
                "writes the run's files there"
            ) from None


def discard(path: Path, created: bool) -> bool:
    """Undo a fresh run that stopped on bad input before its first step: remove the files it wrote
    (``RUN_FILES``, in a folder with the marker) and, when the run ``created`` the folder, the
    folder once empty; the previous run's files a ``--force`` set aside come back. A folder
    holding a checkpoint or a metrics row is kept whole. Returns whether anything was removed."""
    path = Path(path)
    if not is_ours(path) or _trained(path):
        return False
    if not settle(path):
        _remove_run_files(path)
    if created and not workers_alive(path):  # its workers have ended: their lock file goes with
        (path / WORKERS).unlink(missing_ok=True)  # the folder (under the run lock, still held)
    release(path)  # this run's own, which ends now (another run refuses, never waits)
    if created:
        with contextlib.suppress(OSError):
            path.rmdir()  # only when empty: a control/ request or a user's file keeps it
    return True


def _trained(path: Path, signed: bool = False) -> bool:
    """The run in ``path`` wrote a checkpoint or a metrics row (``signed``: a signed checkpoint,
    not just anything under ``checkpoints/``, such as a save that crashed half-way)."""
    ckpts, rows = path / "checkpoints", path / "metrics.jsonl"
    if rows.is_file() and rows.stat().st_size > 0:
        return True
    if signed:
        return bool(checkpoints(ckpts))
    return ckpts.is_dir() and any(ckpts.iterdir())


def _set_aside(path: Path) -> None:
    """Move the previous run's files (``RUN_FILES``) into ``REPLACED`` (renames, one file system)."""
    aside, moved, name = path / REPLACED, [], REPLACED
    try:
        aside.mkdir(mode=0o700)
        for name in RUN_FILES:
            if (path / name).exists() or (path / name).is_symlink():
                os.replace(path / name, aside / name)
                moved.append(name)
    except OSError as exc:  # a mount point, a file where the folder goes: nothing half-moved
        for done in moved:
            os.replace(aside / done, path / done)
        with contextlib.suppress(OSError):
            aside.rmdir()
        raise ConfigError(
            f"--out: {path / name} cannot be set aside for --force ({exc.strerror or type(exc).__name__}); "
            "move the previous run's files away, or choose another --out"
        ) from None


def settle(path: Path) -> bool:
    """Finish a ``--force`` replacement: when the new run trained (a checkpoint or a metrics row),
    the previous run's files set aside are removed; otherwise the new run's files are, and the
    previous run's come back. Nothing to do without ``REPLACED``. Returns whether they came back."""
    aside = Path(path) / REPLACED
    if not aside.is_dir() or aside.is_symlink():
        return False
    if _trained(Path(path), signed=True):
        drop_replaced(path)
        return False
    _remove_run_files(Path(path))
    for entry in aside.iterdir():
        os.replace(entry, Path(path) / entry.name)
    aside.rmdir()
    return True


def recover(path: Path) -> None:
    """Finish a ``--force`` replacement a killed ``nereus run`` left behind (``settle``), under
    the run lock, before anything reads the folder (a ``--resume`` must see the run that is
    there); a run that holds the lock is left to finish its own."""
    path = Path(path)
    if not (path / REPLACED).is_dir() or (path / REPLACED).is_symlink():
        return
    try:
        take(path)
    except ConfigError:
        return  # in use: ``check`` says so
    settle(path)


def drop_replaced(path: Path, wait: bool = True) -> None:
    """Remove the previous run's files a ``--force`` set aside (the new run has trained now):
    renamed out of the way at once, then deleted — in a daemon thread with ``wait=False`` (a
    checkpoint's save must not wait on terabytes of old checkpoints on a parallel file system;
    what a process that exits leaves is removed by the next ``prepare``). Never raises: a rename
    that fails leaves them for the next ``settle``."""
    aside = Path(path) / REPLACED
    if not aside.is_dir() or aside.is_symlink():
        return
    doomed = Path(path) / f"{REPLACED}.{os.getpid()}.{threading.get_ident()}.deleting"
    try:
        os.replace(aside, doomed)
    except OSError:
        return
    if wait:
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        threading.Thread(target=shutil.rmtree, args=(doomed, True), name="nereus-drop", daemon=True).start()


def _remove_leftovers(path: Path) -> None:
    """Folders ``drop_replaced`` renamed for deletion that a process left when it exited."""
    for doomed in path.glob(f"{REPLACED}.*.deleting"):
        if doomed.is_dir() and not doomed.is_symlink():
            shutil.rmtree(doomed, ignore_errors=True)


def _remove_run_files(path: Path) -> None:
    """Remove what a run writes (``RUN_FILES``) from ``path``, nothing else."""
    for name in RUN_FILES:
        old = path / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists() or old.is_symlink():
            old.unlink()
