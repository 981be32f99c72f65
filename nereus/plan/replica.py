"""What one GPU of a replica holds under a layout: layers, parameters and KV heads per rank.

Megatron-compatible split: q/k/v and gate/up column-parallel, o/down row-parallel, KV heads
replicated when tp exceeds them, embedding and LM head vocabulary-parallel, norms replicated,
layers in contiguous pipeline chunks (the first ``L mod pp`` stages take one more), embedding on
the first stage and final norm and head on the last.

The peak GPU of a replica is always on the first or the last pipeline stage: a middle stage has no
more layers than the first (extra layers go first), no embedding, and under 1F1B fewer micro-batches
in flight. ``ReplicaFacts`` therefore keeps those two stages, as arrays over candidate rows, so the
cost and memory models price every layout of a model-stage in one vectorised pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt

from nereus.plan.layout import Layout, split_layers
from nereus.spec.model import Head, ModelSpec

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads a TP rank holds; replicated (one per rank) when tp exceeds the KV heads."""
    return max(model.num_key_value_heads // tp, 1)


def layer_params_per_rank(model: ModelSpec, tp: int) -> float:
    """One decoder layer's parameters on one TP rank (column/row split, norms replicated)."""
    h = model.hidden_size
    q = model.q_size / tp
    kv = kv_heads_per_rank(model, tp) * model.head_dim
    attn = 2 * h * q + 2 * h * kv
    if model.attention_bias:
        attn += q + 2 * kv
    if model.qk_norm:
        attn += 2 * model.head_dim
    mlp = 3 * h * math.ceil(model.intermediate_size / tp)
    return attn + mlp + 2 * h


def stage_params(model: ModelSpec, layout: Layout) -> tuple[float, ...]:
    """Parameters on one GPU of each pipeline stage: layers, embedding (first), norm + head (last)."""
    vocab_shard = math.ceil(model.vocab_size / layout.tp) * model.hidden_size
    layer = layer_params_per_rank(model, layout.tp)
    stages = split_layers(model.num_hidden_layers, layout.pp)
    last = len(stages) - 1
    counts = []
    for p, layers in enumerate(stages):
        n = layers * layer
        if p == 0:
            n += vocab_shard
        if p == last:
            n += model.hidden_size  # final norm
            if model.head is Head.VALUE:
                n += model.hidden_size
            elif not model.tie_word_embeddings or layout.pp > 1:
                n += vocab_shard  # untied head, or the tied copy Megatron keeps on the last stage
        counts.append(n)
    return tuple(counts)


@dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """Per-row layout facts of one model; every field is an array of the same length."""

    tp: FloatArray
    pp: FloatArray
    layers_first: FloatArray  # the most layers of any stage
    layers_last: FloatArray
    params_first: FloatArray  # parameters on one GPU of the first / last pipeline stage
    params_last: FloatArray
    kv_heads: FloatArray  # KV heads per TP rank

    @classmethod
    def of(cls, model: ModelSpec, layouts: Sequence[Layout]) -> ReplicaFacts:
        rows = []
        for lay in layouts:
            layers = split_layers(model.num_hidden_layers, lay.pp)
            params = stage_params(model, lay)
            rows.append(
                (
                    lay.tp,
                    lay.pp,
                    layers[0],
                    layers[-1],
                    params[0],
                    params[-1],
                    kv_heads_per_rank(model, lay.tp),
                )
            )
        cols = np.array(rows, dtype=np.float64).reshape(-1, 7).T
        return cls(*cols)

    def take(self, index: IntArray) -> ReplicaFacts:
        return ReplicaFacts(*(getattr(self, f.name)[index] for f in fields(self)))

    @property
    def size(self) -> FloatArray:
        result: FloatArray = self.tp * self.pp
        return result

    @property
    def single_stage(self) -> npt.NDArray[np.bool_]:
        result: npt.NDArray[np.bool_] = self.pp == 1
        return result
