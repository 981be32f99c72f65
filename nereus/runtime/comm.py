"""Small collectives over the current world: the runtime's control messages (edge module).

Control messages (setup, plans, actions, pool changes, per-rank reports) travel as JSON checked
against the type the receiver expects (``codec.py``): the sender's bytes are broadcast or
gathered as uint8 tensors, never pickled, so a peer can send only values of the expected types.
Tensors (rollouts, scores) travel as tensors. Numbers every rank must agree on (a slowest rank's
seconds, a loss one rank knows) travel as one float64 tensor.

A message travels in one fixed-size slot of ``SLOT`` bytes — its length (8 bytes) and its first
bytes — so a small one (an action, a pool change, a rank's report) costs one collective; only
the rest of a larger one (the job's setup, a plan) follows in a second. ``gather`` brings every
rank's message to one rank only (the leader's telemetry: nobody else reads it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.runtime.codec import MAX_BYTES, MessageError, decode, encode

SLOT = 4096  # bytes of a message's first collective: its length, then its first bytes
HEAD = 8  # the length: a little-endian int64
ROOM = SLOT - HEAD  # a message's bytes that fit in its slot


def _bytes(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _slot(data: bytes) -> Tensor:
    """``data``'s length and its first ``ROOM`` bytes in one ``SLOT``-byte tensor."""
    slot = torch.zeros(SLOT, dtype=torch.uint8)
    first = data[:ROOM]
    slot[:HEAD] = _bytes(len(data).to_bytes(HEAD, "little"))
    slot[HEAD : HEAD + len(first)] = _bytes(first)
    return slot


def _length(slot: Tensor, who: str) -> int:
    n = int.from_bytes(slot[:HEAD].numpy().tobytes(), "little", signed=True)
    if not 0 < n <= MAX_BYTES:
        raise MessageError(f"{who} announced a message of {n} bytes")
    return n


def _first(slot: Tensor, n: int) -> bytes:
    return slot[HEAD : HEAD + min(n, ROOM)].numpy().tobytes()


def broadcast(obj: object, tp: Any, src: int = 0) -> Any:
    """``obj`` (of type ``tp``) from rank ``src`` on every rank; the others pass None. One
    collective for a message of up to ``ROOM`` bytes, two for a larger one."""
    mine = dist.get_rank() == src
    data = broadcast_bytes(encode(obj) if mine else b"", src)
    return obj if mine else decode(data, tp)


def broadcast_bytes(data: bytes, src: int = 0) -> bytes:
    """Rank ``src``'s ``data`` on every rank (the others pass b""): tensors and other binary
    payloads whose reader checks them (``pending.unpack``); one collective up to ``ROOM`` bytes."""
    mine = dist.get_rank() == src
    slot = _slot(data) if mine else torch.empty(SLOT, dtype=torch.uint8)
    dist.broadcast(slot, src=src)
    n = _length(slot, f"rank {src}")
    rest = _bytes(data[ROOM:]) if mine else torch.empty(max(0, n - ROOM), dtype=torch.uint8)
    if n > ROOM:
        dist.broadcast(rest, src=src)
    return data if mine else _first(slot, n) + rest.numpy().tobytes()


def all_gather(obj: object, tp: Any) -> list[Any]:
    """Every rank's ``obj`` (of type ``tp``), in rank order. One collective when every message
    fits in ``ROOM`` bytes; otherwise a second carries the rest of the larger ones."""
    data = encode(obj)
    world, me = dist.get_world_size(), dist.get_rank()
    slots = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(slots, _slot(data))
    lengths = [_length(s, f"rank {r}") for r, s in enumerate(slots)]
    width = max(lengths) - ROOM
    rests = [torch.zeros(0, dtype=torch.uint8) for _ in range(world)]
    if width > 0:
        buf = torch.zeros(width, dtype=torch.uint8)
        tail = data[ROOM:]
        buf[: len(tail)] = _bytes(tail)
        rests = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(rests, buf)
    return [
        obj if r == me else decode(_first(slots[r], n) + rests[r][: max(0, n - ROOM)].numpy().tobytes(), tp)
        for r, n in enumerate(lengths)
    ]


def gather(obj: object, tp: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` (of type ``tp``) on rank ``dst``, in rank order; None elsewhere
    (``dst`` keeps its own ``obj`` as it is: it is neither encoded nor sent)."""
    me = dist.get_rank()
    got = gather_bytes(encode(obj) if me != dst else b"", dst)
    return None if got is None else [obj if r == me else decode(data, tp) for r, data in enumerate(got)]


def gather_bytes(data: bytes, dst: int = 0) -> list[bytes] | None:
    """Every rank's ``data`` on rank ``dst``, in rank order (``dst``'s own as it is); None
    elsewhere. One collective; a rank whose ``data`` is longer than ``ROOM`` bytes sends the rest
    to ``dst`` alone."""
    world, me = dist.get_world_size(), dist.get_rank()
    slots = [torch.empty(SLOT, dtype=torch.uint8) for _ in range(world)] if me == dst else None
    dist.gather(_slot(data) if me != dst else torch.zeros(SLOT, dtype=torch.uint8), slots, dst=dst)
    if me != dst:
        if len(data) > ROOM:
            dist.send(_bytes(data[ROOM:]), dst=dst)
        return None
    assert slots is not None
    out: list[bytes] = []
    for r, slot in enumerate(slots):
        if r == me:
            out.append(data)
            continue
        n = _length(slot, f"rank {r}")
        rest = torch.empty(max(0, n - ROOM), dtype=torch.uint8)
        if n > ROOM:
            dist.recv(rest, src=r)
        out.append(_first(slot, n) + rest.numpy().tobytes())
    return out


def gather_parts(
    part: tuple[int, Sequence[Tensor]] | None, dtypes: Sequence[torch.dtype], group: Any = None
) -> list[tuple[int, list[Tensor]]]:
    """Every rank's part — a first row and 2-D tensors of ``dtypes`` — for the ranks that have
    one, in rank order (the replicas' results, gathered as tensors), over ``group`` (the world
    by default)."""
    k, world = len(dtypes), dist.get_world_size(group)
    header = torch.zeros(2 + 2 * k, dtype=torch.int64)
    if part is not None:
        start, tensors = part
        header[0], header[1] = 1, start
        for i, t in enumerate(tensors):
            if t.dim() != 2:
                raise ValueError(f"gather_parts: tensor {i} has {t.dim()} dimensions, expected 2")
            header[2 + 2 * i], header[3 + 2 * i] = t.shape
    headers = [torch.zeros_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    shapes = [[(int(h[2 + 2 * i]), int(h[3 + 2 * i])) for i in range(k)] for h in headers]
    columns: list[list[Tensor]] = []
    for i, dtype in enumerate(dtypes):
        width = max([1, *(s[i][0] * s[i][1] for s in shapes)])
        flat = torch.zeros(width, dtype=dtype)
        if part is not None:
            t = part[1][i].to(dtype).reshape(-1)
            flat[: t.numel()] = t
        got = [torch.empty(width, dtype=dtype) for _ in range(world)]
        dist.all_gather(got, flat, group=group)
        columns.append(got)
    out = []
    for r, h in enumerate(headers):
        if int(h[0]):
            tensors = [columns[i][r][: a * b].reshape(a, b) for i, (a, b) in enumerate(shapes[r])]
            out.append((int(h[1]), tensors))
    return out


# what gloo says when a peer is gone: mid-collective (closed, reset, broken pipe, timed out), or
# while a new group connects to it (``connectFullMesh failed ... Connect timeout`` or refused)
PEER_GONE = (
    "Connection closed", "Connection reset", "Connection refused", "Broken pipe", "Timed out", "timed out",
    "Connect timeout", "connectFullMesh failed",
)  # fmt: skip


def is_peer_failure(exc: BaseException) -> bool:
    """A collective, or a group forming, failed because a peer is gone (gloo closes or cannot
    open the connection; NCCL reports a backend error), as opposed to a bug in this process."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in PEER_GONE)


def first_line(exc: BaseException) -> str:
    """A failure's first line (torch's distributed errors carry pages of C++ stack frames)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def reduce_max(x: float) -> float:
    """The largest ``x`` over the world."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def barrier() -> None:
    """Return once every rank of the world got here: an all-reduce of a CPU tensor, so over the
    control backend (gloo) in a GPU world too; no rank gets through before all arrived."""
    dist.all_reduce(torch.zeros(1, dtype=torch.int64))


def from_rank(x: float, src: int, group: Any = None) -> float:
    """A value world rank ``src`` knows (a model-stage's loss agrees on all its ranks), on every
    rank of ``group`` (the world by default)."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.broadcast(t, src=src, group=group)
    return float(t)
