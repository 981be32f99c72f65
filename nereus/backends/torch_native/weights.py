"""Hugging Face weights of a bound stage: read this rank's shards of a checkpoint into the state
buffers, gather the whole model on replica 0's first rank, write a checkpoint from there.
Edge module (torch.distributed).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends import hf
from nereus.backends.torch_native.stage import BoundStage
from nereus.state.buffers import BufferKind, rank_buffers
from nereus.state.geometry import Region, shards, tensors_at


def load_hf(b: BoundStage, directory: Path) -> None:
    """Read this rank's shards of the checkpoint in ``directory`` into the param (and master)
    buffers; Adam moments are zeroed. A bad checkpoint leaves the buffers untouched."""
    reader = hf.SafetensorsReader(directory)
    hf.check_compatible(b.model, hf.read_config(directory), Path(directory))
    full = hf.full_reader(reader, b.model)
    rb = b.state.layout_of()
    cut = {s.name: s for s in shards(b.model, b.state.layout, b.state.t, b.state.p)}
    staged = {}
    for s in rb.slots:  # read everything first: a bad checkpoint leaves the buffers untouched
        whole = full(s.source, cut[s.name].full_shape)
        staged[s.name] = whole[tuple(slice(lo, hi) for lo, hi in s.region)]
    for kind in b.state.buffers:
        for s in rb.slots:
            view = b.state.view(kind, s.name)
            if kind in (BufferKind.PARAM, BufferKind.MASTER):
                view.copy_(staged[s.name])
            else:
                view.zero_()


def full_state(b: BoundStage, kind: BufferKind = BufferKind.PARAM) -> dict[str, Tensor] | None:
    """The whole model's tensors of buffer ``kind`` (parameters by default; master weights or
    Adam moments for a trainer) on replica 0's first rank, ``None`` elsewhere. Collective over
    replica 0: every rank sends its flat buffer as one tensor (no pickled objects), and the root
    cuts each rank's slices out by the shard geometry it can compute for every position."""
    if b.coord.dp != 0:
        return None
    layout, policy = b.state.layout, b.state.policy
    positions = layout.positions()
    per_rank = [rank_buffers(b.model, layout, t, p, policy) for t, p in positions]
    width = max(rb.numel for rb in per_rank)
    mine = b.state.buffers[kind].detach().cpu()
    sent = torch.zeros(width, dtype=mine.dtype)
    sent[: mine.numel()] = mine
    root = b.grid.rank_at(0, 0, 0)
    flats = [sent]
    if b.groups.unit is not None:
        got = [torch.empty_like(sent) for _ in positions] if b.groups.rank == root else None
        dist.gather(sent, got, dst=root, group=b.groups.unit)
        if got is not None:  # the group orders its ranks by global rank; the replica by position
            unit = b.grid.unit_groups()[0]
            by_rank = dict(zip(sorted(unit), got, strict=True))
            flats = [by_rank[r] for r in unit]
    if b.groups.rank != root:
        return None
    pieces: dict[str, list[tuple[tuple[int, ...], Region, Tensor]]] = {}
    for (t, p), rb, flat in zip(positions, per_rank, flats, strict=True):
        cut = {s.name: s for s in shards(b.model, layout, t, p)}
        for s in rb.slots:
            if s.source == s.name:
                data = flat[s.offset : s.offset + s.numel].view(s.shape)
                pieces.setdefault(s.name, []).append((cut[s.name].full_shape, s.region, data))
    out: dict[str, Tensor] = {}
    order = [spec.at(layer) for p in range(layout.pp) for spec, layer in tensors_at(b.model, layout.pp, p)]
    for name in order:
        if name not in pieces:
            continue
        shape, _, data = pieces[name][0]
        whole = out.setdefault(name, torch.zeros(shape, dtype=data.dtype))
        for _, region, part in pieces[name]:
            whole[tuple(slice(lo, hi) for lo, hi in region)] = part
    return out


def save_hf(b: BoundStage, directory: Path) -> None:
    """Write the model-stage's weights as a Hugging Face checkpoint (from replica 0's first rank;
    collective over replica 0)."""
    tensors = full_state(b)
    if tensors is not None:
        hf.save(directory, b.model, tensors)
