"""The batches generated ahead of training (asynchronous RL), as bytes: for a checkpoint, for a
newcomer, for survivors that roll back.

Every worker holds the same ``pending`` batches (``Worker.pending``: step → ``Batch``): they are
job state like the trainers' weights, so a checkpoint keeps them (a resume neither repeats nor
skips samples, and trains each batch under the version that generated it), a newcomer receives
them from the leader, and a rollback restores them with the boundary's snapshot.

The format is a JSON header — per batch its step, version, prompt length, sample ids and shape
(and its greedy baseline's, and the engine's ``probs_diff`` where measured) — then the tensors'
raw little-endian bytes in a fixed order: token ids as int32, the valid and response masks as
uint8, the behaviour log-probs as float32. Nothing is unpickled; ``unpack`` checks every field
and the exact byte count, and refuses anything else with a ``ValueError`` naming what is wrong.
Edge module (torch; ``share`` is collective over the world).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nereus.runtime.comm import broadcast_bytes
from nereus.runtime.rollout import PROBS_DIFF, Batch, Rollouts

FORMAT = "nereus-pending/1"
HEAD = 8  # the header's length, little-endian
MAX_HEADER = 64 << 20
ID, FLAG, LOGP = torch.int32, torch.uint8, torch.float32


def pack(pending: Mapping[int, Batch]) -> bytes:
    """``pending`` as bytes (``unpack`` reads them back exactly)."""
    heads: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for step in sorted(pending):
        b = pending[step]
        head = {"step": b.step, "version": b.version, **_head(b.rollouts), "baseline": None}
        if b.probs_diff:
            head["probs_diff"] = dict(b.probs_diff)
        blobs += [*_blobs(b.rollouts), _raw(b.behaviour, LOGP)]
        if b.baseline is not None:
            head["baseline"] = _head(b.baseline)
            blobs += _blobs(b.baseline)
        heads.append(head)
    header = json.dumps({"format": FORMAT, "batches": heads}, separators=(",", ":")).encode()
    return len(header).to_bytes(HEAD, "little") + header + b"".join(blobs)


def unpack(data: bytes) -> dict[int, Batch]:
    """The batches ``pack`` wrote; anything else is a ``ValueError`` naming the fault."""
    n = int.from_bytes(data[:HEAD], "little")
    if len(data) < HEAD or not 0 < n <= min(MAX_HEADER, len(data) - HEAD):
        raise ValueError("pending batches: no header")
    try:
        doc = json.loads(data[HEAD : HEAD + n])
    except ValueError as exc:
        raise ValueError(f"pending batches: header is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("batches"), list):
        raise ValueError(f"pending batches: expected format {FORMAT!r}")
    reader = _Reader(data, HEAD + n)
    out: dict[int, Batch] = {}
    for i, head in enumerate(doc["batches"]):
        where = f"pending batch {i}"
        if not isinstance(head, dict):
            raise ValueError(f"{where}: not an object")
        step, version = _whole(head, "step", where), _whole(head, "version", where)
        r = reader.rollouts(head, where)
        behaviour = reader.take(r.ids.shape, LOGP, f"{where}: behaviour")
        base = head.get("baseline")
        baseline = reader.rollouts(base, f"{where}: baseline") if base is not None else None
        if step in out:
            raise ValueError(f"{where}: step {step} twice")
        out[step] = Batch(step, version, r, behaviour, baseline, _probs_diff(head, where))
    if reader.at != len(data):
        raise ValueError(f"pending batches: {len(data) - reader.at} bytes after the last batch")
    return out


def share(pending: Mapping[int, Batch] | None, src: int = 0) -> dict[int, Batch]:
    """Rank ``src``'s pending batches on every rank (the others pass None; collective)."""
    return unpack(broadcast_bytes(pack(pending) if pending is not None else b"", src))


def _probs_diff(head: Mapping[str, Any], where: str) -> dict[str, float]:
    got = head.get("probs_diff", {})
    if not isinstance(got, dict) or not set(got) <= set(PROBS_DIFF):
        raise ValueError(f"{where}: 'probs_diff' must map some of {list(PROBS_DIFF)} to numbers")
    for key, value in got.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(f"{where}: probs_diff {key!r} must be a number in [0, 1], got {value!r}")
    return {k: float(v) for k, v in got.items()}


def _head(r: Rollouts) -> dict[str, Any]:
    rows, width = (int(x) for x in r.ids.shape)
    return {"prompt_len": r.prompt_len, "sample_ids": list(r.sample_ids), "rows": rows, "width": width}


def _raw(t: Tensor, dtype: torch.dtype) -> bytes:
    data = t.detach().to("cpu", dtype).contiguous()
    if sys.byteorder != "little" and data.element_size() > 1:
        data = data.view(torch.uint8).reshape(-1, data.element_size()).flip(1)
    return data.numpy().tobytes()


def _blobs(r: Rollouts) -> list[bytes]:
    return [_raw(r.ids, ID), _raw(r.valid, FLAG), _raw(r.mask, FLAG)]


def _whole(head: Mapping[str, Any], key: str, where: str) -> int:
    value = head.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: {key!r} must be a non-negative whole number, got {value!r}")
    return value


class _Reader:
    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, where: str) -> Tensor:
        count = 1
        for x in shape:
            count *= int(x)
        size = count * torch.empty(0, dtype=dtype).element_size()
        if self.at + size > len(self.data):
            raise ValueError(f"{where}: the data ends early")
        chunk = bytearray(self.data[self.at : self.at + size])
        self.at += size
        t = torch.frombuffer(chunk, dtype=dtype) if size else torch.empty(0, dtype=dtype)
        if sys.byteorder != "little" and t.element_size() > 1:
            t = t.view(torch.uint8).reshape(-1, t.element_size()).flip(1).contiguous().view(dtype)
        return t.reshape(tuple(int(x) for x in shape)).clone()

    def rollouts(self, head: Any, where: str) -> Rollouts:
        if not isinstance(head, dict):
            raise ValueError(f"{where}: not an object")
        rows, width, prompt = (_whole(head, k, where) for k in ("rows", "width", "prompt_len"))
        ids = head.get("sample_ids")
        if (
            not isinstance(ids, list)
            or len(ids) != rows
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in ids)
        ):
            raise ValueError(f"{where}: 'sample_ids' must be {rows} non-negative whole numbers")
        if prompt > width:
            raise ValueError(f"{where}: prompt_len {prompt} exceeds the width {width}")
        tokens = self.take((rows, width), ID, f"{where}: ids").long()
        valid = self.take((rows, width), FLAG, f"{where}: valid").long()
        mask = self.take((rows, width), FLAG, f"{where}: mask").long()
        if bool((valid > 1).any()) or bool((mask > 1).any()) or bool((mask > valid).any()):
            raise ValueError(f"{where}: masks must be 0/1, the response mask within the valid one")
        if bool((tokens < 0).any()):
            raise ValueError(f"{where}: negative token ids")
        return Rollouts(tokens, valid, mask, tuple(ids), prompt)
