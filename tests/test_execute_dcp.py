"""Our reshard against PyTorch's distributed checkpoint: save under layout A, load under B."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.state.checkpoint import kv_mesh, layout_mesh, to_dtensors
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.execute import Executor
from tests.helpers_spawn import world

pytestmark = pytest.mark.dist

WORLD = 4
# The last pair has tp 4 > tiny-llama's 2 KV heads on one side: replicated heads.
PAIRS = [
    (Layout(2, 2), Layout(1, 4)),
    (Layout(1, 4), Layout(2, 1)),
    (Layout(2, 1), Layout(1, 2)),
    (Layout(4, 1), Layout(2, 2)),
]


def _units(layout: Layout) -> tuple[tuple[int, ...], ...]:
    """The world split into DP replicas of ``layout``."""
    return tuple(tuple(range(r, r + layout.size)) for r in range(0, WORLD, layout.size))


def _worker(rank: int, store: str, root: str) -> None:
    """Every pair in one world (one spawn, not one per pair): each pair's outcome on this rank is
    written to ``<root>/<pair>/rank<r>`` (``ok`` or the failed assertion), for its own test."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for pair in range(len(PAIRS)):
            folder = Path(root) / str(pair)
            try:
                _pair(rank, str(folder / "ckpt"), pair)
            except AssertionError as exc:  # after the pair's last collective: the next pair still runs
                (folder / f"rank{rank}").write_text(f"AssertionError: {exc}")
            else:
                (folder / f"rank{rank}").write_text("ok")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _pair(rank: int, ckpt: str, pair: int) -> None:
    A, B = PAIRS[pair]
    model = load_model("tiny-llama")
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    shapes = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}

    def full(kind, name):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(zlib.crc32(f"{kind.value}/{name}".encode()))
        return torch.randn(shapes[name], generator=g)

    i = rank % A.size
    a_state = RankState.from_full("actor.train", model, A, i % A.tp, i // A.tp, policy, full)
    world = list(range(WORLD))
    dcp.save(to_dtensors(a_state, layout_mesh(A, world), kv_mesh(model, A, world)), checkpoint_id=ckpt)

    i = rank % B.size
    tb, pb = i % B.tp, i // B.tp
    loaded = RankState.empty("actor.train", model, B, tb, pb, policy)
    dcp.load(to_dtensors(loaded, layout_mesh(B, world), kv_mesh(model, B, world)), checkpoint_id=ckpt)

    move = StageMove.between("actor.train", model, policy, A, _units(A), B, _units(B))
    dag = build_dag([move], {"actor.train": 2}, LinkModel(load_cluster("local-cpu"), Efficiencies()), 2**40)
    holder = StateHolder(rank)
    holder.units["actor.train"] = a_state
    Executor(dag, [move], holder, {r: r for r in range(WORLD)}).run()
    ours = holder.by_stage()["actor.train"]
    assert (ours.layout, ours.t, ours.p) == (B, tb, pb)
    for kind in ours.buffers:
        assert torch.equal(ours.buffers[kind], loaded.buffers[kind]), f"rank {rank} {kind.value}"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawned world runs every pair (a world per pair cost four spawns of four processes)."""
    root = tmp_path_factory.mktemp("dcp")
    for pair in range(len(PAIRS)):
        (root / str(pair)).mkdir()
    world(_worker, (str(root / "store"), str(root)), WORLD)
    return root


@pytest.mark.timeout(480)  # the first test waits for the one world that runs all four pairs
@pytest.mark.parametrize("pair", range(len(PAIRS)), ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_our_reshard_equals_dcp_load_with_reshard(outcomes: Path, pair: int) -> None:
    """Parameters and Adam moments: DCP save under A then load under B (its resharding) equals
    our transition A → B, on every rank, bit for bit."""
    got = {r: (outcomes / str(pair) / f"rank{r}").read_text() for r in range(WORLD)}
    assert got == dict.fromkeys(range(WORLD), "ok"), got
