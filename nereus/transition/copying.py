"""Bytes in and out of a transition's messages: the copies around a send or a receive (torch).

Every helper works on one rank's flat buffers (``RankState.buffers``) through the slots and pieces
that ``wire.py`` planned: ``pack``/``unpack`` a packed message (a header with the logical state,
then the pieces of the kinds it carries), ``gather``/``scatter`` a staged chunk, ``copy_local``
what a rank already holds. ``execute.py`` posts the messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nereus.state.buffers import BufferKind, Slot
from nereus.state.emu import LogicalState
from nereus.transition.exchange import Chunk, Piece
from nereus.transition.wire import HEADER


class MessageError(RuntimeError):
    """A message whose size is not the one its pieces need."""


def _piece_view(buf: torch.Tensor, pc: Piece, slot: Slot) -> torch.Tensor:
    v = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return v.narrow(pc.dim, pc.lo - slot.region[pc.dim][0], pc.hi - pc.lo)


def state_tensor(state: LogicalState, device: torch.device | None = None) -> torch.Tensor:
    values = [state.updates, state.version, state.minibatch, state.seed]
    return torch.tensor(values, dtype=torch.int64, device=device)


def pack(
    pieces: Sequence[Piece], buffers: Mapping[BufferKind, torch.Tensor], kinds: Sequence[BufferKind],
    state: LogicalState | None,
) -> torch.Tensor:  # fmt: skip
    """The logical state (a ``HEADER``; none when ``state`` is None), then every piece of every
    kind (widest dtype first, so each kind starts aligned) as bytes: one message, each piece copied
    once into it."""
    device = next(iter(buffers.values())).device
    head = HEADER if state is not None else 0
    total = head + sum(pc.numel * buffers[k].element_size() for k in kinds for pc in pieces)
    msg = torch.empty(total, dtype=torch.uint8, device=device)
    if state is not None:
        msg[:HEADER].copy_(state_tensor(state).view(torch.uint8))
    at = head
    for k in kinds:
        buf = buffers[k]
        for pc in pieces:
            n = pc.numel * buf.element_size()
            src = _piece_view(buf, pc, pc.src)
            msg[at : at + n].view(buf.dtype).view(src.shape).copy_(src)
            at += n
    return msg


def gather(c: Chunk, buf: torch.Tensor, msg: torch.Tensor) -> None:
    """Copy a staged chunk's pieces of ``buf`` one after another into ``msg`` (the sender's side)."""
    at = 0
    for pc in c.pieces:
        src = _piece_view(buf, pc, pc.src)
        msg[at : at + pc.numel].view(src.shape).copy_(src)
        at += pc.numel


def scatter(c: Chunk, msg: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a staged chunk out of ``msg`` into its pieces of ``buf`` (the receiver's side)."""
    at = 0
    for pc in c.pieces:
        dst = _piece_view(buf, pc, pc.dst)
        dst.copy_(msg[at : at + pc.numel].view(dst.shape))
        at += pc.numel


def copy_local(
    pieces: Sequence[Piece], src: Mapping[BufferKind, torch.Tensor], dst: Mapping[BufferKind, torch.Tensor],
    kinds: Sequence[BufferKind],
) -> None:  # fmt: skip
    """Pieces this rank already holds, straight from its old buffers into the new ones."""
    for k in kinds:
        for pc in pieces:
            _piece_view(dst[k], pc, pc.dst).copy_(_piece_view(src[k], pc, pc.src))


def unpack(
    msg: torch.Tensor, pieces: Sequence[Piece], buffers: Mapping[BufferKind, torch.Tensor],
    kinds: Sequence[BufferKind], header: bool = True,
) -> LogicalState | None:  # fmt: skip
    """Write a message's pieces into ``buffers``; return the sender's logical state (None for a
    message packed without one: ``header=False``)."""
    head = msg[:HEADER].clone().view(torch.int64).tolist() if header else None
    at = HEADER if header else 0
    for k in kinds:
        buf = buffers[k]
        for pc in pieces:
            n = pc.numel * buf.element_size()
            view = _piece_view(buf, pc, pc.dst)
            view.copy_(msg[at : at + n].view(buf.dtype).view(view.shape))
            at += n
    if at != msg.numel():
        raise MessageError(f"message of {msg.numel()} bytes, expected {at}")
    return LogicalState(*head) if head is not None else None
