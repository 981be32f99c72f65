"""Grid: where every rank of a model-stage sits, as one value (dp replica, pipeline stage, TP rank).

A model-stage runs as ``dp`` EMUs (replicas) of one layout; ``ranks`` lists the global ranks of
all of them, replica-major and ``p·tp + t`` inside a replica (the order of ``Candidate.replica_gpus``
and of ``layout_mesh``). Every communicator the engine uses is a rank list read off this value:

- ``tp``: the tp ranks of one pipeline stage of one replica (DTensor's mesh);
- ``pp``: the pp ranks of one TP rank of one replica (stage-to-stage sends, pipelining);
- ``dp``: the same (t, p) across replicas (the gradient all-reduce);
- ``unit``: one replica's tp·pp ranks (gradient norm, token broadcast while decoding);
- ``tie``: first and last stage of one TP rank, when tied embeddings need a copy on both;
- ``kv``: TP ranks that hold the same KV head when tp exceeds the KV heads.

Pure: no torch.distributed; ``nereus.backends.groups`` turns the lists into process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state.geometry import check_layout

Ranks = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Coord:
    dp: int
    p: int
    t: int


@dataclass(frozen=True, slots=True)
class Grid:
    layout: Layout
    ranks: Ranks

    def __post_init__(self) -> None:
        if not self.ranks or len(self.ranks) % self.layout.size:
            raise ValueError(f"{len(self.ranks)} ranks do not split into replicas of {self.layout}")
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"ranks must be distinct and non-negative, got {self.ranks}")

    @classmethod
    def single(cls, layout: Layout, dp: int = 1) -> Grid:
        """Ranks 0 … dp·tp·pp − 1 (one model-stage owning the whole world)."""
        return cls(layout, tuple(range(dp * layout.size)))

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.layout.size

    def rank_at(self, dp: int, p: int, t: int) -> int:
        return self.ranks[dp * self.layout.size + self.layout.index(t, p)]

    def coord(self, rank: int) -> Coord:
        try:
            i = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in this grid {self.ranks}") from None
        d, r = divmod(i, self.layout.size)
        t, p = self.layout.position(r)
        return Coord(d, p, t)

    # ------------------------------------------------------------------ rank lists
    def tp_groups(self) -> list[Ranks]:
        tp, pp = self.layout.tp, self.layout.pp
        return [tuple(self.rank_at(d, p, t) for t in range(tp)) for d in range(self.dp) for p in range(pp)]

    def pp_groups(self) -> list[Ranks]:
        tp, pp = self.layout.tp, self.layout.pp
        return [tuple(self.rank_at(d, p, t) for p in range(pp)) for d in range(self.dp) for t in range(tp)]

    def dp_groups(self) -> list[Ranks]:
        tp, pp = self.layout.tp, self.layout.pp
        return [tuple(self.rank_at(d, p, t) for d in range(self.dp)) for p in range(pp) for t in range(tp)]

    def unit_groups(self) -> list[Ranks]:
        n = self.layout.size
        return [self.ranks[d * n : (d + 1) * n] for d in range(self.dp)]

    def tie_groups(self, model: ModelSpec) -> list[Ranks]:
        """(first, last) stage ranks of each TP rank, when the last stage holds a tied head copy."""
        pp = self.layout.pp
        if not model.tie_word_embeddings or pp == 1 or model.head.value != "lm":
            return []
        return [
            (self.rank_at(d, 0, t), self.rank_at(d, pp - 1, t))
            for d in range(self.dp)
            for t in range(self.layout.tp)
        ]

    def kv_replication(self, model: ModelSpec) -> int:
        """How many TP ranks hold each KV head (1 unless tp exceeds the KV heads)."""
        check_layout(model, self.layout)
        kv = model.num_key_value_heads
        return self.layout.tp // kv if self.layout.tp > kv else 1

    def kv_groups(self, model: ModelSpec) -> list[Ranks]:
        rep = self.kv_replication(model)
        if rep == 1:
            return []
        return [group[i : i + rep] for group in self.tp_groups() for i in range(0, len(group), rep)]

    def all_groups(self, model: ModelSpec) -> list[tuple[str, Ranks]]:
        """Every (kind, ranks) with two or more ranks, in the canonical creation order."""
        kinds = (
            ("tp", self.tp_groups()),
            ("pp", self.pp_groups()),
            ("dp", self.dp_groups()),
            ("unit", self.unit_groups()),
            ("tie", self.tie_groups(model)),
            ("kv", self.kv_groups(model)),
        )
        return [(kind, ranks) for kind, lists in kinds for ranks in lists if len(ranks) > 1]
