"""A worker: one rank (a GPU slot; a virtual GPU on CPU) running its part of every RL step.

Every worker runs the same step (SPMD) on the plan it was given: for each model-stage in
workflow order it takes part only if the plan put one of the stage's units on its GPU. Stages
run in the workflow's order (gen → inf → train); model-stages of one stage sit on disjoint GPUs
and so run concurrently. Rollouts and per-token scores are exchanged over the world group after
each stage; every worker then derives the same advantages. Weight syncs (actor.train ⇒ actor.gen,
actor.inf; critic.train ⇒ critic.inf) and plan changes are transition DAGs run by the executor,
after which the engines re-bind to the moved buffers. Edge module (torch.distributed).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.grid import Grid
from nereus.backends.optim import AdamWConfig
from nereus.backends.parallel import Groups
from nereus.backends.protocol import LossFn, TokenBatch
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Candidate, Layout, Plan
from nereus.plan.opclass import OpClass
from nereus.runtime.optimes import OpTime, decode_s, gemm_s, train_times
from nereus.runtime.rollout import Rollouts, assemble, micro_count, placed, split_rows
from nereus.spec import load_cluster
from nereus.spec.model import ModelSpec
from nereus.spec.workload import STAGE_ORDER, Role, WorkloadSpec
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.emu import LogicalState, sample_range
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.between import Transition
from nereus.transition.execute import Executor

ROLE_SEED = {Role.ACTOR: 1, Role.REF: 1, Role.CRITIC: 2, Role.REWARD: 3}  # the reference starts as the actor


def units_of(c: Candidate) -> tuple[tuple[int, ...], ...]:
    return tuple(c.replica_gpus(r) for r in range(c.dp))


def grid_of(c: Candidate, rank_of: Mapping[int, int] | None = None) -> Grid:
    """The candidate's grid over world ranks (``rank_of``: GPU id → rank; identity by default)."""
    gpus = [g for unit in units_of(c) for g in unit]
    return Grid(c.layout, tuple(rank_of[g] for g in gpus) if rank_of is not None else tuple(gpus))


def init_tensor(model: ModelSpec, seed: int, kind: BufferKind, name: str) -> Tensor:
    """A fresh model's tensor: N(0, 0.02²) matrices, unit norms, zero biases and Adam moments."""
    shape = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}[name]
    if kind in (BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ):
        return torch.zeros(shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if len(shape) == 1:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.randn(shape, generator=g) * 0.02


@dataclass(slots=True)
class StageTimes:
    """Seconds each model-stage's work took on this rank during a step."""

    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, s: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + s


class Worker:
    """One worker process's part of the job. ``gpu`` is its GPU id in plans, which never changes;
    its rank in the current world is ``rank_of[gpu]`` and changes when the world re-forms."""

    def __init__(
        self, gpu: int, workload: WorkloadSpec, models: Mapping[Role, ModelSpec], cluster: str,
        optim: Mapping[Role, AdamWConfig], seed: int,
    ) -> None:  # fmt: skip
        self.gpu = gpu
        self.rank_of: dict[int, int] = {}
        self.workload = workload
        self.workflow = workload.workflow()
        self.models = dict(models)
        self.cluster = load_cluster(cluster)
        self.links = LinkModel(self.cluster, Efficiencies())
        self.optim = dict(optim)
        self.seed = seed
        self.holder = StateHolder(gpu)
        self.engines: dict[str, TorchNativeEngine] = {}
        self.groups: dict[str, Groups] = {}
        self.times = StageTimes()
        self.optimes: list[OpTime] = []  # this step's op-class timings (for calibration)
        self.snapshot: dict[str, RankState] = {}  # the trainers' units at the last step boundary
        self.set_world(tuple(range(dist.get_world_size())) if dist.is_initialized() else (gpu,))

    def set_world(self, members: tuple[int, ...]) -> None:
        """The world (re-)formed with ``members`` (GPU ids, in rank order): groups and engines of
        the old world are gone; the units stay resident."""
        self.rank_of = {g: r for r, g in enumerate(members)}
        self.holder.rank = self.rank_of[self.gpu]
        self.groups = {}
        self.engines = {}

    def release(self) -> None:
        """Drop every reference to this world's groups (engines hold them too), so that
        destroying the world closes this process's connections."""
        self.groups = {}
        self.engines = {}

    @property
    def rank(self) -> int:
        return self.rank_of[self.gpu]

    @property
    def gpu_of_rank(self) -> dict[int, int]:
        return {r: g for g, r in self.rank_of.items()}

    # ------------------------------------------------------------------ state and engines
    def model_of(self, name: str) -> ModelSpec:
        ms = self.workflow.get(name)
        return self.models[ms.role].with_head(ms.head)

    def policy_of(self, name: str) -> StatePolicy:
        return StatePolicy.of(self.workflow.get(name).stage, self.workload.precision)

    def init_state(self, plan: Plan) -> None:
        """Fresh weights for every unit this rank holds (the same values in every replica)."""
        for c in plan.candidates:
            model, policy = self.model_of(c.model_stage), self.policy_of(c.model_stage)
            seed = ROLE_SEED[self.workflow.get(c.model_stage).role]
            for gpus in units_of(c):
                if self.gpu in gpus:
                    i = gpus.index(self.gpu)
                    t, p = i % c.layout.tp, i // c.layout.tp

                    def full(kind: BufferKind, name: str, _m: ModelSpec = model, _s: int = seed) -> Tensor:
                        return init_tensor(
                            _m, _s, BufferKind.PARAM if kind is BufferKind.MASTER else kind, name
                        )

                    self.holder.units[c.model_stage] = RankState.from_full(
                        c.model_stage, model, c.layout, t, p, policy, full, LogicalState(seed=self.seed)
                    )

    def bind(self, plan: Plan) -> None:
        """Groups for every model-stage (collective over the world) and engines for what this rank
        holds: a re-bind for a kept engine, a new engine otherwise."""
        dist.barrier()  # every worker is done with the old groups before any tears them down
        for g in self.groups.values():
            g.destroy()
        self.groups = {}
        dist.barrier()  # and has torn them down before any connects new ones
        for ms in self.workflow.model_stages:
            self.groups[ms.name] = Groups.build(
                grid_of(plan.candidate(ms.name), self.rank_of), self.model_of(ms.name), self.rank
            )
        held = dict(self.holder.by_stage())
        self.holder.units = dict(held)
        engines: dict[str, TorchNativeEngine] = {}
        for name, rs in held.items():
            role = self.workflow.get(name).role
            if name in self.engines:
                engines[name] = self.engines[name]
                engines[name].rebind(rs, self.groups[name])
            else:
                engines[name] = TorchNativeEngine(rs, self.groups[name], self.optim.get(role))
        self.engines = engines

    def drop(self) -> None:
        """This worker left the pool: its state is gone."""
        self.holder.units.clear()
        self.engines.clear()

    # ------------------------------------------------------------------ step-boundary rollback
    def sources(self) -> frozenset[str]:
        """Model-stages without a weight-sync source: the state a weight sync cannot rebuild."""
        return frozenset(
            ms.name for ms in self.workflow.model_stages if self.workflow.sync_source(ms.name) is None
        )

    def take_snapshot(self) -> None:
        """Keep this rank's sources at a step boundary: a step that fails part-way (a peer died)
        is rolled back to it and run again, so no rank keeps half a step or half a transition.
        Trainers are copied (a step changes them in place); frozen models are held as they are."""
        sources = self.sources()
        self.snapshot = {
            n: _copied(rs) if rs.policy.trains else rs
            for n, rs in self.holder.by_stage().items()
            if n in sources
        }

    def rollback(self) -> None:
        """Back to the last boundary: the snapshot's sources (copied again, so a second failure
        finds it intact); weight copies are dropped (the next weight sync restores them)."""
        self.holder.units = {n: _copied(rs) if rs.policy.trains else rs for n, rs in self.snapshot.items()}
        self.engines = {}

    def transition(self, tr: Transition) -> float:
        """Run a plan change's DAG (collective over the world); seconds it took."""
        started = time.perf_counter()
        Executor(tr.dag, tr.moves, self.holder, self.gpu_of_rank).run(
            tr.schedule.order() if tr.schedule else None
        )
        return time.perf_counter() - started

    def weight_sync(self, plan: Plan) -> float:
        """Trainers' weights into their receivers (actor.gen, actor.inf, critic.inf), as one DAG of
        restores from the trainers' units."""
        started = time.perf_counter()
        moves: dict[str, StageMove] = {}
        for src, dst in self.workflow.weight_syncs:
            s, d = plan.candidate(src), plan.candidate(dst)
            moves.setdefault(
                src,
                StageMove(
                    src, self.model_of(src), self.policy_of(src), s.layout, units_of(s), s.layout, units_of(s)
                ),
            )
            moves[dst] = StageMove(
                dst, self.model_of(dst), self.policy_of(dst), d.layout, (), d.layout, units_of(d),
                restore_from=src, restore_gpus=s.gpus,
            )  # fmt: skip
            self.holder.units.pop(dst, None)
        ordered = [moves[ms.name] for ms in self.workflow.model_stages if ms.name in moves]
        rank_of = {ms.name: STAGE_ORDER.index(ms.stage) for ms in self.workflow.model_stages}
        dag = build_dag(ordered, rank_of, self.links, 2**62)
        Executor(dag, ordered, self.holder, self.gpu_of_rank).run()
        self.holder.units = dict(self.holder.by_stage())
        for name in (dst for _, dst in self.workflow.weight_syncs):
            if name not in self.holder.units:
                continue
            if name in self.engines:
                self.engines[name].rebind(self.holder.units[name])
            else:  # after a restart: the receiver's first units
                self.engines[name] = TorchNativeEngine(self.holder.units[name], self.groups[name])
        return time.perf_counter() - started

    # ------------------------------------------------------------------ stage work
    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = fn()
        self.times.add(name, time.perf_counter() - started)
        return out

    def generate(
        self, plan: Plan, prompt_ids: Tensor, prompt_valid: Tensor, sample_ids: list[int],
        params: SamplingParams, name: str = "actor.gen",
    ) -> Rollouts:  # fmt: skip
        c = plan.candidate(name)
        part = None
        if name in self.engines:
            eng = self.engines[name]
            rows = split_rows(prompt_ids.shape[0], c.dp, eng.coord.dp)
            batch = TokenBatch(prompt_ids[rows.start : rows.stop], prompt_valid[rows.start : rows.stop])
            started = time.perf_counter()
            out = self._timed(name, lambda: eng.generate(batch, sample_ids[rows.start : rows.stop], params))
            width = dict(self.policy_of(name).kinds)[BufferKind.PARAM].itemsize
            ideal = decode_s(self.model_of(name), c.layout, int(out.tokens.shape[1]), width, self.cluster)
            self.optimes.append(OpTime(name, OpClass.MEMORY, ideal, time.perf_counter() - started))
            if eng.coord.p == 0 and eng.coord.t == 0:
                part = (rows.start, out.tokens, out.valid)
        parts = _all_gather(part)
        return assemble(
            prompt_ids, prompt_valid, [p for p in parts if p is not None], sample_ids, params.pad_token_id
        )

    def infer(self, plan: Plan, name: str, r: Rollouts) -> Tensor:
        """Per-token log-probs (or values) of ``name`` over the whole batch, on every worker."""
        c = plan.candidate(name)
        part = None
        if name in self.engines:
            eng = self.engines[name]
            rows = split_rows(r.rows, c.dp, eng.coord.dp)
            micro = micro_count(len(rows), self.workload.inference_micro_batch)
            started = time.perf_counter()
            out = self._timed(name, lambda: eng.forward(r.batch(rows), micro_batches=micro))
            tokens = int(r.valid[rows.start : rows.stop].sum())
            ideal = gemm_s(self.model_of(name), c.layout, tokens, 2.0, self.cluster)
            self.optimes.append(OpTime(name, OpClass.GEMM, ideal, time.perf_counter() - started))
            if eng.coord.p == 0 and eng.coord.t == 0:
                part = (rows.start, out)
        parts = [p for p in _all_gather(part) if p is not None]
        return placed(parts, r.rows, r.ids.shape[1])

    def train(
        self,
        plan: Plan,
        name: str,
        r: Rollouts,
        fields: Mapping[str, Tensor],
        loss: Callable[[float], LossFn],
    ) -> float:
        """Every optimizer update of ``name`` over the step's batch: minibatches of the global
        batch in order, each dealt to the DP replicas by ``sample_range``. Returns the summed loss."""
        c = plan.candidate(name)
        gb = self.workload.global_batch
        if r.rows % gb or gb % c.dp:
            raise ValueError(f"{name}: {r.rows} rollouts, global batch {gb} and dp {c.dp} must divide evenly")
        total = 0.0
        for _ in range(self.workload.epochs):
            for u in range(r.rows // gb):
                normaliser = float(r.mask[u * gb : (u + 1) * gb].sum().clamp(min=1))
                if name not in self.engines:
                    continue
                eng = self.engines[name]
                mine = sample_range(gb, c.dp, eng.coord.dp, u)
                micro = micro_count(len(mine), self.workload.micro_batch)
                batch = r.batch(mine, **fields)
                started = time.perf_counter()
                stats = eng.train_step(batch, loss(normaliser), micro)
                self.times.add(name, time.perf_counter() - started)
                i = c.replica_gpus(eng.coord.dp).index(self.gpu)
                dp_gpus = tuple(c.replica_gpus(r)[i] for r in range(c.dp))
                self.optimes += train_times(
                    name, self.model_of(name), c.layout, stats.tokens, stats.seconds, stats.dp_allreduce_s,
                    stats.dp_allreduce_bytes, dp_gpus, self.cluster,
                )  # fmt: skip
                total += stats.loss
        return _from_rank(total, self.rank_of[c.gpus[0]])


def _copied(rs: RankState) -> RankState:
    bufs = {k: b.clone() for k, b in rs.buffers.items()}
    return RankState(rs.model_stage, rs.model, rs.layout, rs.t, rs.p, rs.policy, bufs, rs.state)


def _all_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank(x: float, src: int) -> float:
    """A value ``src`` knows (the stage's losses agree on all its ranks), on every rank."""
    t = torch.tensor([x], dtype=torch.float64)
    dist.broadcast(t, src=src)
    return float(t)
