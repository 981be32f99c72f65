"""Recycled host buffers (issue 21, ``nereus.state.recycle``): a freed state buffer's block is
handed out again on the CPU only once nothing references its memory, with room for a rank a few KiB
larger; and transitions on gloo that recycle the old rank's blocks into the new rank's buffers
leave every earlier result intact, bit for bit, with no two live buffers sharing memory."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.plan.calibration import Efficiencies
from nereus.spec import load_cluster
from nereus.state import recycle
from nereus.state.holder import RankState
from nereus.state.recycle import HostCache, capacity
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.execute import Executor
from tests.helpers_spawn import world
from tests.test_execute_zero_copy import STAGE, WORLD, reshards, start

MIB = 1 << 20


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.pure
def test_capacity_leaves_a_64th_to_spare_rounded_up() -> None:
    assert capacity(4000) == 4096 and capacity(1) == 512
    # a tp2·pp2 rank of the 125M model's fp32 kinds holds its tp4 rank, 39,936 bytes larger
    assert capacity(124_686_336) >= 124_726_272
    for n in (1, 511, 512, 513, MIB - 1, MIB, 3 * MIB + 7, 10**9):
        c = capacity(n)
        assert c >= n + n // 64 and c - (n + n // 64) < (512 if n < MIB else 2 * MIB)


@pytest.mark.pure
def test_a_freed_block_is_reused_for_a_buffer_that_fits() -> None:
    cache = HostCache()
    a = cache.take(1000, torch.float32)
    assert a.numel() == 1000 and a.dtype == torch.float32 and a.untyped_storage().nbytes() == capacity(4000)
    where = _ptr(a)
    cache.offer(a)
    del a
    b = cache.take(1010, torch.float32)  # a little larger still fits the spare room
    assert _ptr(b) == where and cache.counts.reused == 1 and cache.counts.reused_bytes == 4040
    b.fill_(7)
    assert b.sum().item() == 7 * 1010
    cache.offer(b)
    del b
    c = cache.take(1200, torch.bfloat16)  # another dtype over the same bytes (2,400 of 4,096: fits)
    assert _ptr(c) == where and cache.counts.reused == 2 and cache.nbytes == 0


@pytest.mark.pure
def test_a_block_something_still_references_is_never_handed_out() -> None:
    cache = HostCache()
    a = cache.take(1000, torch.float32)
    a.fill_(3)
    where = _ptr(a)
    view = a[10:20]
    param = torch.nn.Parameter(a)
    cache.offer(a)
    del a
    for holder in ("view", "param"):
        b = cache.take(1000, torch.float32)
        assert _ptr(b) != where, holder  # a view or a parameter still reads it
        if holder == "view":
            del view
        else:
            assert param.sum().item() == 3000  # untouched
            del param
    same = cache.take(1000, torch.float32)
    assert _ptr(same) == where  # nothing references it any more
    alive = cache.take(500, torch.float32)
    cache.offer(alive)  # offered but still held by the caller
    assert _ptr(cache.take(500, torch.float32)) != _ptr(alive)


@pytest.mark.pure
def test_a_block_too_small_or_over_twice_the_need_is_left() -> None:
    cache = HostCache()
    small = cache.take(100, torch.float32)
    cache.offer(small)
    del small
    big = cache.take(1000, torch.float32)  # 4,000 bytes > the 512 kept
    assert cache.counts.reused == 0
    cache.offer(big)
    del big
    tiny = cache.take(10, torch.float32)  # 40 bytes: the 512-byte block, not the 4,096 one
    assert cache.counts.reused == 1 and tiny.untyped_storage().nbytes() == 512
    assert cache.take(10, torch.float32).untyped_storage().nbytes() == 512  # 4,096 > 2 × 40: new
    assert cache.counts.reused == 1


@pytest.mark.pure
def test_blocks_kept_are_bounded_released_and_offered_once() -> None:
    cache = HostCache(keep=3)
    bufs = [cache.take(100 * (i + 1), torch.uint8) for i in range(5)]
    for b in bufs:
        cache.offer(b)
    cache.offer(bufs[-1])  # twice: kept once
    assert len(cache.blocks) == 3 and cache.nbytes == sum(capacity(100 * (i + 1)) for i in (2, 3, 4))
    del bufs
    cache.release()
    assert cache.blocks == [] and cache.nbytes == 0
    off = HostCache(keep=0)
    x = off.take(100, torch.uint8)
    off.offer(x)
    assert off.blocks == []
    with pytest.raises(ValueError, match="keep"):
        HostCache(keep=-1)


@pytest.mark.pure
def test_off_the_cpu_it_is_the_allocator_s_business() -> None:
    cache = HostCache()
    m = cache.take(1000, torch.float32, "meta")
    assert m.device.type == "meta" and m.numel() == 1000 and cache.counts.taken == 0
    cache.offer(m)
    assert cache.blocks == []


@pytest.mark.pure
def test_a_state_made_empty_is_zero_even_on_a_reused_block() -> None:
    move = reshards(1, 5)[0][2]
    lay = move.current_layout
    first = RankState.empty(STAGE, move.model, lay, 0, 0, move.policy)
    for buf in first.buffers.values():
        buf.fill_(1)
        recycle.offer(buf)
    ptrs = {_ptr(b) for b in first.buffers.values()}
    del first, buf
    again = RankState.empty(STAGE, move.model, lay, 0, 0, move.policy)
    assert {_ptr(b) for b in again.buffers.values()} & ptrs  # at least one block came back
    assert all(not b.any() for b in again.buffers.values())
    recycle.release()


def _expected(move: StageMove, rank: int) -> RankState | None:
    """This rank's target rank, cut from the same full tensors (what the transition must make)."""
    back = StageMove.between(
        STAGE, move.model, move.policy, move.target_layout, [u.gpus for u in move.target],
        move.current_layout, [u.gpus for u in move.current],
    )  # fmt: skip
    return start(back, rank).units.get(STAGE)


def _recycle_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        links = LinkModel(load_cluster("local-cpu"), Efficiencies())
        recycle.release()
        kept: list[tuple[int, RankState | None, RankState | None]] = []
        read: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a view still read, its bytes)
        for k, (_, _, move) in enumerate(reshards(10, 17)):
            dag = build_dag([move], {STAGE: 2}, links, 2**40)
            holder = start(move, rank)
            if k % 2 and STAGE in holder.units:  # as an engine would: views of the old rank kept
                read += [(b[1:], b[1:].clone()) for b in holder.units[STAGE].buffers.values()]
            Executor(dag, [move], holder, {r: r for r in range(WORLD)}).run()
            kept.append((k, holder.by_stage().get(STAGE), _expected(move, rank)))
        for view, was in read:  # never handed out while viewed
            assert torch.equal(view.view(torch.uint8), was.view(torch.uint8))
        # every result, checked after all later transitions recycled what they freed
        for k, got, want in kept:
            assert (got is None) == (want is None), k
            if got is None or want is None:
                continue
            assert (got.layout, got.t, got.p, got.state) == (want.layout, want.t, want.p, want.state), k
            for kind, buf in got.buffers.items():
                assert torch.equal(buf.view(torch.uint8), want.buffers[kind].view(torch.uint8)), (k, kind)
        spans = sorted(
            (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
            for _, got, _ in kept
            if got is not None
            for b in got.buffers.values()
        )
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "two live buffers overlap"
        Path(out, f"reused{rank}").write_text(str(recycle.cache().counts.reused))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_transitions_recycle_freed_blocks_and_leave_earlier_results_intact(tmp_path: Path) -> None:
    """Ten random reshards on 4 gloo ranks, every result kept alive (and, every other time, views
    of the old rank, as an engine holds them): the new buffers reuse blocks of the old rank's kinds
    freed round by round, never a viewed one, and every result still equals the target cut from
    the full tensors once all of them ran."""
    world(_recycle_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD)
    reused = [int((tmp_path / f"reused{r}").read_text()) for r in range(WORLD)]
    assert sum(reused) > 0, reused
