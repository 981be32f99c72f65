"""The start-up collective sweep: which collectives a job times before its first plan, how a timing
becomes a calibration sample, and that the calibrated cost model then prices the collectives a
plan has never run (decode-sized all-reduces between nodes) near what they take."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from nereus.plan.calibration import CalibrationStore, Efficiencies
from nereus.plan.cost import collective
from nereus.plan.links import Links
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.sweep import REPEATS, SIZES, WARMUP, Probe, measurements, probes, seconds_spent
from nereus.sim.truth import PARAMS, collectives
from nereus.spec import load_cluster

pytestmark = pytest.mark.pure

CLUSTER = load_cluster("a100-64gb-hdr100")  # 4 GPUs per node, 12.5 GB/s per GPU between nodes


def _spread(p: Probe, gpn: int) -> Counter[int]:
    return Counter(g // gpn for g in p.gpus)


def test_probes_cover_every_kind_size_and_group_the_pool_holds() -> None:
    # nodes 0-2 whole (4 GPUs each), node 3 holds 2 GPUs
    pool = (*range(12), 12, 13)
    found = probes(pool, 4)
    groups = {(p.per_node, p.nodes) for p in found}
    assert groups == {(2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 3)}
    for p in found:
        assert set(p.gpus) <= set(pool)
        spread = _spread(p, 4)
        assert len(spread) == p.nodes and set(spread.values()) == {p.per_node}
        assert p.link is (Link.INTER if p.nodes > 1 else Link.INTRA)
    for group in groups:
        mine = [p for p in found if (p.per_node, p.nodes) == group]
        kinds = {p.kind for p in mine}
        pair = group[0] * group[1] == 2
        assert kinds == set(Collective) if pair else kinds == set(Collective) - {Collective.SENDRECV}
        for kind in kinds:
            assert sorted(p.nbytes for p in mine if p.kind is kind) == list(SIZES)
    assert min(SIZES) <= 8192 and max(SIZES) >= 2**30  # a decode step's all-reduce to gradient buckets


def test_one_node_probes_no_link_between_nodes_and_one_gpu_per_node_none_inside() -> None:
    assert {p.link for p in probes(range(4), 4)} == {Link.INTRA}
    assert {p.link for p in probes((0, 4, 8), 4)} == {Link.INTER}
    assert probes((5,), 4) == ()
    with pytest.raises(ValueError, match="gpus_per_node"):
        probes((0, 1), 0)


def test_a_probe_needs_its_gpus_on_its_nodes() -> None:
    with pytest.raises(ValueError, match="per_node"):
        Probe(Collective.ALLREDUCE, (0, 1, 4), 2, 2, 4096)
    with pytest.raises(ValueError, match="two distinct"):
        Probe(Collective.ALLREDUCE, (0, 0), 2, 1, 4096)
    with pytest.raises(ValueError, match="nbytes"):
        Probe(Collective.SENDRECV, (0, 1), 2, 1, 0)


def test_a_timing_pairs_with_the_planner_ideal_sized_and_grouped_as_the_cost_model_prices_it() -> None:
    links = Links(CLUSTER, Efficiencies())
    ar = Probe(Collective.ALLREDUCE, (0, 1, 4, 5), 2, 2, 65536)
    m = ar.measurement(links, 1e-3)
    assert m.op_class is OpClass.ALLREDUCE_INTER and m.measured_s == 1e-3
    assert m.ideal_s == links.ideal_ring_s(Collective.ALLREDUCE, 4, 65536.0, Link.INTER)
    assert (m.size, m.group) == (65536.0, 2.0)  # ranks per node, as ``costterms.ranks_per_node``
    bc = Probe(Collective.BROADCAST, (0, 1), 2, 1, 4096).measurement(links, 1e-4)
    assert bc.op_class is OpClass.BROADCAST_INTRA and bc.group == 0.0  # η by size only
    timed = [(ar, 1e-3), (ar, 0.0)]
    assert len(measurements(links, timed)) == 1  # a probe the clock could not see says nothing
    assert seconds_spent(timed) == pytest.approx((WARMUP + REPEATS) * 1e-3)


def _truth(kind: Collective, per_node: int, nodes: int, nbytes: float) -> float:
    intra, inter = CLUSTER.intra_node_bandwidth_gbs * 1e9, CLUSTER.inter_node_bandwidth_gbs * 1e9
    group = collectives.Group(per_node, nodes)
    return collectives.seconds(kind.value, group, nbytes, intra, inter, PARAMS)


def _priced(eff: Efficiencies, kind: Collective, per_node: int, nodes: int, nbytes: float) -> float:
    links = Links(CLUSTER, eff)
    span = nodes * CLUSTER.gpus_per_node if nodes > 1 else per_node
    cost = collective(links, kind, np.array([span]), np.array([per_node * nodes]), np.array([nbytes]))
    return float(sum(float(np.sum(t)) for t in cost.by_class.values()))


@pytest.mark.parametrize(
    ("kind", "per_node", "nodes", "nbytes"),
    [
        (Collective.ALLREDUCE, 2, 2, 48e3),  # tp4 across two nodes, one decode step of a small batch
        (Collective.ALLREDUCE, 2, 2, 700e3),  # ... of a large one (between two probed sizes)
        (Collective.ALLREDUCE, 1, 2, 3e6),
        (Collective.ALLREDUCE, 4, 3, 200e6),  # a gradient bucket over three whole nodes
        (Collective.ALLGATHER, 2, 2, 300e3),
        (Collective.ALLREDUCE, 4, 1, 48e3),  # tp4 inside a node
        (Collective.SENDRECV, 1, 2, 2e6),  # a pipeline hop between nodes
    ],
)
def test_after_the_sweep_the_cost_model_prices_collectives_no_plan_has_run_near_the_truth(
    kind: Collective, per_node: int, nodes: int, nbytes: float
) -> None:
    """The winner's curse the sweep removes: with no measurement of small messages between nodes,
    a decode-sized all-reduce across nodes is priced several times faster than it runs (the
    fabric's bandwidth at KB-sized messages is a small fraction of its peak); after a sweep timed
    on the truth, every collective is priced within 25% of it, at sizes between the probed ones
    and on groups of other sizes than probed too."""
    pool = tuple(range(12))  # three whole nodes
    links = Links(CLUSTER, Efficiencies())
    timed = [(p, _truth(p.kind, p.per_node, p.nodes, p.nbytes)) for p in probes(pool, CLUSTER.gpus_per_node)]
    store = CalibrationStore(CLUSTER.name)
    store.update(measurements(links, timed))
    truth = _truth(kind, per_node, nodes, nbytes)
    assert _priced(store.efficiencies(), kind, per_node, nodes, nbytes) == pytest.approx(truth, rel=0.25)
    if (kind, nodes, nbytes) == (Collective.ALLREDUCE, 2, 48e3):
        assert _priced(Efficiencies(), kind, per_node, nodes, nbytes) < truth / 3  # the priors' error
