"""The worker-side state holder: every unit's flat buffers on this rank, and views into them.

A ``RankState`` is one rank of one unit: the layout and position, the policy, one contiguous
tensor per buffer kind (param, master, Adam moments) laid out by ``rank_buffers``, and the
logical state. The engine binds parameters and optimizer state as views (``view``), so a
transition that replaces a rank's buffers is only a re-bind. Uses torch tensors, never
torch.distributed; the executor moves the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from nereus.devices import CPU
from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state import recycle
from nereus.state.buffers import BufferKind, Dtype, RankBuffers, StatePolicy, rank_buffers
from nereus.state.emu import Holding, LogicalState

TORCH_DTYPE = {Dtype.BF16: torch.bfloat16, Dtype.FP32: torch.float32}


@dataclass(slots=True)
class RankState:
    model_stage: str
    model: ModelSpec
    layout: Layout
    t: int
    p: int
    policy: StatePolicy
    buffers: dict[BufferKind, torch.Tensor]
    state: LogicalState = field(default_factory=LogicalState)

    def __post_init__(self) -> None:
        rb = self.layout_of()
        dtypes = dict(self.policy.kinds)
        if set(self.buffers) != set(dtypes):
            raise ValueError(f"{self.model_stage}: buffers {sorted(self.buffers)} != kinds {sorted(dtypes)}")
        for kind, buf in self.buffers.items():
            want = TORCH_DTYPE[dtypes[kind]]
            if buf.dtype != want or buf.dim() != 1 or buf.numel() != rb.numel:
                raise ValueError(
                    f"{self.model_stage} rank (t={self.t}, p={self.p}) {kind.value}: expected a flat "
                    f"{want} buffer of {rb.numel} elements, got {buf.dtype} {tuple(buf.shape)}"
                )

    def layout_of(self) -> RankBuffers:
        return rank_buffers(self.model, self.layout, self.t, self.p, self.policy)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def view(self, kind: BufferKind, name: str) -> torch.Tensor:
        """The shard of tensor ``name`` in buffer ``kind``, shaped, sharing its memory."""
        s = self.layout_of().slot(name)
        return self.buffers[kind][s.offset : s.offset + s.numel].view(s.shape)

    def views(self, kind: BufferKind = BufferKind.PARAM) -> Iterator[tuple[str, torch.Tensor]]:
        for s in self.layout_of().slots:
            yield s.name, self.buffers[kind][s.offset : s.offset + s.numel].view(s.shape)

    @classmethod
    def empty(
        cls, model_stage: str, model: ModelSpec, layout: Layout, t: int, p: int, policy: StatePolicy,
        state: LogicalState | None = None, device: torch.device | str = CPU,
    ) -> RankState:  # fmt: skip
        n = rank_buffers(model, layout, t, p, policy).numel
        bufs = {k: recycle.take(n, TORCH_DTYPE[d], device).zero_() for k, d in policy.kinds}
        return cls(model_stage, model, layout, t, p, policy, bufs, state or LogicalState())

    @classmethod
    def uninitialised(
        cls, model_stage: str, model: ModelSpec, layout: Layout, t: int, p: int, policy: StatePolicy,
        device: torch.device | str = CPU,
    ) -> RankState:  # fmt: skip
        """Buffers without a memset, for a receive that overwrites every byte (padding included)."""
        n = rank_buffers(model, layout, t, p, policy).numel
        bufs = {k: recycle.take(n, TORCH_DTYPE[d], device) for k, d in policy.kinds}
        return cls(model_stage, model, layout, t, p, policy, bufs, LogicalState())

    def zero_padding(self) -> None:
        """Zero the alignment padding between and after the slots (what ``empty`` leaves zero), for
        buffers made ``uninitialised`` whose every slot is then written."""
        gaps = padding(self.layout_of())
        for buf in self.buffers.values():
            for lo, hi in gaps:
                buf[lo:hi].zero_()

    @classmethod
    def from_full(
        cls, model_stage: str, model: ModelSpec, layout: Layout, t: int, p: int, policy: StatePolicy,
        full: Callable[[BufferKind, str], torch.Tensor], state: LogicalState | None = None,
        device: torch.device | str = CPU,
    ) -> RankState:  # fmt: skip
        """Cut this rank's shards out of full tensors (``full(kind, source_name)``, on the CPU),
        into buffers on ``device``."""
        rs = cls.empty(model_stage, model, layout, t, p, policy, state)
        for kind, _ in policy.kinds:
            for s in rs.layout_of().slots:
                whole = full(kind, s.source)
                cut = whole[tuple(slice(a, b) for a, b in s.region)]
                rs.buffers[kind][s.offset : s.offset + s.numel].copy_(cut.reshape(-1))
        return rs.to(device)

    @property
    def device(self) -> torch.device:
        return self.buffers[BufferKind.PARAM].device

    def to(self, device: torch.device | str, pinned: bool = False, non_blocking: bool = False) -> RankState:
        """This rank's state with its buffers on ``device`` (this object when they are there
        already; ``pinned``: page-locked host buffers, for asynchronous copies from a GPU)."""
        device = torch.device(device)
        if self.device == device and not pinned:
            return self
        bufs = {}
        for k, b in self.buffers.items():
            out = torch.empty(b.shape, dtype=b.dtype, device=device, pin_memory=pinned)
            out.copy_(b, non_blocking=non_blocking)
            bufs[k] = out
        return RankState(
            self.model_stage, self.model, self.layout, self.t, self.p, self.policy, bufs, self.state
        )


class StateHolder:
    """This rank's units, by unit id (``<model-stage>/<unit>``) during a transition."""

    def __init__(self, rank: int, device: torch.device | str = CPU) -> None:
        self.rank = rank
        self.device = torch.device(device)  # where this rank's units live and new ones are made
        self.units: dict[str, RankState] = {}

    def by_stage(self) -> Mapping[str, RankState]:
        """Between transitions a rank holds at most one unit of each model-stage."""
        out: dict[str, RankState] = {}
        for rs in self.units.values():
            if rs.model_stage in out:
                raise ValueError(f"rank {self.rank} holds two units of {rs.model_stage}")
            out[rs.model_stage] = rs
        return out

    @property
    def nbytes(self) -> int:
        return sum(rs.nbytes for rs in self.units.values())

    def holdings(self, gpu: int) -> list[Holding]:
        """What this rank (on ``gpu``) reports to the controller: one entry per unit it holds."""
        return [
            Holding(gpu, rs.model_stage, rs.layout, rs.t, rs.p, rs.layout_of().payload_numel, rs.state, uid)
            for uid, rs in self.units.items()
        ]


def padding(rb: RankBuffers) -> list[tuple[int, int]]:
    """The element ranges of a rank's flat buffers that no slot covers (alignment padding)."""
    gaps, end = [], 0
    for s in sorted(rb.slots, key=lambda s: s.offset):
        if s.offset > end:
            gaps.append((end, s.offset))
        end = max(end, s.offset + s.numel)
    if rb.numel > end:
        gaps.append((end, rb.numel))
    return gaps
