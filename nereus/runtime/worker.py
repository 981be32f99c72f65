"""A worker: one rank (a GPU slot; a virtual GPU on CPU) running its part of every RL step.

Every worker runs the same step (SPMD) on the plan it was given: for each model-stage in
workflow order it takes part only if the plan put one of the stage's EMUs on its GPU. Stages
run in the workflow's order (gen → inf → train); model-stages of one stage sit on disjoint GPUs
and so run concurrently. Rollouts and per-token scores are exchanged over the world group after
each stage (in an async job, inference and training exchange in the training side's group,
``train_side``, while generation runs apart: ``asynchrony.py``); every worker then derives the
same advantages. Weight syncs (actor.train ⇒ actor.gen, actor.inf; critic.train ⇒ critic.inf)
and plan changes are transition DAGs run by the executor, after which the engines re-bind to the
moved buffers. Engines come from the registry (``nereus.backends.registry``, one engine name per
model-stage), spoken to only through the Backend protocol. Edge module (torch.distributed).
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.backends.protocol import (
    AdamWConfig,
    Backend,
    EngineOptions,
    GenerationStats,
    Groups,
)
from nereus.backends.registry import build_engine, time_out_engine_groups
from nereus.control.transition_cost import FixedCosts
from nereus.devices import CPU, Devices, StageMemory, synchronize
from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Candidate, Layout, Plan
from nereus.runtime.health import HealthCheck
from nereus.runtime.optimes import OpTime
from nereus.runtime.place import Place, StageTimes, grid_of
from nereus.runtime.rollcall import HOLD_S
from nereus.runtime.rollout import Batch
from nereus.runtime.snapshot import Mark, Snapshot
from nereus.runtime.stagework import StageWork
from nereus.runtime.weights import fresh, stored
from nereus.spec import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import STAGE_ORDER, ExecutionMode, Role, Stage, WorkloadSpec
from nereus.state import recycle, staging
from nereus.state.buffers import StatePolicy
from nereus.state.emu import LogicalState, replica_of, replicas
from nereus.state.holder import RankState, StateHolder
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.between import Transition
from nereus.transition.execute import Executor
from nereus.transition.wire import consumed_on

# the weight sync's group (``Worker.bind``): a peer that dies mid-sync surfaces within this, as
# it did with a group of the walk's own (``Executor``'s default)
SYNC_TIMEOUT = datetime.timedelta(seconds=60)


def _no_hold(seconds: float) -> AbstractContextManager[None]:
    return nullcontext()


class Worker(StageWork):
    """One worker process's part of the job. ``gpu`` is its GPU id in plans, which never changes;
    its rank in the current world is ``rank_of[gpu]`` and changes when the world re-forms."""

    def __init__(
        self, gpu: int, workload: WorkloadSpec, models: Mapping[Role, ModelSpec], cluster: ClusterSpec,
        optim: Mapping[Role, AdamWConfig], seed: int, engines: Callable[[str], str],
        devices: Devices | None = None, workdir: Path | None = None, longest_response: int = 0,
        members: tuple[int, ...] | None = None,
    ) -> None:  # fmt: skip
        self.gpu = gpu
        self.devices = devices or Devices(CPU)
        self.device = self.devices.device
        self.rank_of: dict[int, int] = {}
        self.workload = workload
        self.workflow = workload.workflow()
        self.models = dict(models)
        self.cluster = cluster
        self.links = LinkModel(self.cluster, Efficiencies())
        self.optim = dict(optim)
        self.seed = seed
        self.engine_of = engines  # model-stage → engine name in the registry
        self.workdir = workdir  # the run's folder for engines' files (vLLM's caches and sockets)
        # the longest response a generation engine must hold: the run's (max_new_tokens at its
        # longest), else (0) the workload's max_response_len
        self.longest_response = longest_response or workload.max_response_len
        self.generation: dict[str, GenerationStats] = {}  # this step's, per generating model-stage
        self.rebuilds = 0.0  # seconds engines spent being built since the last look (``take_rebuilds``)
        self.built: dict[str, float] = {}  # the latest bind's: model-stage → seconds building its engine
        self.grouped: dict[str, float] = {}  # and → seconds forming its process groups
        self.degrees: dict[str, tuple[int, int, int]] = {}  # and → (TP, PP, DP) of those groups
        self.holder = StateHolder(gpu, self.device)
        self.engines: dict[str, Backend] = {}
        self.groups: dict[str, Groups] = {}
        self.times = StageTimes()
        self.temperature = 1.0  # the sampling's (``make_worker`` sets the experiment's)
        self.optimes: list[OpTime] = []  # this step's op-class timings (for calibration)
        # around a full collection: the member's heartbeat hold (``Membership.holding``; the job's
        # loop sets it), so peers do not take this worker for lost while it collects
        self.hold: Callable[[float], AbstractContextManager[None]] = _no_hold
        self.memory = StageMemory(self.devices)  # this step's peak memory per model-stage (GPU)
        self.fault: Callable[[str], None] | None = None  # a scripted fault at a stage's start
        # How long a peer is waited for in the groups ``bind`` forms (None: torch's default): a
        # pipeline's sends and receives wait ``p2p_timeout`` (the step's collective timeout; gloo
        # fixes a send's or receive's wait when the group is created, ``set_timeout`` does not
        # reach it), their collectives ``collective_timeout`` until the next ``time_collectives_out``.
        self.p2p_timeout: datetime.timedelta | None = None
        self.collective_timeout: datetime.timedelta | None = None
        self.snapshot = Snapshot(self.device)  # the sources' units at the last step boundaries
        self.health = HealthCheck.of(self.devices)  # its GPU's health, for the boundary report
        self.weights_of: Callable[[str], str] = lambda role: ""  # role → its Hugging Face folder, if any
        self.exchange: Any = None  # the group inference and training results travel in (None: the world)
        self.train_side: Any = None  # async: the group of every rank but generation's (None: the world)
        # the weight sync's group, formed with the others at ``bind`` (None until then, and once
        # the world re-forms: ``release``; the walk then forms one of its own)
        self.sync_group: Any = None
        self.train_side_member = True  # async: this rank holds some model-stage other than actor.gen
        self.pending: dict[int, Batch] = {}  # async: batches generated ahead, by the step that trains on them
        # the world's GPU ids in rank order: ``members`` (a generation's need not be 0…n − 1:
        # newcomers joining as GPUs 4 and 6 beside 0–3), else the default world's or this GPU alone
        if members is None:
            members = tuple(range(dist.get_world_size())) if dist.is_initialized() else (gpu,)
        self.set_world(members)

    def set_world(self, members: tuple[int, ...]) -> None:
        """The world (re-)formed with ``members`` (GPU ids, in rank order): groups and engines of
        the old world are gone; the units stay resident."""
        self.rank_of = {g: r for r, g in enumerate(members)}
        self.holder.rank = self.rank_of[self.gpu]
        self.release()

    def release(self) -> None:
        """Drop every reference to this world's groups (engines hold them too), so that
        destroying the world closes this process's connections."""
        self.groups = {}
        self.engines = {}
        self.train_side, self.train_side_member, self.sync_group = None, True, None

    @property
    def rank(self) -> int:
        return self.rank_of[self.gpu]

    @property
    def gpu_of_rank(self) -> dict[int, int]:
        return {r: g for g, r in self.rank_of.items()}

    def place(self, c: Candidate) -> Place | None:
        """Where this GPU sits in ``c`` (None: it holds none of its units)."""
        found = replica_of(c, self.gpu)
        if found is None:
            return None
        dp, unit = found
        return Place(dp, *unit.position(self.gpu))

    # ------------------------------------------------------------------ state and engines
    def model_of(self, name: str) -> ModelSpec:
        ms = self.workflow.get(name)
        return self.models[ms.role].with_head(ms.head)

    def policy_of(self, name: str) -> StatePolicy:
        return StatePolicy.of(self.workflow.get(name).stage, self.workload.precision)

    def init_state(self, plan: Plan) -> None:
        """Fresh weights for every unit this rank holds (the same values in every replica)."""
        for c in plan.candidates:
            place = self.place(c)
            if place is None:
                continue
            model, policy = self.model_of(c.model_stage), self.policy_of(c.model_stage)
            full = fresh(model, self.workflow.get(c.model_stage).role)
            self.holder.units[c.model_stage] = RankState.from_full(
                c.model_stage, model, c.layout, place.t, place.p, policy, full, LogicalState(seed=self.seed),
                self.device,
            )  # fmt: skip

    def from_storage(self, name: str, layout: Layout, t: int, p: int) -> RankState:
        """Frozen model-stage ``name``'s rank (t, p) of ``layout`` from its copy on shared storage:
        the weights it started from (a transition restores it so when its last replica was lost)."""
        model, role = self.model_of(name), self.workflow.get(name).role
        full = stored(model, role, self.weights_of(role.value))
        policy = self.policy_of(name)
        return RankState.from_full(
            name, model, layout, t, p, policy, full, LogicalState(seed=self.seed), self.device
        )

    def options(self, plan: Plan, name: str) -> EngineOptions:
        """What ``plan`` tells the engine of ``name``: a generation replica's concurrency (its
        candidate's micro-batch), the workload's longest sequence, whether it shares a GPU with
        a trainer (on a GPU it then sleeps while that trains)."""
        ms = self.workflow.get(name)
        if ms.stage is not Stage.GEN:
            return EngineOptions(workdir=self.workdir)
        c = plan.candidate(name)
        trainers = {
            g
            for t in plan.candidates
            if self.workflow.get(t.model_stage).stage is Stage.TRAIN
            for g in t.gpus
        }
        w = self.workload
        return EngineOptions(
            max_num_seqs=c.micro_batch, max_model_len=w.max_prompt_len + self.longest_response,
            workdir=self.workdir, sleep=self.devices.accelerated and bool(trainers & set(c.gpus)),
        )  # fmt: skip

    def _engine(self, name: str, rs: RankState, plan: Plan) -> Backend:
        role = self.workflow.get(name).role
        started = time.perf_counter()
        engine = build_engine(
            self.engine_of(name), rs, self.groups[name], self.optim.get(role), self.options(plan, name)
        )
        self.built[name] = time.perf_counter() - started
        self.rebuilds += self.built[name]
        return engine

    def bind(self, plan: Plan) -> None:
        """Groups for every model-stage (collective over the world) and engines for what this rank
        holds: a re-bind for a kept engine, a new engine otherwise."""
        dist.barrier()  # every worker is done with the old groups before any tears them down
        for g in self.groups.values():
            g.destroy()
        for group in (self.train_side, self.sync_group):
            if group is not None:
                dist.destroy_process_group(group)
        self.groups, self.train_side, self.sync_group = {}, None, None
        dist.barrier()  # and has torn them down before any connects new ones
        self.built, self.grouped = {}, {}
        for ms in self.workflow.model_stages:
            started = time.perf_counter()
            groups = Groups.build(
                grid_of(plan.candidate(ms.name), self.rank_of), self.model_of(ms.name), self.rank,
                self.p2p_timeout,
            )  # fmt: skip
            if self.collective_timeout is not None:
                groups.time_out(self.collective_timeout)
            self.groups[ms.name] = groups
            self.grouped[ms.name] = time.perf_counter() - started
            c = plan.candidate(ms.name)
            self.degrees[ms.name] = (c.layout.tp, c.layout.pp, c.dp)
        self._train_side(plan)
        self.sync_group = dist.new_group(backend=dist.get_backend(), timeout=SYNC_TIMEOUT)
        held = dict(self.holder.by_stage())
        self.holder.units = dict(held)
        engines: dict[str, Backend] = {}
        for name, rs in held.items():
            if name in self.engines:
                engines[name] = self.engines[name]
                started = time.perf_counter()
                engines[name].rebind(rs, self.groups[name], self.options(plan, name))
                self.rebuilds += time.perf_counter() - started
            else:
                engines[name] = self._engine(name, rs, plan)
        for name in set(self.engines) - set(engines):  # an engine whose units left this GPU
            self.engines[name].close()
        self.engines = engines

    def _train_side(self, plan: Plan) -> None:
        """Async RL: the group of the ranks that hold any model-stage but actor.gen, in which
        inference and training exchange while generation runs apart (collective over the world;
        the world itself when it is every rank)."""
        self.train_side, self.train_side_member = None, True
        if self.workload.mode is not ExecutionMode.ASYNC:
            return
        ranks = sorted(
            {self.rank_of[g] for c in plan.candidates if c.model_stage != "actor.gen" for g in c.gpus}
        )
        self.train_side_member = self.rank in ranks
        if len(ranks) < len(self.rank_of):
            self.train_side = dist.new_group(ranks)

    def time_collectives_out(self, timeout: datetime.timedelta) -> None:
        """Each later collective on this worker's groups (the model-stages', the train side's,
        vLLM's) fails after ``timeout``; the weight sync's and a transition's keep their own."""
        self.collective_timeout = timeout
        for groups in self.groups.values():
            groups.time_out(timeout)
        if isinstance(self.train_side, dist.ProcessGroup):  # not this rank's: NON_GROUP_MEMBER
            self.train_side.set_timeout(timeout)
        time_out_engine_groups(timeout)

    def close(self) -> None:
        """Shut every engine down (the job is over for this worker); the units stay."""
        for engine in self.engines.values():
            with suppress(Exception):  # an engine of a failed world: nothing left to release
                engine.close()
        self.engines = {}

    def drop(self) -> None:
        """This worker's state is gone (a checkpoint is about to refill it)."""
        self.holder.units.clear()
        self.engines.clear()

    # ------------------------------------------------------------------ step-boundary rollback
    def sources(self) -> frozenset[str]:
        """Model-stages without a weight-sync source: the state a weight sync cannot rebuild."""
        return frozenset(
            ms.name for ms in self.workflow.model_stages if self.workflow.sync_source(ms.name) is None
        )

    def receivers(self) -> tuple[str, ...]:
        """Model-stages a weight sync fills (actor.gen, actor.inf, critic.inf), in sync order."""
        return tuple(dst for _, dst in self.workflow.weight_syncs)

    def bind_costs(self) -> FixedCosts:
        """The latest bind's engine builds and group formation per kind, each model-stage's
        slowest rank (collective over the world): at start-up, what a move's rebuilds cost."""
        names = [ms.name for ms in self.workflow.model_stages]
        rows = [[self.built.get(n, 0.0), self.grouped.get(n, 0.0)] for n in names]
        t = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stages = [self.workflow.get(n).stage for n in names]
        degrees = [self.degrees.get(n, (1, 1, 1)) for n in names]
        return FixedCosts.of(stages, t[:, 0].tolist(), t[:, 1].tolist(), degrees)

    def take_rebuilds(self) -> float:
        """Seconds spent building and re-binding engines since the last call."""
        seconds, self.rebuilds = self.rebuilds, 0.0
        return seconds

    def take_snapshot(self, generation: int, step: int, plan: Plan) -> Mark:
        """Keep this rank's sources at the boundary before ``step`` on ``plan`` (in world generation
        ``generation``): a step that fails part-way (a peer died, a stage ran out of memory) is
        rolled back to it and run again, so no rank keeps half a step or half a transition. The
        snapshot before stays until ``snapshot.settle()``."""
        units, sources = self.holder.by_stage(), self.sources()
        return self.snapshot.take(generation, step, plan, units, sources, self.pending)

    def rollback(self, mark: Mark | None, plan: Plan | None = None) -> None:
        """Back to the boundary the survivors agreed on (``mark``, before a step on ``plan``): the
        snapshot's sources, newer snapshots forgotten; weight copies are dropped (the next weight
        sync restores them). ``None``: no survivor kept any snapshot, nothing to go back to."""
        if mark is None:
            self.holder.units = {}
            self.engines = {}
            self.pending = {}
            return
        units = self.snapshot.back_to(mark)
        self.pending = self.snapshot.pending(mark) if self.snapshot.marks() else {}
        if plan is not None and not self.snapshot.marks():  # it joined after the boundary: nothing held
            placed_here = sorted(n for n in self.sources() if self.gpu in plan.candidate(n).gpus)
            if placed_here:
                raise RuntimeError(
                    f"GPU {self.gpu}: no snapshot {tuple(mark)} to roll back to, yet its plan puts "
                    f"{', '.join(placed_here)} here"
                )
        self.holder.units = units
        self.engines = {}

    def transition(self, tr: Transition) -> float:
        """Run a plan change's DAG (collective over the world); seconds it took."""
        started = time.perf_counter()
        self.let_go({n for n in consumed_on(tr.dag, tr.moves, self.gpu) if self.policy_of(n).trains})
        try:
            executor = Executor(
                tr.dag, tr.moves, self.holder, self.gpu_of_rank,
                storage=self.from_storage, staging_budget=tr.staging_budget,
            )  # fmt: skip
            executor.run(tr.schedule.order() if tr.schedule else None)
        finally:  # the next step's memory is what the ledger counts: staging and kept blocks go back
            staging.release_all()
            recycle.release()
        synchronize(self.devices)  # the moves' work, not their launch
        return time.perf_counter() - started

    def let_go(self, names: set[str]) -> None:
        """Close the engines of ``names`` (trainers whose unit here the transition consumes): a
        trainer's engine views its unit's buffers (parameters, master weights, Adam moments), which
        would keep the old unit in memory through the whole transition while the ledger counts it
        freed kind by kind. ``bind`` builds them anew (a trainer that changes layout or position is
        rebuilt there anyway)."""
        closing = [n for n in sorted(names) if n in self.engines]
        for name in closing:
            self.engines.pop(name).close()
        if closing:
            with self.hold(HOLD_S):  # a full collection holds the interpreter, the heartbeat's too
                gc.collect()  # modules hold reference cycles: free their buffers now, not at some later GC

    def weight_sync(self, plan: Plan) -> float:
        """Trainers' weights into their receivers (actor.gen, actor.inf, critic.inf), as one DAG of
        restores from the trainers' units."""
        started = time.perf_counter()
        moves: dict[str, StageMove] = {}
        for src, dst in self.workflow.weight_syncs:
            s, d = plan.candidate(src), plan.candidate(dst)
            on = [u.gpus for u in replicas(s)]
            moves.setdefault(
                src,
                StageMove.between(src, self.model_of(src), self.policy_of(src), s.layout, on, s.layout, on),
            )
            moves[dst] = StageMove.between(
                dst, self.model_of(dst), self.policy_of(dst), d.layout, (), d.layout,
                [u.gpus for u in replicas(d)], restore_from=src, restore_gpus=s.gpus,
            )  # fmt: skip
            self.holder.units.pop(dst, None)
        ordered = [moves[ms.name] for ms in self.workflow.model_stages if ms.name in moves]
        rank_of = {ms.name: STAGE_ORDER.index(ms.stage) for ms in self.workflow.model_stages}
        dag = build_dag(ordered, rank_of, self.links, 2**62)
        try:
            Executor(dag, ordered, self.holder, self.gpu_of_rank, group=self.sync_group).run()
        finally:
            staging.release_all()
            recycle.release()
        self.holder.units = dict(self.holder.by_stage())
        for name in self.receivers():
            if name not in self.holder.units:
                continue
            if name in self.engines:
                self.engines[name].rebind(self.holder.units[name])
            else:  # after a restart: the receiver's first units
                self.engines[name] = self._engine(name, self.holder.units[name], plan)
        synchronize(self.devices)
        return time.perf_counter() - started
