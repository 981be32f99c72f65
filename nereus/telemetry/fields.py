"""Field checks shared by the inventory's value types (``inventory``, ``health``) and the readers
(``nvml``, ``amd``): the bounds on text and lists, the ``__post_init__`` validators, and the
readers of ``from_json`` documents. Every check raises ValueError naming the field; the
readers' cleaning of what a library returned (``say``, ``nonneg``, ``printable``) never raises."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MAX_TEXT = 256  # characters of a model name, a bus id, a node name
MAX_LINES = 64  # entries of tried / errors / events / problems


# ------------------------------------------------------------------ validation helpers
def check_count(owner: object, name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        who = f"{type(owner).__name__}.{name}"
        raise ValueError(f"{who} must be a non-negative integer or None, got {value!r}")


def check_text(owner: object, name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT or not value.isprintable():
        raise ValueError(
            f"{type(owner).__name__}.{name} must be printable text of 1-{MAX_TEXT} characters, got {value!r}"
        )


def check_lines(owner: object, name: str, value: object) -> None:
    if not isinstance(value, tuple) or len(value) > MAX_LINES:
        raise ValueError(f"{type(owner).__name__}.{name} must be a tuple of at most {MAX_LINES} strings")
    for item in value:
        if not isinstance(item, str) or len(item) > 4 * MAX_TEXT:
            raise ValueError(f"{type(owner).__name__}.{name} holds a bad entry {item!r}")


def clip_lines(lines: Iterable[str]) -> tuple[str, ...]:
    """At most ``MAX_LINES`` lines, each cut to ``MAX_TEXT`` characters (for ``tried``/``errors``)."""
    out = [line[:MAX_TEXT] for line in lines]
    if len(out) > MAX_LINES:
        out = [*out[: MAX_LINES - 1], f"... and {len(out) - MAX_LINES + 1} more"]
    return tuple(out)


# ------------------------------------------------------------------ JSON field readers
def mapping(doc: object, what: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise ValueError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    return doc


def opt_int(d: Mapping[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"'{key}' must be an integer or null, got {v!r}")
    return v


def opt_str(d: Mapping[str, Any], key: str) -> str | None:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise ValueError(f"'{key}' must be a string or null, got {type(v).__name__}")
    return v


def flag(d: Mapping[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise ValueError(f"'{key}' must be true or false, got {v!r}")
    return v


def strings(d: Mapping[str, Any], key: str) -> tuple[str, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or len(v) > MAX_LINES or not all(isinstance(s, str) for s in v):
        raise ValueError(f"'{key}' must be a list of at most {MAX_LINES} strings")
    return tuple(v)


# ------------------------------------------------------------------ what a library returned
def say(exc: BaseException) -> str:
    """An exception as one short line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:200]


def nonneg(value: object) -> int | None:
    """A count a library returned, or None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def printable(value: object) -> str | None:
    """Text a library returned (str or bytes), printable and at most ``MAX_TEXT`` characters;
    None when empty, not text, or the libraries' "N/A"."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    value = "".join(c for c in value.strip() if c.isprintable())[:MAX_TEXT]
    return value if value and value != "N/A" else None
