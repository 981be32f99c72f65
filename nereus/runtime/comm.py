"""Small collectives over the current world: the runtime's control messages (edge module).

Control messages (setup, plans, actions, pool changes, per-rank reports) travel as JSON checked
against the type the receiver expects (``codec.py``): the sender's bytes are broadcast or
gathered as uint8 tensors, never pickled, so a peer can send only values of the expected types.
Tensors (rollouts, scores) travel as tensors. Numbers every rank must agree on (a slowest rank's
seconds, a loss one rank knows) travel as one float64 tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.runtime.codec import MAX_BYTES, MessageError, decode, encode


def _bytes(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def broadcast(obj: object, tp: Any, src: int = 0) -> Any:
    """``obj`` (of type ``tp``) from rank ``src`` on every rank; the others pass None."""
    mine = dist.get_rank() == src
    data = encode(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src)
    n = int(size)
    if not 0 < n <= MAX_BYTES:
        raise MessageError(f"rank {src} announced a message of {n} bytes")
    buf = _bytes(data) if mine else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return obj if mine else decode(buf.numpy().tobytes(), tp)


def all_gather(obj: object, tp: Any) -> list[Any]:
    """Every rank's ``obj`` (of type ``tp``), in rank order."""
    data = encode(obj)
    world, me = dist.get_world_size(), dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    lengths = [int(s) for s in sizes]
    if not all(0 < n <= MAX_BYTES for n in lengths):
        raise MessageError(f"message sizes {lengths} out of range")
    width = max(lengths)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = _bytes(data)
    bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [obj if r == me else decode(bufs[r][: lengths[r]].numpy().tobytes(), tp) for r in range(world)]


def gather_parts(
    part: tuple[int, Sequence[Tensor]] | None, dtypes: Sequence[torch.dtype]
) -> list[tuple[int, list[Tensor]]]:
    """Every rank's part — a first row and 2-D tensors of ``dtypes`` — for the ranks that have
    one, in rank order (the replicas' results, gathered as tensors)."""
    k, world = len(dtypes), dist.get_world_size()
    header = torch.zeros(2 + 2 * k, dtype=torch.int64)
    if part is not None:
        start, tensors = part
        header[0], header[1] = 1, start
        for i, t in enumerate(tensors):
            if t.dim() != 2:
                raise ValueError(f"gather_parts: tensor {i} has {t.dim()} dimensions, expected 2")
            header[2 + 2 * i], header[3 + 2 * i] = t.shape
    headers = [torch.zeros_like(header) for _ in range(world)]
    dist.all_gather(headers, header)
    shapes = [[(int(h[2 + 2 * i]), int(h[3 + 2 * i])) for i in range(k)] for h in headers]
    columns: list[list[Tensor]] = []
    for i, dtype in enumerate(dtypes):
        width = max([1, *(s[i][0] * s[i][1] for s in shapes)])
        flat = torch.zeros(width, dtype=dtype)
        if part is not None:
            t = part[1][i].to(dtype).reshape(-1)
            flat[: t.numel()] = t
        got = [torch.empty(width, dtype=dtype) for _ in range(world)]
        dist.all_gather(got, flat)
        columns.append(got)
    out = []
    for r, h in enumerate(headers):
        if int(h[0]):
            tensors = [columns[i][r][: a * b].reshape(a, b) for i, (a, b) in enumerate(shapes[r])]
            out.append((int(h[1]), tensors))
    return out


def reduce_max(x: float) -> float:
    """The largest ``x`` over the world."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def barrier() -> None:
    """Return once every rank of the world got here: an all-reduce of a CPU tensor, so over the
    control backend (gloo) in a GPU world too; no rank gets through before all arrived."""
    dist.all_reduce(torch.zeros(1, dtype=torch.int64))


def from_rank(x: float, src: int) -> float:
    """A value rank ``src`` knows (a model-stage's loss agrees on all its ranks), on every rank."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.broadcast(t, src=src)
    return float(t)
