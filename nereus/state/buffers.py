"""Flat state buffers: a rank's whole state packed into one contiguous buffer per kind.

Every kind (parameters, fp32 master weights, Adam's first and second moments) uses the same table
of element offsets, so one offset table describes all of a rank's buffers and each transfer of a
kind is one message. Offsets are aligned to ``ALIGN_BYTES`` for the widest dtype, so the backend's
parameters and optimizer tensors are views into these buffers without copies.

What a model-stage keeps between steps (paper §2.10, ZeRO-0):
- a trainer in bf16 mixed precision: bf16 parameters, fp32 master weights, fp32 Adam m and v
  (2 + 4 + 4 + 4 = 14 bytes per parameter, the planner's resident trainer state);
- a trainer in fp32: fp32 parameters, m and v (12 bytes per parameter);
- inference and generation: the parameters only, bf16 (fp32 when the workload runs fp32).
Gradients and KV caches hold nothing at a step boundary, so they are not state.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.geometry import Region, shards

ALIGN_BYTES = 128
STAGING_ALIGN = 64  # bytes: a region of a transition's staging buffer starts aligned for any dtype


class Dtype(StrEnum):
    BF16 = "bfloat16"
    FP32 = "float32"

    @property
    def itemsize(self) -> int:
        return 2 if self is Dtype.BF16 else 4


class BufferKind(StrEnum):
    PARAM = "param"
    MASTER = "master"  # fp32 master weights (bf16 mixed precision)
    EXP_AVG = "exp_avg"  # Adam first moment
    EXP_AVG_SQ = "exp_avg_sq"  # Adam second moment


@dataclass(frozen=True, slots=True)
class StatePolicy:
    """The buffers a model-stage's rank keeps, each with its dtype."""

    kinds: tuple[tuple[BufferKind, Dtype], ...]

    def __post_init__(self) -> None:
        names = [k for k, _ in self.kinds]
        if not names or names[0] is not BufferKind.PARAM or len(set(names)) != len(names):
            raise ValueError(f"state kinds must start with param and not repeat, got {names}")

    @classmethod
    def of(cls, stage: Stage, precision: Precision) -> StatePolicy:
        fp32 = precision is Precision.FP32
        param = Dtype.FP32 if fp32 else Dtype.BF16
        if stage is not Stage.TRAIN:
            return cls(((BufferKind.PARAM, param),))
        kinds = [(BufferKind.PARAM, param)]
        if not fp32:
            kinds.append((BufferKind.MASTER, Dtype.FP32))
        kinds += [(BufferKind.EXP_AVG, Dtype.FP32), (BufferKind.EXP_AVG_SQ, Dtype.FP32)]
        return cls(tuple(kinds))

    @property
    def bytes_per_element(self) -> int:
        return sum(d.itemsize for _, d in self.kinds)

    @property
    def trains(self) -> bool:
        return any(k is BufferKind.EXP_AVG for k, _ in self.kinds)

    @property
    def order(self) -> tuple[BufferKind, ...]:
        """Kinds in the order a transition moves them: widest dtype first (a packed message
        then starts every kind aligned)."""
        width = dict(self.kinds)
        return tuple(sorted(width, key=lambda k: -width[k].itemsize))

    def streamed(self, new: int, old: int) -> int:
        """Bytes above what a GPU held before, at most, while it builds ``new`` bytes of one rank
        and frees ``old`` bytes of another, kind by kind in ``order``: each kind's new buffer is
        allocated before that kind's old one goes, and every kind takes its dtype's share of the
        bytes. One kind: ``new`` (the whole rank is built before anything is freed)."""
        width = dict(self.kinds)
        total = self.bytes_per_element
        peak = run = 0
        for k in self.order:
            run += new * width[k].itemsize
            peak = max(peak, run)
            run -= old * width[k].itemsize
        return -(-peak // total)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor slice sits in a rank's buffers (the same element offset in every kind)."""

    name: str
    source: str
    region: Region
    shape: tuple[int, ...]
    offset: int  # elements
    numel: int


@dataclass(frozen=True, slots=True)
class RankBuffers:
    """The buffer layout of one rank: slots in state-dict order and the padded element count."""

    slots: tuple[Slot, ...]
    numel: int  # padded length of every buffer, in elements
    policy: StatePolicy

    def nbytes(self, kind: BufferKind | None = None) -> int:
        """Bytes of one kind's buffer, or of all kinds together."""
        dtypes = dict(self.policy.kinds)
        if kind is None:
            return self.numel * self.policy.bytes_per_element
        return self.numel * dtypes[kind].itemsize

    @property
    def payload_numel(self) -> int:
        """Elements that carry state (without alignment padding)."""
        return sum(s.numel for s in self.slots)

    def slot(self, name: str) -> Slot:
        for s in self.slots:
            if s.name == name:
                return s
        raise KeyError(name)


@lru_cache(maxsize=4096)
def rank_buffers(model: ModelSpec, layout: Layout, t: int, p: int, policy: StatePolicy) -> RankBuffers:
    """Pack rank (t, p)'s shards into aligned offsets (alignment fits the widest dtype)."""
    align = ALIGN_BYTES // min(d.itemsize for _, d in policy.kinds)
    offset, slots = 0, []
    for s in shards(model, layout, t, p):
        if s.numel == 0:
            continue  # an empty chunk (tp larger than a dimension): nothing to hold
        slots.append(Slot(s.name, s.source, s.region, s.shape, offset, s.numel))
        offset += -(-s.numel // align) * align
    return RankBuffers(tuple(slots), offset, policy)


def staged(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of staging regions (``STAGING_ALIGN``)."""
    return -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN
