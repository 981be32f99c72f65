"""A model-stage's starting weights: fresh and seeded, or a Hugging Face folder's.

A job starts every model-stage from them (``Worker.init_state``, then the engines read a Hugging
Face folder where the experiment names one), and a frozen model — the reference, the reward
model, which nothing ever changes — can be read from them again at any time: they are its copy on
shared storage, from which a transition restores it when its last replica was lost
(``Worker.from_storage``). Edge module (torch, safetensors).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from nereus.backends import hf
from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Role
from nereus.state.buffers import BufferKind
from nereus.state.geometry import shards

ROLE_SEED = {Role.ACTOR: 1, Role.REF: 1, Role.CRITIC: 2, Role.REWARD: 3}  # the reference starts as the actor
MOMENTS = (BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)


def init_tensor(model: ModelSpec, seed: int, kind: BufferKind, name: str) -> Tensor:
    """A fresh model's tensor: N(0, 0.02²) matrices, unit norms, zero biases and Adam moments."""
    shape = _shapes(model)[name]
    if kind in MOMENTS:
        return torch.zeros(shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.randn(shape, generator=g) * 0.02


def fresh(model: ModelSpec, role: Role) -> Callable[[BufferKind, str], Tensor]:
    """``full(kind, name)`` of a fresh model of ``role`` (master weights equal the parameters)."""
    seed = ROLE_SEED[role]

    def full(kind: BufferKind, name: str) -> Tensor:
        return init_tensor(model, seed, BufferKind.PARAM if kind is BufferKind.MASTER else kind, name)

    return full


def stored(model: ModelSpec, role: Role, folder: str) -> Callable[[BufferKind, str], Tensor]:
    """``full(kind, name)`` of the weights ``role`` starts from: the Hugging Face ``folder``'s
    (checked against ``model``; Adam moments zero), or fresh ones when there is none."""
    if not folder:
        return fresh(model, role)
    path = Path(folder)
    reader = hf.SafetensorsReader(path)
    hf.check_compatible(model, hf.read_config(path), path)
    read, shapes = hf.full_reader(reader, model), _shapes(model)

    def full(kind: BufferKind, name: str) -> Tensor:
        return torch.zeros(shapes[name]) if kind in MOMENTS else read(name, shapes[name])

    return full


def _shapes(model: ModelSpec) -> dict[str, tuple[int, ...]]:
    return {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}
