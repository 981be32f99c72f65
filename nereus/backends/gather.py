"""A model-stage's whole tensors from its replica's flat buffers (one per rank).

Every rank of a replica holds one flat buffer per kind, its shards laid out by the shard
geometry (``nereus.state.geometry``). ``assemble`` cuts each rank's slices out of the flats and
writes them into Hugging Face shaped tensors; ``gather_flats`` moves the flats over the replica's
group to its first rank, on the host (a checkpoint written from there). ``stream_whole`` gives
every rank of the replica the whole tensors on its device, a bucket of tensors at a time (an
engine that loads whole tensors on each rank, as vLLM's weight loaders do: a rank never holds
more than a bucket beyond its engine's weights). Everything travels as flat tensors, no pickled
objects. Edge module (torch.distributed).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.groups import Groups
from nereus.state.buffers import BufferKind, Slot, rank_buffers
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


STREAM_BUCKET_BYTES = 256 << 20  # whole tensors gathered per collective by ``stream_whole``


def stream_whole(
    state: RankState, groups: Groups, kind: BufferKind, bucket_bytes: int = STREAM_BUCKET_BYTES
) -> Iterator[tuple[str, Tensor]]:
    """The replica's whole tensors of ``kind`` (Hugging Face names and shapes, state-dict order)
    on every rank, on the state's device. Collective over the replica's group, one all-gather per
    bucket of consecutive tensors of at most ``bucket_bytes`` whole (a larger tensor is a bucket
    of its own): every rank of the replica must take the iterator to its end. A yielded tensor
    is the caller's until the next one is asked for; a replica of one rank yields views of its
    buffer."""
    positions = state.layout.positions()
    mine = state.buffers[kind].detach()
    pieces = _pieces(state)
    order = _order(state, pieces)
    if groups.unit is None:  # a replica of one rank: its slots are whole
        for name in order:
            _, slot, _ = pieces[name][0]
            yield name, mine[slot.offset : slot.offset + slot.numel].view(slot.shape)
        return
    replica = groups.grid.unit_groups()[groups.coord.dp]
    at = {r: i for i, r in enumerate(replica)}
    members = sorted(replica)  # the group's ranks in its own order
    me = at[groups.rank]
    for bucket in _buckets(order, pieces, mine.element_size(), bucket_bytes):
        held = [[s for n in bucket for i, s, _ in pieces[n] if i == pos] for pos in range(len(positions))]
        width = max(sum(s.numel for s in slots) for slots in held)
        send = torch.zeros(width, dtype=mine.dtype, device=mine.device)
        filled = 0
        for s in held[me]:  # this rank's slices of the bucket's tensors, back to back
            send[filled : filled + s.numel] = mine[s.offset : s.offset + s.numel]
            filled += s.numel
        got = [torch.empty_like(send) for _ in members]
        dist.all_gather(got, send, group=groups.unit)
        flat_of = {at[r]: g for r, g in zip(members, got, strict=True)}
        cursor = dict.fromkeys(range(len(positions)), 0)
        for name in bucket:
            whole: Tensor | None = None
            for i, slot, full in pieces[name]:
                part = flat_of[i][cursor[i] : cursor[i] + slot.numel].view(slot.shape)
                cursor[i] += slot.numel
                if whole is None:
                    whole = torch.zeros(full, dtype=mine.dtype, device=mine.device)
                whole[tuple(slice(lo, hi) for lo, hi in slot.region)] = part
            assert whole is not None
            yield name, whole
        del got, flat_of


Piece = tuple[int, Slot, tuple[int, ...]]  # a position of the replica, its slot, the whole shape


def _pieces(state: RankState) -> dict[str, list[Piece]]:
    """Each tensor's slices over the replica's positions (its own slots; not aliases)."""
    layout = state.layout
    pieces: dict[str, list[Piece]] = {}
    for i, (t, p) in enumerate(layout.positions()):
        cut = {s.name: s for s in shards(state.model, layout, t, p)}
        for s in rank_buffers(state.model, layout, t, p, state.policy).slots:
            if s.source == s.name:
                pieces.setdefault(s.name, []).append((i, s, cut[s.name].full_shape))
    return pieces


def whole_names(state: RankState) -> list[str]:
    """The names ``stream_whole`` yields, in its (state-dict) order."""
    return _order(state, _pieces(state))


def _order(state: RankState, pieces: dict[str, list[Piece]]) -> list[str]:
    layout = state.layout
    return [
        name
        for stage in range(layout.pp)
        for spec, layer in tensors_at(state.model, layout.pp, stage)
        if (name := spec.at(layer)) in pieces
    ]


def _buckets(
    order: list[str], pieces: dict[str, list[Piece]], itemsize: int, limit: int
) -> Iterator[list[str]]:
    """Consecutive names whose whole tensors take at most ``limit`` bytes together."""
    bucket: list[str] = []
    size = 0
    for name in order:
        whole = itemsize * math.prod(pieces[name][0][2])
        if bucket and size + whole > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += whole
    if bucket:
        yield bucket
