"""The bound stage: this rank's pipeline stage of a model-stage, bound to its EMU buffers and groups.

- TP: DTensor ``parallelize_module`` (``parallel.py``), parameters viewing the EMU buffers.
- PP inference (and decoding, ``generation.py``): stage-to-stage send/recv, one micro-batch (or
  one decoding step) at a time; the last stage's result is broadcast to every rank of the replica.
- Gradient reductions ahead of the DP all-reduce (``training.py``): TP-partial (Qwen3's q/k
  norms), KV-replica and tied-embedding, each a (slot names, group) pair read off the grid.
Edge module (torch.distributed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.groups import Groups
from nereus.backends.logprobs import token_logprobs, token_values
from nereus.backends.parallel import build_stage, rebind
from nereus.backends.protocol import TokenBatch
from nereus.spec.model import Head
from nereus.state.buffers import BufferKind
from nereus.state.geometry import chunk, tensors_at
from nereus.state.holder import RankState

Reductions = list[tuple[list[str], Any]]


class BoundStage:
    """This rank's ``DecoderStage`` (``stage``), its parameters views of ``state``'s param buffer,
    placed by ``groups`` on their grid; the passes every engine call is made of."""

    def __init__(self, state: RankState, groups: Groups, device: torch.device) -> None:
        c = groups.coord
        if (state.layout, state.t, state.p) != (groups.grid.layout, c.t, c.p):
            raise ValueError(
                f"rank {groups.rank}: state is (t={state.t}, p={state.p}) of {state.layout}, "
                f"the grid puts it at (t={c.t}, p={c.p}) of {groups.grid.layout}"
            )
        groups.require(state.model)
        held = state.buffers[BufferKind.PARAM].device
        if held.type != device.type or (device.index is not None and held != device):
            raise ValueError(
                f"rank {groups.rank}: the state's buffers are on {held}, the engine runs on {device}"
            )
        self.device = device
        self.state, self.groups, self.grid, self.coord = state, groups, groups.grid, c
        self.model = state.model
        self.trains = state.policy.trains
        self.stage = build_stage(state, groups, device, self.trains)
        self.first, self.last = c.p == 0, c.p == state.layout.pp - 1
        self.vocab_start = chunk(self.model.vocab_size, state.layout.tp, c.t)[0]
        self.dtype = state.buffers[BufferKind.PARAM].dtype
        self.params = dict(self.stage.named_parameters(remove_duplicate=False))
        self.kv_replication = self.grid.kv_replication(self.model)
        self.reductions = self._reductions(self.kv_replication)

    def same_place(self, state: RankState) -> bool:
        """Whether ``state`` has this stage's layout and position (a re-view suffices)."""
        return (state.layout, state.t, state.p) == (self.state.layout, self.state.t, self.state.p)

    def rebind(self, state: RankState) -> None:
        """View new buffers of the same layout and position."""
        rebind(self.stage, state, self.trains)
        self.state = state
        self.params = dict(self.stage.named_parameters(remove_duplicate=False))

    def close(self) -> None:
        self.stage = None  # type: ignore[assignment]
        self.params = {}

    def _reductions(self, kv_rep: int) -> Reductions:
        """(slot names, group) pairs whose gradients are summed before the DP all-reduce."""
        specs = {
            spec.at(layer): spec for spec, layer in tensors_at(self.model, self.state.layout.pp, self.state.p)
        }
        names = [s.name for s in self.state.layout_of().slots]
        out: Reductions = []
        if self.groups.tp is not None:  # q/k norms see only the local heads: partial sums
            out.append(([n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))], self.groups.tp))
        if kv_rep > 1:
            out.append(([n for n in names if specs[n].kv], self.groups.kv))
        if self.grid.tie_groups(self.model):  # groups may serve several models: ask this one
            tied = "model.embed_tokens.weight" if self.first else "lm_head.weight"
            out.append(([tied], self.groups.tie))
        return [(n, g) for n, g in out if n]

    # ------------------------------------------------------------------ passes
    def peer(self, dp: int) -> int:
        return self.grid.rank_at(self.coord.dp, self.coord.p + dp, self.coord.t)

    def last_rank(self) -> int:
        return self.grid.rank_at(self.coord.dp, self.state.layout.pp - 1, 0)

    def run_pass(
        self, x: Tensor, valid: Tensor, caches: Any = None, start: int = 0, positions: Tensor | None = None
    ) -> Tensor:
        """One stage of a forward pass: receive from the previous stage, run, send on."""
        if not self.first:
            h = torch.empty(
                (valid.shape[0], x.shape[1], self.model.hidden_size), dtype=self.dtype, device=self.device
            )
            dist.recv(h, src=self.peer(-1))
            x = h
        out: Tensor = self.stage(x, valid, caches, start, positions)
        if not self.last:
            dist.send(out.contiguous(), dst=self.peer(+1))
        return out

    def score(self, out: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
        if self.model.head is Head.VALUE:
            return token_values(out)
        return token_logprobs(out, ids, self.vocab_start, self.groups.tp, temperature)

    def from_last(self, x: Tensor) -> Tensor:
        """Broadcast a result of the last stage to every rank of the replica."""
        if self.state.layout.pp > 1:
            dist.broadcast(x, src=self.last_rank(), group=self.groups.unit)
        return x

    @torch.no_grad()
    def forward(self, batch: TokenBatch, micro_batches: int = 1, temperature: float = 1.0) -> Tensor:
        """Per-token log-probs or values (B, T) of ``batch``, on every rank of the replica."""
        outs = []
        for mb in batch.split(micro_batches):
            ids, valid = mb.ids.to(self.device), mb.valid.to(self.device)
            out = self.run_pass(ids, valid)
            outs.append(
                self.score(out, ids, temperature) if self.last else torch.empty(ids.shape, device=self.device)
            )
        return self.from_last(torch.cat(outs))
