"""The torch-native engine under (tp, pp, dp) layouts on gloo (4 spawned processes).

The slime-style check: one fixed batch gives the same log-probs, loss, gradient norm, post-step
parameters and Adam moments under every layout, and the same tokens when decoding (and a critic,
with a value head, the same values and update); and a run
whose state is moved by transitions (Extend, Split, Merge) between steps continues exactly as
the run without them. fp32. The bound: log-probs within 2e-5 and loss and gradient norm within
a relative 1e-5 (only the order of summation differs); parameters and moments within 5e-5 after
steps of lr 1e-2 (Adam divides by √v, which magnifies rounding where gradients are near zero).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.optim import AdamWConfig
from nereus.backends.protocol import TokenBatch
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import load_cluster, load_model
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState, StateHolder
from nereus.transition import LinkModel, StageMove, build_dag
from nereus.transition.execute import Executor
from tests.helpers_spawn import world

pytestmark = pytest.mark.dist

WORLD = 4
TIMEOUT_S = 480  # the first test waits for the one world that runs every test's job
EXECUTOR_TIMEOUT_S = 300.0  # a transition's group setup and transfers
LAYOUTS = {
    "tiny-qwen3": [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (4, 1, 1)],
    "tiny-llama": [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (1, 4, 1)],
}
MOVED = ("tiny-llama", "tiny-qwen2")  # Qwen2: q/k/v biases move with their heads
ROWS, SEQ, PROMPT = 4, 12, 5
OPTIM = AdamWConfig(lr=1e-2, weight_decay=0.1, eps=1e-5, max_grad_norm=1.0)
POLICY = StatePolicy.of(Stage.TRAIN, Precision.FP32)
KINDS = (BufferKind.PARAM, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)


def full_tensor(model: ModelSpec, kind: BufferKind, name: str) -> torch.Tensor:
    shape = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}[name]
    if kind is not BufferKind.PARAM:
        return torch.zeros(shape)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1
    return 1 + x if name.endswith("norm.weight") else x


def batch(model: ModelSpec, step: int) -> TokenBatch:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, model.vocab_size, (ROWS, SEQ), generator=g)
    valid = torch.ones(ROWS, SEQ, dtype=torch.long)
    valid[1, :3] = 0  # a left-padded prompt
    valid[2, -2:] = 0  # a short response
    adv = torch.randn(ROWS, SEQ, generator=g)
    return TokenBatch(ids, valid, {"adv": adv, "mask": valid.float()})


def rows_of(b: TokenBatch, dp: int, d: int) -> TokenBatch:
    per = ROWS // dp
    cut = slice(d * per, (d + 1) * per)
    return TokenBatch(b.ids[cut], b.valid[cut], {k: v[cut] for k, v in b.fields.items()})


def loss_fn(scores: torch.Tensor, fields: Any) -> torch.Tensor:
    """A policy-gradient surrogate normalised by a global constant (as the RL losses are)."""
    return -(scores * fields["adv"] * fields["mask"]).sum() / (ROWS * SEQ)


def value_loss(values: torch.Tensor, fields: Any) -> torch.Tensor:
    return ((values - fields["adv"]).square() * fields["mask"]).sum() / (ROWS * SEQ)


def _init(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _engine(model: ModelSpec, grid: Grid, groups: Groups, rank: int) -> TorchNativeEngine:
    c = grid.coord(rank)
    rs = RankState.from_full(
        "actor.train", model, grid.layout, c.t, c.p, POLICY, lambda k, n: full_tensor(model, k, n)
    )
    return TorchNativeEngine(rs, groups, OPTIM)


# ------------------------------------------------------------------ one batch, every layout
def _layouts_job(rank: int, model_name: str, layouts: list[tuple[int, int, int]], out: str) -> None:
    model = load_model(model_name)
    prompts = TokenBatch(batch(model, 0).ids[:, :PROMPT], batch(model, 0).valid[:, :PROMPT])
    for tp, pp, dp in layouts:
        grid = Grid.single(Layout(tp, pp), dp)
        groups = Groups.build(grid, model, rank)
        if rank in grid.ranks:
            c = grid.coord(rank)
            eng = _engine(model, grid, groups, rank)
            result: dict[str, Any] = {"logprobs": eng.forward(batch(model, 0), micro_batches=2)}
            stats = [
                eng.train_step(rows_of(batch(model, s), dp, c.dp), loss_fn, micro_batches=2) for s in (0, 1)
            ]
            result["loss"] = [s.loss for s in stats]
            result["grad_norm"] = [s.grad_norm for s in stats]
            mine = list(range(c.dp * ROWS // dp, (c.dp + 1) * ROWS // dp))
            sub = TokenBatch(prompts.ids[mine], prompts.valid[mine])
            greedy = eng.generate(sub, mine, SamplingParams(6, greedy=True))
            sampled = eng.generate(sub, mine, SamplingParams(6, temperature=0.8, top_p=0.9, seed=7))
            result["greedy"], result["sampled"], result["rows"] = greedy.tokens, sampled.tokens, mine
            result["updates"] = eng.state.state.updates
            for kind in KINDS:
                result[kind.value] = eng.full_state(kind)
            critic = _engine(model.with_head(Head.VALUE), grid, groups, rank)
            result["values"] = critic.forward(batch(model, 0), micro_batches=2)
            result["critic_loss"] = critic.train_step(rows_of(batch(model, 0), dp, c.dp), value_loss, 2).loss
            result["critic"] = critic.full_state()
            if rank == grid.rank_at(c.dp, 0, 0):
                torch.save(result, Path(out) / f"tp{tp}pp{pp}dp{dp}-{c.dp}.pt")
        dist.barrier()
        groups.destroy()


def _load(out: Path, tp: int, pp: int, dp: int) -> dict[str, Any]:
    parts = [torch.load(out / f"tp{tp}pp{pp}dp{dp}-{d}.pt", weights_only=False) for d in range(dp)]
    merged = dict(parts[0])
    merged["greedy"] = torch.cat([p["greedy"] for p in parts])
    merged["sampled"] = torch.cat([p["sampled"] for p in parts])
    return merged


def _assert_same_state(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    for kind in KINDS:
        assert set(got[kind.value]) == set(ref[kind.value]), what
        for name, want in ref[kind.value].items():
            err = (got[kind.value][name] - want).abs().max().item()
            assert err <= 5e-5, f"{what}: {kind.value} {name} differs by {err:.2e}"


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model", list(LAYOUTS))
def test_every_layout_computes_the_same_step(results: Path, model: str) -> None:
    """tiny-qwen3: tied embeddings, QK-norm, tp 4 > 2 KV heads (replicated heads); tiny-llama: an
    untied head and pp 4 (one layer per stage)."""
    layouts, out = LAYOUTS[model], results / f"layouts-{model}"
    ref = _load(out, 1, 1, 1)
    assert ref["updates"] == 2
    for tp, pp, dp in layouts[1:]:
        got, what = _load(out, tp, pp, dp), f"{model} tp{tp} pp{pp} dp{dp}"
        assert (got["logprobs"] - ref["logprobs"]).abs().max().item() <= 2e-5, what
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), what
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), what
        assert torch.equal(got["greedy"], ref["greedy"]), what
        assert torch.equal(got["sampled"], ref["sampled"]), what
        _assert_same_state(got, ref, what)
        assert (got["values"] - ref["values"]).abs().max().item() <= 2e-5, what
        assert got["critic_loss"] == pytest.approx(ref["critic_loss"], rel=1e-5), what
        for name, want in ref["critic"].items():
            assert (got["critic"][name] - want).abs().max().item() <= 5e-5, f"{what}: critic {name}"


# ------------------------------------------------------------------ training across transitions
PHASES: list[tuple[Layout, tuple[tuple[int, ...], ...]]] = [
    (Layout(2, 1), ((0, 1),)),  # tp2 on ranks 0-1
    (Layout(2, 1), ((0, 1), (2, 3))),  # Extend: a second replica on ranks 2-3
    (Layout(1, 1), ((0,), (1,), (2,), (3,))),  # Split: four tp1 replicas, in place
    (Layout(2, 2), ((0, 1, 2, 3),)),  # Merge: one tp2·pp2 replica
]


def _transition_job(rank: int, out: str, model_name: str) -> None:
    model = load_model(model_name)
    links = LinkModel(load_cluster("local-cpu"), Efficiencies())
    # the reference: every step on one rank, no transitions
    grid = Grid.single(Layout(1, 1))
    groups = Groups.build(grid, model, rank)
    if rank == 0:
        eng = _engine(model, grid, groups, rank)
        losses = [eng.train_step(batch(model, s), loss_fn, micro_batches=2).loss for s in range(len(PHASES))]
        ref = {kind.value: eng.full_state(kind) for kind in KINDS}
        torch.save({"loss": losses, **ref, "updates": eng.state.state.updates}, Path(out) / "reference.pt")
    dist.barrier()
    # the same steps, with the state moved between them
    holder = StateHolder(rank)
    engine: TorchNativeEngine | None = None
    groups = Groups(grid, rank, grid.coord(0))  # nothing to destroy yet
    losses = []
    for step, (layout, units) in enumerate(PHASES):
        if step:
            prev_layout, prev_units = PHASES[step - 1]
            moves = [StageMove.between("actor.train", model, POLICY, prev_layout, prev_units, layout, units)]
            dag = build_dag(moves, {"actor.train": 0}, links, 2**40)
            # a loaded machine may hold a rank back longer than the executor's 60 s default: the
            # test's own timeout bounds the world
            Executor(dag, moves, holder, {r: r for r in range(WORLD)}, timeout_s=EXECUTOR_TIMEOUT_S).run()
        grid = Grid(layout, tuple(r for u in units for r in u))
        groups.destroy()
        groups = Groups.build(grid, model, rank)
        if rank in grid.ranks:
            if step == 0:
                engine = _engine(model, grid, groups, rank)
                holder.units["actor.train"] = engine.state
            else:
                rs = holder.by_stage()["actor.train"]
                if engine is None:
                    engine = TorchNativeEngine(rs, groups, OPTIM)
                else:
                    engine.rebind(rs, groups)
            c = grid.coord(rank)
            assert engine is not None
            micro = min(2, ROWS // grid.dp)
            losses.append(engine.train_step(rows_of(batch(model, step), grid.dp, c.dp), loss_fn, micro).loss)
        dist.barrier()
    if rank == 0 and engine is not None:
        state = {kind.value: engine.full_state(kind) for kind in KINDS}
        torch.save({"loss": losses, **state, "updates": engine.state.state.updates}, Path(out) / "moved.pt")
    else:
        for kind in KINDS:
            if engine is not None:
                engine.full_state(kind)
    dist.barrier()


# ------------------------------------------------------------------ one world for every test


def _worker(rank: int, store: str, root: str) -> None:
    """Every test's job in one spawned world (a world per test cost four spawns of four
    processes): ``<root>/layouts-<model>`` and ``<root>/moved-<model>`` hold their results."""
    _init(rank, store)
    try:
        for model, layouts in LAYOUTS.items():
            _layouts_job(rank, model, layouts, str(Path(root) / f"layouts-{model}"))
        for model in MOVED:
            _transition_job(rank, str(Path(root) / f"moved-{model}"), model)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parallel")
    for name in [*(f"layouts-{m}" for m in LAYOUTS), *(f"moved-{m}" for m in MOVED)]:
        (root / name).mkdir()
    world(_worker, (str(root / "store"), str(root)), WORLD)
    return root


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("model", MOVED)
def test_training_continues_identically_across_extend_split_and_merge(results: Path, model: str) -> None:
    out = results / f"moved-{model}"
    ref = torch.load(out / "reference.pt", weights_only=False)
    got = torch.load(out / "moved.pt", weights_only=False)
    assert got["updates"] == ref["updates"] == len(PHASES)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    _assert_same_state(got, ref, "after Extend, Split and Merge")
