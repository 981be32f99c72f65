"""Transitions move a trainer's state one buffer kind at a time (``StatePolicy.streamed``): a GPU
that re-lays out a unit it holds frees each kind of the old rank once that kind of the new one has
arrived, so it needs room for one kind of the new rank, not all of it. The ledger counts that
peak; on gloo (2 spawned ranks) the executor frees as the ledger says, and a node that fails
part-way leaves no half-freed unit behind. A worker closes the engine of a trainer whose unit the
transition consumes, so the engine's views do not keep the old rank alive."""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.runtime.worker import Worker
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.holder import RankState
from nereus.transition import LinkModel, StageMove, Transition, build_dag
from nereus.transition import execute as execute_mod
from nereus.transition.build import initial_bytes
from nereus.transition.dag import Primitive
from nereus.transition.execute import Executor, TransitionError
from nereus.transition.primitives import geometry
from tests.helpers_spawn import world
from tests.test_execute_zero_copy import STAGE, start

LINKS = LinkModel(load_cluster("local-cpu"), Efficiencies())
TRAIN_BF16 = StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED)  # master, exp_avg, exp_avg_sq fp32; param bf16
TIMEOUT_S = 180


def _in_place(layouts: tuple[Layout, Layout] = (Layout(1, 2), Layout(2, 1))) -> StageMove:
    """One bf16-mixed trainer unit re-laid out on its own two GPUs."""
    a, b = layouts
    return StageMove.between(STAGE, load_model("tiny-qwen3"), TRAIN_BF16, a, ((0, 1),), b, ((0, 1),))


@pytest.mark.pure
def test_the_streamed_peak_is_one_kind_of_the_new_rank_when_it_is_no_larger() -> None:
    assert TRAIN_BF16.order == (
        BufferKind.MASTER,
        BufferKind.EXP_AVG,
        BufferKind.EXP_AVG_SQ,
        BufferKind.PARAM,
    )
    n = 14 * 1000  # 14 bytes per element: three fp32 kinds and a bf16 one
    assert TRAIN_BF16.streamed(n, n) == 4 * 1000  # one fp32 kind
    assert TRAIN_BF16.streamed(n, 2 * n) == 4 * 1000
    # growing: the last kind's new buffer comes while the old bf16 weights are still there
    assert TRAIN_BF16.streamed(2 * n, n) == n + 2 * 1000
    assert TRAIN_BF16.streamed(0, n) == 0 and TRAIN_BF16.streamed(n, 0) == n
    frozen = StatePolicy.of(Stage.INF, Precision.BF16_MIXED)
    assert frozen.streamed(n, n) == n  # one kind: the whole rank before anything is freed
    rng = random.Random(5)
    for _ in range(500):
        new, old = rng.randrange(0, 10**9), rng.randrange(0, 10**9)
        peak = TRAIN_BF16.streamed(new, old)
        assert max(0, new - old) <= peak <= new


@pytest.mark.pure
def test_an_in_place_reshard_fits_in_one_kind_of_headroom() -> None:
    move = _in_place()
    geo = geometry(move.model, move.policy)
    held = initial_bytes([move])
    new = {g: geo.held(Layout(2, 1), t, p) for g, t, p in move.target[0].ranks()}
    peak = {g: TRAIN_BF16.streamed(new[g], held[g]) for g in held}
    assert all(peak[g] < new[g] // 2 for g in held)  # before: the whole new rank on top of the old
    cap = {g: held[g] + peak[g] for g in held}
    dag = build_dag([move], {STAGE: 2}, LINKS, cap)
    assert dag.feasible, dag.reason
    (merge,) = [n for n in dag.nodes if n.primitive is Primitive.MERGE]
    assert dict(merge.acquire) == peak
    assert all(dag.peak[g] <= cap[g] for g in dag.peak)
    ends = {g: held[g] + a - r for (g, a), (_, r) in zip(merge.acquire, merge.release, strict=True)}
    assert ends == new  # it ends holding the new rank and nothing of the old
    tight = {g: c - 1 for g, c in cap.items()}
    assert not build_dag([move], {STAGE: 2}, LINKS, tight).feasible


def _streams(rank: int, layouts: tuple[Layout, Layout]) -> None:
    move = _in_place(layouts)
    holder = start(move, rank)
    old = {k: weakref.ref(b) for k, b in holder.units[STAGE].buffers.items()}
    live_at_alloc: list[tuple[int, ...]] = []

    def recording(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        live_at_alloc.append(tuple(j for j, k in enumerate(TRAIN_BF16.order) if old[k]() is not None))
        return torch.empty(numel, dtype=dtype, device=device)

    execute_mod.allocate = recording
    dag = build_dag([move], {STAGE: 2}, LINKS, 2**40)
    Executor(dag, [move], holder, {0: 0, 1: 1}).run()
    # kind j of the new rank is allocated once kinds 0 … j−1 of the old one are gone
    assert live_at_alloc == [(0, 1, 2, 3), (1, 2, 3), (2, 3), (3,)], (layouts, live_at_alloc)
    assert all(r() is None for r in old.values())
    rs = holder.by_stage()[STAGE]
    assert rs.layout == layouts[1] and set(rs.buffers) == set(TRAIN_BF16.order)


def _on_two_ranks(rank: int, store: str, out: str, check: Callable[[int], None]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        check(rank)
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path: Path, check: Callable[[int], None]) -> None:
    """``check(rank)`` on a gloo world of two spawned ranks; both must get through it."""
    world(_on_two_ranks, (str(tmp_path / "store"), str(tmp_path), check), nprocs=2)
    assert all((tmp_path / f"ok{r}").exists() for r in range(2))


def _streams_both_ways(rank: int) -> None:
    for layouts in ((Layout(1, 2), Layout(2, 1)), (Layout(2, 1), Layout(1, 2))):
        _streams(rank, layouts)


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT_S)
def test_the_executor_frees_each_kind_before_it_builds_the_next(tmp_path: Path) -> None:
    _two_ranks(tmp_path, _streams_both_ways)


def _fails_part_way(rank: int) -> None:
    move = _in_place()
    holder = start(move, rank)
    calls = 0

    def failing(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if rank == 1 and calls == 2:  # rank 1 fails in the second round
            raise RuntimeError("out of memory (simulated)")
        return torch.empty(numel, dtype=dtype, device=device)

    execute_mod.allocate = failing
    dag = build_dag([move], {STAGE: 2}, LINKS, 2**40)
    with pytest.raises(TransitionError, match="rank"):
        Executor(dag, [move], holder, {0: 0, 1: 1}, timeout_s=5.0).run()
    # the unit lost its first kind on both ranks: gone, not kept half-freed
    assert STAGE not in holder.units and not holder.units


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT_S)
def test_a_node_that_fails_part_way_leaves_no_half_freed_unit(tmp_path: Path) -> None:
    _two_ranks(tmp_path, _fails_part_way)


class _Viewer:
    """What any trainer's engine does to its unit: keeps views of its buffers until closed."""

    def __init__(self, rs: RankState) -> None:
        self.views: list[torch.Tensor] | None = [b[:8] for b in rs.buffers.values()]

    def close(self) -> None:
        self.views = None


@pytest.mark.pure
def test_closing_a_trainers_engine_collects_under_a_heartbeat_hold() -> None:
    """The collection that frees a closed engine's buffers holds the interpreter, the heartbeat
    thread's too: it runs inside the member's hold (``Membership.holding``), as a recovery's does,
    so peers do not take the worker for lost (a transition's ``let_go``)."""
    import gc

    from nereus.runtime.rollcall import HOLD_S

    move = _in_place()
    worker = Worker(
        0, load_workload("ppo"), dict.fromkeys(Role, move.model), load_cluster("local-cpu"),
        {}, 0, lambda name: "torch",
    )  # fmt: skip
    worker.holder = start(move, 0)
    worker.engines = {STAGE: _Viewer(worker.holder.units[STAGE])}  # type: ignore[dict-item]
    events: list[str] = []

    class Hold:
        def __init__(self, seconds: float) -> None:
            events.append(f"hold {seconds}")

        def __enter__(self) -> None:
            events.append("enter")

        def __exit__(self, *exc: object) -> None:
            events.append("exit")

    def collected(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            events.append("collect")

    worker.hold = Hold  # type: ignore[assignment]
    gc.callbacks.append(collected)
    try:
        worker.let_go({STAGE})
    finally:
        gc.callbacks.remove(collected)
    assert events[:4] == [f"hold {HOLD_S}", "enter", "collect", "exit"], events
    assert STAGE not in worker.engines


def _lets_go(rank: int) -> None:
    move = _in_place()
    worker = Worker(
        rank, load_workload("ppo"), dict.fromkeys(Role, move.model), load_cluster("local-cpu"),
        {}, 0, lambda name: "torch",
    )  # fmt: skip
    worker.set_world((0, 1))
    worker.holder = start(move, rank)
    worker.engines = {STAGE: _Viewer(worker.holder.units[STAGE])}  # type: ignore[dict-item]
    old = [weakref.ref(b) for b in worker.holder.units[STAGE].buffers.values()]
    dag = build_dag([move], {STAGE: 2}, LINKS, 2**40)
    live: list[int] = []

    def recording(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        live.append(sum(r() is not None for r in old))
        return torch.empty(numel, dtype=dtype, device=device)

    execute_mod.allocate = recording
    worker.transition(Transition(dag, None, (move,)))
    assert live == [4, 3, 2, 1], live  # the engine's views did not keep the old kinds alive
    assert STAGE not in worker.engines  # ``bind`` builds it anew


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT_S)
def test_a_worker_closes_the_engine_of_a_trainer_it_reshards_before_the_walk(tmp_path: Path) -> None:
    _two_ranks(tmp_path, _lets_go)
