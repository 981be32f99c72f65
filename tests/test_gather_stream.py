"""``stream_whole``: every rank of a replica gets the whole tensors, a bucket at a time, on gloo
(4 spawned processes), equal to the tensors the replica's shards were cut from, in
``whole_names`` order, with buckets of any size (one tensor, a few, all) and under TP, PP and
both. What a vLLM weight sync loads (``nereus.backends.vllm.engine``)."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.backends.gather import assemble, gather_flats, stream_whole, whole_names
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState
from tests.helpers_spawn import world

WORLD = 4
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]
BUCKETS = (1, 4096, 1 << 30)  # bytes: a tensor per bucket, a few, one bucket for all
POLICY = StatePolicy.of(Stage.GEN, Precision.FP32)


def whole(model: ModelSpec, name: str) -> torch.Tensor:
    shape = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}[name]
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _job(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    for model_name in ("tiny-qwen2", "tiny-llama"):
        model = load_model(model_name)
        for tp, pp in LAYOUTS:
            grid = Grid.single(Layout(tp, pp))
            groups = Groups.build(grid, model, rank)
            if rank in grid.ranks:
                c = grid.coord(rank)
                state = RankState.from_full(
                    "actor.gen", model, grid.layout, c.t, c.p, POLICY, lambda k, n, m=model: whole(m, n)
                )
                names = whole_names(state)
                for bucket in BUCKETS:
                    got = list(stream_whole(state, groups, BufferKind.PARAM, bucket))
                    assert [n for n, _ in got] == names, (model_name, tp, pp, bucket)
                    for name, tensor in got:
                        assert torch.equal(tensor, whole(model, name)), (model_name, tp, pp, bucket, name)
                flats = gather_flats(state, groups, BufferKind.PARAM, everywhere=False)
                if flats is not None:  # the checkpoint's path gives the same tensors, in order
                    assert list(assemble(state, flats)) == names
            dist.barrier()
            groups.destroy()
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_every_rank_streams_the_whole_tensors_in_buckets(tmp_path: Path) -> None:
    world(_job, (str(tmp_path / "store"),), WORLD)


@pytest.mark.pure
def test_a_tied_head_is_loaded_under_its_own_name_right_after_the_embedding() -> None:
    """vLLM's dummy-initialised head is its own tensor until a load names it: a tied model's
    stream (which holds no head of its own) names it with the embedding's tensor."""
    from nereus.backends.vllm.engine import HEAD, _with_tied_head

    for name, tied in (("tiny-qwen3", True), ("tiny-llama", False)):
        model = load_model(name)
        state = RankState.from_full(
            "actor.gen", model, Layout(1, 1), 0, 0, POLICY, lambda k, n, m=model: whole(m, n)
        )
        names = whole_names(state)
        streamed = [(n, torch.zeros(1)) for n in names]
        got = [n for n, _ in _with_tied_head(state, iter(streamed))]
        if tied:
            assert HEAD not in names and got.count(HEAD) == 1
            assert got[got.index("model.embed_tokens.weight") + 1] == HEAD
        else:
            assert got == names and HEAD in names
