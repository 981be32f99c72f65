"""Tensor parallelism through PyTorch's own API, bound to EMU buffers.

``build_stage`` turns a ``DecoderStage`` built on the meta device into this rank's shard of it:
``parallelize_module`` with Megatron's plan — q/k/v, gate and up column-parallel, o and down
row-parallel, the embedding vocabulary-parallel (``RowwiseParallel`` on ``nn.Embedding``) and the
LM head column-parallel with local logits out (vocabulary-parallel log-probs follow in
``logprobs.py``) — then replaces every parameter by a view of the rank's EMU ``param`` buffer
(a ``DTensor.from_local`` of it for sharded tensors). No copy: the optimizer writes the buffers
and the model sees it; a transition that replaces the buffers is a re-bind. The placements are
the EMU geometry's (``Shard(0)`` for column, ``Shard(1)`` for row, ``torch.chunk`` splits).

When tp exceeds the KV heads, k/v projections hold one replicated head each (a plain tensor, not
a DTensor placement): their input passes through ``copy_to_tp`` so its gradient is summed over
the TP group, and their weight gradients are summed over the ranks sharing the head (``kv``).
Edge module (torch.distributed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Replicate

from nereus.backends.groups import Groups
from nereus.backends.model import DecoderStage, inv_frequencies
from nereus.state.buffers import BufferKind
from nereus.state.geometry import stage_layers
from nereus.state.holder import RankState


class _CopyToTp(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient over the TP group backward (Megatron's f)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTp(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (Megatron's g): the result feeds a loss that
    every TP rank computes identically, so each rank's part gets the gradient once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def reduce_from_tp(x: Tensor, group: Any) -> Tensor:
    out: Tensor = _ReduceFromTp.apply(x, group)  # type: ignore[no-untyped-call]
    return out


class _KvInput:
    """k/v projections' input when their heads are replicated over TP ranks."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, x: Tensor) -> Tensor:
        out: Tensor = _CopyToTp.apply(x, self.group)  # type: ignore[no-untyped-call]
        return out


def tp_plan(stage: DecoderStage, kv_replicated: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    if stage.model.embed_tokens is not None:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    for i in stage.model.layers:
        pre = f"model.layers.{i}."
        plan[pre + "self_attn.q_proj"] = ColwiseParallel()
        if not kv_replicated:
            plan[pre + "self_attn.k_proj"] = ColwiseParallel()
            plan[pre + "self_attn.v_proj"] = ColwiseParallel()
        plan[pre + "self_attn.o_proj"] = RowwiseParallel()
        plan[pre + "mlp.gate_proj"] = ColwiseParallel()
        plan[pre + "mlp.up_proj"] = ColwiseParallel()
        plan[pre + "mlp.down_proj"] = RowwiseParallel()
    if stage.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(use_local_output=True)
    return plan


def build_stage(rs: RankState, groups: Groups, device: torch.device, trains: bool) -> DecoderStage:
    """This rank's stage module, its parameters views of ``rs``'s param buffer."""
    model, layout = rs.model, rs.layout
    with torch.device("meta"):
        stage = DecoderStage(model, stage_layers(model, layout.pp, rs.p), rs.p == 0, rs.p == layout.pp - 1)
    stage.inv_freq = inv_frequencies(model).to(device)  # built on the meta device above
    mesh = groups.tp_mesh(device.type)
    kv_replicated = groups.grid.kv_replication(model) > 1
    if mesh is not None:
        parallelize_module(stage, mesh, tp_plan(stage, kv_replicated))
        if kv_replicated:
            for layer in stage.model.layers.values():
                attn = layer.self_attn
                attn.kv_input = _KvInput(groups.tp)  # type: ignore[union-attr]
    rebind(stage, rs, trains)
    return stage


def rebind(stage: DecoderStage, rs: RankState, trains: bool) -> None:
    """Point every parameter of ``stage`` at ``rs``'s param buffer (same layout, new buffers)."""
    slots = {s.name for s in rs.layout_of().slots}
    dtype = rs.buffers[BufferKind.PARAM].dtype
    for name, old in list(stage.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and name not in slots and stage.model.embed_tokens is not None:
            continue  # tied head with pp = 1: bound to the embedding below
        if name in slots:
            local = rs.view(BufferKind.PARAM, name)
        else:  # an empty torch.chunk piece (tp larger than the dimension): nothing to hold
            shape = old.to_local().shape if isinstance(old, DTensor) else old.shape
            local = torch.zeros(shape, dtype=dtype, device=rs.buffers[BufferKind.PARAM].device)
        new: Tensor = local
        if isinstance(old, DTensor):
            new = DTensor.from_local(
                local, old.device_mesh, old.placements, run_check=False, shape=old.shape, stride=old.stride()
            )
        owner, leaf = _owner(stage, name)
        setattr(owner, leaf, nn.Parameter(new, requires_grad=trains))
    if stage.lm_head is not None and "lm_head.weight" not in slots and stage.model.embed_tokens is not None:
        stage.lm_head.weight = stage.model.embed_tokens.weight  # tied (pp = 1): one parameter


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return root.get_submodule(path), leaf


def local_grad(p: Tensor) -> Tensor | None:
    """This rank's part of ``p``'s gradient, in ``p``'s own placement (DTensor may leave, e.g.,
    an embedding's gradient replicated; cutting it to the shard needs no communication)."""
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor):
        assert isinstance(p, DTensor)
        if g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
        return g.to_local()
    return g
