"""A worker's part of each model-stage's work in a step: generation of its replica's rows,
inference and training over the whole batch; each timed, its peak memory measured, its op-class
timings kept for calibration, and an out-of-memory error named after the model-stage. A mixin of
``Worker`` (``nereus.runtime.worker``), which holds the state it reads. Edge module
(torch.distributed).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor

from nereus.backends.protocol import Backend, GenerationStats, LossFn, SamplingParams, TokenBatch, TrainStats
from nereus.devices import StageMemory
from nereus.plan.layout import Candidate, Plan
from nereus.plan.opclass import OpClass
from nereus.runtime.comm import from_rank, gather_parts
from nereus.runtime.optimes import OpTime, decode_s, gemm_s, train_times
from nereus.runtime.place import Place, StageTimes
from nereus.runtime.rollout import Rollouts, assemble, micro_count, placed, split_rows
from nereus.runtime.snapshot import Snapshot
from nereus.spec import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.emu import replicas, sample_range
from nereus.state.holder import StateHolder


class StageWork:
    """The step's stage work on this rank (``Worker``'s state)."""

    engines: dict[str, Backend]
    holder: StateHolder
    memory: StageMemory
    times: StageTimes
    fault: Callable[[str], None] | None
    optimes: list[OpTime]
    generation: dict[str, GenerationStats]
    workload: WorkloadSpec
    temperature: float  # the sampling's: log-probs are scored (and trained) at it
    cluster: ClusterSpec
    exchange: Any
    snapshot: Snapshot
    rank_of: dict[int, int]
    place: Callable[[Candidate], Place | None]
    model_of: Callable[[str], ModelSpec]
    policy_of: Callable[[str], StatePolicy]

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run a model-stage's work: its seconds, its peak memory (on a GPU), an out-of-memory
        error named after it, and a scripted fault (``fault(name)``) at its start."""
        started = time.perf_counter()
        with self.memory.measure(name, self.holder.units[name].nbytes if name in self.holder.units else 0):
            if self.fault is not None:
                self.fault(name)
            out = fn()
        self.times.add(name, time.perf_counter() - started)
        return out

    def generate_part(
        self, plan: Plan, prompt_ids: Tensor, prompt_valid: Tensor, sample_ids: list[int],
        params: SamplingParams, name: str = "actor.gen",
    ) -> tuple[int, list[Tensor]] | None:  # fmt: skip
        """This rank's replica's share of the rows (no collective): its first row, tokens and
        valid mask when this rank reports its replica; None otherwise."""
        c = plan.candidate(name)
        place = self.place(c)
        if name not in self.engines or place is None:
            return None
        eng = self.engines[name]
        rows = split_rows(prompt_ids.shape[0], c.dp, place.dp)
        batch = TokenBatch(prompt_ids[rows.start : rows.stop], prompt_valid[rows.start : rows.stop])
        started = time.perf_counter()
        out = self._timed(name, lambda: eng.generate(batch, sample_ids[rows.start : rows.stop], params))
        if place.reports:  # a replica's statistics, once
            self.generation[name] = self.generation.get(name, GenerationStats()).plus(out.stats)
        width = dict(self.policy_of(name).kinds)[BufferKind.PARAM].itemsize
        ideal = decode_s(self.model_of(name), c.layout, int(out.tokens.shape[1]), width, self.cluster)
        self.optimes.append(OpTime(name, OpClass.DECODE, ideal, time.perf_counter() - started))
        return (rows.start, [out.tokens, out.valid, out.logprobs]) if place.reports else None

    @staticmethod
    def collect(
        part: tuple[int, list[Tensor]] | None, prompt_ids: Tensor, prompt_valid: Tensor,
        sample_ids: list[int], pad_id: int,
    ) -> Rollouts:  # fmt: skip
        """The replicas' parts gathered into the rollouts, with the engine's log-probs of the
        tokens, on every worker (collective over the world)."""
        parts = gather_parts(part, (torch.long, torch.long, torch.float32))
        got = [(s, t, v, lp) for s, (t, v, lp) in parts]
        return assemble(prompt_ids, prompt_valid, got, sample_ids, pad_id)

    def infer(self, plan: Plan, name: str, r: Rollouts) -> Tensor:
        """Per-token log-probs (or values) of ``name`` over the whole batch, on every worker."""
        c = plan.candidate(name)
        place = self.place(c)
        part: tuple[int, list[Tensor]] | None = None
        if name in self.engines and place is not None:
            eng = self.engines[name]
            rows = split_rows(r.rows, c.dp, place.dp)
            micro = micro_count(len(rows), self.workload.inference_micro_batch)
            started = time.perf_counter()
            out = self._timed(
                name, lambda: eng.forward(r.batch(rows), micro_batches=micro, temperature=self.temperature)
            )
            tokens = int(r.valid[rows.start : rows.stop].sum())
            peak = self.cluster.peak_flops_at(self.workload.precision)
            ideal = gemm_s(self.model_of(name), c.layout, tokens, 2.0, peak)
            self.optimes.append(OpTime(name, OpClass.GEMM, ideal, time.perf_counter() - started))
            if place.reports:
                part = (rows.start, [out])
        parts = gather_parts(part, (torch.float32,), self.exchange)
        return placed([(s, out) for s, (out,) in parts], r.rows, r.ids.shape[1])

    def train(
        self,
        plan: Plan,
        name: str,
        r: Rollouts,
        fields: Mapping[str, Tensor],
        loss: Callable[[float], LossFn],
    ) -> float:
        """Every optimizer update of ``name`` over the step's batch: minibatches of the global
        batch in order, each dealt to the DP replicas by ``sample_range``. Returns the loss: the mean over
        the updates (as verl reports it)."""
        c = plan.candidate(name)
        gb = self.workload.global_batch
        if r.rows % gb or gb % c.dp:
            raise ValueError(f"{name}: {r.rows} rollouts, global batch {gb} and dp {c.dp} must divide evenly")
        place = self.place(c)
        total = 0.0
        for _ in range(self.workload.epochs):
            for u in range(r.rows // gb):
                normaliser = float(r.mask[u * gb : (u + 1) * gb].sum().clamp(min=1))
                if name not in self.engines or place is None:
                    continue
                mine = sample_range(gb, c.dp, place.dp, u)
                micro = micro_count(len(mine), self.workload.micro_batch)
                batch = r.batch(mine, **fields)
                self.snapshot.fence()  # the boundary's copy has read the trainer before it changes
                engine, loss_fn = self.engines[name], loss(normaliser)
                step = partial(engine.train_step, batch, loss_fn, micro, self.temperature)
                stats: TrainStats = self._timed(name, step)
                if not math.isfinite(stats.grad_norm) and place.dp == 0 and place.reports:  # said once
                    print(
                        f"nereus: warning: {name}: update {u + 1} of the step: gradient norm "
                        f"{stats.grad_norm}: the update is skipped (a non-finite score or loss)",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
                dp_gpus = tuple(unit.gpu(place.t, place.p) for unit in replicas(c))
                self.optimes += train_times(
                    name, self.model_of(name), c.layout, stats.tokens, stats.seconds, stats.dp_allreduce_s,
                    stats.dp_allreduce_bytes, dp_gpus, self.cluster,
                    self.cluster.peak_flops_at(self.workload.precision),
                )  # fmt: skip
                total += stats.loss
        updates = self.workload.epochs * (r.rows // gb)
        return from_rank(total / max(1, updates), self.rank_of[c.gpus[0]], self.exchange)
