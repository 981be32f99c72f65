"""What users hand the launcher: files it reads, text that reaches an sbatch script, error lines.

Every value rendered into an sbatch script (flags, site-file values, names) must be free of control
characters: a newline in ``#SBATCH --account=...`` would start a shell line of its own. Files are
checked before they are parsed (a directory, a device, a missing file, bytes that are not UTF-8,
YAML nested past Python's recursion limit), so each is one ``ConfigError`` line naming the file.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.spec.schema import load_yaml

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character (below 0x20, or DEL): newline, CR, tab, NUL…"""
    return _CONTROL.search(text) is not None


def shown(value: str, limit: int = 100) -> str:
    """``repr(value)`` for an error line, cut to about ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}…{text[-4:]}"


def control_error(field: str, value: str) -> str:
    return f"{field}: control characters are not allowed (got {shown(value)})"


def check_text(field: str, value: str) -> None:
    """A ``ConfigError`` naming ``field`` when ``value`` holds a control character."""
    if has_control(value):
        raise ConfigError(control_error(field, value))


def check_file(path: Path, what: str) -> None:
    """``path`` must be a regular file this user can stat; else a ``ConfigError`` naming ``what``."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{what}: no such file: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path} ({exc.strerror})") from None
    except ValueError:  # an embedded NUL
        raise ConfigError(f"{what}: no such file: {str(path)!r}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{what}: {path} is a directory, not a YAML file")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what}: {path} is not a regular file")


def read_yaml(path: Path, what: str) -> dict[str, Any]:
    """The top-level mapping of the YAML file ``path`` (``nereus.spec.schema.load_yaml``), after
    ``check_file``; bytes that are not UTF-8 and runaway nesting are one line naming the file."""
    check_file(path, what)
    try:
        path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
    try:
        return load_yaml(path)
    except RecursionError:
        raise ConfigError(f"{path}: is not valid YAML (nested too deeply)") from None
