"""EMU: one DP replica of a model-stage and the logical state it carries (paper §2.10, §2.15).

``Emu = ⟨model-stage, layout, GPUs, logical state⟩``: tp·pp ranks (GPU ``gpus[layout.index(t, p)]``
holds TP rank t of pipeline stage p), each with its parameter (and, for trainers, optimizer) shards.
The ``LogicalState`` is what must survive every transition bit for bit: update counter c,
model-stage and policy versions v, minibatch position p of the last completed update, and the
seed from which RNG state and data position derive. A replica's data position and RNG stream
are *derived* from its DP rank and p in a global sample order, so a new replica (Extend) or a
re-ranked one needs nothing copied to continue without repeating or skipping a sample.

A collection is valid (paper §2.10) when (1) every unit's ranks hold the shards its layout needs,
(2) units that run concurrently (and replicas of one model-stage) use disjoint GPUs, and (3) the
units of one model-stage are DP replicas of the same logical state: same layout, same state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nereus.plan.layout import Candidate, Layout, Plan
from nereus.spec.workload import ExecutionMode, Stage


@dataclass(frozen=True, slots=True)
class LogicalState:
    """What a model-stage's units agree on: Λ = (c, v, p) plus the job's seed."""

    updates: int = 0  # c: optimizer steps applied
    version: int = 0  # v: model-stage version (a trainer's updates, or the synced policy version)
    minibatch: int = 0  # p: global minibatches consumed (the last completed update's position)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("updates", "version", "minibatch", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"logical state {name} must be non-negative, got {getattr(self, name)}")


def sample_range(global_batch: int, dp: int, dp_rank: int, minibatch: int) -> range:
    """Global sample indices DP rank ``dp_rank`` of ``dp`` consumes for minibatch ``minibatch``.

    The global order is fixed; minibatch p is samples [p·B, (p+1)·B), dealt to replicas in
    contiguous blocks of B/dp. Changing dp between minibatches repeats and skips nothing.
    """
    if dp <= 0 or global_batch % dp:
        raise ValueError(f"dp {dp} must divide the global batch {global_batch}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp})")
    per = global_batch // dp
    start = minibatch * global_batch + dp_rank * per
    return range(start, start + per)


def rng_seed(seed: int, model_stage: str, dp_rank: int, minibatch: int) -> int:
    """A replica's RNG seed for a minibatch: a stable hash, identical on every process and run."""
    text = f"{seed}/{model_stage}/{dp_rank}/{minibatch}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True, slots=True)
class Emu:
    """One DP replica of a model-stage: ⟨model-stage, layout, GPUs, logical state⟩ (paper §2.10).

    ``gpus[layout.index(t, p)]`` holds TP rank t of pipeline stage p. ``id`` names the unit in a
    transition DAG (``<model-stage>/u<i>`` for the i-th intact unit of the current plan,
    ``<model-stage>/v<i>`` for the i-th unit of the target, others for units a transition makes
    on the way); a unit outside a transition needs none. This one type is the unit of the
    planner's candidates, the transition DAG, the executor and the runtime's recovery.
    """

    model_stage: str
    layout: Layout
    gpus: tuple[int, ...]
    state: LogicalState = LogicalState()
    id: str = ""

    def __post_init__(self) -> None:
        if len(self.gpus) != self.layout.size:
            raise ValueError(
                f"{self.id or self.model_stage}: {self.layout} needs {self.layout.size} distinct GPUs, "
                f"got {len(self.gpus)}"
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"{self.id or self.model_stage}: unit GPUs repeat in {self.gpus}")

    def gpu(self, t: int, p: int) -> int:
        return self.gpus[self.layout.index(t, p)]

    def position(self, gpu: int) -> tuple[int, int]:
        """(t, p) of ``gpu`` in this unit."""
        return self.layout.position(self.gpus.index(gpu))

    def ranks(self) -> tuple[tuple[int, int, int], ...]:
        """(GPU, t, p) of every rank, in rank-index order."""
        return tuple((g, t, p) for g, (t, p) in zip(self.gpus, self.layout.positions(), strict=True))

    def named(self, uid: str) -> Emu:
        """The same unit under the DAG name ``uid``."""
        return Emu(self.model_stage, self.layout, self.gpus, self.state, uid)


def replicas(c: Candidate, state: LogicalState = LogicalState(), prefix: str = "") -> tuple[Emu, ...]:
    """The candidate's DP replicas as EMUs, in replica order (ids ``<model-stage>/<prefix><r>``
    when a ``prefix`` is given)."""
    return tuple(
        Emu(
            c.model_stage,
            c.layout,
            c.replica_gpus(r),
            state,
            f"{c.model_stage}/{prefix}{r}" if prefix else "",
        )
        for r in range(c.dp)
    )


def replica_of(c: Candidate, gpu: int) -> tuple[int, Emu] | None:
    """(DP rank, unit) of the replica of ``c`` that holds ``gpu``, or None."""
    for r, u in enumerate(replicas(c)):
        if gpu in u.gpus:
            return r, u
    return None


@dataclass(frozen=True, slots=True)
class Holding:
    """What one GPU reports it holds for a unit: the rank position and the elements it has."""

    gpu: int
    model_stage: str
    layout: Layout
    t: int
    p: int
    numel: int
    state: LogicalState
    unit: str = ""  # the unit it belongs to (a transition's unit id), when known


def units_of(plan: Plan, states: Mapping[str, LogicalState] | None = None) -> tuple[Emu, ...]:
    """Φ(π): one EMU per DP replica of every model-stage of ``plan``."""
    states = states or {}
    return tuple(u for c in plan.candidates for u in replicas(c, states.get(c.model_stage, LogicalState())))


def validate(
    units: Iterable[Emu],
    stage_of: Mapping[str, Stage],
    mode: ExecutionMode = ExecutionMode.SYNC,
    holdings: Iterable[Holding] | None = None,
    numel: Mapping[tuple[str, Layout, int, int], int] | None = None,
) -> list[str]:
    """Every way ``units`` fail to be a valid collection (empty when valid).

    ``holdings`` (what ranks report) and ``numel`` (elements each (model-stage, layout, t, p)
    must hold, from the geometry) check condition (1); without them only (2) and (3) are checked.
    """
    units = list(units)
    problems: list[str] = []
    by_stage: dict[str, list[Emu]] = {}
    for u in units:
        if u.model_stage not in stage_of:
            problems.append(f"unit of unknown model-stage {u.model_stage}")
            continue
        by_stage.setdefault(u.model_stage, []).append(u)
    for name, group in by_stage.items():
        first = group[0]
        for u in group[1:]:
            if u.layout != first.layout:
                problems.append(f"{name}: replicas have layouts {first.layout} and {u.layout}")
            if u.state != first.state:
                problems.append(f"{name}: replicas disagree on logical state ({first.state} vs {u.state})")
    for a_i, a in enumerate(units):
        for b in units[a_i + 1 :]:
            if a.model_stage not in stage_of or b.model_stage not in stage_of:
                continue
            if (
                _concurrent(stage_of[a.model_stage], stage_of[b.model_stage], mode)
                or a.model_stage == b.model_stage
            ):
                shared = sorted(set(a.gpus) & set(b.gpus))
                if shared:
                    problems.append(f"{a.model_stage} and {b.model_stage} units share GPUs {shared}")
    if holdings is not None:
        problems += _check_holdings(units, list(holdings), numel or {})
    return problems


def _concurrent(a: Stage, b: Stage, mode: ExecutionMode) -> bool:
    if a is b:
        return True
    return mode is ExecutionMode.ASYNC and Stage.GEN in (a, b)


def _check_holdings(
    units: list[Emu], holdings: list[Holding], numel: Mapping[tuple[str, Layout, int, int], int]
) -> list[str]:
    problems = []
    held = {(h.gpu, h.model_stage): h for h in holdings}
    for u in units:
        for g, t, p in u.ranks():
            h = held.get((g, u.model_stage))
            if h is None:
                problems.append(f"{u.model_stage}: GPU {g} holds no shard (rank t={t}, p={p})")
                continue
            if (h.layout, h.t, h.p) != (u.layout, t, p):
                problems.append(
                    f"{u.model_stage}: GPU {g} holds rank {h.layout} t={h.t} p={h.p}, needs t={t} p={p}"
                )
            want = numel.get((u.model_stage, u.layout, t, p))
            if want is not None and h.numel != want:
                problems.append(f"{u.model_stage}: GPU {g} holds {h.numel} elements, its shard has {want}")
            if h.state != u.state:
                problems.append(f"{u.model_stage}: GPU {g} is at {h.state}, its unit at {u.state}")
    return problems


def rebuild(holdings: Iterable[Holding], dead: Iterable[int] = ()) -> tuple[Emu, ...]:
    """The intact units among what surviving ranks report (after a failed transition).

    A unit is intact when every rank position of its layout is held by a live GPU and all its
    ranks agree on the logical state. Units are told apart by ``Holding.unit``. The result is
    what the controller replans from; pass it to ``validate`` with the numel table to check it.
    """
    gone = set(dead)
    by_unit: dict[tuple[str, str], list[Holding]] = {}
    for h in holdings:
        if h.gpu not in gone:
            by_unit.setdefault((h.model_stage, h.unit or f"gpu{h.gpu}"), []).append(h)
    out = []
    for (name, _), hs in sorted(by_unit.items()):
        lay = hs[0].layout
        at = {(h.t, h.p): h for h in hs if h.layout == lay}
        complete = len(at) == lay.size == len(hs)
        if not complete or len({h.state for h in hs}) != 1:
            continue
        gpus = tuple(at[pos].gpu for pos in lay.positions())
        out.append(Emu(name, lay, gpus, hs[0].state, hs[0].unit))
    return tuple(out)
