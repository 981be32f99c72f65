"""Hugging Face weights of a bound stage: read this rank's shards of a checkpoint into the state
buffers, gather the whole model on replica 0's first rank, write a checkpoint from there.
Edge module (torch.distributed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from nereus.backends import hf
from nereus.backends.gather import assemble, gather_flats
from nereus.backends.torch_native.stage import BoundStage
from nereus.state.buffers import BufferKind
from nereus.state.geometry import shards


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
    replica 0 (``nereus.backends.gather``)."""
    if b.coord.dp != 0:
        return None
    flats = gather_flats(b.state, b.groups, kind, everywhere=False)
    return None if flats is None else assemble(b.state, flats)


def save_hf(b: BoundStage, directory: Path, companions: Sequence[Path] = ()) -> None:
    """Write the model-stage's weights as a Hugging Face checkpoint (from replica 0's first rank;
    collective over replica 0), ``companions`` copied beside them."""
    tensors = full_state(b)
    if tensors is not None:
        hf.save(directory, b.model, tensors, companions)
