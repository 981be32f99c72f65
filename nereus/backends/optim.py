"""AdamW over a rank's flat EMU buffers: the optimizer state is the EMU state, so transitions carry it.

The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias-corrected moments), applied
element-wise to whole flat buffers: param (or the fp32 master copy in bf16 mixed precision),
``exp_avg`` and ``exp_avg_sq``. Element-wise means the result of an update does not depend on how
the model is sharded. Weight decay skips one-dimensional tensors (norms, biases), as Megatron
does. The step count is the logical state's update counter. Gradient clipping uses the global
norm; ``norm_weights`` marks the elements this rank owns so replicated tensors count once.
Pure torch (the caller all-reduces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nereus.devices import CPU
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


def decay_weights(rb: RankBuffers, device: torch.device | str = CPU) -> Tensor:
    """1.0 on elements of matrices (weight decay applies), 0.0 on vectors and padding."""
    w = torch.zeros(rb.numel, dtype=torch.float32, device=device)
    for s in rb.slots:
        if len(s.shape) > 1:
            w[s.offset : s.offset + s.numel] = 1.0
    return w


def norm_weights(rs: RankState, t: int, kv_replication: int) -> Tensor:
    """1.0 where this rank owns the element for the global gradient norm.

    TP-replicated tensors count on TP rank 0; a KV head held by several TP ranks on the first of
    them; a tied head's copy on the last pipeline stage never (its embedding counts)."""
    rb = rs.layout_of()
    specs = {spec.at(layer): spec for spec, layer in tensors_at(rs.model, rs.layout.pp, rs.p)}
    w = torch.zeros(rb.numel, dtype=torch.float32, device=rs.buffers[BufferKind.PARAM].device)
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
            w[s.offset : s.offset + s.numel] = 1.0
    return w


class FlatAdamW:
    def __init__(self, config: AdamWConfig, rb: RankBuffers, device: torch.device | str = CPU) -> None:
        self.config = config
        self.decay = decay_weights(rb, device)

    def step(self, rs: RankState, grad: Tensor, step: int) -> None:
        """Apply update number ``step`` (1-based) with the fp32 flat gradient ``grad``."""
        c = self.config
        bufs = rs.buffers
        master = bufs.get(BufferKind.MASTER, bufs[BufferKind.PARAM])
        m, v = bufs[BufferKind.EXP_AVG], bufs[BufferKind.EXP_AVG_SQ]
        if c.weight_decay:
            master.mul_(1.0 - c.lr * c.weight_decay * self.decay)
        m.lerp_(grad, 1.0 - c.beta1)
        v.mul_(c.beta2).addcmul_(grad, grad, value=1.0 - c.beta2)
        bias1 = 1.0 - c.beta1**step
        bias2_sqrt = math.sqrt(1.0 - c.beta2**step)
        denom = (v.sqrt() / bias2_sqrt).add_(c.eps)
        master.addcdiv_(m, denom, value=-c.lr / bias1)
        if BufferKind.MASTER in bufs:
            bufs[BufferKind.PARAM].copy_(master)
