"""The edge between the CLI and the file system: user files read, output folders written.

Reading: a user's file (config, trace, curve, plan or calibration JSON) must be a regular file of
bounded size holding UTF-8 text; JSON must be finite and shallow. Every refusal is one
``ConfigError`` line naming the file. ``brief`` and ``one_line`` keep user values in error lines
short and on one line.

Writing: a command writes only into a folder that is new, empty, or marked as its own (a
``.nereus-output`` file naming the command and the files it wrote); anything else needs
``--force``. ``OutputFolder.check`` runs every check before the first byte is written, and
``OutputFolder.write`` writes each file atomically (a temporary file in the folder, then a rename).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import reprlib
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20  # YAML and JSON configs, plans, calibration files
MAX_DATA_BYTES = 16 << 20  # traces and sequence-length curves
MAX_DEPTH = 32  # nesting of a YAML or JSON document
MAX_INT_DIGITS = 30  # an integer in a JSON file (beyond 10^30 nothing is meaningful)
SHOWN = 60  # characters of a user value shown in an error line
MARKER = ".nereus-output"

# control characters, line separators, and the bidirectional controls that reorder what a terminal
# shows (a name with U+202E reads backwards after it)
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_REPR = reprlib.Repr()
_REPR.maxstring = SHOWN
_REPR.maxother = SHOWN
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 6
_REPR.maxlevel = 3


def one_line(text: str) -> str:
    """``text`` with control characters and line separators escaped as Python writes them."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


def shorten(text: str, limit: int = SHOWN) -> str:
    """A user's text (a key, a reason) on one line, cut to at most ``limit`` characters."""
    text = one_line(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def ascii_int(text: str) -> int:
    """A command-line integer in ASCII digits (an optional ``-``, spaces around): ``int`` also
    takes "３２", "1_0" and "+1", which a flag should refuse. Raises ValueError."""
    if not re.fullmatch(r"[ \t]*-?[0-9]+[ \t]*", text):
        raise ValueError(text)
    return int(text)


def ascii_float(text: str) -> float:
    """A command-line number in ASCII (``float`` also takes "０.５" and "1_0"). Raises ValueError."""
    if not text.isascii() or "_" in text:
        raise ValueError(text)
    return float(text)


def float_flag(text: str) -> float:
    """An argparse type: a number in ASCII (ranges are checked where it is used)."""
    try:
        return ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {brief(text)}") from None


def int_flag(text: str) -> int:
    """An argparse type: an integer in ASCII digits (ranges are checked where it is used)."""
    try:
        return ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {brief(text)}") from None


def brief(value: object, limit: int = SHOWN) -> str:
    """``repr(value)`` for an error line: bounded in time and length, on one line."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'over 4000'} digits"
    text = one_line(_REPR.repr(value))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _stat(path: Path, what: str) -> os.stat_result:
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read ({exc.strerror})") from None
    except ValueError:  # an embedded NUL
        raise ConfigError(f"{what} {brief(str(path))}: no such file") from None


def read_text(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> str:
    """The text of the user's file ``path`` (a ``what``: "config", "trace", …): a regular file of at
    most ``limit`` bytes holding UTF-8. Checked before it is read, so a FIFO or a device never
    blocks and a huge file is never loaded."""
    st = _stat(path, what)
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {path}: is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path}: not a regular file")
    if st.st_size > limit:
        raise ConfigError(f"{what} {path}: {st.st_size} bytes (allowed: at most {limit})")
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read ({exc.strerror})") from None
    if len(data) > limit:
        raise ConfigError(f"{what} {path}: more than {limit} bytes (allowed: at most {limit})")
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (as Excel writes UTF-8) is not text
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None


class _JsonRefusedError(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _JsonRefusedError(f"{name} is not a number (allowed: finite numbers)")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _JsonRefusedError(f"an integer of {len(text)} digits (allowed: at most {MAX_INT_DIGITS})")
    return int(text)


def _bounded_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _JsonRefusedError(f"{brief(text)} is out of range (allowed: finite numbers)")
    return value


def _depth(value: object, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iterative: no recursion)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if level > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return False


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different (JSON keeps the last of two silently; a YAML
    config refuses the same)."""
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise _JsonRefusedError(f"key {brief(key)} given twice")
        doc[key] = value
    return doc


def parse_json(text: str, source: str) -> Any:
    """A JSON document from ``text``; NaN, Infinity, huge integers and deep nesting are refused."""
    try:
        doc = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_int=_bounded_int,
            parse_float=_bounded_float,
            object_pairs_hook=unique_keys,
        )
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: line {exc.lineno}: not valid JSON ({exc.msg})") from None
    except _JsonRefusedError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid JSON (nested deeper than {MAX_DEPTH} levels)") from None
    except ValueError as exc:
        raise ConfigError(f"{source}: not valid JSON ({brief(str(exc))})") from None
    if _depth(doc, MAX_DEPTH):
        raise ConfigError(f"{source}: not valid JSON (nested deeper than {MAX_DEPTH} levels)")
    return doc


def load_json(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> Any:
    """``read_text`` then ``parse_json``: one ``ConfigError`` line for anything wrong."""
    return parse_json(read_text(path, what, limit), str(path))


# ------------------------------------------------------------------ output folders
def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _owner(folder: Path) -> tuple[str, tuple[str, ...]] | None:
    """(command, files) of the marker in ``folder``, or None if it has no readable marker."""
    marker = folder / MARKER
    try:
        if not stat.S_ISREG(marker.lstat().st_mode) or marker.stat().st_size > 1 << 16:
            return None
        lines = marker.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if not lines:
        return None
    return lines[0].strip(), tuple(n for n in lines[1:] if n and "/" not in n and n != MARKER)


def _accepts_folders(parent: Path) -> bool:
    """A folder can be made in ``parent`` (``access`` says yes for root even where the file
    system refuses, as in /proc): make one and remove it."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".nereus-probe-"))
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class OutputFolder:
    """A folder a command may write ``names`` into, checked before anything is written."""

    path: Path
    command: str
    mine: bool  # new, empty, or marked by this command: we mark it and may remove our stale files
    previous: tuple[str, ...] = ()  # what our marker says we wrote last time
    flag: str = "--out"  # the option that named it, for errors

    @classmethod
    def check(
        cls, path: Path, command: str, names: Iterable[str], force: bool = False, flag: str = "--out"
    ) -> OutputFolder:
        """Refuse (``ConfigError``, exit 2) a folder that is a file, not writable, or holds files
        this command did not write (unless ``force``)."""
        names = tuple(names)
        where = f"{flag} {shorten(str(path), 200)}"
        try:
            exists = path.exists()
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"{where}: not a usable folder ({getattr(exc, 'strerror', None) or exc})"
            ) from None
        if not exists:
            if path.is_symlink():
                raise ConfigError(f"{where}: a broken symbolic link, not a folder")
            parent = path.parent
            while not parent.exists() and parent != parent.parent:
                if parent.is_symlink():
                    raise ConfigError(f"{where}: {parent} is a broken symbolic link, not a folder")
                parent = parent.parent
            if not parent.is_dir():
                raise ConfigError(f"{where}: {parent} is a file, not a folder")
            if not _writable(parent) or not _accepts_folders(parent):
                raise ConfigError(f"{where}: cannot create it ({parent} is not writable)")
            return cls(path, command, mine=True, flag=flag)
        if not path.is_dir():
            raise ConfigError(f"{where}: is a file, not a folder (allowed: a new or empty folder)")
        if not _writable(path):
            raise ConfigError(f"{where}: folder is not writable")
        try:
            entries = set(os.listdir(path))
        except OSError as exc:
            raise ConfigError(f"{where}: cannot list the folder ({exc.strerror})") from None
        owner = _owner(path) if MARKER in entries else None
        if not entries:
            folder = cls(path, command, mine=True, flag=flag)
        elif owner is not None and owner[0] == command:
            folder = cls(path, command, mine=True, previous=owner[1], flag=flag)
        elif force:
            folder = cls(path, command, mine=False, flag=flag)
        else:
            by = f" (it holds output of nereus {brief(owner[0], 20)})" if owner else ""
            raise ConfigError(
                f"{where}: folder is not empty and was not written by nereus {command}{by}; allowed: "
                f"a new or empty folder, or one nereus {command} wrote (add --force to write into it)"
            )
        for name in (*names, MARKER):
            target = path / name
            if name in entries and target.is_dir() and not target.is_symlink():
                raise ConfigError(f"{where}: {name} in it is a folder; nereus {command} writes a file there")
        return folder

    def _atomic(self, name: str, write: Callable[[Path], object]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.", suffix=Path(name).suffix)
        os.close(fd)
        try:
            write(Path(tmp))
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 → what open() would have made
            os.replace(tmp, self.path / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _mark(self, names: Iterable[str]) -> None:
        text = "\n".join((self.command, *sorted(set(names)))) + "\n"
        self._atomic(MARKER, lambda p: p.write_text(text, encoding="utf-8"))

    def write(self, files: Mapping[str, Callable[[Path], object]]) -> None:
        """Write every file (``name → writer(path)``), each atomically; in a folder of our own,
        first mark it (so an interrupted write leaves a folder we may overwrite), then remove the
        files our last run wrote that this one does not."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if self.mine:
                self._mark((*self.previous, *files))
            for name, write in files.items():
                self._atomic(name, write)
        except OSError as exc:  # checked at the start; the disk or the folder changed since
            raise ConfigError(
                f"{self.flag} {shorten(str(self.path), 200)}: cannot write ({exc.strerror or exc})"
            ) from None
        if self.mine:
            for stale in set(self.previous) - set(files):
                target = self.path / stale
                if target.is_file() and not target.is_symlink():
                    target.unlink()
            self._mark(files)


def nonempty_path(text: str) -> Path:
    """An argparse type for a path flag: an empty value is refused (``Path("")`` is the current
    folder, which a run or a simulation would then write into)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty value")
    return Path(text)
