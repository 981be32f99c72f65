"""Which slices move where: the exchange plan behind Split, Merge, Extend and restores (pure).

A receiving rank needs the shard of some (layout, t, p); providers hold shards of possibly other
layouts of the same model. For every slot it needs, the plan takes each piece from the first
provider (in preference order, the receiver itself first) that holds it, so nothing is sent
twice and nothing already resident is sent at all. Geometry regions differ from the full tensor
in at most one dimension (heads, rows or columns), so coverage is interval arithmetic on that
dimension. ``chunks`` groups a provider's pieces for one receiver into messages: a piece whose
slice is contiguous on a side (cut along its leading dimension, or whole) is read or written in
place there; the others go through a staging buffer on that side only. ``execute.pack`` and
``unpack`` keep the older form, every piece of every kind in one packed message.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state.buffers import Slot, StatePolicy, rank_buffers
from nereus.state.geometry import Region


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [lo, hi) along ``dim`` of logical tensor slice ``src`` at ``provider`` → ``dst``."""

    provider: int  # index into the providers
    src: Slot
    dst: Slot
    dim: int  # the dimension the slices are cut along (0 when the slot is whole)
    lo: int  # full-tensor coordinates
    hi: int

    @property
    def numel(self) -> int:
        other = 1
        for i, n in enumerate(self.dst.shape):
            if i != self.dim:
                other *= n
        return other * (self.hi - self.lo)


def _cut_dim(a: Region, b: Region) -> int | None:
    """The one dimension where two regions of a tensor differ (None when they are equal)."""
    dims = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if len(dims) > 1:
        raise ValueError(f"regions {a} and {b} differ in more than one dimension")
    return dims[0] if dims else None


def _subtract(
    todo: list[tuple[int, int]], lo: int, hi: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(what of ``todo`` lies in [lo, hi), what remains) as interval lists."""
    taken, rest = [], []
    for a, b in todo:
        x, y = max(a, lo), min(b, hi)
        if x >= y:
            rest.append((a, b))
            continue
        taken.append((x, y))
        if a < x:
            rest.append((a, x))
        if y < b:
            rest.append((y, b))
    return taken, rest


def plan_pieces(
    model: ModelSpec,
    policy: StatePolicy,
    need: tuple[Layout, int, int],
    providers: tuple[tuple[Layout, int, int], ...],
    provider_policy: StatePolicy | None = None,
) -> tuple[Piece, ...]:
    """Pieces that fill rank ``need``'s buffers from ``providers`` (first provider preferred).

    ``provider_policy`` is the providers' buffer policy when it differs (a restore from a
    trainer). Raises ValueError naming the slot when no provider holds part of it.
    """
    mine = rank_buffers(model, need[0], need[1], need[2], policy)
    theirs = provider_policy or policy
    held = [rank_buffers(model, lay, t, p, theirs) for lay, t, p in providers]
    by_source: list[dict[str, list[Slot]]] = []
    for rb in held:
        index: dict[str, list[Slot]] = {}
        for s in rb.slots:
            index.setdefault(s.source, []).append(s)
        by_source.append(index)
    out: list[Piece] = []
    for slot in mine.slots:
        dim: int | None = None
        todo: list[tuple[int, int]] | None = None
        for k, index in enumerate(by_source):
            for src in index.get(slot.source, ()):
                cut = _cut_dim(slot.region, src.region)
                if dim is None:
                    dim = 0 if cut is None else cut
                    todo = [slot.region[dim]]
                elif cut is not None and cut != dim:
                    raise ValueError(f"{slot.name}: providers cut it along dimensions {dim} and {cut}")
                assert todo is not None
                lo, hi = src.region[dim]
                taken, todo = _subtract(todo, lo, hi)
                out += [Piece(k, src, slot, dim, a, b) for a, b in taken]
                if not todo:
                    break
            if todo == []:
                break
        if todo is None or todo:
            raise ValueError(f"no provider holds all of {slot.name} {slot.region} (missing {todo})")
    return tuple(out)


# ------------------------------------------------------------------ zero-copy messages
def view_at(slot: Slot, dim: int, lo: int, hi: int) -> int | None:
    """Element offset of the view of ``slot``'s [lo, hi) along ``dim`` in the flat buffer when that
    view is contiguous (a cut along the leading non-trivial dimension, or the whole extent), else
    None. Pure geometry: both ends of a message compute both sides' answers alike."""
    start = slot.region[dim][0]
    outer = 1
    for n in slot.shape[:dim]:
        outer *= n
    if outer != 1 and hi - lo != slot.shape[dim]:
        return None
    inner = 1
    for n in slot.shape[dim + 1 :]:
        inner *= n
    return slot.offset + (lo - start) * inner


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message of a transfer (per buffer kind): consecutive pieces that each side reads or
    writes in place — one contiguous range of its flat buffer (``src``/``dst`` its element
    offset) — or copies through its staging buffer (None), piece after piece."""

    pieces: tuple[Piece, ...]
    numel: int
    src: int | None
    dst: int | None


def _joins(at: int | None, numel: int, nxt: int | None) -> bool:
    if at is None or nxt is None:
        return at is None and nxt is None
    return nxt == at + numel


def chunks(pieces: tuple[Piece, ...]) -> tuple[Chunk, ...]:
    """Group ``pieces`` (in message order) into the fewest messages that copy nothing a side can
    read or write in place: a piece joins the previous chunk when, on each side, both are in
    place and adjacent, or both are staged."""
    groups: list[tuple[list[Piece], int, int | None, int | None]] = []  # (pieces, numel, src, dst)
    for pc in pieces:
        src = view_at(pc.src, pc.dim, pc.lo, pc.hi)
        dst = view_at(pc.dst, pc.dim, pc.lo, pc.hi)
        numel = pc.numel
        if groups:
            members, total, at_src, at_dst = groups[-1]
            if _joins(at_src, total, src) and _joins(at_dst, total, dst):
                members.append(pc)
                groups[-1] = (members, total + numel, at_src, at_dst)
                continue
        groups.append(([pc], numel, src, dst))
    return tuple(Chunk(tuple(members), total, src, dst) for members, total, src, dst in groups)


Assembly = tuple[tuple[int, tuple[Piece, ...], tuple[Chunk, ...]], ...]


# an entry of a 70B model's rank at pp 1 holds ~0.56 MB (its pieces alone ~0.3 MB): 2,048 entries
# bound the memory where the 4,096 cached ``plan_pieces`` results it replaces did (~1.2 GB)
@lru_cache(maxsize=2048)
def assembly(
    model: ModelSpec,
    policy: StatePolicy,
    need: tuple[Layout, int, int],
    providers: tuple[tuple[Layout, int, int], ...],
    provider_policy: StatePolicy | None = None,
) -> Assembly:
    """``plan_pieces`` by provider, in provider order: (provider index, its pieces, their
    ``chunks``). Ranks of one geometry recur across a transition's nodes (every replica of a
    layout, every transition between the same two layouts), so this is computed once for them
    (the one cache of the pieces: ``plan_pieces`` itself keeps nothing)."""
    by_provider: dict[int, list[Piece]] = {}
    for pc in plan_pieces(model, policy, need, providers, provider_policy):
        by_provider.setdefault(pc.provider, []).append(pc)
    return tuple((k, tuple(part), chunks(tuple(part))) for k, part in sorted(by_provider.items()))
