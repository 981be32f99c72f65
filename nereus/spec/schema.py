"""Strict mapping → frozen dataclass conversion for YAML and JSON configs.

Unknown keys are refused, types are checked (bool is not an int, an int is accepted as a float,
NaN and infinities are not numbers, integers beyond 2^53 are refused), and every error names the
file, the dotted key and the expected type, in one line. YAML is read through ``files.read_text``
(a regular file of at most 1 MiB, UTF-8) and composed by a loader that refuses more than
``MAX_ALIASES`` aliases and deep nesting before anything is expanded (no alias bombs), that
refuses a key given twice in one mapping (YAML would keep the last silently), and that reads
``1e3`` as the number it is (YAML 1.2; PyYAML's YAML 1.1 wants ``1.0e+3``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, Node, ScalarNode

from nereus.errors import ConfigError
from nereus.spec.files import MAX_CONFIG_BYTES, MAX_DEPTH, MAX_INT_DIGITS, brief, read_text, shorten

T = TypeVar("T")

MAX_ALIASES = 8  # YAML aliases (*name) per document: enough for shared blocks, too few for a bomb
MAX_INT = 2**53  # the largest integer a config may hold (exact as a float)
ALLOWED = "allowed"  # a dataclass field's metadata key: its allowed values, for type errors


def _num(limit: float) -> str:
    return str(int(limit)) if float(limit).is_integer() else f"{limit:g}"


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts aliases and nesting while composing, before any expansion,
    and turns a constructor's ``ValueError`` (a 5,000-digit integer, a 13th month) into a
    ``YAMLError`` with a line number."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise ComposerError(None, None, f"more than {MAX_ALIASES} aliases (*name)", mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        if isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:int":
            digits = sum(c.isalnum() for c in str(node.value))
            if digits > MAX_INT_DIGITS:
                raise ConstructorError(
                    None,
                    None,
                    f"an integer of {digits} digits, at most {MAX_INT_DIGITS} allowed",
                    node.start_mark,
                )
        if isinstance(node, ScalarNode) and node.tag in (INT_TAG, FLOAT_TAG):
            text = str(node.value)
            if ":" in text or _OLD_OCTAL.match(text) or _OLD_BINARY.match(text):
                raise ConstructorError(
                    None,
                    None,
                    f"{shorten(text, 20)!r} reads as octal, binary or base 60 in YAML 1.1; "
                    "write it in decimal",
                    node.start_mark,
                )
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:
            raise ConstructorError(None, None, brief(str(exc)), node.start_mark) from None

    def construct_mapping(self, node: Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            seen: set[tuple[str, str]] = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, ScalarNode) or key_node.tag == MERGE_TAG:
                    continue
                key = (key_node.tag, str(key_node.value))
                if key in seen:
                    raise ConstructorError(
                        None, None, f"key '{shorten(key[1])}' given twice", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep)  # type: ignore[arg-type]


MERGE_TAG = "tag:yaml.org,2002:merge"
INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.1's readings PyYAML keeps that YAML 1.2 (and a reader) does not: 020 is 16, 1:20 is 80
_OLD_OCTAL = re.compile(r"^[-+]?0[0-9_]+$")
_OLD_BINARY = re.compile(r"^[-+]?0b[01_]+$")
# YAML 1.2's floats: an exponent without a dot or sign (1e3, 2E-5) is a number, not a string
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML file whose top level must be a mapping."""
    text = read_text(path, "config", MAX_CONFIG_BYTES)
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None)
        why = f" ({shorten(str(problem), 80)})" if problem else ""
        raise ConfigError(f"{path}:{where} is not valid YAML{why}") from None
    except RecursionError:
        raise ConfigError(f"{path}: is not valid YAML (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def coerce_enums(obj: object, **fields: type[enum.Enum]) -> None:
    """In ``__post_init__``: turn enum values given as plain strings into members (or fail clearly)."""
    for name, kind in fields.items():
        value = getattr(obj, name)
        try:
            object.__setattr__(obj, name, kind(value))
        except ValueError:
            allowed = ", ".join(str(k.value) for k in kind)
            raise ValueError(f"{name} must be one of {allowed}, got {brief(value)}") from None


def require_positive(obj: object, *names: str) -> None:
    """In ``__post_init__``: every named numeric field must be > 0 (NaN is not)."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def require_at_most(obj: object, limit: float, *names: str) -> None:
    """In ``__post_init__``: every named numeric field must be ≤ ``limit`` (absurd values refused)."""
    for name in names:
        value = getattr(obj, name)
        if not value <= limit:
            raise ValueError(f"{name} must be at most {_num(limit)}, got {brief(value)}")


def require_at_least(obj: object, limit: float, *names: str) -> None:
    """In ``__post_init__``: every named numeric field must be ≥ ``limit`` (a speed or a size
    too small to price anything with: its reciprocals overflow)."""
    for name in names:
        value = getattr(obj, name)
        if not value >= limit:
            raise ValueError(f"{name} must be at least {limit:g}, got {brief(value)}")


def require_finite(obj: object, *names: str) -> None:
    """In ``__post_init__``: every named float field must be a finite number."""
    for name in names:
        value = getattr(obj, name)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")


def named(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """``data`` with its ``name`` (default: the file's stem), which must not be blank: errors
    about the spec name it."""
    data.setdefault("name", path.stem)
    if isinstance(data["name"], str) and not data["name"].strip():
        raise ConfigError(f"{path}: key 'name': expected a non-empty name (or leave it out: the file's stem)")
    if isinstance(data["name"], str) and any(unicodedata.category(c)[0] == "C" for c in data["name"]):
        raise ConfigError(
            f"{path}: key 'name': expected one line of printable text, got {brief(data['name'])} "
            "(a newline, or another control or format character)"
        )
    return data


def load_spec(cls: type[T], path: Path, check_name: bool = True) -> T:
    """A spec from a YAML file; its ``name`` defaults to the file's stem (``named``; a spec that
    checks its own name passes ``check_name=False``)."""
    data = load_yaml(path)
    data = named(data, path) if check_name else {"name": path.stem, **data}
    return build(cls, data, str(path))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + "|".join(str(m.value) for m in tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        _, val = typing.get_args(tp)
        return f"mapping of {_type_name(val)}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):  # a nested section: name its keys, not our class
        keys = [f.name for f in dataclasses.fields(tp) if f.init]
        return f"a mapping with keys {', '.join(keys[:8])}{', …' if len(keys) > 8 else ''}"
    return getattr(tp, "__name__", str(tp))


def _fail(source: str, key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{source}: key '{key}': expected {_type_name(tp)}, got {brief(value)}")


def _convert(value: Any, tp: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is not None and len(args) == 1:  # an optional value: its own errors, precisely
            return _convert(value, args[0], source, key)
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, source, key)
            except ConfigError:
                continue
        raise _fail(source, key, tp, value)
    if tp is type(None):
        if value is None:
            return None
        raise _fail(source, key, tp, value)
    if origin is tuple:
        (item_tp, *_) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise _fail(source, key, tp, value)
        return tuple(_convert(v, item_tp, source, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise _fail(source, key, tp, value)
        return {
            _convert(k, key_tp, source, key): _convert(v, val_tp, source, f"{key}.{shorten(str(k))}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise _fail(source, key, tp, value)
        return build(tp, value, source, prefix=f"{key}.")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _fail(source, key, tp, value) from None
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_INT:
            raise ConfigError(f"{source}: key '{key}': expected int of at most 2^53, got {brief(value)}")
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise ConfigError(f"{source}: key '{key}': expected a number of at most 2^53, got {brief(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{source}: key '{key}': expected a finite number, got {value}")
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    if tp is Any:
        return value
    raise _fail(source, key, tp, value)


def build(cls: type[T], data: Mapping[str, Any], source: str, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``.

    ``source`` names where the data came from (a file path, a CLI flag); ``prefix`` is the dotted
    path of ``data`` inside it. Errors read ``<source>: key '<dotted.key>': <problem>``; a value of
    the wrong type for a field whose metadata names what it allows (``ALLOWED``) says that too.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(shorten(str(k)) for k in set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key '{prefix}{unknown[0]}' (allowed: {', '.join(sorted(fields))})"
        )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            try:
                kwargs[name] = _convert(data[name], hints[name], source, prefix + name)
            except ConfigError as exc:  # a field may say what it allows beyond its type
                allowed = field.metadata.get(ALLOWED)
                if allowed is None:
                    raise
                raise ConfigError(f"{exc} (allowed: {allowed})") from None
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing key '{prefix}{name}' (expected {_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        where = f" '{prefix.rstrip('.')}'" if prefix else ""
        raise ConfigError(f"{source}:{where} {exc}") from None
