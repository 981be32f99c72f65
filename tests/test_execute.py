"""Transitions executed on torch.distributed (gloo, spawned processes): state moves bit for bit."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.plan.layout import Layout, Plan
from nereus.spec.workload import Precision
from nereus.state.buffers import BufferKind
from nereus.state.emu import LogicalState
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.transition import Transition, plan_transition
from nereus.transition.execute import Executor
from tests.helpers import make_problem, random_plan

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
        for r in range(cand.dp):
            gpus = cand.replica_gpus(r)
            if rank not in gpus:
                continue
            i = gpus.index(rank)
            t, p = i % cand.layout.tp, i // cand.layout.tp
            dtypes = dict(m.policy.kinds)

            def full(kind: BufferKind, name: str, _m=m, _s=shapes, _d=dtypes) -> torch.Tensor:  # type: ignore[no-untyped-def]
                x = full_tensor(_m.model.name, _s, kind, name)
                return x.to(torch.bfloat16 if _d[kind].value == "bfloat16" else torch.float32)

            state = LogicalState(updates=7, version=7, minibatch=21, seed=3) if when == "start" else None
            holder.units[m.name] = RankState.from_full(
                m.name, m.model, cand.layout, t, p, m.policy, full, state
            )
    return holder


def _worker(rank: int, store: str, trials: list[tuple[Transition, Plan, Plan]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
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
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


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


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(
    ("model", "precision"), [("tiny-llama", Precision.FP32), ("tiny-qwen3", Precision.BF16_MIXED)]
)
def test_random_transitions_move_state_bit_for_bit(tmp_path: Path, model: str, precision: Precision) -> None:
    """Random plan pairs of a PPO job on 4 ranks: every rank's parameters and optimizer state end
    up equal to the target layout's slices of the same full tensors, logical state preserved."""
    trials = _trials(10, 1, model, precision)
    mp.spawn(_worker, args=(str(tmp_path / "store"), trials, str(tmp_path)), nprocs=WORLD, join=True)
    assert all((tmp_path / f"ok{r}").exists() for r in range(WORLD))
