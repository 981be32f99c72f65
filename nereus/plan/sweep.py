"""The start-up collective sweep: what a job times before its first plan, as nccl-tests would.

Calibration by shape (``nereus.plan.shapefit``) learns a collective class's η only at the sizes
and groups the job's plans have run, and holds a curve's end values outside them. A job whose
first plans sync gradients between nodes (large messages) but never ran a tensor-parallel group
across nodes (decode-sized messages, a few hundred KB) prices the latter at the former's
efficiency: on a real fabric several times too fast, since small messages leave the wires idle
(nccl-tests doc/PERFORMANCE.md). The planner then picks layouts for a speed they never reach.

So at start-up the job times each collective kind (all-reduce, all-gather, broadcast, send/recv)
over log-spaced message sizes, on groups inside one node and across nodes with each power-of-two
count of ranks per node the pool holds: the same sweep nccl-tests runs, at ``REPEATS`` timed calls
per size after ``WARMUP``. Each probe becomes a calibration ``Measurement`` against the planner's
own ideal of it (``Links.ideal_ring_s``), sized and grouped as the cost model sizes and groups that
collective, so the curves cover every size and group a plan may use before any plan has run.

``probes`` chooses the groups from the pool (concrete GPUs, so a runtime can form them);
``measurements`` pairs timings with ideals. Timing is the caller's: the runtime's collectives
(``nereus.runtime.sweep``), or the simulator's truth. Pure (no torch, no processes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nereus.plan.calibration import CalibrationStore, Efficiencies, Measurement
from nereus.plan.candidates import powers_of_two_upto
from nereus.plan.costterms import GROUPED
from nereus.plan.links import Links
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.spec.cluster import ClusterSpec

# nccl-tests' range (-b 4K -e 1G) in steps of 4× (-f 4): decode's tensor-parallel all-reduces (KB)
# to gradient buckets (tens to hundreds of MB)
SIZES: tuple[int, ...] = tuple(4096 * 4**i for i in range(10))
WARMUP, REPEATS = 1, 5  # untimed calls, then timed ones (the median is kept)


@dataclass(frozen=True, slots=True)
class Probe:
    """One collective of ``nbytes`` per rank among ``gpus`` (``per_node`` on each of ``nodes``
    nodes), timed at start-up."""

    kind: Collective
    gpus: tuple[int, ...]
    per_node: int
    nodes: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.nodes < 1 or len(self.gpus) != self.per_node * self.nodes:
            raise ValueError(
                f"a probe needs per_node × nodes GPUs, got {len(self.gpus)} for {self.per_node}×{self.nodes}"
            )
        if len(self.gpus) < 2 or len(set(self.gpus)) != len(self.gpus):
            raise ValueError("a probe needs at least two distinct GPUs")
        if self.nbytes <= 0:
            raise ValueError(f"a probe's nbytes must be positive, got {self.nbytes}")

    @property
    def link(self) -> Link:
        return Link.INTER if self.nodes > 1 else Link.INTRA

    @property
    def op_class(self) -> OpClass:
        return OpClass.of(self.kind, self.link)

    def measurement(self, links: Links, measured_s: float) -> Measurement:
        """This probe's timing as a calibration sample: against the planner's ideal of the same
        collective, sized by its bytes per rank and (all-reduce, all-gather) grouped by its ranks
        per node, as the cost model sizes and groups it (``nereus.plan.costterms.collective``)."""
        ideal = links.ideal_ring_s(self.kind, len(self.gpus), float(self.nbytes), self.link)
        group = float(self.per_node) if self.kind in GROUPED else 0.0
        return Measurement(self.op_class, ideal, measured_s, float(self.nbytes), group)


def _groups(by_node: Mapping[int, list[int]]) -> list[tuple[tuple[int, ...], int, int]]:
    """(GPUs, per node, nodes) of each group probed: inside the fullest node, every power of
    two from 2 and the whole node; across nodes, every power of two per node over 2 nodes and
    over all nodes that hold that many."""
    fullest = sorted(by_node.values(), key=len, reverse=True)
    out: list[tuple[tuple[int, ...], int, int]] = []
    top = len(fullest[0]) if fullest else 0
    for n in sorted({*(p for p in powers_of_two_upto(top) if p >= 2), *([top] if top >= 2 else [])}):
        out.append((tuple(fullest[0][:n]), n, 1))
    for g in powers_of_two_upto(top):
        holders = [gpus for gpus in fullest if len(gpus) >= g]
        for k in sorted({2, len(holders)}):
            if 2 <= k <= len(holders):
                out.append((tuple(x for gpus in holders[:k] for x in gpus[:g]), g, k))
    return out


def probes(pool: Sequence[int], gpus_per_node: int, sizes: Sequence[int] = SIZES) -> tuple[Probe, ...]:
    """The collectives a job on ``pool`` times at start-up: every kind at every size on every
    group of ``_groups``, except send/recv, which pairs two GPUs (one node, or two)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be positive, got {gpus_per_node}")
    by_node: dict[int, list[int]] = {}
    for gpu in sorted(set(pool)):
        by_node.setdefault(gpu // gpus_per_node, []).append(gpu)
    out: list[Probe] = []
    for gpus, per_node, nodes in _groups(by_node):
        for kind in Collective:
            if kind is Collective.SENDRECV and len(gpus) != 2:
                continue
            out.extend(Probe(kind, gpus, per_node, nodes, int(b)) for b in sizes)
    return tuple(out)


def measurements(links: Links, timed: Sequence[tuple[Probe, float]]) -> list[Measurement]:
    """Calibration samples of timed probes (seconds per call; probes that took no time are
    skipped: a clock too coarse for them says nothing)."""
    return [p.measurement(links, t) for p, t in timed if t > 0]


def seconds_spent(timed: Sequence[tuple[Probe, float]]) -> float:
    """Wall seconds the sweep took: each probe's warm-up and timed calls."""
    return sum((WARMUP + REPEATS) * t for _, t in timed)


def calibration(cluster: ClusterSpec, timed: Sequence[tuple[Probe, float]]) -> CalibrationStore:
    """A calibration store for ``cluster`` holding the sweep's samples."""
    store = CalibrationStore(cluster.name)
    store.update(measurements(Links(cluster, Efficiencies()), timed))
    return store
