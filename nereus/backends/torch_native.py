"""``torch_native``: the reference engine, any (tp, pp, dp) on CPU (gloo) or GPU (NCCL/RCCL).

- TP: DTensor ``parallelize_module`` (``parallel.py``), parameters viewing the EMU buffers.
- PP training: ``torch.distributed.pipelining`` (1F1B when there are at least as many
  micro-batches as stages, else GPipe), with static stage metadata; the attention mask travels
  with the hidden states. PP inference and decoding: stage-to-stage send/recv, one micro-batch
  (or one decoding step) at a time.
- DP: EMU replicas; gradients are all-reduced over the ``dp`` group, after the TP-partial
  (Qwen3's q/k norms), KV-replica and tied-embedding reductions.
- Optimizer: ``FlatAdamW`` over the flat buffers; the step count is the logical state's.
Edge module (torch.distributed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from nereus.backends import hf
from nereus.backends.logprobs import token_logprobs, token_values
from nereus.backends.model import DecoderStage
from nereus.backends.optim import AdamWConfig, FlatAdamW, norm_weights
from nereus.backends.parallel import Groups, build_stage, local_grad, rebind
from nereus.backends.protocol import Capabilities, Generation, LossFn, TokenBatch, TrainStats
from nereus.backends.sampling import SamplingParams, sample
from nereus.spec.model import Head
from nereus.state.buffers import BufferKind
from nereus.state.geometry import chunk, shards, tensors_at
from nereus.state.holder import RankState


class _PipeModule(nn.Module):
    """A stage for ``torch.distributed.pipelining``: (x, valid) in, (hidden, valid) or the head out."""

    def __init__(self, stage: DecoderStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: Tensor, valid: Tensor) -> Any:
        out = self.stage(x, valid)
        return out if self.stage.last else (out, valid)


class TorchNativeEngine:
    capabilities = Capabilities(
        train=True, generate=True, value_head=True, devices=("cpu", "cuda"),
        tensor_parallel="DTensor parallelize_module", pipeline_parallel="torch.distributed.pipelining",
    )  # fmt: skip

    def __init__(
        self, state: RankState, groups: Groups, optim: AdamWConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        self.optim_config = optim or AdamWConfig()
        self._dp_allreduce_s = 0.0
        self.device = torch.device(device) if device is not None else state.buffers[BufferKind.PARAM].device
        self._build(state, groups)

    # ------------------------------------------------------------------ binding
    def _build(self, state: RankState, groups: Groups) -> None:
        c = groups.coord
        if (state.layout, state.t, state.p) != (groups.grid.layout, c.t, c.p):
            raise ValueError(
                f"rank {groups.rank}: state is (t={state.t}, p={state.p}) of {state.layout}, "
                f"the grid puts it at (t={c.t}, p={c.p}) of {groups.grid.layout}"
            )
        groups.require(state.model)
        held = state.buffers[BufferKind.PARAM].device
        if held.type != self.device.type or (self.device.index is not None and held != self.device):
            raise ValueError(
                f"rank {groups.rank}: the state's buffers are on {held}, the engine runs on {self.device}"
            )
        self.state, self.groups, self.grid, self.coord = state, groups, groups.grid, c
        self.model = state.model
        self.trains = state.policy.trains
        self.stage = build_stage(state, groups, self.device, self.trains)
        self.first, self.last = c.p == 0, c.p == state.layout.pp - 1
        self.vocab_start = chunk(self.model.vocab_size, state.layout.tp, c.t)[0]
        self.dtype = state.buffers[BufferKind.PARAM].dtype
        self._params = dict(self.stage.named_parameters(remove_duplicate=False))
        self.optim = FlatAdamW(self.optim_config, state.layout_of(), self.device) if self.trains else None
        rep = self.grid.kv_replication(self.model)
        self.norm_w = norm_weights(state, c.t, rep) if self.trains else None
        self._reduce = self._reductions(rep)

    def rebind(self, state: RankState, groups: Groups | None = None) -> None:
        if groups is None and (state.layout, state.t, state.p) == (
            self.state.layout,
            self.state.t,
            self.state.p,
        ):
            rebind(self.stage, state, self.trains)
            self.state = state
            self._params = dict(self.stage.named_parameters(remove_duplicate=False))
            return
        if groups is None:
            raise ValueError("a new layout or position needs the new grid's groups")
        self._build(state, groups)

    def close(self) -> None:
        self.stage = None  # type: ignore[assignment]
        self._params = {}

    def _reductions(self, kv_rep: int) -> list[tuple[list[str], Any]]:
        """(slot names, group) pairs whose gradients are summed before the DP all-reduce."""
        specs = {
            spec.at(layer): spec for spec, layer in tensors_at(self.model, self.state.layout.pp, self.state.p)
        }
        names = [s.name for s in self.state.layout_of().slots]
        out: list[tuple[list[str], Any]] = []
        if self.groups.tp is not None:  # q/k norms see only the local heads: partial sums
            out.append(([n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))], self.groups.tp))
        if kv_rep > 1:
            out.append(([n for n in names if specs[n].kv], self.groups.kv))
        if self.grid.tie_groups(self.model):  # groups may serve several models: ask this one
            tied = "model.embed_tokens.weight" if self.first else "lm_head.weight"
            out.append(([tied], self.groups.tie))
        return [(n, g) for n, g in out if n]

    # ------------------------------------------------------------------ passes
    def _peer(self, dp: int) -> int:
        return self.grid.rank_at(self.coord.dp, self.coord.p + dp, self.coord.t)

    def _last_rank(self) -> int:
        return self.grid.rank_at(self.coord.dp, self.state.layout.pp - 1, 0)

    def _pass(
        self, x: Tensor, valid: Tensor, caches: Any = None, start: int = 0, positions: Tensor | None = None
    ) -> Tensor:
        """One stage of a forward pass: receive from the previous stage, run, send on."""
        if not self.first:
            h = torch.empty(
                (valid.shape[0], x.shape[1], self.model.hidden_size), dtype=self.dtype, device=self.device
            )
            dist.recv(h, src=self._peer(-1))
            x = h
        out: Tensor = self.stage(x, valid, caches, start, positions)
        if not self.last:
            dist.send(out.contiguous(), dst=self._peer(+1))
        return out

    def _score(self, out: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
        if self.model.head is Head.VALUE:
            return token_values(out)
        return token_logprobs(out, ids, self.vocab_start, self.groups.tp, temperature)

    def _from_last(self, x: Tensor) -> Tensor:
        """Broadcast a result of the last stage to every rank of the replica."""
        if self.state.layout.pp > 1:
            dist.broadcast(x, src=self._last_rank(), group=self.groups.unit)
        return x

    @torch.no_grad()
    def forward(self, batch: TokenBatch, micro_batches: int = 1, temperature: float = 1.0) -> Tensor:
        outs = []
        for mb in batch.split(micro_batches):
            ids, valid = mb.ids.to(self.device), mb.valid.to(self.device)
            out = self._pass(ids, valid)
            outs.append(
                self._score(out, ids, temperature)
                if self.last
                else torch.empty(ids.shape, device=self.device)
            )
        return self._from_last(torch.cat(outs))

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TokenBatch, loss_fn: LossFn, micro_batches: int = 1) -> TrainStats:
        if self.optim is None or self.norm_w is None:
            raise RuntimeError(
                f"{self.state.model_stage} does not train (its state has no optimizer buffers)"
            )
        t0 = time.perf_counter()
        self._dp_allreduce_s = 0.0
        for p in self._params.values():
            p.grad = None
        if self.state.layout.pp == 1:
            total = torch.zeros((), device=self.device)
            for mb in batch.split(micro_batches):
                ids = mb.ids.to(self.device)
                out = self.stage(ids, mb.valid.to(self.device))
                fields = {k: v.to(self.device) for k, v in mb.fields.items()}
                loss = loss_fn(self._score(out, ids), fields)
                loss.backward()  # type: ignore[no-untyped-call]
                total += loss.detach()
        else:
            total = self._pipeline_backward(batch, loss_fn, micro_batches)
        grad = self._flat_grad()
        norm = self._clip(grad)
        step = self.state.state.updates + 1
        self.optim.step(self.state, grad, step)
        self.state.state = dataclasses.replace(
            self.state.state, updates=step, version=self.state.state.version + 1
        )
        loss_sum = self._global_loss(total)
        return TrainStats(
            loss_sum, norm, int(batch.valid.sum()), time.perf_counter() - t0, self._dp_allreduce_s,
            grad.numel() * grad.element_size() if self.groups.dp is not None else 0,
        )  # fmt: skip

    def _pipeline_backward(self, batch: TokenBatch, loss_fn: LossFn, micro_batches: int) -> Tensor:
        layout, rows = self.state.layout, batch.rows
        if micro_batches <= 0 or rows % micro_batches:
            raise ValueError(f"micro_batches {micro_batches} must divide the batch of {rows} rows")
        per, seq, h = rows // micro_batches, batch.ids.shape[1], self.model.hidden_size
        valid_meta = torch.zeros((per, seq), dtype=torch.long, device="meta")
        if self.first:
            inputs: tuple[Tensor, ...] = (
                torch.zeros((per, seq), dtype=torch.long, device="meta"),
                valid_meta,
            )
        else:
            hidden = torch.zeros((per, seq, h), dtype=self.dtype, device="meta", requires_grad=True)
            inputs = (hidden, valid_meta)
        if self.last:
            width = () if self.model.head is Head.VALUE else (self._local_vocab(),)
            outputs: tuple[Tensor, ...] = (
                torch.zeros((per, seq, *width), dtype=self.dtype, device="meta", requires_grad=True),
            )
        else:
            outputs = (
                torch.zeros((per, seq, h), dtype=self.dtype, device="meta", requires_grad=True),
                valid_meta,
            )
        stage = PipelineStage(
            _PipeModule(self.stage), self.coord.p, layout.pp, self.device,
            input_args=inputs, output_args=outputs, group=self.groups.pp,
        )  # fmt: skip
        names = sorted(batch.fields)

        def loss(out: Tensor, target: Tensor) -> Tensor:
            ids = target[..., 0].long()
            fields = {n: target[..., 1 + j] for j, n in enumerate(names)}
            result: Tensor = loss_fn(self._score(out, ids), fields)
            return result

        kind = Schedule1F1B if micro_batches >= layout.pp else ScheduleGPipe
        schedule = kind(stage, n_microbatches=micro_batches, loss_fn=loss, scale_grads=False)
        losses: list[Tensor] = []
        if self.first:
            schedule.step(batch.ids.to(self.device), batch.valid.to(self.device).long())
        elif self.last:
            cols = [batch.ids.double(), *(batch.fields[n].double() for n in names)]
            target = torch.stack(cols, -1).to(self.device)
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        total = torch.zeros((), device=self.device)
        for x in losses:
            total += x.detach().float()
        return total

    def _local_vocab(self) -> int:
        lo, hi = chunk(self.model.vocab_size, self.state.layout.tp, self.coord.t)
        return hi - lo

    def _flat_grad(self) -> Tensor:
        rb = self.state.layout_of()
        grad = torch.zeros(rb.numel, dtype=torch.float32, device=self.device)
        for s in rb.slots:
            g = local_grad(self._params[s.name])
            if g is not None:
                grad[s.offset : s.offset + s.numel].copy_(g.reshape(-1))
        for names, group in self._reduce:
            slots = [rb.slot(n) for n in names]
            part = torch.cat([grad[s.offset : s.offset + s.numel] for s in slots])
            dist.all_reduce(part, group=group)
            at = 0
            for s in slots:
                grad[s.offset : s.offset + s.numel].copy_(part[at : at + s.numel])
                at += s.numel
        if self.groups.dp is not None:
            started = time.perf_counter()
            dist.all_reduce(grad, group=self.groups.dp)
            self._dp_allreduce_s += time.perf_counter() - started
        return grad

    def _clip(self, grad: Tensor) -> float:
        assert self.norm_w is not None
        sq = (grad.double().square() * self.norm_w).sum()
        if self.groups.unit is not None:
            dist.all_reduce(sq, group=self.groups.unit)
        norm = float(sq.sqrt())
        limit = self.optim_config.max_grad_norm
        if limit > 0:
            grad.mul_(min(1.0, limit / (norm + 1e-6)))
        return norm

    def _global_loss(self, total: Tensor) -> float:
        x = (total if self.last and self.coord.t == 0 else torch.zeros_like(total)).double()
        if self.groups.unit is not None:
            dist.all_reduce(x, group=self.groups.unit)
        if self.groups.dp is not None:
            dist.all_reduce(x, group=self.groups.dp)
        return float(x)

    # ------------------------------------------------------------------ generation
    def _full_logits(self, local: Tensor) -> Tensor:
        tp = self.state.layout.tp
        if tp == 1:
            return local
        vocab = self.model.vocab_size
        size = -(-vocab // tp)
        padded = torch.zeros((local.shape[0], size), dtype=local.dtype, device=local.device)
        padded[:, : local.shape[1]] = local
        pieces = [torch.empty_like(padded) for _ in range(tp)]
        dist.all_gather(pieces, padded, group=self.groups.tp)
        return torch.cat(
            [pieces[i][:, : chunk(vocab, tp, i)[1] - chunk(vocab, tp, i)[0]] for i in range(tp)], -1
        )

    @torch.no_grad()
    def generate(self, prompts: TokenBatch, sample_ids: Sequence[int], params: SamplingParams) -> Generation:
        if self.model.head is not Head.LM:
            raise RuntimeError(f"{self.state.model_stage} has a value head; it cannot generate")
        rows, plen = prompts.ids.shape
        if len(sample_ids) != rows:
            raise ValueError(f"{len(sample_ids)} sample ids for {rows} prompts")
        capacity = plen + params.max_new_tokens
        if capacity > self.model.max_position_embeddings:
            raise ValueError(f"prompt {plen} + max_new_tokens {params.max_new_tokens} exceed the model's "
                             f"max_position_embeddings {self.model.max_position_embeddings}")  # fmt: skip
        caches = self.stage.layer_caches(rows, capacity, self.stage.kv_heads(), self.dtype)
        ids = prompts.ids.to(self.device)
        valid = torch.zeros((rows, capacity), dtype=torch.long, device=self.device)
        valid[:, :plen] = prompts.valid.to(self.device).long()
        count = valid[:, :plen].sum(-1)
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        out = self._pass(ids, valid[:, :plen], caches, 0, None)
        tokens, alive, logps = [], [], []
        for step in range(params.max_new_tokens):
            tok = torch.full((rows,), params.pad_token_id, dtype=torch.long, device=self.device)
            lp = torch.zeros(rows, dtype=torch.float32, device=self.device)
            if self.last:
                drawn, drawn_lp = sample(self._full_logits(out[:, -1].float()), params, sample_ids, step)
                tok = torch.where(done, tok, drawn.to(self.device))
                lp = torch.where(done, lp, drawn_lp.to(self.device))
            if self.state.layout.pp > 1:  # one broadcast: ids are exact in float64
                both = self._from_last(torch.stack([tok.double(), lp.double()]))
                tok, lp = both[0].long(), both[1].float()
            tokens.append(tok)
            logps.append(lp)
            alive.append(~done)
            done = done | torch.isin(tok, stop)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            slot = plen + step
            valid[:, slot] = alive[-1].long()
            out = self._pass(tok[:, None], valid[:, : slot + 1], caches, slot, (count + step)[:, None])
        return Generation(
            prompts.ids, prompts.valid, torch.stack(tokens, 1).cpu(), torch.stack(alive, 1).long().cpu(),
            torch.stack(logps, 1).cpu(),
        )  # fmt: skip

    # ------------------------------------------------------------------ Hugging Face weights
    def load_hf(self, directory: Path) -> None:
        reader = hf.SafetensorsReader(directory)
        hf.check_compatible(self.model, hf.read_config(directory), Path(directory))
        full = hf.full_reader(reader, self.model)
        rb = self.state.layout_of()
        cut = {s.name: s for s in shards(self.model, self.state.layout, self.state.t, self.state.p)}
        staged = {}
        for s in rb.slots:  # read everything first: a bad checkpoint leaves the buffers untouched
            whole = full(s.source, cut[s.name].full_shape)
            staged[s.name] = whole[tuple(slice(a, b) for a, b in s.region)]
        for kind in self.state.buffers:
            for s in rb.slots:
                view = self.state.view(kind, s.name)
                if kind in (BufferKind.PARAM, BufferKind.MASTER):
                    view.copy_(staged[s.name])
                else:
                    view.zero_()

    def full_state(self, kind: BufferKind = BufferKind.PARAM) -> dict[str, Tensor] | None:
        """The whole model's tensors of buffer ``kind`` (parameters by default; master weights or
        Adam moments for a trainer) on replica 0's first rank, ``None`` elsewhere. Collective over
        replica 0."""
        if self.coord.dp != 0:
            return None
        cut = {s.name: s for s in shards(self.model, self.state.layout, self.state.t, self.state.p)}
        mine = [
            (
                s.name,
                cut[s.name].full_shape,
                s.region,
                self.state.view(kind, s.name).detach().cpu(),
            )
            for s in self.state.layout_of().slots
            if s.source == s.name
        ]
        root = self.grid.rank_at(0, 0, 0)
        gathered: list[Any] = [mine]
        if self.groups.unit is not None:
            gathered = [None] * self.state.layout.size
            dist.gather_object(
                mine, gathered if self.groups.rank == root else None, dst=root, group=self.groups.unit
            )
        if self.groups.rank != root:
            return None
        out: dict[str, Tensor] = {}
        order = [
            spec.at(layer)
            for p in range(self.state.layout.pp)
            for spec, layer in tensors_at(self.model, self.state.layout.pp, p)
        ]
        pieces: dict[str, list[tuple[tuple[int, ...], Any, Tensor]]] = {}
        for part in gathered:
            for name, shape, region, data in part:
                pieces.setdefault(name, []).append((shape, region, data))
        for name in order:
            if name not in pieces:
                continue
            shape, _, data = pieces[name][0]
            whole = out.setdefault(name, torch.zeros(shape, dtype=data.dtype))
            for _, region, data in pieces[name]:
                whole[tuple(slice(a, b) for a, b in region)] = data
        return out

    def save_hf(self, directory: Path) -> None:
        tensors = self.full_state()
        if tensors is not None:
            hf.save(directory, self.model, tensors)
