"""Control messages as JSON with a schema: no pickle crosses the network.

The runtime's control messages — the job's setup, plans, pool changes, the boundary's action with
its transition, every rank's report — are frozen dataclasses. ``encode`` writes one as JSON
(dataclasses as objects of their init fields and their class name, enums by value, tuples as
lists, mappings as lists of pairs so keys keep their types); ``decode`` reads it back *against
the type the receiver expects*, field by field from the dataclasses' own annotations, and
constructs it, so every
``__post_init__`` validates what arrived. A message of another type, an unknown or missing
field, a value of the wrong type, or more than ``MAX_BYTES`` is refused (``MessageError``);
nothing a peer sends is executed. Pure (stdlib).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

MAX_BYTES = 256 << 20
TYPE = "__type__"  # a dataclass's class name, in its object
T = TypeVar("T")


class MessageError(ValueError):
    """A control message that does not match the type it should have."""


def encode(value: object) -> bytes:
    return json.dumps(_to_json(value), separators=(",", ":")).encode()


def decode(data: bytes, tp: Any) -> Any:
    """The value of type ``tp`` (a dataclass, ``X | None``, a tuple type, or plain JSON types)."""
    if len(data) > MAX_BYTES:
        raise MessageError(f"a message of {len(data)} bytes (at most {MAX_BYTES})")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MessageError(f"not JSON ({exc})") from None
    try:
        return _from_json(doc, tp, "message")
    except MessageError:
        raise
    except (TypeError, ValueError, KeyError) as exc:  # a dataclass refused its fields
        raise MessageError(f"message: {exc}") from None


def _to_json(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {TYPE: type(value).__name__, **fields}
    if isinstance(value, enum.Enum):
        return _to_json(value.value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return [[_to_json(k), _to_json(v)] for k, v in value.items()]
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise MessageError(f"cannot send a {type(value).__name__} as a control message")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_json(doc: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return _plain(doc, where)
    if origin in (typing.Union, types.UnionType):
        if doc is None and type(None) in args:
            return None
        tagged = [a for a in args if isinstance(doc, dict) and getattr(a, "__name__", None) == doc.get(TYPE)]
        if tagged:  # a dataclass says which member of the union it is
            return _from_json(doc, tagged[0], where)
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _from_json(doc, arg, where)
            except (MessageError, TypeError, ValueError, KeyError) as exc:
                errors.append(str(exc))
        raise MessageError(f"{where}: matches none of {tp} ({'; '.join(errors)[:200]})")
    if tp is type(None):
        if doc is not None:
            raise MessageError(f"{where}: expected null")
        return None
    if origin is typing.Literal:
        if doc not in args:
            raise MessageError(f"{where}: expected one of {args}")
        return doc
    if origin in (tuple, list, Sequence):
        if not isinstance(doc, list):
            raise MessageError(f"{where}: expected a list")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(doc):
                raise MessageError(f"{where}: expected {len(args)} items, got {len(doc)}")
            return tuple(
                _from_json(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(doc, args, strict=True))
            )
        item = args[0] if args else Any
        items = [_from_json(v, item, f"{where}[{i}]") for i, v in enumerate(doc)]
        return items if origin is list else tuple(items)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        key_tp, val_tp = args or (Any, Any)
        if not isinstance(doc, list) or not all(isinstance(p, list) and len(p) == 2 for p in doc):
            raise MessageError(f"{where}: expected a list of [key, value] pairs")
        return {
            _from_json(k, key_tp, f"{where} key"): _from_json(v, val_tp, f"{where}[{k!r}]") for k, v in doc
        }
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(doc, tp, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(doc)
        except ValueError:
            raise MessageError(f"{where}: {str(doc)[:40]!r} is not a {tp.__name__}") from None
    if tp is Path:
        if not isinstance(doc, str):
            raise MessageError(f"{where}: expected a path")
        return Path(doc)
    if tp is bool:
        if not isinstance(doc, bool):
            raise MessageError(f"{where}: expected true or false")
        return doc
    if tp is int:
        if not isinstance(doc, int) or isinstance(doc, bool):
            raise MessageError(f"{where}: expected an integer")
        return doc
    if tp is float:
        if not isinstance(doc, int | float) or isinstance(doc, bool):
            raise MessageError(f"{where}: expected a number")
        return float(doc)
    if tp is str:
        if not isinstance(doc, str):
            raise MessageError(f"{where}: expected a string")
        return doc
    raise MessageError(f"{where}: {tp} is not a message type")


def _dataclass(doc: Any, cls: type[T], where: str) -> T:
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    if not isinstance(doc, dict) or doc.get(TYPE) != cls.__name__:
        raise MessageError(f"{where}: expected a {cls.__name__} object")
    names = {f.name for f in fields} | {TYPE}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise MessageError(f"{where}: unknown fields {unknown} for {cls.__name__}")
    hints = _hints(cls)  # type: ignore[arg-type]
    values = {}
    for f in fields:
        if f.name in doc:
            values[f.name] = _from_json(doc[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MessageError(f"{where}: missing field {f.name!r} of {cls.__name__}")
    return cls(**values)


def _plain(doc: Any, where: str) -> Any:
    """JSON as it is (for values typed Any): only JSON's own types, nothing to construct."""
    if doc is None or isinstance(doc, bool | int | float | str):
        return doc
    if isinstance(doc, list):
        return [_plain(v, where) for v in doc]
    if isinstance(doc, dict):
        return {k: _plain(v, where) for k, v in doc.items()}
    raise MessageError(f"{where}: not JSON")
