"""Small collectives over the current world: the runtime's control messages (edge module).

Control messages (setup, plans, actions, pool changes, per-rank reports) are small Python values
sent with torch.distributed's object collectives; numbers every rank must agree on (a slowest
rank's seconds, a loss one rank knows) travel as one float64 tensor.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def broadcast(obj: object) -> Any:
    """``obj`` from rank 0 on every rank (others pass None); callers annotate what they receive."""
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def reduce_max(x: float) -> float:
    """The largest ``x`` over the world."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def from_rank(x: float, src: int) -> float:
    """A value rank ``src`` knows (a model-stage's loss agrees on all its ranks), on every rank."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.broadcast(t, src=src)
    return float(t)
