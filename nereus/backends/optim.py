"""AdamW over a rank's flat EMU buffers: the optimizer state is the EMU state, so transitions carry it.

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias-corrected moments), applied
element-wise to whole flat buffers: param (or the fp32 master copy in bf16 mixed precision),
``exp_avg`` and ``exp_avg_sq``. Element-wise means the result of an update does not depend on how
the model is sharded. Weight decay skips one-dimensional tensors (norms, biases), as Megatron
does. The step count is the logical state's update counter. Gradient clipping uses the global
norm; ``norm_ranges`` are the elements this rank owns, so replicated tensors count once.
Pure torch (the caller all-reduces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nereus.state.buffers import BufferKind, RankBuffers
from nereus.state.geometry import Partition, tensors_at
from nereus.state.holder import RankState


@dataclass(frozen=True, slots=True)
class AdamWConfig:
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0  # 0: no clipping

    def __post_init__(self) -> None:
        if self.lr < 0 or self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("lr, weight_decay and max_grad_norm must be non-negative and eps positive")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


Ranges = tuple[tuple[int, int], ...]  # (offset, end) spans of a flat buffer, ascending, disjoint
NORM_CHUNK = 1 << 22  # elements squared in fp64 at once: 32 MiB, not a buffer-sized fp64 copy


def _spans(pairs: list[tuple[int, int]]) -> Ranges:
    """Adjacent spans merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in pairs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        elif hi > lo:
            out.append((lo, hi))
    return tuple(out)


def decay_ranges(rb: RankBuffers) -> Ranges:
    """The spans of matrices' elements (weight decay applies; not to vectors, nor padding)."""
    return _spans([(s.offset, s.offset + s.numel) for s in rb.slots if len(s.shape) > 1])


def norm_ranges(rs: RankState, t: int, kv_replication: int) -> Ranges:
    """The spans of elements this rank owns for the global gradient norm.

    TP-replicated tensors count on TP rank 0; a KV head held by several TP ranks on the first of
    them; a tied head's copy on the last pipeline stage never (its embedding counts)."""
    rb = rs.layout_of()
    specs = {spec.at(layer): spec for spec, layer in tensors_at(rs.model, rs.layout.pp, rs.p)}
    owned = []
    for s in rb.slots:
        spec = specs[s.name]
        if s.source != s.name:
            own = False
        elif spec.partition is Partition.REPLICATED:
            own = t == 0
        elif spec.kv and kv_replication > 1:
            own = t % kv_replication == 0
        else:
            own = True
        if own:
            owned.append((s.offset, s.offset + s.numel))
    return _spans(owned)


def squared_norm(grad: Tensor, spans: Ranges) -> Tensor:
    """Σ grad² over ``spans``, in fp64 (a 0-d tensor on grad's device), a chunk at a time: the
    trainer's peak memory stays its state and one fp32 gradient."""
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for lo, hi in spans:
        for at in range(lo, hi, NORM_CHUNK):
            total += grad[at : min(hi, at + NORM_CHUNK)].double().square().sum()
    return total


class FlatAdamW:
    def __init__(self, config: AdamWConfig, rb: RankBuffers) -> None:
        self.config = config
        self.decay = decay_ranges(rb)

    def step(self, rs: RankState, grad: Tensor, step: int) -> None:
        """Apply update number ``step`` (1-based) with the fp32 flat gradient ``grad``."""
        c = self.config
        bufs = rs.buffers
        master = bufs.get(BufferKind.MASTER, bufs[BufferKind.PARAM])
        m, v = bufs[BufferKind.EXP_AVG], bufs[BufferKind.EXP_AVG_SQ]
        if c.weight_decay:  # the factor rounded to fp32 as an fp32 product with a 0/1 mask would be
            keep = (1.0 - torch.tensor(c.lr * c.weight_decay, dtype=torch.float32)).to(master.device)
            for lo, hi in self.decay:
                master[lo:hi].mul_(keep)
        m.lerp_(grad, 1.0 - c.beta1)
        v.mul_(c.beta2).addcmul_(grad, grad, value=1.0 - c.beta2)
        bias1 = 1.0 - c.beta1**step
        bias2_sqrt = math.sqrt(1.0 - c.beta2**step)
        denom = v.sqrt().div_(bias2_sqrt).add_(c.eps)  # one temporary the size of the buffer
        master.addcdiv_(m, denom, value=-c.lr / bias1)
        if BufferKind.MASTER in bufs:
            bufs[BufferKind.PARAM].copy_(master)
