"""Shard geometry and flat state buffers against an independent Megatron/HF slicing oracle.

The oracle below is written from the rules (Megatron-LM column/row/vocabulary parallelism, GQA
with KV heads replicated when tp exceeds them, torch.chunk splits, contiguous pipeline chunks,
Hugging Face state-dict names and order); it calls none of nereus.state's helpers. Every layout
with tp·pp ≤ 8 a model admits is compared rank by rank, on tiny, odd and real model shapes, and
tiny models make a numpy round trip (cut every full tensor by region, reassemble from all ranks).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import defaultdict
from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.plan.layout import Layout
from nereus.plan.replica import stage_params
from nereus.spec import Head, ModelFamily, ModelSpec, Precision, Stage, load_model
from nereus.state.buffers import ALIGN_BYTES, BufferKind, Dtype, StatePolicy, rank_buffers
from nereus.state.geometry import check_layout, rank_numel, shards, shared_numel

pytestmark = pytest.mark.pure

Box = tuple[tuple[int, int], ...] | None  # a region, or None when it holds nothing
Row = tuple[str, str, Box, tuple[int, ...]]  # name, source, region, full shape

LAYOUTS = tuple(Layout(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if tp * pp <= 8)
EMBED = "model.embed_tokens.weight"


# --------------------------------------------------------------------------- the oracle
@cache
def torch_chunk(n: int, parts: int, index: int) -> tuple[int, int] | None:
    """Bounds of ``torch.arange(n).chunk(parts)[index]`` (None: torch returns no such chunk)."""
    pieces = torch.arange(n).chunk(parts)
    if index >= len(pieces) or pieces[index].numel() == 0:
        return None
    piece = pieces[index]
    return int(piece[0]), int(piece[-1]) + 1


def admits(m: ModelSpec, lay: Layout) -> bool:
    heads, kv = m.num_attention_heads, m.num_key_value_heads
    return heads % lay.tp == 0 and (kv % lay.tp == 0 or lay.tp % kv == 0) and lay.pp <= m.num_hidden_layers


def oracle_stage_layers(num_layers: int, pp: int, p: int) -> range:
    base, extra = divmod(num_layers, pp)
    start = p * base + min(p, extra)
    return range(start, start + base + (1 if p < extra else 0))


def box(*dims: tuple[int, int] | None) -> Box:
    return None if any(d is None for d in dims) else tuple(dims)  # type: ignore[arg-type]


def oracle_layer(m: ModelSpec, tp: int, t: int, i: int) -> list[Row]:
    h, hd, heads, kv, inter = (
        m.hidden_size,
        m.head_dim,
        m.num_attention_heads,
        m.num_key_value_heads,
        m.intermediate_size,
    )
    q_heads = range(t * heads // tp, (t + 1) * heads // tp)
    group = heads // kv  # q heads per KV head (HF repeat_kv)
    kv_heads = sorted({j // group for j in q_heads})  # the KV heads rank t's q heads attend with
    assert kv_heads == list(range(kv_heads[0], kv_heads[-1] + 1))
    if tp > kv:
        assert kv_heads == [t // (tp // kv)]
    q_rows = (q_heads.start * hd, q_heads.stop * hd)
    kv_rows = (kv_heads[0] * hd, (kv_heads[-1] + 1) * hd)
    mlp = torch_chunk(inter, tp, t)
    full_h = (0, h)
    a = f"model.layers.{i}.self_attn."
    out: list[tuple[str, Box, tuple[int, ...]]] = []
    for proj, rows, size in (("q", q_rows, heads * hd), ("k", kv_rows, kv * hd), ("v", kv_rows, kv * hd)):
        out.append((f"{a}{proj}_proj.weight", box(rows, full_h), (size, h)))
        if m.attention_bias:  # nn.Linear(bias=True): weight then bias, module by module
            out.append((f"{a}{proj}_proj.bias", box(rows), (size,)))
    out.append((f"{a}o_proj.weight", box(full_h, q_rows), (h, heads * hd)))
    if m.qk_norm:
        out += [(f"{a}q_norm.weight", ((0, hd),), (hd,)), (f"{a}k_norm.weight", ((0, hd),), (hd,))]
    b = f"model.layers.{i}.mlp."
    out += [
        (f"{b}gate_proj.weight", box(mlp, full_h), (inter, h)),
        (f"{b}up_proj.weight", box(mlp, full_h), (inter, h)),
        (f"{b}down_proj.weight", box(full_h, mlp), (h, inter)),
        (f"model.layers.{i}.input_layernorm.weight", (full_h,), (h,)),
        (f"model.layers.{i}.post_attention_layernorm.weight", (full_h,), (h,)),
    ]
    return [(name, name, region, shape) for name, region, shape in out]


def oracle(m: ModelSpec, lay: Layout, t: int, p: int) -> list[Row]:
    """What rank (t, p) holds, in Hugging Face state-dict order."""
    h, vocab = m.hidden_size, m.vocab_size
    vocab_rows = box(torch_chunk(vocab, lay.tp, t), (0, h))
    out: list[Row] = []
    if p == 0:
        out.append((EMBED, EMBED, vocab_rows, (vocab, h)))
    for i in oracle_stage_layers(m.num_hidden_layers, lay.pp, p):
        out += oracle_layer(m, lay.tp, t, i)
    if p == lay.pp - 1:
        out.append(("model.norm.weight", "model.norm.weight", ((0, h),), (h,)))
        if m.head is Head.VALUE:
            out.append(("score.weight", "score.weight", ((0, 1), (0, h)), (1, h)))
        elif not m.tie_word_embeddings:
            out.append(("lm_head.weight", "lm_head.weight", vocab_rows, (vocab, h)))
        elif lay.pp > 1:  # the last stage's own copy of the tied embedding
            out.append(("lm_head.weight", EMBED, vocab_rows, (vocab, h)))
    return out


def library(m: ModelSpec, lay: Layout, t: int, p: int) -> list[Row]:
    rows: list[Row] = []
    for s in shards(m, lay, t, p):
        assert len(s.region) == len(s.full_shape)
        assert all(0 <= a <= b <= n for (a, b), n in zip(s.region, s.full_shape, strict=True))
        assert s.shape == tuple(b - a for a, b in s.region) and s.numel == math.prod(s.shape)
        rows.append((s.name, s.source, None if s.numel == 0 else s.region, s.full_shape))
    return rows


def oracle_logical(m: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the model (pp = 1, tp = 1) and its shape."""
    return {name: shape for name, _, _, shape in oracle(m, Layout(1, 1), 0, 0)}


def ranks(lay: Layout) -> list[tuple[int, int]]:
    return [(t, p) for p in range(lay.pp) for t in range(lay.tp)]


def admitted(m: ModelSpec) -> list[Layout]:
    return [lay for lay in LAYOUTS if admits(m, lay)]


def volume(region: Box) -> int:
    return 0 if region is None else math.prod(b - a for a, b in region)


def overlap(x: Box, y: Box) -> int:
    if x is None or y is None:
        return 0
    return math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(x, y, strict=True))


def cut(region: Box) -> tuple[slice, ...]:
    assert region is not None
    return tuple(slice(a, b) for a, b in region)


# --------------------------------------------------------------------------- models
def odd(name: str, **kw: object) -> ModelSpec:
    return dataclasses.replace(load_model("tiny-llama"), name=name, **kw)  # type: ignore[arg-type]


TINY = {
    "tiny-llama": load_model("tiny-llama"),
    "tiny-qwen3": load_model("tiny-qwen3"),
    "tiny-llama-critic": load_model("tiny-llama").with_head(Head.VALUE),
    "tiny-qwen3-critic": load_model("tiny-qwen3").with_head(Head.VALUE),
    # tied, q/k/v bias, KV heads < tp, 3 layers (uneven pp), vocab 13 (rank 7 empty at tp 8), I = 100
    "odd-qwen2": odd(
        "odd-qwen2",
        family=ModelFamily.QWEN2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=3,
        vocab_size=13,
        intermediate_size=100,
        tie_word_embeddings=True,
        attention_bias=True,
    ),
    # value head, qk-norm, head_dim ≠ hidden/heads, 5 layers, I = 6 (ranks 6, 7 empty at tp 8)
    "odd-qwen3-critic": odd(
        "odd-qwen3-critic",
        family=ModelFamily.QWEN3,
        hidden_size=24,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=4,
        num_hidden_layers=5,
        vocab_size=30,
        intermediate_size=6,
        qk_norm=True,
        head=Head.VALUE,
    ),
    # multi-query attention (one KV head), 7 layers, untied vocab 37
    "odd-mqa": odd(
        "odd-mqa", num_key_value_heads=1, num_hidden_layers=7, vocab_size=37, intermediate_size=33
    ),
}
REAL = {name: load_model(name) for name in ("llama-3.1-8b", "qwen3-14b", "qwen3-32b", "llama-3.3-70b")}
REAL_VARIANTS = {
    "llama-3.1-8b-critic": REAL["llama-3.1-8b"].with_head(Head.VALUE),
    "qwen3-14b-tied": dataclasses.replace(REAL["qwen3-14b"], tie_word_embeddings=True),
}
ALL = {**TINY, **REAL, **REAL_VARIANTS}


# --------------------------------------------------------------------------- 1. oracle comparison
def assert_matches_oracle(m: ModelSpec) -> None:
    for lay in LAYOUTS:
        if not admits(m, lay):
            with pytest.raises(ValueError):
                check_layout(m, lay)
            with pytest.raises(ValueError):
                shards(m, lay, 0, 0)
            continue
        check_layout(m, lay)
        for t, p in ranks(lay):
            got, want = library(m, lay, t, p), oracle(m, lay, t, p)
            assert {r[0]: r for r in got} == {r[0]: r for r in want}, (m.name, lay, t, p)
            assert len(got) == len(want)
            assert [r[0] for r in got] == [r[0] for r in want], (m.name, lay, t, p)


@pytest.mark.parametrize("name", list(ALL))
def test_shards_match_oracle(name: str) -> None:
    m = ALL[name]
    assert_matches_oracle(m)
    if name in REAL:  # every real shape admits every layout up to tp·pp = 8
        assert admitted(m) == list(LAYOUTS)


def test_oracle_layout_coverage() -> None:
    """The grid is what the brief asks for, and the odd shapes exercise the odd rules."""
    assert len(LAYOUTS) == 10
    assert [str(lay) for lay in admitted(TINY["tiny-llama"])] == [
        "tp1·pp1", "tp1·pp2", "tp1·pp4", "tp2·pp1", "tp2·pp2", "tp2·pp4", "tp4·pp1", "tp4·pp2",
    ]  # fmt: skip
    # empty chunks exist and the library reports them as empty
    odd2 = TINY["odd-qwen3-critic"]
    assert [s.numel for s in shards(odd2, Layout(8, 1), 7, 0) if "gate_proj" in s.name] == [0] * 5
    assert [s.numel for s in shards(TINY["odd-qwen2"], Layout(8, 1), 7, 0) if "embed" in s.name] == [0]


def test_state_dict_order_with_attention_bias() -> None:
    m = TINY["odd-qwen2"]
    assert [r[0] for r in library(m, Layout(1, 1), 0, 0)] == [r[0] for r in oracle(m, Layout(1, 1), 0, 0)]


@pytest.mark.parametrize("name", list(ALL))
def test_regions_tile_every_tensor(name: str) -> None:
    """Without arrays: per stored name the distinct regions are disjoint and sum to the tensor."""
    m = ALL[name]
    logical = oracle_logical(m)
    for lay in admitted(m):
        regions: dict[str, set[Box]] = defaultdict(set)
        counts: dict[str, int] = defaultdict(int)
        sources: dict[str, str] = {}
        for t, p in ranks(lay):
            for s in shards(m, lay, t, p):
                sources[s.name] = s.source
                counts[s.name] += 1
                if s.numel:
                    regions[s.name].add(s.region)
        for tensor, boxes in regions.items():
            shape = logical[sources[tensor]]
            assert sum(volume(b) for b in boxes) == math.prod(shape), (tensor, lay)
            assert all(overlap(x, y) == 0 for x, y in itertools.combinations(boxes, 2)), (tensor, lay)
            assert counts[tensor] == lay.tp, (tensor, lay)  # every TP rank of its stage lists it once
        assert {sources[n] for n in regions} == set(logical)


# --------------------------------------------------------------------------- 2. numpy round trip
def is_replicated(name: str) -> bool:
    return name.endswith("norm.weight") or name == "score.weight"


def is_kv(name: str) -> bool:
    return name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))


def multiplicity(m: ModelSpec, tp: int, name: str) -> int:
    """How many ranks of one replica hold each element of ``name``."""
    if is_replicated(name):
        return tp
    if is_kv(name):
        return max(1, tp // m.num_key_value_heads)
    return 1


def round_trip(m: ModelSpec, lay: Layout, full: dict[str, np.ndarray]) -> None:
    """Cut each rank's shards, pack them into a rank buffer, unpack and reassemble every tensor."""
    out = {k: np.full(v.shape, np.nan) for k, v in full.items()}
    cover = {k: np.zeros(v.shape, dtype=np.int64) for k, v in full.items()}  # by logical tensor
    per_name: dict[str, np.ndarray] = {}
    policy = StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED)
    for t, p in ranks(lay):
        held = {s.name: full[s.source][s.region and cut(s.region)] for s in shards(m, lay, t, p)}
        buf = rank_buffers(m, lay, t, p, policy)
        flat = np.full(buf.numel, np.nan)
        for slot in buf.slots:  # pack
            piece = held[slot.name]
            assert piece.shape == slot.shape and piece.size == slot.numel
            flat[slot.offset : slot.offset + slot.numel] = piece.ravel()
        for slot in buf.slots:  # unpack: an overlap of slots would have clobbered a piece
            piece = flat[slot.offset : slot.offset + slot.numel].reshape(slot.shape)
            np.testing.assert_array_equal(piece, held[slot.name])
            where = cut(slot.region)
            seen = cover[slot.source][where] > 0
            np.testing.assert_array_equal(out[slot.source][where][seen], piece[seen])  # replicas agree
            out[slot.source][where] = piece
            cover[slot.source][where] += 1
            counter = per_name.setdefault(slot.name, np.zeros(full[slot.source].shape, dtype=np.int64))
            counter[where] += 1
        assert sum(slot.numel for slot in buf.slots) == sum(v.size for v in held.values())
    for k, v in full.items():
        np.testing.assert_array_equal(out[k], v, err_msg=f"{m.name} {lay} {k}")
        assert cover[k].min() >= 1
    for name, counter in per_name.items():
        assert (counter == multiplicity(m, lay.tp, name)).all(), (m.name, lay, name)


def random_model_state(m: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(shape) for k, shape in oracle_logical(m).items()}


@pytest.mark.parametrize("name", list(TINY))
def test_round_trip_numpy(name: str) -> None:
    m = TINY[name]
    full = random_model_state(m, 0)
    assert sum(v.size for v in full.values()) == m.param_count()
    for lay in admitted(m):
        round_trip(m, lay, full)


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    kv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = kv * draw(st.sampled_from([1, 2, 3, 4]))
    qk_norm, bias = draw(st.booleans()), draw(st.booleans())
    family = ModelFamily.QWEN3 if qk_norm else ModelFamily.QWEN2 if bias else ModelFamily.LLAMA
    return ModelSpec(
        name="drawn",
        family=family,
        hidden_size=draw(st.integers(1, 12)),
        num_hidden_layers=draw(st.integers(1, 6)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=draw(st.integers(1, 4)),
        intermediate_size=draw(st.integers(1, 20)),
        vocab_size=draw(st.integers(1, 20)),
        tie_word_embeddings=draw(st.booleans()),
        qk_norm=qk_norm,
        attention_bias=bias,
        head=draw(st.sampled_from(Head)),
    )


@settings(max_examples=30)
@given(m=model_specs(), seed=st.integers(0, 2**16))
def test_drawn_models_match_oracle_and_round_trip(m: ModelSpec, seed: int) -> None:
    assert_matches_oracle(m)
    full = random_model_state(m, seed)
    for lay in admitted(m):
        round_trip(m, lay, full)
        check_totals(m, lay)


# --------------------------------------------------------------------------- 3. packing and totals
POLICIES = {
    (Stage.TRAIN, Precision.BF16_MIXED): 14,
    (Stage.TRAIN, Precision.FP32): 12,
    (Stage.INF, Precision.BF16_MIXED): 2,
    (Stage.GEN, Precision.BF16_MIXED): 2,
    (Stage.INF, Precision.FP32): 4,
    (Stage.GEN, Precision.FP32): 4,
}


def test_state_policies() -> None:
    for (stage, precision), per_element in POLICIES.items():
        policy = StatePolicy.of(stage, precision)
        assert policy.bytes_per_element == per_element
        assert policy.trains == (stage is Stage.TRAIN)
        assert policy.kinds[0][0] is BufferKind.PARAM
    assert StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED).kinds == (
        (BufferKind.PARAM, Dtype.BF16),
        (BufferKind.MASTER, Dtype.FP32),
        (BufferKind.EXP_AVG, Dtype.FP32),
        (BufferKind.EXP_AVG_SQ, Dtype.FP32),
    )
    assert StatePolicy.of(Stage.TRAIN, Precision.FP32).kinds == (
        (BufferKind.PARAM, Dtype.FP32),
        (BufferKind.EXP_AVG, Dtype.FP32),
        (BufferKind.EXP_AVG_SQ, Dtype.FP32),
    )
    for bad in ((), ((BufferKind.MASTER, Dtype.FP32),), ((BufferKind.PARAM, Dtype.BF16),) * 2):
        with pytest.raises(ValueError, match="start with param"):
            StatePolicy(bad)


def check_packing(m: ModelSpec, lay: Layout, t: int, p: int, policy: StatePolicy) -> None:
    buf = rank_buffers(m, lay, t, p, policy)
    itemsize = {Dtype.BF16: 2, Dtype.FP32: 4}
    held = [s for s in shards(m, lay, t, p) if s.numel]
    assert [(s.name, s.source, s.region, s.shape, s.numel) for s in buf.slots] == [
        (s.name, s.source, s.region, s.shape, s.numel) for s in held
    ]  # state-dict order, empty chunks dropped
    offsets = np.array([s.offset for s in buf.slots], dtype=np.int64)
    ends = offsets + np.array([s.numel for s in buf.slots], dtype=np.int64)
    assert (offsets[1:] >= ends[:-1]).all()  # increasing, no overlap
    for _, dtype in policy.kinds:  # every kind's view of every slot starts on an aligned byte
        assert (offsets * itemsize[dtype] % ALIGN_BYTES == 0).all(), dtype
    end = int(ends[-1]) if len(ends) else 0
    assert end <= buf.numel
    for _, dtype in policy.kinds:
        assert buf.numel * itemsize[dtype] % ALIGN_BYTES == 0
    widest_step = ALIGN_BYTES // min(itemsize[d] for _, d in policy.kinds)
    assert buf.numel - end < widest_step  # no padding after the last slot beyond one alignment step
    assert buf.payload_numel == rank_numel(m, lay, t, p)
    assert buf.payload_numel <= buf.numel < buf.payload_numel + widest_step * max(1, len(buf.slots))
    for kind, dtype in policy.kinds:
        assert buf.nbytes(kind) == buf.numel * itemsize[dtype]
    assert buf.nbytes() == buf.numel * policy.bytes_per_element == sum(buf.nbytes(k) for k, _ in policy.kinds)
    if buf.slots:
        assert buf.slot(buf.slots[-1].name) is buf.slots[-1]
    with pytest.raises(KeyError):
        buf.slot("no.such.tensor")


@pytest.mark.parametrize("name", list(ALL))
def test_rank_buffers_packing(name: str) -> None:
    m = ALL[name]
    # real shapes: the bf16-mixed trainer (the tiny ones cover every policy and alignment step)
    policies = list(POLICIES) if name in TINY else list(POLICIES)[:1]
    for lay in admitted(m):
        for stage, precision in policies:
            policy = StatePolicy.of(stage, precision)
            for t, p in ranks(lay):
                check_packing(m, lay, t, p, policy)


def check_totals(m: ModelSpec, lay: Layout) -> None:
    tied_copy = m.head is Head.LM and m.tie_word_embeddings and lay.pp > 1
    logical = oracle_logical(m)
    extra = m.vocab_size * m.hidden_size if tied_copy else 0
    # one TP slice (t = 0 … tp − 1) of the replica per stage: the sharded tensors once, the
    # replicated ones tp times, KV tensors tp / kv times when tp exceeds the KV heads
    replicated = sum(math.prod(s) for n, s in logical.items() if is_replicated(n))
    kv_tensors = sum(math.prod(s) for n, s in logical.items() if is_kv(n))
    kv_copies = max(1, lay.tp // m.num_key_value_heads) - 1
    if lay.tp > 1:
        expected = m.param_count() + extra + (lay.tp - 1) * replicated + kv_copies * kv_tensors
    else:
        expected = m.param_count() + extra
    assert sum(rank_numel(m, lay, t, p) for t, p in ranks(lay)) == expected, lay
    planner = stage_params(m, lay)
    assert len(planner) == lay.pp
    for p in range(lay.pp):
        by_rank = [rank_numel(m, lay, t, p) for t in range(lay.tp)]
        assert by_rank[0] == max(by_rank) == planner[p], (lay, p)  # rank 0 holds every ceil chunk
        assert rank_numel(m, lay, 0, p) == sum(volume(r[2]) for r in oracle(m, lay, 0, p))


@pytest.mark.parametrize("name", list(ALL))
def test_rank_numel_totals(name: str) -> None:
    m = ALL[name]
    for lay in admitted(m):
        check_totals(m, lay)
    one = Layout(1, 1)
    assert rank_numel(m, one, 0, 0) == m.param_count()  # tp = pp = 1: exactly the checkpoint
    for pp in (pp for pp in (2, 4, 8) if pp <= m.num_hidden_layers):
        copy = m.vocab_size * m.hidden_size if m.head is Head.LM and m.tie_word_embeddings else 0
        assert sum(rank_numel(m, Layout(1, pp), 0, p) for p in range(pp)) == m.param_count() + copy


# --------------------------------------------------------------------------- 4. shared_numel
def holdings(m: ModelSpec, lay: Layout, t: int, p: int) -> dict[str, np.ndarray]:
    """Boolean masks of what rank (t, p) holds, per logical tensor (from the oracle)."""
    logical = oracle_logical(m)
    masks: dict[str, np.ndarray] = {}
    for _, source, region, _ in oracle(m, lay, t, p):
        mask = masks.setdefault(source, np.zeros(logical[source], dtype=bool))
        if region is not None:
            mask[cut(region)] = True
    return masks


def oracle_shared(have: dict[str, np.ndarray], m: ModelSpec, lay: Layout, t: int, p: int) -> int:
    return sum(
        int(have[source][cut(region)].sum())
        for _, source, region, _ in oracle(m, lay, t, p)
        if region is not None and source in have
    )


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "odd-qwen2", "odd-qwen3-critic", "odd-mqa"])
def test_shared_numel_against_masks(name: str) -> None:
    m = TINY[name]
    lays = admitted(m)
    every = [(lay, t, p) for lay in lays for t, p in ranks(lay)]
    masks = {key: holdings(m, *key) for key in every}
    for a, b in itertools.product(every, every):
        assert shared_numel(m, *a, *b) == oracle_shared(masks[a], m, *b), (a, b)


@settings(max_examples=30)
@given(m=model_specs(), data=st.data())
def test_drawn_shared_numel(m: ModelSpec, data: st.DataObject) -> None:
    lays = admitted(m)
    a, b = data.draw(st.sampled_from(lays)), data.draw(st.sampled_from(lays))
    ta, pa = data.draw(st.sampled_from(ranks(a)))
    tb, pb = data.draw(st.sampled_from(ranks(b)))
    want = oracle_shared(holdings(m, a, ta, pa), m, b, tb, pb)
    assert shared_numel(m, a, ta, pa, b, tb, pb) == want
    assert 0 <= want <= rank_numel(m, b, tb, pb)


@pytest.mark.parametrize("name", list(ALL))
def test_shared_numel_rules(name: str) -> None:
    m = ALL[name]
    tied_copy = m.head is Head.LM and m.tie_word_embeddings
    for lay in admitted(m):
        for t, p in ranks(lay):
            n = rank_numel(m, lay, t, p)
            assert shared_numel(m, lay, t, p, lay, t, p) == n  # identical rank keeps everything
            # a rank holding the whole model (tp = pp = 1) already has everything any rank needs
            assert shared_numel(m, Layout(1, 1), 0, 0, lay, t, p) == n
            # TP → 1 on the same pipeline layout: everything it holds is needed by the merged rank
            assert shared_numel(m, lay, t, p, Layout(1, lay.pp), 0, p) == n
            if lay.tp > 1:  # the TP group together holds all the merged rank needs (norms tp times)
                merged = sum(shared_numel(m, lay, u, p, Layout(1, lay.pp), 0, p) for u in range(lay.tp))
                assert merged >= rank_numel(m, Layout(1, lay.pp), 0, p)
        for pa, pb in itertools.permutations(range(lay.pp), 2):  # disjoint stages share no layer
            want = 0
            if tied_copy and {pa, pb} == {0, lay.pp - 1}:  # … but the tied head is the embedding
                want = sum(
                    overlap(ra[2], rb[2])
                    for ra in oracle(m, lay, 0, pa)
                    for rb in oracle(m, lay, 0, pb)
                    if ra[1] == rb[1] == EMBED
                )
                assert want == math.ceil(m.vocab_size / lay.tp) * m.hidden_size
            assert shared_numel(m, lay, 0, pa, lay, 0, pb) == want, (lay, pa, pb)
        if lay.tp > 1 and lay.tp <= m.num_key_value_heads:  # TP ranks of one stage share only norms
            norms = sum(volume(r[2]) for r in oracle(m, lay, 0, 0) if is_replicated(r[0]))
            assert shared_numel(m, lay, 0, 0, lay, 1, 0) == norms  # heads, vocab, MLP chunks disjoint


# --------------------------------------------------------------------------- 5. check_layout
def test_check_layout_errors() -> None:
    tiny = TINY["tiny-llama"]  # 4 heads, 2 KV heads, 4 layers
    with pytest.raises(ValueError, match="tp 8 must divide the 4 attention heads"):
        check_layout(tiny, Layout(8, 1))
    with pytest.raises(ValueError, match="pp 8 exceeds the 4 layers"):
        check_layout(tiny, Layout(1, 8))
    six_kv = dataclasses.replace(tiny, num_attention_heads=12, num_key_value_heads=6, head_dim=4)
    check_layout(six_kv, Layout(2, 1))
    with pytest.raises(ValueError, match="tp 4 and the 6 KV heads must divide one another"):
        check_layout(six_kv, Layout(4, 1))
    with pytest.raises(ValueError, match="must divide one another"):
        shards(six_kv, Layout(4, 1), 0, 0)
    for t, p in ((2, 0), (0, 2), (-1, 0), (0, -1)):
        with pytest.raises(ValueError, match="outside"):
            shards(tiny, Layout(2, 2), t, p)
    for bad in ((3, 1), (2, 0), (1, 6)):
        with pytest.raises(ValueError, match="power of two"):
            Layout(*bad)
    check_layout(REAL["llama-3.3-70b"], Layout(8, 64))  # large layouts are fine where they divide
    with pytest.raises(ValueError, match="exceeds the 80 layers"):
        check_layout(REAL["llama-3.3-70b"], Layout(8, 128))
