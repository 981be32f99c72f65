"""Zero-copy transitions (issue 21) on gloo, 4 spawned processes: the same state as the packed
path bit for bit on random layouts, and staging buffers that a second transition reuses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.state.emu import LogicalState
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.state.staging import Staging, pool
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.execute import Executor
from tests.helpers_spawn import world
from tests.test_execute import _trials, full_tensor, holder_for

pytestmark = pytest.mark.dist

WORLD = 4
TIMEOUT_S = 240
LAYOUTS = [Layout(t, p) for t in (1, 2, 4) for p in (1, 2, 4) if t * p <= WORLD]
STAGE = "actor.train"


def reshards(n: int, seed: int) -> list[tuple[str, Precision, StageMove]]:
    """Random re-layouts of one trainer on the 4 ranks: random layouts, DP and GPU order."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        model, precision = rng.choice([("tiny-llama", Precision.FP32), ("tiny-qwen3", Precision.BF16_MIXED)])
        a, b = rng.choice(LAYOUTS), rng.choice(LAYOUTS)
        if a == b:
            continue
        ga, gb = rng.sample(range(WORLD), WORLD), rng.sample(range(WORLD), WORLD)
        ua = [tuple(ga[i : i + a.size]) for i in range(0, rng.choice([a.size, WORLD]), a.size)]
        ub = [tuple(gb[i : i + b.size]) for i in range(0, rng.choice([b.size, WORLD]), b.size)]
        policy = StatePolicy.of(Stage.TRAIN, precision)
        out.append(
            (
                model,
                precision,
                StageMove.between(STAGE, load_model(model), policy, a, tuple(ua), b, tuple(ub)),
            )
        )
    return out


def start(move: StageMove, rank: int) -> StateHolder:
    """This rank's share of ``move``'s current units, cut from deterministic full tensors."""
    holder = StateHolder(rank)
    shapes = {s.source: s.full_shape for s in shards(move.model, Layout(1, 1), 0, 0)}
    dtypes = dict(move.policy.kinds)
    for u in move.current:
        if rank in u.gpus:
            t, p = u.position(rank)

            def full(kind, name):  # type: ignore[no-untyped-def]
                x = full_tensor(move.model.name, shapes, kind, name)
                return x.to(torch.bfloat16 if dtypes[kind].value == "bfloat16" else torch.float32)

            holder.units[STAGE] = RankState.from_full(
                STAGE, move.model, u.layout, t, p, move.policy, full, LogicalState(updates=3, seed=9)
            )
    return holder


def _run(dag, moves, holder, rank, zero_copy, order=None, staging=None):  # type: ignore[no-untyped-def]
    ex = Executor(dag, moves, holder, {r: r for r in range(WORLD)}, zero_copy=zero_copy, staging=staging)
    ex.run(order)
    return ex, {n: (rs.layout, rs.t, rs.p, rs.state, rs.buffers) for n, rs in holder.by_stage().items()}


def _same(a, b, what: str) -> None:  # type: ignore[no-untyped-def]
    assert a.keys() == b.keys(), what
    for name, (lay, t, p, state, bufs) in a.items():
        assert (lay, t, p, state) == b[name][:4], (what, name)
        for kind, buf in bufs.items():
            other = b[name][4][kind]
            assert buf.dtype == other.dtype and torch.equal(buf.view(torch.uint8), other.view(torch.uint8)), (
                f"{what} {name} {kind.value}"
            )


def _equal_worker(rank: int, store: str, seed: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        links = LinkModel(load_cluster("local-cpu"), Efficiencies())
        for k, (_, _, move) in enumerate(reshards(8, seed)):
            dag = build_dag([move], {STAGE: 2}, links, 2**40)
            packed, got = _run(dag, [move], start(move, rank), rank, False)
            zc, want = _run(dag, [move], start(move, rank), rank, True)
            _same(got, want, f"reshard {k} rank {rank}")
            assert zc.sent == packed.sent and zc.received == packed.received, k  # the same bytes
        for k, (tr, a, _) in enumerate(_trials(4, seed, "tiny-qwen3", Precision.BF16_MIXED)):
            order = tr.schedule.order() if tr.schedule else None
            _, got = _run(tr.dag, tr.moves, holder_for(rank, tr, a, "start"), rank, False, order)
            _, want = _run(tr.dag, tr.moves, holder_for(rank, tr, a, "start"), rank, True, order)
            _same(got, want, f"plan pair {k} rank {rank}")
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_zero_copy_equals_the_packed_path_bit_for_bit(tmp_path: Path) -> None:
    """Random re-layouts (both precisions, random DP and GPU order) and random plan pairs (extends,
    restores, destroys): every buffer, padding included, and every logical state come out byte for
    byte as the packed path leaves them, with the same bytes on the wire."""
    world(_equal_worker, (str(tmp_path / "store"), 21, str(tmp_path)), WORLD)
    assert all((tmp_path / f"ok{r}").exists() for r in range(WORLD))


def _reuse_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        model = load_model("tiny-llama")
        policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
        # tp2·pp2 → tp4 on the same ranks: row-parallel tensors are cut along dimension 1 (staged)
        move = StageMove.between(
            STAGE, model, policy, Layout(2, 2), ((0, 1, 2, 3),), Layout(4, 1), ((0, 1, 2, 3),)
        )
        dag = build_dag([move], {STAGE: 2}, LinkModel(load_cluster("local-cpu"), Efficiencies()), 2**40)
        staging = Staging()
        _, first = _run(dag, [move], start(move, rank), rank, True, staging=staging)
        held = {peer: (b.data_ptr(), b.numel()) for peer, b in staging.buffers.items()}
        allocations = staging.allocations
        assert staging.nbytes > 0 and allocations == len(held)
        _, second = _run(dag, [move], start(move, rank), rank, True, staging=staging)
        assert staging.allocations == allocations  # nothing allocated by the second transition
        assert {peer: (b.data_ptr(), b.numel()) for peer, b in staging.buffers.items()} == held
        _same(first, second, f"rank {rank}")
        ex = Executor(dag, [move], start(move, rank), {r: r for r in range(WORLD)})
        assert ex.staging is pool(torch.device("cpu"))  # by default, one pool per process and device
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(TIMEOUT_S)
def test_staging_buffers_are_reused_across_transitions(tmp_path: Path) -> None:
    world(_reuse_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD)
    assert all((tmp_path / f"ok{r}").exists() for r in range(WORLD))
