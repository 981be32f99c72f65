"""The cost model's building blocks: seconds by op class (``Cost``, ``LatencyTerms``) and the
priced pieces every stage is made of (ring collectives, compute, memory-bound work), each at the
calibrated efficiency of its op class, by shape where calibration has curves
(``nereus.plan.shapefit``): GEMM at the forward FLOPs of one layer's matmuls on one GPU for one
micro-batch (prefill chunk, decode step), attention likewise, a collective at its bytes per rank
and (all-reduce, all-gather) its ranks per node, memory-bound work at the bytes of one pass.
Tracked costs also carry, per class, the seconds-weighted ln size and ln group of what they
priced (``Cost.feats``): the shape a measurement of that class carries
(``evaluate.ideal_shapes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from nereus.plan.calibration import Efficiencies
from nereus.plan.links import Links, ring
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.replica import FloatArray


@dataclass(frozen=True, slots=True)
class Cost:
    """Seconds attributed to op classes (arrays over candidate rows), so calibration can compare
    each class's prediction with what was measured."""

    by_class: Mapping[OpClass, FloatArray]
    # tracked only (``CostModel(track=True)``): per class, Σ seconds·ln size and Σ seconds·ln group
    feats: Mapping[OpClass, tuple[FloatArray, FloatArray]] | None = None

    __array_ufunc__ = None  # ``ndarray * Cost`` defers to ``Cost.__rmul__``

    def __add__(self, other: Cost) -> Cost:
        merged = dict(self.by_class)
        for op, t in other.by_class.items():
            merged[op] = merged[op] + t if op in merged else t
        if not (self.feats or other.feats):
            return Cost(merged)
        feats = dict(self.feats or {})
        for op, (a, b) in (other.feats or {}).items():
            feats[op] = (feats[op][0] + a, feats[op][1] + b) if op in feats else (a, b)
        return Cost(merged, feats)

    def __mul__(self, factor: FloatArray | float) -> Cost:
        if self.feats:
            feats = {op: (a * factor, b * factor) for op, (a, b) in self.feats.items()}
            return Cost({op: t * factor for op, t in self.by_class.items()}, feats)
        return Cost({op: t * factor for op, t in self.by_class.items()})

    __rmul__ = __mul__

    @property
    def total(self) -> FloatArray:
        return sum(self.by_class.values(), np.zeros(()))

    @staticmethod
    def slower(a: Cost, b: Cost) -> Cost:
        """Per row, whichever of two alternatives takes longer (a roofline)."""
        pick_b = b.total > a.total
        ops = set(a.by_class) | set(b.by_class)
        zero = np.zeros(())
        chosen = {op: np.where(pick_b, b.by_class.get(op, zero), a.by_class.get(op, zero)) for op in ops}
        if not (a.feats or b.feats):
            return Cost(chosen)
        pair, fa, fb = (zero, zero), a.feats or {}, b.feats or {}
        feats = {}
        for op in set(fa) | set(fb):
            (xa, ya), (xb, yb) = fa.get(op, pair), fb.get(op, pair)
            feats[op] = (np.where(pick_b, xb, xa), np.where(pick_b, yb, ya))
        return Cost(chosen, feats)


@dataclass(frozen=True, slots=True)
class LatencyTerms:
    """Seconds per RL step by named term (compute, tp_comm, pp_comm, bubble, dp_sync, ...), each
    attributed to op classes."""

    parts: Mapping[str, Cost]

    @property
    def terms(self) -> dict[str, FloatArray]:
        return {name: c.total for name, c in self.parts.items()}

    @property
    def by_class(self) -> dict[OpClass, FloatArray]:
        return dict(sum(self.parts.values(), Cost({})).by_class)

    @property
    def feats(self) -> dict[OpClass, tuple[FloatArray, FloatArray]]:
        """Per class, Σ seconds·ln size and Σ seconds·ln group (tracked costs only)."""
        return dict(sum(self.parts.values(), Cost({})).feats or {})

    @property
    def total(self) -> FloatArray:
        return sum((c.total for c in self.parts.values()), np.zeros(()))


GROUPED = (Collective.ALLREDUCE, Collective.ALLGATHER)  # collectives whose η follows ranks per node


def ranks_per_node(links: Links, span: FloatArray | float, ranks: FloatArray | float) -> FloatArray:
    """Ranks of a group on each node it spans: all of them inside a node; spread evenly over
    ⌈span / GPUs per node⌉ nodes otherwise."""
    gpn = links.gpus_per_node
    r = np.asarray(ranks, dtype=np.float64)
    nodes = np.maximum(np.ceil(np.asarray(span, dtype=np.float64) / gpn), 1.0)
    result: FloatArray = np.maximum(r / nodes, 1.0)
    return result


def _shaped_ring_s(
    links: Links,
    kind: Collective,
    span: FloatArray | float,
    r: FloatArray,
    nbytes: FloatArray,
    group: FloatArray,
) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
    """``Links.ring_s`` with each row's η read from the classes' shape curves."""
    eff = links.efficiencies
    intra = np.asarray(span) <= links.gpus_per_node
    g = group if kind in GROUPED else None
    eta = np.where(
        intra,
        eff.at(OpClass.of(kind, Link.INTRA), nbytes, g),
        eff.at(OpClass.of(kind, Link.INTER), nbytes, g),
    )
    peak = np.where(intra, links.peak_bandwidth(Link.INTRA), links.peak_bandwidth(Link.INTER))
    hop = np.where(intra, links.hop_s(Link.INTRA), links.hop_s(Link.INTER))
    factor, steps = ring(kind, np.maximum(r, 1.0))
    # η divides the whole ideal, latency too (see ``Links.ideal_ring_s``)
    t: FloatArray = np.where(r > 1, (factor * nbytes / peak + steps * hop) / eta, 0.0)
    return t, intra


def collective(links: Links, kind: Collective, span: FloatArray | float, ranks: FloatArray | float,
               nbytes: FloatArray | float, track: bool = False) -> Cost:  # fmt: skip
    """One ring collective of ``nbytes`` per rank among ``ranks`` ranks whose GPUs span ``span``
    consecutive GPUs (inside a node when span ≤ GPUs per node), attributed to its link's op class;
    at each row's η by message size and ranks per node where calibration has curves."""
    intra_op, inter_op = OpClass.of(kind, Link.INTRA), OpClass.of(kind, Link.INTER)
    if not (track or links.efficiencies.shaped(intra_op, inter_op)):
        t, intra = links.ring_s(kind, span, ranks, nbytes)
        return Cost({intra_op: np.where(intra, t, 0.0), inter_op: np.where(intra, 0.0, t)})
    r = np.asarray(ranks, dtype=np.float64)
    b = np.asarray(nbytes, dtype=np.float64)
    group = ranks_per_node(links, span, r)
    t, intra = _shaped_ring_s(links, kind, span, r, b, group)
    on, off = np.where(intra, t, 0.0), np.where(intra, 0.0, t)
    if not track:
        return Cost({intra_op: on, inter_op: off})
    ln_b = np.log(np.maximum(b, 1.0))
    ln_g = np.log(group) if kind in GROUPED else np.zeros(())
    return Cost(
        {intra_op: on, inter_op: off},
        {intra_op: (on * ln_b, on * ln_g), inter_op: (off * ln_b, off * ln_g)},
    )


def exposed(per_bucket: Cost, buckets: FloatArray, behind: Cost) -> Cost:
    """What ``buckets`` equal transfers of ``per_bucket`` each leave exposed when bucket k is
    ready at k/n of a compute phase of ``behind`` seconds and they run in order on one stream:
    the stream ends at max_k(k·T/n + (n − k + 1)·c), so max(c, n·c − T·(n − 1)/n) is exposed (the
    last bucket alone when compute hides the rest, else what compute cannot hide). Attributed to
    the transfers' op classes in proportion."""
    c = per_bucket.total
    total = buckets * c
    exposed = np.maximum(c, total - behind.total * (buckets - 1.0) / buckets)
    share: FloatArray = buckets * np.where(total > 0, exposed / np.where(total > 0, total, 1.0), 0.0)
    return per_bucket * share


def compute(
    peak: float,
    eff: Efficiencies,
    gemm_flops: FloatArray | float,
    attn_flops: FloatArray | float,
    sizes: tuple[FloatArray | float, FloatArray | float] | None = None,
    track: bool = False,
) -> Cost:
    """Matmul and attention FLOPs against ``peak`` FLOP/s (the cluster's at the workload's
    precision, ``ClusterSpec.peak_flops_at``) at the calibrated efficiencies;
    ``sizes``: (GEMM, attention) FLOPs of one kernel set (a layer, one GPU, one micro-batch), at
    which a class with a shape curve reads its η."""
    g_size, a_size = sizes if sizes is not None else (0.0, 0.0)
    eta_g = eff.at(OpClass.GEMM, g_size) if sizes is not None else eff[OpClass.GEMM]
    eta_a = eff.at(OpClass.ATTENTION, a_size) if sizes is not None else eff[OpClass.ATTENTION]
    t_g = np.asarray(gemm_flops, dtype=np.float64) / (eta_g * peak)
    t_a = np.asarray(attn_flops, dtype=np.float64) / (eta_a * peak)
    if not (track and sizes is not None):
        return Cost({OpClass.GEMM: t_g, OpClass.ATTENTION: t_a})
    zero = np.zeros(())
    ln_g = np.log(np.maximum(np.asarray(g_size, dtype=np.float64), 1.0))
    ln_a = np.log(np.maximum(np.asarray(a_size, dtype=np.float64), 1.0))
    return Cost(
        {OpClass.GEMM: t_g, OpClass.ATTENTION: t_a},
        {OpClass.GEMM: (t_g * ln_g, zero), OpClass.ATTENTION: (t_a * ln_a, zero)},
    )


def memory_bound(
    links: Links,
    nbytes: FloatArray | float,
    track: bool = False,
    stages: FloatArray | float = 1.0,
    op: OpClass = OpClass.MEMORY,
) -> Cost:
    """One memory-bound pass over ``nbytes`` of HBM in class ``op`` (``OpClass.DECODE``: a decode
    step's weight and KV reads; ``OpClass.MEMORY``: an optimizer step); where calibration has a
    curve for ``op``, at η by the pass's bytes (small passes pay fixed per-step costs the byte
    count does not show) and by the pipeline ``stages`` a decode step cycles through (its group
    feature; 1 for work on one GPU)."""
    eff = links.efficiencies
    b = np.asarray(nbytes, dtype=np.float64)
    hbm = links.cluster.hbm_bandwidth_gbs * 1e9
    if not (track or eff.shaped(op)):
        return Cost({op: b / (links.copy_rate if op is OpClass.MEMORY else hbm * eff[op])})
    g = np.asarray(stages, dtype=np.float64)
    t = b / (hbm * eff.at(op, b, g))
    if not track:
        return Cost({op: t})
    return Cost({op: t}, {op: (t * np.log(np.maximum(b, 1.0)), t * np.log(g))})
