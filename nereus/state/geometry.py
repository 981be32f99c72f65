"""Shard geometry: which slice of every tensor of a Llama-family model lives at TP rank t, PP rank p.

Megatron-compatible (Shoeybi et al. 2019, §3; Narayanan et al. 2021, §2.2):

- ``q/k/v_proj`` (and their Qwen2 biases) are column-parallel by heads; when tp exceeds the KV
  heads, rank t holds KV head ``t // (tp / kv)`` (KV heads replicated, as Megatron's GQA does);
- ``gate/up_proj`` are column-parallel by rows, ``o_proj`` and ``down_proj`` row-parallel (by
  input columns);
- the embedding and the LM head are vocabulary-parallel (rows); a scalar value head
  (``score.weight``) and every norm (RMSNorm, Qwen3's per-head q/k norms) are replicated;
- layers are split into pp contiguous chunks, the first ``L mod pp`` stages taking one more
  (``split_layers``); the embedding lives on the first stage, the final norm and the head on the
  last. With tied embeddings and pp > 1 the last stage keeps its own copy of its embedding shard as
  ``lm_head.weight`` (Megatron's shared embedding); with pp = 1 the head is the embedding itself.

Uneven dimensions (a vocabulary or an intermediate size that tp does not divide) use
``torch.chunk`` semantics: chunks of ``ceil(n / tp)``, the last ones shorter or empty — the same
split DTensor's ``Shard(dim)`` uses, so the engine's DTensors view these slices directly.

A region is a tuple of half-open ``(start, stop)`` ranges, one per dimension of the full tensor.
Names are Hugging Face state-dict names, so a shard is a slice of a safetensors tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from nereus.plan.layout import Layout, split_layers
from nereus.spec.model import Head, ModelSpec

Region = tuple[tuple[int, int], ...]


class Partition(StrEnum):
    REPLICATED = "replicated"
    HEADS = "heads"  # dim 0 by attention heads (q, or k/v by KV heads)
    COLUMN = "column"  # dim 0 in tp chunks (gate, up; vocabulary rows of embedding and LM head)
    ROW = "row"  # dim 1 in tp chunks (o by heads, down by rows of the MLP)


class Place(StrEnum):
    LAYER = "layer"
    FIRST = "first"  # first pipeline stage (embedding)
    LAST = "last"  # last pipeline stage (final norm, head)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the model as stored, or a per-layer template (``{i}`` in the name).

    ``source`` is the logical tensor whose values it holds (a tied LM head holds the embedding).
    ``kv`` marks k/v tensors, partitioned by KV heads.
    """

    name: str
    shape: tuple[int, ...]
    partition: Partition
    place: Place
    source: str = ""
    kv: bool = False

    def __post_init__(self) -> None:
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"{self.name}: shape must be positive, got {self.shape}")
        if self.partition is Partition.ROW and len(self.shape) < 2:
            raise ValueError(f"{self.name}: a row-parallel tensor needs two dimensions")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def at(self, layer: int) -> str:
        return self.name.replace("{i}", str(layer))

    def source_at(self, layer: int) -> str:
        return (self.source or self.name).replace("{i}", str(layer))


def check_layout(model: ModelSpec, layout: Layout) -> None:
    """Raise ValueError when ``layout`` cannot shard ``model`` Megatron-style."""
    conflict = model.layout_conflict(layout.tp, layout.pp)  # the planner's candidates keep the same rule
    if conflict:
        raise ValueError(f"{model.name}: {conflict}")


@lru_cache(maxsize=256)
def layer_tensors(model: ModelSpec) -> tuple[TensorSpec, ...]:
    """One decoder layer's tensors (names with ``{i}``), in state-dict order."""
    h, hd = model.hidden_size, model.head_dim
    q, kv, inter = model.q_size, model.kv_size, model.intermediate_size
    attn = "model.layers.{i}.self_attn."
    out: list[TensorSpec] = []
    for proj, rows, kv_ in (("q_proj", q, False), ("k_proj", kv, True), ("v_proj", kv, True)):
        out.append(TensorSpec(attn + proj + ".weight", (rows, h), Partition.HEADS, Place.LAYER, kv=kv_))
        if model.attention_bias:  # Qwen2: state-dict order is weight, bias per projection
            out.append(TensorSpec(attn + proj + ".bias", (rows,), Partition.HEADS, Place.LAYER, kv=kv_))
    out.append(TensorSpec(attn + "o_proj.weight", (h, q), Partition.ROW, Place.LAYER))
    if model.qk_norm:
        out += [
            TensorSpec(attn + "q_norm.weight", (hd,), Partition.REPLICATED, Place.LAYER),
            TensorSpec(attn + "k_norm.weight", (hd,), Partition.REPLICATED, Place.LAYER),
        ]
    mlp = "model.layers.{i}.mlp."
    out += [
        TensorSpec(mlp + "gate_proj.weight", (inter, h), Partition.COLUMN, Place.LAYER),
        TensorSpec(mlp + "up_proj.weight", (inter, h), Partition.COLUMN, Place.LAYER),
        TensorSpec(mlp + "down_proj.weight", (h, inter), Partition.ROW, Place.LAYER),
        TensorSpec("model.layers.{i}.input_layernorm.weight", (h,), Partition.REPLICATED, Place.LAYER),
        TensorSpec(
            "model.layers.{i}.post_attention_layernorm.weight", (h,), Partition.REPLICATED, Place.LAYER
        ),
    ]
    return tuple(out)


EMBEDDING = "model.embed_tokens.weight"


def edge_tensors(model: ModelSpec, pp: int) -> tuple[TensorSpec, ...]:
    """Tensors outside the layers: embedding (first stage), final norm and head (last stage)."""
    h, vocab = model.hidden_size, model.vocab_size
    out = [
        TensorSpec(EMBEDDING, (vocab, h), Partition.COLUMN, Place.FIRST),
        TensorSpec("model.norm.weight", (h,), Partition.REPLICATED, Place.LAST),
    ]
    if model.head is Head.VALUE:
        out.append(TensorSpec("score.weight", (1, h), Partition.REPLICATED, Place.LAST))
    elif not model.tie_word_embeddings:
        out.append(TensorSpec("lm_head.weight", (vocab, h), Partition.COLUMN, Place.LAST))
    elif pp > 1:  # Megatron's shared embedding: the last stage keeps a copy of its shard
        out.append(TensorSpec("lm_head.weight", (vocab, h), Partition.COLUMN, Place.LAST, source=EMBEDDING))
    return tuple(out)


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk`` bounds of piece ``index`` of ``n`` split into ``parts`` (may be empty)."""
    size = -(-n // parts)
    return min(index * size, n), min((index + 1) * size, n)


def tp_region(model: ModelSpec, tensor: TensorSpec, tp: int, t: int) -> Region:
    """The slice of ``tensor`` that TP rank ``t`` of ``tp`` holds (whole tensor if replicated)."""
    full = tuple((0, d) for d in tensor.shape)
    part = tensor.partition
    if part is Partition.REPLICATED or tp == 1:
        return full
    if part is Partition.HEADS:
        hd = model.head_dim
        heads = model.num_key_value_heads if tensor.kv else model.num_attention_heads
        if heads >= tp:
            per = heads // tp
            lo, hi = t * per * hd, (t + 1) * per * hd
        else:  # fewer KV heads than ranks: each head replicated on tp / heads consecutive ranks
            head = t // (tp // heads)
            lo, hi = head * hd, (head + 1) * hd
        return ((lo, hi), *full[1:])
    if part is Partition.COLUMN:
        return (chunk(tensor.shape[0], tp, t), *full[1:])
    # ROW: o_proj splits its input by attention heads, down_proj by MLP rows (same chunks as up)
    return (full[0], chunk(tensor.shape[1], tp, t), *full[2:])


def stage_layers(model: ModelSpec, pp: int, p: int) -> range:
    """The layers pipeline stage ``p`` of ``pp`` holds."""
    counts = split_layers(model.num_hidden_layers, pp)
    start = sum(counts[:p])
    return range(start, start + counts[p])


@dataclass(frozen=True, slots=True)
class Shard:
    """One tensor slice held by a rank: the stored name, the logical tensor and its region."""

    name: str
    source: str
    region: Region
    full_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.region)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def tensors_at(model: ModelSpec, pp: int, p: int) -> list[tuple[TensorSpec, int]]:
    """(template, layer) of every tensor stage p holds, in state-dict order (layer −1: none)."""
    out: list[tuple[TensorSpec, int]] = []
    edges = edge_tensors(model, pp)
    if p == 0:
        out += [(t, -1) for t in edges if t.place is Place.FIRST]
    for layer in stage_layers(model, pp, p):
        out += [(t, layer) for t in layer_tensors(model)]
    if p == pp - 1:
        out += [(t, -1) for t in edges if t.place is Place.LAST]
    return out


@lru_cache(maxsize=4096)
def shards(model: ModelSpec, layout: Layout, t: int, p: int) -> tuple[Shard, ...]:
    """Every tensor slice rank (t, p) holds, in state-dict order (empty slices included)."""
    check_layout(model, layout)
    if not (0 <= t < layout.tp and 0 <= p < layout.pp):
        raise ValueError(f"rank (t={t}, p={p}) outside {layout}")
    return tuple(
        Shard(spec.at(layer), spec.source_at(layer), tp_region(model, spec, layout.tp, t), spec.shape)
        for spec, layer in tensors_at(model, layout.pp, p)
    )


@lru_cache(maxsize=4096)
def rank_numel(model: ModelSpec, layout: Layout, t: int, p: int) -> int:
    """Parameters rank (t, p) holds (sum over its shards)."""
    return sum(s.numel for s in shards(model, layout, t, p))


def _overlap(a: Region, b: Region) -> int:
    n = 1
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        n *= max(0, min(a1, b1) - max(a0, b0))
        if n == 0:
            return 0
    return n


@lru_cache(maxsize=65536)
def shared_numel(model: ModelSpec, a: Layout, ta: int, pa: int, b: Layout, tb: int, pb: int) -> int:
    """Elements rank (tb, pb) of layout b needs that rank (ta, pa) of layout a already holds.

    Matched by logical tensor (a tied head's copy counts as the embedding it holds); this is the
    part of a reshard that stays local, so ``rank_numel(b…) − shared_numel(…)`` must arrive.
    """
    held: dict[tuple[str, str], Region] = {(s.name, s.source): s.region for s in shards(model, a, ta, pa)}
    by_source: dict[str, list[Region]] = {}
    for (_, source), region in held.items():
        by_source.setdefault(source, []).append(region)
    total = 0
    for s in shards(model, b, tb, pb):
        regions = by_source.get(s.source, ())
        total += max((_overlap(s.region, r) for r in regions), default=0)
    return total
