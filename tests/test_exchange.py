"""Exchange plans: every element a receiver needs comes exactly once, the receiver's own first."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy, rank_buffers
from nereus.transition.exchange import chunks, plan_pieces, view_at

pytestmark = pytest.mark.pure

LAYOUTS = [Layout(t, p) for t in (1, 2, 4) for p in (1, 2, 4) if t * p <= 8]


def _cover(model_name: str, need: Layout, nt: int, np_: int, have: Layout, order: list[int]) -> None:
    model = load_model(model_name)
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    ranks = list(have.positions())
    providers = tuple((have, *ranks[i]) for i in order)
    pieces = plan_pieces(model, policy, (need, nt, np_), providers)
    rb = rank_buffers(model, need, nt, np_, policy)
    filled = {s.name: np.zeros(s.shape, dtype=int) for s in rb.slots}
    for pc in pieces:
        idx = [slice(None)] * len(pc.dst.shape)
        start = pc.dst.region[pc.dim][0]
        idx[pc.dim] = slice(pc.lo - start, pc.hi - start)
        filled[pc.dst.name][tuple(idx)] += 1
        src = pc.src.region[pc.dim]
        assert src[0] <= pc.lo < pc.hi <= src[1]  # the provider holds what it sends
    for name, counts in filled.items():
        assert (counts == 1).all(), f"{name}: covered {counts.min()}..{counts.max()} times"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_every_element_comes_once_from_any_provider_order(model: str) -> None:
    m = load_model(model)
    for need, have in itertools.product(LAYOUTS, LAYOUTS):
        if m.num_attention_heads % max(need.tp, have.tp) or need.pp > m.num_hidden_layers:
            continue
        orders = [list(range(have.size)), list(reversed(range(have.size)))]
        for order, (nt, np_) in itertools.product(orders, [(0, 0), (need.tp - 1, need.pp - 1)]):
            _cover(model, need, nt, np_, have, order)


def test_a_later_provider_with_the_same_region_completes_a_row_cut() -> None:
    """Regression: tp2·pp2 → tp2·pp1, the receiver needs layer 2's down_proj columns of TP rank 1;
    the first holder of layer 2 has the other columns, the next holds exactly the needed ones."""
    _cover("tiny-llama", Layout(2, 1), 1, 0, Layout(2, 2), [0, 1, 2, 3])


def test_nothing_to_provide_names_the_slot() -> None:
    model = load_model("tiny-llama")
    policy = StatePolicy.of(Stage.INF, Precision.FP32)
    with pytest.raises(ValueError, match="no provider holds"):
        plan_pieces(model, policy, (Layout(1, 1), 0, 0), ((Layout(1, 2), 0, 0),))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_chunks_read_and_write_in_place_exactly_where_torch_views_are_contiguous(model: str) -> None:
    """``view_at`` agrees with torch on every piece of every re-layout (contiguous, and where);
    ``chunks`` keeps the pieces in order, and an in-place side of a chunk is one range of the flat
    buffer holding its pieces back to back."""
    m = load_model(model)
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    staged = in_place = 0
    for need, have in itertools.product(LAYOUTS, LAYOUTS):
        if m.num_attention_heads % max(need.tp, have.tp) or max(need.pp, have.pp) > m.num_hidden_layers:
            continue
        providers = tuple((have, *at) for at in have.positions())
        for nt, np_ in need.positions():
            pieces = plan_pieces(m, policy, (need, nt, np_), providers)
            for k in {pc.provider for pc in pieces}:
                mine = tuple(pc for pc in pieces if pc.provider == k)
                out = chunks(mine)
                assert tuple(pc for c in out for pc in c.pieces) == mine
                for c in out:
                    assert c.numel == sum(pc.numel for pc in c.pieces)
                    for side in ("src", "dst"):
                        at = getattr(c, side)
                        staged += at is None
                        in_place += at is not None
                        off = 0
                        for pc in c.pieces:
                            slot = getattr(pc, side)
                            # torch's view arithmetic on a meta buffer: no memory to fill
                            flat = torch.empty(slot.offset + slot.numel, device="meta")
                            view = flat[slot.offset :].view(slot.shape)
                            view = view.narrow(pc.dim, pc.lo - slot.region[pc.dim][0], pc.hi - pc.lo)
                            where = view_at(slot, pc.dim, pc.lo, pc.hi)
                            assert (where is not None) == view.is_contiguous(), (slot.name, pc)
                            if where is not None:
                                assert where == view.storage_offset()
                                assert at is not None and where == at + off  # back to back
                            else:
                                assert at is None
                            off += pc.numel
    assert staged and in_place
