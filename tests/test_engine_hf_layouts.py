"""Hugging Face checkpoints of each architecture (Llama 3 with RoPE scaling, Qwen2 with q/k/v
biases, Qwen3 with QK-norm and a tied head) loaded under every (tp, pp) layout of 4 gloo
processes give transformers' next-token log-probs: each rank reads its own shards of the
checkpoint (``load_hf``), and the replica's forward pass is compared with transformers' on the
same left-padded batch. fp32; the bound is ``engine_oracle.ATOL`` (only the order of summation
differs between layouts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.backends import hf
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.layout import Layout
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.state.holder import RankState
from tests.engine_oracle import ATOL, KINDS, hf_lm_logits, left_padded, next_token_logprobs, scored_mask
from tests.helpers_spawn import world

pytestmark = pytest.mark.dist

WORLD = 4
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1))  # tp 4 > the 2 KV heads; pp 2 over 3 layers
POLICY = StatePolicy.of(Stage.INF, Precision.FP32)


def _batch(vocab: int) -> object:
    return left_padded(3, 20, [0, 4, 9], vocab, seed=5)


def _worker(rank: int, store: str, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for kind in KINDS:
            folder = Path(root) / kind
            model = hf.read_config(folder)
            for tp, pp in LAYOUTS:
                layout = Layout(tp, pp)
                grid = Grid(layout, tuple(range(tp * pp)))
                groups = Groups.build(grid, model, rank)
                if rank in grid.ranks:
                    c = grid.coord(rank)
                    engine = TorchNativeEngine(
                        RankState.empty("actor.inf", model, layout, c.t, c.p, POLICY), groups
                    )
                    engine.load_hf(folder)
                    got = engine.forward(_batch(model.vocab_size))  # type: ignore[arg-type]
                    if rank == 0:
                        torch.save(got, Path(root) / f"{kind}-tp{tp}pp{pp}.pt")
                    engine.close()
                dist.barrier()
                groups.destroy()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_every_layout_gives_transformers_logprobs(checkpoints: dict[str, tuple[Path, object]]) -> None:
    root = next(iter(checkpoints.values()))[0].parent
    world(_worker, (str(root / "store"), str(root)), WORLD)
    for kind in KINDS:
        _, theirs = checkpoints[kind]
        vocab = hf.read_config(root / kind).vocab_size
        batch = _batch(vocab)
        want = next_token_logprobs(hf_lm_logits(theirs, batch.ids, batch.valid), batch.ids)  # type: ignore[attr-defined]
        scored = scored_mask(batch.valid)  # type: ignore[attr-defined]
        for tp, pp in LAYOUTS:
            got = torch.load(root / f"{kind}-tp{tp}pp{pp}.pt")
            err = float((got[scored] - want[scored]).abs().max())
            assert err <= ATOL, f"{kind} tp{tp}·pp{pp}: log-probs differ from transformers' by {err:.2e}"
