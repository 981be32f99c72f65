"""How a dataset's rows become task records: the column layouts users bring.

* ``nereus`` (``dataset: FILE``): ``{"prompt": str, "answer": str, "id": str | int | null}``.
* ``verl`` (verl's RL data sets, e.g. its GSM8K and MATH preprocessors): ``prompt`` a list of
  ``{"role", "content"}`` chat messages, ``reward_model: {"ground_truth", "style"}``,
  ``data_source`` (which verifier scores the row under ``verifier: by_source``) and an optional
  ``extra_info`` (its ``index`` is the record's id).
* ``qa``: ``{"question", "answer"}``, the prompt made of the question by ``template`` (for
  example ``"{question} Let's think step by step and output the final answer after ####."``).

Column names are the ``DataSpec``'s; a row that does not fit is one ``ConfigError`` naming the
file, the row and the column. Pure (no torch).
"""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from nereus.errors import ConfigError
from nereus.rl.tasks import TaskRecord

LAYOUTS = ("nereus", "verl", "qa")


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """Which columns hold what (defaults: each layout's usual names)."""

    name: str = "nereus"
    prompt_key: str = "prompt"  # nereus: the prompt text; verl: the chat messages
    question_key: str = "question"  # qa
    answer_key: str = ""  # nereus, qa: "answer"; verl: "reward_model.ground_truth"
    source_key: str = "data_source"  # verl
    template: str = "{question}"  # qa
    by_source: bool = False  # verl: each row's source picks its verifier, so it must name a known one

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {self.name!r}")
        if "{question}" not in self.template:
            raise ValueError(f"template must contain {{question}}, got {self.template!r}")
        why = _template_error(self.template)
        if why:
            raise ValueError(f"template {self.template!r}: {why}")

    @property
    def id_key(self) -> str:
        """The column a row's id comes from (verl: ``extra_info.index``, per data source)."""
        return "extra_info.index" if self.name == "verl" else "id"

    @property
    def answer(self) -> str:
        if self.answer_key:
            return self.answer_key
        return "reward_model.ground_truth" if self.name == "verl" else "answer"

    def record(self, raw: object, where: str, default_id: str) -> TaskRecord:
        """The task record of one row (``default_id``: its line or row number)."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected an object with the {self.name} layout's columns")
        if self.name == "verl":
            messages = _messages(_column(raw, self.prompt_key, where), f"{where}: column {self.prompt_key!r}")
            source = _column(raw, self.source_key, where) if self.source_key in raw or self.by_source else ""
            if source is None and not self.by_source:  # a null source no verifier routes by: unused
                source = ""
            if not isinstance(source, str):
                raise ConfigError(f"{where}: column {self.source_key!r}: expected a string, got {source!r}")
            encodable(source, f"{where}: column {self.source_key!r}")
            if self.by_source:
                from nereus.rl.verifiers import verifier_for_source

                try:
                    verifier_for_source(source)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: column {self.source_key!r}: {exc}") from None
            extra = raw.get("extra_info")
            index = extra.get("index") if isinstance(extra, Mapping) else None
            rid = self._id(index, where, default_id, source)
            prompt = next((c for r, c in reversed(messages) if r == "user"), messages[-1][1])
            return _task(prompt, _text(_column(raw, self.answer, where), where, self.answer), rid, where,
                         messages, source)  # fmt: skip
        rid = self._id(raw.get("id"), where, default_id)
        if self.name == "qa":
            question = _text(_column(raw, self.question_key, where), where, self.question_key)
            answer = _text(_column(raw, self.answer, where), where, self.answer)
            return _task(self.template.format(question=question), answer, rid, where)
        prompt = _text(_column(raw, self.prompt_key, where), where, self.prompt_key)
        return _task(prompt, _text(_column(raw, self.answer, where), where, self.answer), rid, where)

    def _id(self, raw: object, where: str, default_id: str, source: str = "") -> str:
        """A row's id: its ``id_key`` column as written (a string, or an integer: a float column's
        integral value, as pandas writes an integer column holding nulls, is that integer), else
        ``default_id``. verl numbers each source's rows apart (GSM8K and MATH both from 0), so a
        verl id is qualified by its source."""
        if raw is None:
            return default_id
        if isinstance(raw, float) and raw.is_integer():
            raw = int(raw)
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise ConfigError(
                f"{where}: column {self.id_key!r}: expected a string or an integer, got {raw!r}"
            )
        if isinstance(raw, str):
            encodable(raw, f"{where}: column {self.id_key!r}")
        return f"{source}/{raw}" if source else str(raw)


def _column(raw: Mapping[str, Any], key: str, where: str) -> Any:
    """The value at ``key`` (dots go into nested objects: ``reward_model.ground_truth``)."""
    value: Any = raw
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            there = ", ".join(sorted(str(k) for k in value)[:12]) if isinstance(value, Mapping) else ""
            found = f"the row has {there}; " if there else ""
            raise ConfigError(
                f"{where}: missing column {key!r} ({found}data.prompt_key, question_key, answer_key and "
                "source_key name the columns)"
            )
        value = value[part]
    return value


def _text(value: Any, where: str, key: str) -> str:
    """A string column (a number in a ground-truth column reads as its text)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{where}: column {key!r}: expected a string, got {value!r}")
    # a float column as written in positional notation (str(1e16) is '1e+16', which reads as 1)
    text = (
        format(Decimal(repr(value)).normalize(), "f")  # 72.0 → 72, 1e16 → 10000000000000000
        if isinstance(value, float) and math.isfinite(value)
        else str(value)
    )
    if not text.strip():
        raise ConfigError(f"{where}: column {key!r}: must not be empty")
    encodable(text, f"{where}: column {key!r}")
    return text


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of {{role, content}} messages")
    out = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ConfigError(f"{where}: message {i}: expected {{role: str, content: str}}, got {m!r}")
        for field in ("role", "content"):
            encodable(m[field], f"{where}: message {i}: {field}")
        out.append((m["role"], m["content"]))
    return tuple(out)


def encodable(text: str, where: str) -> None:
    """``text`` is text: JSON may escape a lone surrogate (``"\\ud800"``), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end].encode("unicode_escape").decode()
        raise ConfigError(f"{where}: not text (a lone surrogate {bad} at character {exc.start})") from None


def _task(
    prompt: str,
    answer: str,
    rid: str,
    where: str,
    messages: tuple[tuple[str, str], ...] = (),
    source: str = "",
) -> TaskRecord:
    if not prompt:
        raise ConfigError(f"{where}: the prompt is empty")
    return TaskRecord(prompt, answer, rid, messages, source)


def _template_error(template: str) -> str:
    """Why ``template`` is not text with bare ``{question}`` fields ("" when it is): no attribute,
    index, conversion or format spec of it (``{question.__class__}``), braces written ``{{ }}``."""
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"not a format string ({exc}; write {{{{ and }}}} for braces)"
    if any((f, spec, conv) != ("question", "", None) for f, spec, conv in fields):
        return "only a bare {question} may be substituted (write {{ and }} for braces)"
    return ""
