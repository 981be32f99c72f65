"""Transitions executed on torch.distributed (gloo, spawned processes): state moves bit for bit."""

from __future__ import annotations

import os
import pickle
import random
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout, Plan
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.emu import LogicalState, rebuild, replicas, validate
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.transition import (
    LinkModel,
    Node,
    Primitive,
    StageMove,
    Transition,
    build_dag,
    plan_transition,
)
from nereus.transition.execute import Executor, TransitionError
from tests.helpers import make_problem, random_plan
from tests.helpers_spawn import world

pytestmark = pytest.mark.dist

WORLD = 4
TIMEOUT_S = 240


def full_tensor(
    model_name: str, shapes: dict[str, tuple[int, ...]], kind: BufferKind, name: str
) -> torch.Tensor:
    """The whole logical tensor, deterministic per (model, kind, name); fp32 (cast by kind)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{model_name}/{kind.value}/{name}".encode()))
    return torch.randn(shapes[name], generator=g)


def holder_for(rank: int, tr: Transition, plan: Plan, when: str) -> StateHolder:
    holder = StateHolder(rank)
    for m in tr.moves:
        cand = plan.candidate(m.name)
        shapes = {s.source: s.full_shape for s in shards(m.model, Layout(1, 1), 0, 0)}
        for u in replicas(cand):
            if rank not in u.gpus:
                continue
            t, p = u.position(rank)
            dtypes = dict(m.policy.kinds)

            def full(kind: BufferKind, name: str, _m=m, _s=shapes, _d=dtypes) -> torch.Tensor:  # type: ignore[no-untyped-def]
                x = full_tensor(_m.model.name, _s, kind, name)
                return x.to(torch.bfloat16 if _d[kind].value == "bfloat16" else torch.float32)

            state = LogicalState(updates=7, version=7, minibatch=21, seed=3) if when == "start" else None
            holder.units[m.name] = RankState.from_full(
                m.name, m.model, cand.layout, t, p, m.policy, full, state
            )
    return holder


def _worker(rank: int, store: str, cases: dict[str, list[tuple[Transition, Plan, Plan]]], out: str) -> None:
    """Every case's trials in one world (a world per case cost a spawn of four processes each);
    ``<out>/<case>/ok<rank>`` once a case's trials all passed on this rank."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for case, trials in cases.items():
            _trials_on(rank, trials)
            Path(out, case, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def _trials_on(rank: int, trials: list[tuple[Transition, Plan, Plan]]) -> None:
    for k, (tr, a, b) in enumerate(trials):
        holder = holder_for(rank, tr, a, "start")
        before = {n: rs.state for n, rs in holder.by_stage().items()}
        ex = Executor(tr.dag, tr.moves, holder, {r: r for r in range(WORLD)})
        ex.run(tr.schedule.order() if tr.schedule else None)
        want = holder_for(rank, tr, b, "end")
        got = holder.by_stage()
        assert set(got) == set(want.units), (k, rank, sorted(got), sorted(want.units))
        for name, exp in want.units.items():
            rs = got[name]
            assert (rs.layout, rs.t, rs.p) == (exp.layout, exp.t, exp.p), (k, name)
            for kind, buf in exp.buffers.items():
                assert torch.equal(rs.buffers[kind], buf), f"trial {k} rank {rank} {name} {kind.value}"
            if name in before:
                assert rs.state == before[name], (k, name)
            else:
                assert rs.state == LogicalState(updates=7, version=7, minibatch=21, seed=3), (k, name)
        dist.barrier()


def _trials(n: int, seed: int, model: str, precision: Precision) -> list[tuple[Transition, Plan, Plan]]:
    rng = random.Random(seed)
    problem = make_problem(model=model, cluster="local-cpu", gpus=WORLD, response=32, precision=precision)
    out = []
    while len(out) < n:
        a, b = random_plan(rng, problem, (1, 2, 4)), random_plan(rng, problem, (1, 2, 4))
        tr = plan_transition(problem, a, b)
        if tr.feasible and tr.dag.nodes:
            out.append((tr, a, b))
    return out


CASES = {"tiny-llama": Precision.FP32, "tiny-qwen3": Precision.BF16_MIXED}


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moved")
    cases = {model: _trials(10, 1, model, precision) for model, precision in CASES.items()}
    for model in cases:
        (root / model).mkdir()
    world(_worker, (str(root / "store"), cases, str(root)), WORLD)
    return root


@pytest.mark.timeout(2 * TIMEOUT_S)  # the first test waits for the one world that runs both cases
@pytest.mark.parametrize("model", list(CASES))
def test_random_transitions_move_state_bit_for_bit(moved: Path, model: str) -> None:
    """Random plan pairs of a PPO job on 4 ranks (tiny-llama in fp32, tiny-qwen3 in bf16 mixed
    precision): every rank's parameters and optimizer state end up equal to the target layout's
    slices of the same full tensors, logical state preserved."""
    assert all((moved / model / f"ok{r}").exists() for r in range(WORLD))


# ------------------------------------------------------------------ a rank dies mid-transition
def _fault_moves(scenario: str) -> list[StageMove]:
    m = load_model("tiny-llama")
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    one, two = Layout(1, 1), Layout(2, 1)
    if scenario == "after-split":  # two tp2 replicas split into four tp1 replicas in place
        return [
            StageMove.between("actor.train", m, policy, two, ((0, 1), (2, 3)), one, ((0,), (1,), (2,), (3,)))
        ]
    # two replicas grow to four: rank 1 is the source of the copy onto rank 0, and dies first
    return [StageMove.between("actor.train", m, policy, one, ((1,), (2,)), one, ((1,), (2,), (0,), (3,)))]


def _fault_worker(rank: int, store: str, scenario: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    moves = _fault_moves(scenario)
    dag = build_dag(moves, {"actor.train": 2}, LinkModel(load_cluster("local-cpu"), Efficiencies()), 2**40)
    move = moves[0]
    holder = StateHolder(rank)
    shapes = {s.source: s.full_shape for s in shards(move.model, Layout(1, 1), 0, 0)}
    for u in move.current:
        if rank in u.gpus:
            t, p = u.position(rank)
            holder.units["actor.train"] = RankState.from_full(
                "actor.train", move.model, u.layout, t, p, move.policy,
                lambda kind, name: full_tensor(move.model.name, shapes, kind, name), LogicalState(updates=5),
            )  # fmt: skip

    def die(node: Node, when: str) -> None:
        if rank == 1 and (
            (scenario == "after-split" and node.primitive is Primitive.SPLIT and when == "done")
            or (scenario == "dead-source" and when == "start")
        ):
            os._exit(0)

    error = ""
    started = time.monotonic()
    try:
        Executor(dag, moves, holder, {r: r for r in range(WORLD)}, timeout_s=10).run(on_node=die)
    except TransitionError as exc:
        error = str(exc)
    elapsed = time.monotonic() - started
    good = True  # every unit this rank kept holds exactly its slice of the full tensors

    def full(kind: BufferKind, name: str) -> torch.Tensor:
        return full_tensor(move.model.name, shapes, kind, name)

    for rs in holder.units.values():
        exp = RankState.from_full("actor.train", move.model, rs.layout, rs.t, rs.p, move.policy, full)
        good &= all(torch.equal(rs.buffers[k], exp.buffers[k]) for k in exp.buffers)
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps((holder.holdings(rank), error, elapsed, good)))
    os._exit(0)  # skip the world's teardown: a peer is dead


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("scenario", ["after-split", "dead-source"])
def test_a_rank_dying_mid_transition_loses_no_state(tmp_path: Path, scenario: str) -> None:
    ctx = mp.get_context("spawn")
    args = (str(tmp_path / "store"), scenario, str(tmp_path))
    procs = [ctx.Process(target=_fault_worker, args=(r, *args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    reports = {r: pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 2, 3)}
    assert not (tmp_path / "rank1.pkl").exists()
    assert all(good for _, _, _, good in reports.values())
    units = rebuild([h for holdings, _, _, _ in reports.values() for h in holdings], dead=[1])
    stage_of = {"actor.train": Stage.TRAIN}
    assert validate(units, stage_of) == []
    assert all(u.state == LogicalState(updates=5) for u in units)
    if scenario == "after-split":  # rank 0 kept its full tp1 replica; ranks 2 and 3 finished
        assert sorted(u.gpus for u in units) == [(0,), (2,), (3,)]
        assert all(not err for _, err, _, _ in reports.values())
    else:  # rank 0 waited on the dead source: an error within seconds naming the peer
        _, err, elapsed, _ = reports[0]
        assert "rank 0" in err and "[1]" in err and elapsed < 10
        assert sorted(u.gpus for u in units) == [(2,), (3,)]
