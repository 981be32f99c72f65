"""``nereus run``'s output folder, one run at a time (edge module: file locks).

One run at a time: ``outdir.prepare`` takes an exclusive lock on ``.nereus-lock`` in the folder (``flock``,
held by the ``nereus run`` process until it exits, which the kernel releases however it ends) before
it replaces or writes anything, and a second run on the same folder (``--resume`` or ``--force``
alike) is refused naming the holder's process id; ``check`` tries the lock too, without keeping it.
A run whose fresh start is undone removes the file as it ends; whoever takes the lock checks that
the file it locked is still the one in the folder, and takes it again if not. The lock lives in
the ``nereus run`` process: its workers stop at their next boundary when it dies, and until then
they may still write a checkpoint and a metrics row. So each local worker also holds a shared
lock on ``.nereus-workers`` while it lives (``hold_as_worker``), and a run that finds it held —
the workers of a ``nereus run`` that was killed — is refused as in use until they have ended.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

from nereus.errors import ConfigError

LOCK = ".nereus-lock"
WORKERS = ".nereus-workers"  # each local worker's shared lock, held while it lives
LOCKS = frozenset({LOCK, WORKERS})  # a folder's lock files: not a run's files, nor a user's
_HELD: dict[Path, int] = {}  # this process's locks (descriptors), by folder: open until it exits
_WORKING: list[int] = []  # a worker's shared locks on ``WORKERS``: open until it exits


def _in_use(path: Path) -> ConfigError:
    try:
        holder = (path / LOCK).read_text(encoding="utf-8").strip() or "?"
    except (OSError, UnicodeDecodeError):
        holder = "?"
    return ConfigError(
        f"--out: {path} is in use by another nereus run (pid {holder[:20]}); wait for it to end, or "
        "choose another --out"
    )


def _workers_in_use(path: Path) -> ConfigError:
    return ConfigError(
        f"--out: {path} is in use by the worker processes of a nereus run that was killed (they stop "
        "at their next boundary, after a checkpoint); wait for them to end, or choose another --out"
    )


def workers_alive(path: Path) -> bool:
    """Whether a worker process of some run still holds ``path``'s ``WORKERS`` lock; a link, a
    folder or a FIFO in its place is a ``ConfigError`` (a worker could not hold it)."""
    try:
        fd = _open_lock(path / WORKERS, create=False)
    except OSError:
        return False  # none there
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and the lock taken to probe with it
    return False


def hold_as_worker(path: Path) -> int:
    """A local worker of the run in ``path``: hold a shared lock on its ``WORKERS`` file until
    this process exits (the kernel lets go however it ends), so that no other run starts in the
    folder while this worker may still write there. Returns the descriptor."""
    lock = Path(path) / WORKERS
    for _ in range(5):  # a run that ended may remove the file between our open and our lock
        fd = _open_lock(lock, create=True)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while another run probes it
        if _current(fd, lock):
            _WORKING.append(fd)
            return fd
        os.close(fd)
    raise ConfigError(f"--out: {lock} keeps changing; is another nereus run in {path}?")


def _open_lock(lock: Path, create: bool) -> int:
    """A descriptor of the lock file: a regular file, never through a link (``O_NOFOLLOW``) and
    never blocking on a FIFO put in its place."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        fd = os.open(lock, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"--out: {lock} is a symbolic link; expected the run lock file (move it away)"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"--out: {lock} is not a regular file; expected the run lock file (move it away)")
    return fd


def _current(fd: int, lock: Path) -> bool:
    """Whether ``fd`` is still the file at ``lock`` (a run that ended may have removed it, and a
    lock on a removed file locks nothing)."""
    try:
        on_disk = os.stat(lock, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def probe(path: Path) -> None:
    """Refuse ``path`` when another run holds its lock (a lock this process holds is fine)."""
    lock = path / LOCK
    if _held(path):
        return
    if lock.exists():  # a running run first: its pid is the better answer
        try:
            fd = _open_lock(lock, create=False)
        except OSError:
            fd = -1  # gone meanwhile, or unreadable: ``prepare`` says so when it takes the lock
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(path) from None
            finally:
                os.close(fd)
    if workers_alive(path):
        raise _workers_in_use(path)


def _held(path: Path) -> bool:
    """Whether this process holds ``path``'s lock (on the file that is there now)."""
    fd = _HELD.get(path.resolve())
    if fd is None:
        return False
    if _current(fd, path / LOCK):
        return True
    del _HELD[path.resolve()]  # the folder was removed and made again: that lock locks nothing
    os.close(fd)
    return False


def take(path: Path) -> None:
    """Hold ``path``'s run lock until this process exits; ``ConfigError`` when another run has it."""
    if _held(path):
        return
    lock = path / LOCK
    for _ in range(5):  # a run that ended may remove the file between our open and our lock
        try:
            fd = _open_lock(lock, create=True)
        except OSError as exc:
            raise ConfigError(f"--out: {lock} cannot be opened ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(path) from None
        if _current(fd, lock):
            if workers_alive(path):  # a killed run's workers, which may still write
                os.close(fd)
                raise _workers_in_use(path)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _HELD[path.resolve()] = fd
            return
        os.close(fd)
    raise ConfigError(f"--out: {lock} keeps changing; is another nereus run starting in {path}?")


def release(path: Path) -> None:
    """Let go of ``path``'s lock and remove its file (the run that held it ends; a run that opened
    the file meanwhile finds it removed and takes a new one)."""
    fd = _HELD.pop(path.resolve(), None)
    with contextlib.suppress(OSError):
        (path / LOCK).unlink()
    if fd is not None:
        os.close(fd)
