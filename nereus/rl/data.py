"""Prompt datasets and the global sample order every DP split of a minibatch agrees on.

A dataset is a JSONL (or, with pyarrow, Parquet) file of records ``{"prompt": str, "answer": str,
"id": str | int | null (optional)}``, validated strictly on load: every bad record is a ``ConfigError``
naming the file, the line (Parquet: the row) and the field.

The global order (paper §2.15: a replica's data position is derived, never stored) is a seeded
permutation per epoch: global sample index i is position i mod n of epoch i // n. Minibatch p is
the samples ``sample_range(B, dp, rank, p)`` (``nereus.state.emu``) deals out, so the replicas of
any dp together take exactly the samples dp = 1 takes, none repeated or skipped.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nereus.errors import ConfigError
from nereus.rl.layouts import RecordLayout, encodable
from nereus.rl.tasks import TaskRecord
from nereus.rl.tokenizer import Tokenizer
from nereus.spec.files import unique_keys
from nereus.state.emu import sample_range

FIELDS = ("prompt", "answer", "id")
REQUIRED = ("prompt", "answer")
SUFFIXES = (".jsonl", ".json", ".parquet")  # .json: JSON Lines (as datasets' to_json writes) or an array


@dataclass(frozen=True, slots=True)
class Sample:
    """The record at global sample index ``index``: position ``position`` of epoch ``epoch``."""

    index: int
    epoch: int
    position: int
    record: TaskRecord

    def __post_init__(self) -> None:
        if min(self.index, self.epoch, self.position) < 0:
            raise ValueError(
                f"sample index, epoch and position must be non-negative, got {self.index}, {self.epoch}, "
                f"{self.position}"
            )


def _check(raw: object, where: str, tokenizer: Tokenizer, max_prompt_len: int, default_id: str) -> TaskRecord:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object with fields {', '.join(FIELDS)}")
    for key in raw:
        if key not in FIELDS:
            raise ConfigError(f"{where}: unknown field {key!r} (allowed: {', '.join(FIELDS)})")
    for key in REQUIRED:
        if key not in raw:
            raise ConfigError(f"{where}: missing field {key!r} (required: {', '.join(REQUIRED)})")
        value = raw[key]
        if not isinstance(value, str):
            raise ConfigError(f"{where}: field {key!r}: expected a string, got {value!r}")
        if not value:
            raise ConfigError(f"{where}: field {key!r}: must not be empty")
        encodable(value, f"{where}: field {key!r}")
    rid = raw.get("id")
    if rid is None:  # absent, or null (as a Parquet column without a value)
        rid = default_id
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        raise ConfigError(f"{where}: field 'id': expected a string or an integer, got {rid!r}")
    if isinstance(rid, str):
        encodable(rid, f"{where}: field 'id'")
    return TaskRecord(raw["prompt"], raw["answer"], str(rid))


def prompt_ids(tokenizer: Tokenizer, record: TaskRecord) -> list[int]:
    """A record's prompt ids: its chat messages through the tokenizer's template, else its text."""
    if not record.messages:
        return tokenizer.encode(record.prompt)
    encode_messages = getattr(tokenizer, "encode_messages", None)
    if encode_messages is None:
        raise ConfigError(
            "chat-message prompts need a Hugging Face tokenizer with a chat template (tokenizer: DIR)"
        )
    ids: list[int] = encode_messages([{"role": r, "content": c} for r, c in record.messages])
    return ids


def _fits(record: TaskRecord, where: str, tokenizer: Tokenizer, max_prompt_len: int) -> None:
    texts = [
        ("prompt", record.prompt),
        ("answer", record.answer),
        *(("prompt", c) for _, c in record.messages),
    ]
    for key, text in texts:
        bad = tokenizer.unknown(text)
        if bad is not None:
            raise ConfigError(
                f"{where}: field {key!r}: character {bad!r} is not in the tokenizer's alphabet "
                f"(allowed: {getattr(tokenizer, 'alphabet', '')!r})"
            )
    tokens = len(prompt_ids(tokenizer, record))
    if tokens > max_prompt_len:
        raise ConfigError(
            f"{where}: field 'prompt': {tokens} tokens (as encoded: template and special tokens) "
            f"exceed max_prompt_len {max_prompt_len}"
        )


def _check_file(path: Path) -> None:
    if path.is_dir():
        raise ConfigError(f"{path}: a folder, not a dataset file (allowed: a .jsonl, .json or .parquet file)")
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: unknown dataset format {path.suffix!r} (allowed: {', '.join(SUFFIXES)})")
    if not path.is_file():
        raise ConfigError(f"{path}: dataset file does not exist")


def _text_of(path: Path) -> str:
    """The file as text (a byte-order mark dropped, as Windows tools write one); bytes that are
    not UTF-8 are named by their line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def _rows(path: Path) -> list[tuple[str, int, object]]:
    """(location, line or row number, raw record) for each record of the file."""
    if path.suffix == ".parquet":
        try:
            pq = importlib.import_module("pyarrow.parquet")
        except ImportError:
            raise ConfigError(
                f"{path}: reading Parquet needs pyarrow (pip install pyarrow); or use JSONL"
            ) from None
        try:
            rows: list[Any] = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises its own error types for corrupt files
            raise ConfigError(f"{path}: not a readable Parquet file ({exc})") from None
        for i, r in enumerate(rows, 1):
            where = _nonfinite(r)
            if where is not None:
                raise ConfigError(
                    f"{path}:row {i}: field '{where}': NaN and Infinity are not values a record holds"
                )
        return [(f"{path}:row {i}", i, r) for i, r in enumerate(rows, 1)]
    text = _text_of(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of records
        try:
            array = json.loads(text, parse_constant=_no_constant, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        return [(f"{path}:record {i}", i, r) for i, r in enumerate(array, 1)]
    lines = text.splitlines()
    out: list[tuple[str, int, object]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_constant=_no_constant, object_pairs_hook=unique_keys)
            out.append((f"{path}:{n}", n, row))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        except ValueError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc})") from None
        except RecursionError:
            raise ConfigError(f"{path}:{n}: not valid JSON (nested too deeply)") from None
    return out


def _nonfinite(value: object, at: str = "") -> str | None:
    """Where in a Parquet record a NaN or infinite float sits (dotted path), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return at or "."
    if isinstance(value, dict):
        for k, v in value.items():
            found = _nonfinite(v, f"{at}.{k}" if at else str(k))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _nonfinite(v, f"{at}[{i}]")
            if found is not None:
                return found
    return None


def _no_constant(name: str) -> object:
    """JSON's NaN and Infinity are not values a record holds (an answer of NaN read as "nan")."""
    raise ValueError(f"{name} is not a number a record may hold")


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    key = hashlib.blake2b(f"{seed}/data/{epoch}".encode(), digest_size=8).digest()
    perm = list(range(n))
    random.Random(int.from_bytes(key, "little")).shuffle(perm)
    return tuple(perm)


@dataclass(frozen=True, slots=True, eq=False)
class PromptDataset:
    """Validated records in file order and the seed of the per-epoch order."""

    source: str
    records: tuple[TaskRecord, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.records:
            raise ConfigError(f"{self.source}: no records")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    @classmethod
    def load(
        cls, paths: Path | Sequence[Path], tokenizer: Tokenizer, max_prompt_len: int, seed: int = 0,
        layout: RecordLayout | None = None,
    ) -> PromptDataset:  # fmt: skip
        """Read and validate ``paths`` (``.jsonl``, ``.json`` or ``.parquet``; several files are
        one data set, in order, as verl's ``train_files``) in ``layout`` (default: ours). Ids must
        be unique; a row without one is its line or row number (in a later file, qualified by it)."""
        files = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
        if max_prompt_len <= 0:
            raise ValueError(f"max_prompt_len must be positive, got {max_prompt_len}")
        if not files:
            raise ConfigError("no dataset file named")
        for path in files:
            _check_file(path)
        id_key = layout.id_key if layout is not None else "id"
        records: list[TaskRecord] = []
        seen: dict[str, str] = {}
        for k, path in enumerate(files):
            for where, number, raw in _rows(path):
                default = str(number) if k == 0 else f"{path}:{number}"
                if layout is None or layout.name == "nereus":
                    r = _check(raw, where, tokenizer, max_prompt_len, default)
                else:
                    r = layout.record(raw, where, default)
                _fits(r, where, tokenizer, max_prompt_len)
                if r.id in seen:
                    raise ConfigError(f"{where}: column {id_key!r}: {r.id!r} repeats the id of {seen[r.id]}")
                seen[r.id] = where
                records.append(r)
        return cls(", ".join(map(str, files)), tuple(records), seed)

    def __len__(self) -> int:
        return len(self.records)

    def order(self, epoch: int) -> tuple[int, ...]:
        """Epoch ``epoch``'s permutation of the record indices (stable across processes and runs)."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        return _permutation(self.seed, epoch, len(self.records))

    def samples(self, start: int, count: int) -> list[Sample]:
        """Global sample indices ``start … start + count − 1``, crossing epochs as needed."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be non-negative, got {start}, {count}")
        n = len(self.records)
        orders: dict[int, tuple[int, ...]] = {}
        out = []
        for i in range(start, start + count):
            epoch, pos = divmod(i, n)
            if epoch not in orders:
                orders[epoch] = self.order(epoch)
            out.append(Sample(i, epoch, pos, self.records[orders[epoch][pos]]))
        return out

    def shard(self, batch: int, dp: int, dp_rank: int, minibatch: int) -> list[Sample]:
        """DP rank ``dp_rank``'s share of minibatch ``minibatch`` of ``batch`` samples."""
        r = sample_range(batch, dp, dp_rank, minibatch)
        return self.samples(r.start, len(r))


def collate(
    samples: Sequence[Sample],
    tokenizer: Tokenizer,
    samples_per_prompt: int = 1,
    pad_to: int | None = None,
) -> tuple[Tensor, Tensor, list[int]]:
    """Prompt ids (B, P) left-padded with pad, validity (B, P) int64, and one sample id per row.

    Each prompt is repeated ``samples_per_prompt`` (GRPO's G) times: row s·G + g is draw g of
    sample s, with sample id ``index·G + g`` (distinct, and independent of the DP split). P is the
    longest prompt, or ``pad_to`` when given (it must fit every prompt).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    if samples_per_prompt <= 0:
        raise ValueError(f"samples_per_prompt must be positive, got {samples_per_prompt}")
    encoded = [prompt_ids(tokenizer, s.record) for s in samples]
    longest = max(map(len, encoded))
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to {pad_to} is shorter than the longest prompt ({longest} tokens)")
    g = samples_per_prompt
    ids = torch.full((len(samples) * g, width), tokenizer.pad_id, dtype=torch.long)
    valid = torch.zeros((len(samples) * g, width), dtype=torch.long)
    sample_ids = []
    for s, (sample, enc) in enumerate(zip(samples, encoded, strict=True)):
        rows = slice(s * g, (s + 1) * g)
        ids[rows, width - len(enc) :] = torch.tensor(enc, dtype=torch.long)
        valid[rows, width - len(enc) :] = 1
        sample_ids += [sample.index * g + k for k in range(g)]
    return ids, valid, sample_ids
