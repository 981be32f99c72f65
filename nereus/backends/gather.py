"""A model-stage's whole tensors from its replica's flat buffers (one per rank).

Every rank of a replica holds one flat buffer per kind, its shards laid out by the shard
geometry (``nereus.state.geometry``). ``assemble`` cuts each rank's slices out of the flats and
writes them into Hugging Face shaped tensors; ``gather_flats`` moves the flats over the replica's
group: to its first rank (a checkpoint written from there) or to every rank (an engine that
loads whole tensors on each rank, as vLLM's weight loaders do). A flat travels as one tensor, no
pickled objects. Edge module (torch.distributed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.groups import Groups
from nereus.state.buffers import BufferKind, rank_buffers
from nereus.state.geometry import Region, shards, tensors_at
from nereus.state.holder import RankState


def gather_flats(state: RankState, groups: Groups, kind: BufferKind, everywhere: bool) -> list[Tensor] | None:
    """The replica's flat buffers of ``kind`` in position order (``layout.positions()``), on its
    first rank (``everywhere``: on each of its ranks); ``None`` on a rank that gets none.
    Collective over the replica's group."""
    layout = state.layout
    positions = layout.positions()
    widths = [rank_buffers(state.model, layout, t, p, state.policy).numel for t, p in positions]
    mine = state.buffers[kind].detach()
    sent = torch.zeros(max(widths), dtype=mine.dtype, device=mine.device)
    sent[: mine.numel()] = mine
    grid = groups.grid
    replica = grid.unit_groups()[groups.coord.dp]
    root = replica[0]
    if groups.unit is None:  # a replica of one rank
        return [sent.cpu()]
    got = [torch.empty_like(sent) for _ in positions] if everywhere or groups.rank == root else None
    if everywhere:
        assert got is not None
        dist.all_gather(got, sent, group=groups.unit)
    else:
        dist.gather(sent, got, dst=root, group=groups.unit)
    if got is None:
        return None
    # the group orders its ranks by global rank; the replica by position
    by_rank = dict(zip(sorted(replica), got, strict=True))
    return [by_rank[r].cpu() for r in replica]


def assemble(state: RankState, flats: list[Tensor]) -> dict[str, Tensor]:
    """The whole model's tensors (Hugging Face names and shapes, state-dict order) from the
    replica's flat buffers in position order."""
    model, layout, policy = state.model, state.layout, state.policy
    pieces: dict[str, list[tuple[tuple[int, ...], Region, Tensor]]] = {}
    for (t, p), flat in zip(layout.positions(), flats, strict=True):
        rb = rank_buffers(model, layout, t, p, policy)
        cut = {s.name: s for s in shards(model, layout, t, p)}
        for s in rb.slots:
            if s.source == s.name:
                data = flat[s.offset : s.offset + s.numel].view(s.shape)
                pieces.setdefault(s.name, []).append((cut[s.name].full_shape, s.region, data))
    out: dict[str, Tensor] = {}
    order = [spec.at(layer) for p in range(layout.pp) for spec, layer in tensors_at(model, layout.pp, p)]
    for name in order:
        if name not in pieces:
            continue
        shape, _, data = pieces[name][0]
        whole = out.setdefault(name, torch.zeros(shape, dtype=data.dtype))
        for _, region, part in pieces[name]:
            whole[tuple(slice(lo, hi) for lo, hi in region)] = part
    return out
