"""Generated tasks with checkable one-digit answers, small enough to learn by RL from scratch.

Every answer is one digit in base ``b = difficulty + 1`` (2 … 10): the difficulty knob sets the
answer space, which decides how fast a randomly initialised tiny model learns. The verifier's
format credit (``nereus.rl.verifiers``) rewards the first thing to learn, emitting a digit, long
before the right digit is found. Three kinds over ``length`` digits (default 2):

* ``copy``: the last digit, ``"copy 21=" → "1"`` (an attention look-back; learns fastest)
* ``max``:  the largest digit, ``"max 21=" → "2"``
* ``add``:  the sum mod b, ``"2+1=" → "0"`` (b = 3)

Learning fastest: ``copy`` at difficulty 2 with ``max_new_tokens = 1`` (the answer's length; the
verifier then sees the digit as if eos followed). From random weights a tiny model finds the
digits within ~15 GRPO steps and then the right one (tests/test_rl_learning.py). With a longer
budget the stop token, drawn ~1/512 of the time at first, takes far longer to learn.

Generation is deterministic in (kind, difficulty, length, seed) and prefix-stable in ``n``: the
first m records of ``generate_tasks(kind, n, seed)`` do not depend on n ≥ m.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

MAX_DIFFICULTY = 9  # base 10
MAX_LENGTH = 16


class TaskKind(StrEnum):
    COPY = "copy"
    MAX = "max"
    ADD = "add"


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One prompt and the answer a verifier checks a response against; a chat data set's prompt
    is its ``messages`` ((role, content) pairs, ``prompt`` then the last user turn) and its
    ``source`` the verl ``data_source`` that picks its verifier."""

    prompt: str
    answer: str
    id: str = ""
    messages: tuple[tuple[str, str], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("prompt", "answer", "id", "source"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"task {name} must be a string, got {getattr(self, name)!r}")
        if not self.prompt:
            raise ValueError("task prompt must not be empty")
        if not self.answer:
            raise ValueError("task answer must not be empty")

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "prompt": self.prompt, "answer": self.answer}


def _kind(kind: TaskKind | str) -> TaskKind:
    try:
        return TaskKind(kind)
    except ValueError:
        allowed = ", ".join(k.value for k in TaskKind)
        raise ValueError(f"task kind must be one of {allowed}, got {kind!r}") from None


def _one(kind: TaskKind, digits: list[int], base: int) -> tuple[str, str]:
    text = "".join(map(str, digits))
    if kind is TaskKind.COPY:
        return f"copy {text}=", str(digits[-1])
    if kind is TaskKind.MAX:
        return f"max {text}=", str(max(digits))
    return "+".join(map(str, digits)) + "=", str(sum(digits) % base)


def generate_tasks(
    kind: TaskKind | str, n: int, seed: int = 0, difficulty: int = 2, length: int = 2
) -> list[TaskRecord]:
    """``n`` records of ``kind``, each over ``length`` digits drawn uniformly from 0 … difficulty."""
    k = _kind(kind)
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if not 1 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"difficulty must be in [1, {MAX_DIFFICULTY}], got {difficulty}")
    if not 2 <= length <= MAX_LENGTH:
        raise ValueError(f"length must be in [2, {MAX_LENGTH}], got {length}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    base = difficulty + 1
    rng = random.Random(f"{k.value}/{difficulty}/{length}/{seed}")  # str seeds hash with sha512: stable
    out = []
    for i in range(n):
        prompt, answer = _one(k, [rng.randrange(base) for _ in range(length)], base)
        out.append(TaskRecord(prompt, answer, f"{k.value}-d{difficulty}-l{length}-s{seed}-{i}"))
    return out


def jsonl_text(records: Iterable[TaskRecord]) -> str:
    """One JSON object per line (``id``, ``prompt``, ``answer``): what ``write_jsonl`` writes."""
    return "".join(json.dumps(r.to_json()) + "\n" for r in records)


def write_jsonl(records: Iterable[TaskRecord], path: Path) -> int:
    """Write ``jsonl_text(records)`` to ``path`` whole, then rename it into place (a crash leaves
    the old file or the new one, never half); returns the record count."""
    records = list(records)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    tmp.write_text(jsonl_text(records), encoding="utf-8")
    os.replace(tmp, path)
    return len(records)
