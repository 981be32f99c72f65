"""Training on a bound stage: one ``train_step`` is gradient accumulation, reductions, clipping and
one AdamW update.

- PP training: ``torch.distributed.pipelining`` (1F1B when there are at least as many
  micro-batches as stages, else GPipe), with static stage metadata; the attention mask travels
  with the hidden states. Without PP, micro-batches run forward and backward one after another.
- DP: EMU replicas; gradients are all-reduced over the ``dp`` group, after the TP-partial
  (Qwen3's q/k norms), KV-replica and tied-embedding reductions (``BoundStage.reductions``).
- Optimizer: ``FlatAdamW`` over the flat buffers; the step count is the logical state's.
  Clipping uses the global norm, each element counted once (``norm_ranges``).
Edge module (torch.distributed).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.hooks import RemovableHandle

from nereus.backends.model import DecoderStage
from nereus.backends.optim import AdamWConfig, FlatAdamW, Ranges, norm_ranges, squared_norm
from nereus.backends.parallel import local_grad
from nereus.backends.protocol import LossFn, TokenBatch, TrainStats
from nereus.backends.torch_native.stage import BoundStage
from nereus.devices import synchronize_device
from nereus.spec.model import Head
from nereus.state.geometry import chunk


@dataclass(frozen=True, slots=True, eq=False)
class Optimizer:
    """A trainer's AdamW over its flat buffers, and the weights of its elements in the global
    gradient norm (replicated tensors count once)."""

    config: AdamWConfig
    adamw: FlatAdamW
    owned: Ranges

    @classmethod
    def of(cls, b: BoundStage, config: AdamWConfig) -> Optimizer | None:
        """``None`` for a stage that does not train (its state has no optimizer buffers)."""
        if not b.trains:
            return None
        adamw = FlatAdamW(config, b.state.layout_of())
        return cls(config, adamw, norm_ranges(b.state, b.coord.t, b.kv_replication))


class _PipeModule(nn.Module):
    """A stage for ``torch.distributed.pipelining``: (x, valid) in, (hidden, valid) or the head out."""

    def __init__(self, stage: DecoderStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Tensor, valid: Tensor) -> Any:
        out = self.stage(x, valid)
        return out if self.stage.last else (out, valid)


def train_step(
    b: BoundStage, opt: Optimizer | None, batch: TokenBatch, loss_fn: LossFn, micro_batches: int = 1,
    temperature: float = 1.0,
) -> TrainStats:  # fmt: skip
    """Gradient accumulation over micro-batches, DP all-reduce, clipping, one AdamW update (the
    log-probs at the sampling's ``temperature``); the logical state's update count and version advance."""
    if opt is None:
        raise RuntimeError(f"{b.state.model_stage} does not train (its state has no optimizer buffers)")
    t0 = time.perf_counter()
    for p in b.params.values():
        p.grad = None
    grad = torch.zeros(b.state.layout_of().numel, dtype=torch.float32, device=b.device)
    hooks = accumulate_into(b, grad)
    try:
        if b.state.layout.pp == 1:
            total = torch.zeros((), device=b.device)
            for mb in batch.split(micro_batches):
                ids = mb.ids.to(b.device)
                out = b.stage(ids, mb.valid.to(b.device))
                fields = {k: v.to(b.device) for k, v in mb.fields.items()}
                loss = loss_fn(b.score(out, ids, temperature), fields)
                loss.backward()  # type: ignore[no-untyped-call]
                total += loss.detach()
        else:
            total = pipeline_backward(b, batch, loss_fn, micro_batches, temperature)
    finally:
        for h in hooks:
            h.remove()
    dp_seconds = reduce_grad(b, grad)
    norm = clip(b, opt, grad)
    if math.isfinite(norm):  # a NaN or inf (a non-finite score or loss) would poison every weight:
        step = b.state.state.updates + 1  # the update is skipped, as verl does (every rank of the
        opt.adamw.step(b.state, grad, step)  # stage reduced the same norm, so all skip alike)
        b.state.state = dataclasses.replace(b.state.state, updates=step, version=b.state.state.version + 1)
    loss_sum = global_loss(b, total)
    return TrainStats(
        loss_sum, norm, int(batch.valid.sum()), time.perf_counter() - t0, dp_seconds,
        grad.numel() * grad.element_size() if b.groups.dp is not None else 0,
    )  # fmt: skip


def pipeline_backward(
    b: BoundStage, batch: TokenBatch, loss_fn: LossFn, micro_batches: int, temperature: float = 1.0
) -> Tensor:
    """Forward and backward of every micro-batch through the pipeline; the sum of this stage's
    micro-batch losses (zero except on the last stage)."""
    layout, rows = b.state.layout, batch.rows
    if micro_batches <= 0 or rows % micro_batches:
        raise ValueError(f"micro_batches {micro_batches} must divide the batch of {rows} rows")
    per, seq, h = rows // micro_batches, batch.ids.shape[1], b.model.hidden_size
    valid_meta = torch.zeros((per, seq), dtype=torch.long, device="meta")
    if b.first:
        inputs: tuple[Tensor, ...] = (
            torch.zeros((per, seq), dtype=torch.long, device="meta"),
            valid_meta,
        )
    else:
        hidden = torch.zeros((per, seq, h), dtype=b.dtype, device="meta", requires_grad=True)
        inputs = (hidden, valid_meta)
    if b.last:
        width = () if b.model.head is Head.VALUE else (_local_vocab(b),)
        outputs: tuple[Tensor, ...] = (
            torch.zeros((per, seq, *width), dtype=b.dtype, device="meta", requires_grad=True),
        )
    else:
        outputs = (
            torch.zeros((per, seq, h), dtype=b.dtype, device="meta", requires_grad=True),
            valid_meta,
        )
    stage = PipelineStage(
        _PipeModule(b.stage), b.coord.p, layout.pp, b.device,
        input_args=inputs, output_args=outputs, group=b.groups.pp,
    )  # fmt: skip
    names = sorted(batch.fields)

    def loss(out: Tensor, target: Tensor) -> Tensor:
        ids = target[..., 0].long()
        fields = {n: target[..., 1 + j] for j, n in enumerate(names)}
        result: Tensor = loss_fn(b.score(out, ids, temperature), fields)
        return result

    kind = Schedule1F1B if micro_batches >= layout.pp else ScheduleGPipe
    schedule = kind(stage, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
    losses: list[Tensor] = []
    if b.first:
        schedule.step(batch.ids.to(b.device), batch.valid.to(b.device).long())
    elif b.last:
        cols = [batch.ids.double(), *(batch.fields[n].double() for n in names)]
        target = torch.stack(cols, -1).to(b.device)
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    total = torch.zeros((), device=b.device)
    for x in losses:
        total += x.detach().float()
    return total


def _local_vocab(b: BoundStage) -> int:
    lo, hi = chunk(b.model.vocab_size, b.state.layout.tp, b.coord.t)
    return hi - lo


def accumulate_into(b: BoundStage, grad: Tensor) -> list[RemovableHandle]:
    """Hooks that add each micro-batch's gradient into ``grad``, this rank's fp32 flat gradient in
    the layout's slot order, as autograd accumulates it, and free the parameter's own: a bf16
    parameter would otherwise sum its micro-batches in bf16 (Megatron accumulates into an fp32
    main_grad too). In fp32 the sums are the same, in the same order."""
    slots: dict[int, tuple[Tensor, list[tuple[int, int]]]] = {}
    for s in b.state.layout_of().slots:
        param = b.params[s.name]
        slots.setdefault(id(param), (param, []))[1].append((s.offset, s.offset + s.numel))
    handles: list[RemovableHandle] = []
    try:
        for tensor, spans in slots.values():
            if tensor.requires_grad:  # a frozen tensor's spans stay zero
                handles.append(_adding(tensor, spans, grad))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    return handles


def _adding(tensor: Tensor, spans: list[tuple[int, int]], grad: Tensor) -> RemovableHandle:
    """The hook adding ``tensor``'s gradient into ``spans`` of ``grad``, then freeing it."""

    def add(param: Tensor) -> None:
        g = local_grad(param)
        if g is not None:
            flat = g.reshape(-1)
            for lo, hi in spans:
                grad[lo:hi].add_(flat)
        param.grad = None

    handle: RemovableHandle = tensor.register_post_accumulate_grad_hook(add)  # type: ignore[no-untyped-call]
    return handle


def reduce_grad(b: BoundStage, grad: Tensor) -> float:
    """Reduce the accumulated ``grad`` (the stage's reductions, then the DP all-reduce); the
    seconds the DP all-reduce took."""
    rb = b.state.layout_of()
    for names, group in b.reductions:
        slots = [rb.slot(n) for n in names]
        part = torch.cat([grad[s.offset : s.offset + s.numel] for s in slots])
        dist.all_reduce(part, group=group)
        at = 0
        for s in slots:
            grad[s.offset : s.offset + s.numel].copy_(part[at : at + s.numel])
            at += s.numel
    dp_seconds = 0.0
    if b.groups.dp is not None:  # timed on the device's work (NCCL returns once it is queued)
        synchronize_device(b.device)
        started = time.perf_counter()
        dist.all_reduce(grad, group=b.groups.dp)
        synchronize_device(b.device)
        dp_seconds += time.perf_counter() - started
    return dp_seconds


def clip(b: BoundStage, opt: Optimizer, grad: Tensor) -> float:
    """Scale ``grad`` in place to the global norm limit; the norm before clipping."""
    sq = squared_norm(grad, opt.owned)
    if b.groups.unit is not None:
        dist.all_reduce(sq, group=b.groups.unit)
    norm = float(sq.sqrt())
    limit = opt.config.max_grad_norm
    if limit > 0:
        grad.mul_(min(1.0, limit / (norm + 1e-6)))
    return norm


def global_loss(b: BoundStage, total: Tensor) -> float:
    """The global batch's loss: the last stages' sums (TP rank 0), added over the replica and DP."""
    x = (total if b.last and b.coord.t == 0 else torch.zeros_like(total)).double()
    if b.groups.unit is not None:
        dist.all_reduce(x, group=b.groups.unit)
    if b.groups.dp is not None:
        dist.all_reduce(x, group=b.groups.dp)
    return float(x)
