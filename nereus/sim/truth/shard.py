"""What one GPU of a model-stage holds and where its groups sit, from plain ints and GPU ids.

The truth's own accounting (it shares no code with ``nereus.plan``): per TP rank, the q/k/v/o and
gate/up/down weights split column/row-wise (KV heads replicated when TP exceeds them), the
vocabulary split for the embedding and LM head; layers split in contiguous pipeline chunks, the
first stages taking the remainder, the embedding on the first and the head on the last stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.sim.truth.collectives import Group
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Recompute


@dataclass(frozen=True, slots=True)
class Shard:
    """Per-rank dimensions of ``model`` under TP ``tp`` and PP ``pp``."""

    h: int
    q: float  # query width per rank
    kv: float  # key (= value) width per rank
    inter: float  # MLP intermediate width per rank
    vocab: float  # vocabulary rows per rank
    layers: int  # layers on the busiest pipeline stage
    lm_head: bool
    heads: float  # query heads per rank
    head_dim: int
    window: int = 0  # sliding-window attention: tokens a sliding layer attends to (0: none)
    sliding: float = 0.0  # the share of the busiest stage's layers that slide

    @staticmethod
    def of(model: ModelSpec, tp: int, pp: int) -> Shard:
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be positive, got {tp}, {pp}")
        kv_heads = max(model.num_key_value_heads // tp, 1)
        layers = math.ceil(model.num_hidden_layers / pp)
        # the first stage is the busiest; its layers 0 … layers-1 slide from max_window_layers on
        sliding = max(layers - model.max_window_layers, 0) / layers if model.sliding_window else 0.0
        return Shard(
            h=model.hidden_size,
            q=model.q_size / tp,
            kv=float(kv_heads * model.head_dim),
            inter=float(math.ceil(model.intermediate_size / tp)),
            vocab=float(math.ceil(model.vocab_size / tp)),
            layers=layers,
            lm_head=model.head is Head.LM,
            heads=model.num_attention_heads / tp,
            head_dim=model.head_dim,
            window=model.sliding_window,
            sliding=sliding,
        )

    def layer_params(self) -> float:
        return self.h * (self.q + 2 * self.kv) + self.q * self.h + 3 * self.h * self.inter + 2 * self.h

    def stage_params(self, pp: int) -> float:
        """Parameters on one GPU of the fuller end stage (embedding first, head last)."""
        emb = self.vocab * self.h
        head = emb if self.lm_head else float(self.h)
        body = self.layers * self.layer_params()
        return body + emb + head if pp == 1 else body + max(emb, head)

    def gemms(self, tokens: float) -> list[tuple[float, float, float]]:
        """Forward weight GEMMs (m, n, k) of one layer on ``tokens`` tokens."""
        t = tokens
        return [
            (t, self.q + 2 * self.kv, self.h),
            (t, self.h, self.q),
            (t, 2 * self.inter, self.h),
            (t, self.h, self.inter),
        ]

    def attended(self, context: float) -> float:
        """Keys a decode step at ``context`` tokens reads per layer, averaged over the layers (a
        sliding layer reads the last ``window`` only)."""
        if not self.window:
            return context
        return (1.0 - self.sliding) * context + self.sliding * min(context, self.window)

    def causal_square(self, length: float) -> float:
        """The attention of a causal pass over ``length`` tokens as an equivalent squared length
        (QKᵀ over half the square): length², or 2·w·length − w² in a layer of window w < length."""
        if not self.window or length <= self.window:
            return length * length
        w = float(self.window)
        return (1.0 - self.sliding) * length * length + self.sliding * (2.0 * w * length - w * w)

    def kv_bytes_per_token(self) -> float:
        """bf16 K and V of one token on this rank's layers."""
        return 2.0 * self.layers * self.kv * 2.0

    def elementwise_bytes(self, tokens: float, tp: int, sequence_parallel: bool) -> float:
        """HBM bytes one layer's forward moves outside GEMMs and attention: two RMSNorms (read +
        write h), two residual adds (read 2h, write h), rotary on q and k (read + write), SwiGLU
        (read gate and up, write the product); bf16. Hidden-size tensors are split across TP
        only with sequence parallelism."""
        hid = self.h / tp if sequence_parallel else float(self.h)
        per_token = 2.0 * (2 * 2 * hid + 2 * 3 * hid + 2 * (self.q + self.kv) + 3 * self.inter)
        return tokens * per_token


@dataclass(frozen=True, slots=True)
class Placement:
    """A model-stage's layout as ints and the node spans of its groups."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    recompute: Recompute
    tp_group: Group
    dp_group: Group
    pp_group: Group  # two neighbouring pipeline stages
    replica: Group  # one whole replica (weight syncs)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def of(
        tp: int,
        pp: int,
        dp: int,
        gpus: tuple[int, ...],
        gpus_per_node: int,
        micro_batch: int = 1,
        recompute: Recompute = Recompute.NONE,
    ) -> Placement:
        """GPU ids in replica-major, then stage, then TP-rank order (rank p·tp + t of replica r)."""
        size = tp * pp
        if len(gpus) != size * dp:
            raise ValueError(f"tp{tp}·pp{pp}·dp{dp} needs {size * dp} GPUs, got {len(gpus)}")
        tp_group = max(
            (Group.of(gpus[i : i + tp], gpus_per_node) for i in range(0, len(gpus), tp)),
            key=lambda g: (g.nodes, g.per_node),
        )
        dp_group = max(
            (Group.of(gpus[i::size], gpus_per_node) for i in range(size)), key=lambda g: (g.nodes, g.per_node)
        )
        pairs = [
            Group.of((gpus[r * size + p * tp], gpus[r * size + (p + 1) * tp]), gpus_per_node)
            for r in range(dp)
            for p in range(pp - 1)
        ]
        pp_group = max(pairs, key=lambda g: g.nodes) if pairs else Group(1, 1)
        replica = max(
            (Group.of(gpus[r * size : (r + 1) * size], gpus_per_node) for r in range(dp)),
            key=lambda g: (g.nodes, g.per_node),
        )
        return Placement(tp, pp, dp, micro_batch, Recompute(recompute), tp_group, dp_group, pp_group, replica)
