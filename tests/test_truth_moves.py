"""The truth's transition: a DAG walked in waves at the truth's link speeds, not the planner's
estimate rescaled (``nereus.sim.truth.moves``)."""

from __future__ import annotations

import pytest

from nereus.control.transition_cost import DagEstimator, staged
from nereus.plan.search import search
from nereus.sim.moving import links, transfers, true_moving_seconds
from nereus.sim.truth import PARAMS
from nereus.sim.truth import collectives as coll
from nereus.sim.truth.engines import (
    CompileCache,
    Engine,
    build_seconds,
    comm_init_seconds,
    regroup_seconds,
)
from nereus.sim.truth.moves import Flow, Links, Transfer, message_seconds, moving_seconds, waves
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

GIB = 2**30
MIB = 2**20
LINKS = Links(300e9, 25e9, 2e9, 8)


def _copy(
    dst: int, src: int, nbytes: int = GIB, link: str = "intra", preds: tuple[int, ...] = ()
) -> Transfer:
    return Transfer(preds, (src, dst), (Flow(dst, nbytes, link),), (src,))


def test_a_message_moves_at_the_truths_point_to_point_time() -> None:
    for link, group in (("intra", coll.Group(2, 1)), ("inter", coll.Group(1, 2))):
        want = coll.seconds("sendrecv", group, GIB, LINKS.intra, LINKS.inter, PARAMS)
        assert message_seconds(GIB, link, LINKS, PARAMS) == pytest.approx(want)
    # a storage read shares the node's rate among its GPUs
    assert message_seconds(GIB, "storage", LINKS, PARAMS) == pytest.approx(GIB / (2e9 / 8))


def test_smaller_staging_batches_move_the_same_bytes_slower() -> None:
    """The bus bandwidth a message reaches falls with its size: what a constant-bandwidth
    estimate cannot see."""
    node = [_copy(1, 0, 4 * GIB, "inter")]
    times = [moving_seconds(node, b, LINKS, PARAMS) for b in (256 * MIB, 64 * MIB, 16 * MIB, MIB)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]
    assert times[0] > 4 * GIB / LINKS.inter  # never faster than the link


def test_nodes_on_disjoint_gpus_overlap_and_a_shared_gpu_serialises() -> None:
    one = moving_seconds([_copy(1, 0)], 256 * MIB, LINKS, PARAMS)
    apart = moving_seconds([_copy(1, 0), _copy(3, 2)], 256 * MIB, LINKS, PARAMS)
    shared = moving_seconds([_copy(1, 0), _copy(2, 0)], 256 * MIB, LINKS, PARAMS)
    chained = moving_seconds([_copy(1, 0), _copy(3, 2, preds=(0,))], 256 * MIB, LINKS, PARAMS)
    assert apart == pytest.approx(one) and shared == pytest.approx(2 * one)
    assert chained == pytest.approx(2 * one)  # a later wave waits for its predecessor


def test_a_receiver_takes_its_flows_in_turn_and_senders_share_the_wire() -> None:
    gather = Transfer((), (0, 1, 2), (Flow(0, GIB, "intra"), Flow(0, GIB, "intra")), (1, 2))
    scatter = Transfer((), (0, 1, 2), (Flow(1, GIB, "intra"), Flow(2, GIB, "intra")), (0,))
    one = moving_seconds([_copy(1, 0)], 256 * MIB, LINKS, PARAMS)
    assert moving_seconds([gather], 256 * MIB, LINKS, PARAMS) == pytest.approx(2 * one)
    assert moving_seconds([scatter], 256 * MIB, LINKS, PARAMS) == pytest.approx(2 * one)


def test_waves_follow_depth_and_refuse_a_node_listed_before_its_predecessor() -> None:
    nodes = [_copy(1, 0), _copy(2, 1, preds=(0,)), _copy(4, 3), _copy(5, 4, preds=(1, 2))]
    assert waves(nodes) == [0, 1, 0, 2]
    with pytest.raises(ValueError, match="not listed before"):
        waves([_copy(1, 0, preds=(1,)), _copy(2, 1)])
    with pytest.raises(ValueError, match="staging budget"):
        moving_seconds(nodes, 0, LINKS, PARAMS)
    with pytest.raises(ValueError, match="flow link"):
        Flow(0, 1, "nvlink")


@pytest.mark.parametrize(("gpus", "target_gpus"), [(16, 32), (32, 16)])
def test_a_planned_transition_is_walked_whole_and_differs_from_the_planners_estimate(
    gpus: int, target_gpus: int
) -> None:
    """Every node of the DAG the move runs reaches the truth, and the truth's seconds are its own:
    within a small factor of the planner's estimate, not a constant multiple of it."""
    ratios = []
    for response in (1024, 4096):
        before = make_problem(gpus=gpus, response=1024)
        after = make_problem(gpus=target_gpus, response=response)
        est = staged(after, DagEstimator().estimate(after, search(before).plan, search(after).plan))
        tr = est.transition
        assert tr is not None and est.feasible
        nodes = transfers(tr)
        assert len(nodes) == len(tr.dag.nodes)
        assert sum(f.bytes for n in nodes for f in n.flows) == sum(
            f.bytes for n in tr.dag.nodes for f in n.flows
        )
        true = true_moving_seconds(tr, after.cluster, PARAMS)
        assert true == moving_seconds(nodes, tr.staging_budget, links(after.cluster), PARAMS)
        assert true > 0 and 0.2 < true / est.features[0] < 5
        ratios.append(true / est.features[0])
    assert len(set(ratios)) == len(ratios)


def test_a_generation_layout_compiled_before_builds_faster_and_other_engines_cost_the_same() -> None:
    cache = CompileCache()
    gen = Engine("gen", 32, 2, 1, 4, key="llama tp2 pp1")
    cold, warm = cache.build(gen, PARAMS), cache.build(gen, PARAMS)
    assert cold == pytest.approx(build_seconds(gen, False, PARAMS)) and warm < 0.7 * cold
    assert cache.build(Engine("gen", 32, 4, 1, 2, key="llama tp4 pp1"), PARAMS) == pytest.approx(cold)
    relaunched = Engine("gen", 32, 8, 1, 1, key="llama tp8 pp1")
    cache.mark(relaunched)  # built by a restart's relaunch
    assert cache.build(relaunched, PARAMS) == pytest.approx(warm)
    deeper = build_seconds(Engine("gen", 80, 2, 1, 4), False, PARAMS)
    assert deeper > cold  # compile and capture walk the layers
    train = Engine("train", 32, 2, 2, 2)
    assert cache.build(train, PARAMS) == cache.build(train, PARAMS) == PARAMS.module_setup_s


def test_a_communicator_costs_more_with_more_ranks_and_nothing_for_one() -> None:
    inits = [comm_init_seconds(n, PARAMS) for n in (1, 2, 8, 64, 1024)]
    assert inits[0] == 0.0 and inits[1:] == sorted(inits[1:])
    e = Engine("inf", 32, 1, 1, 1)
    assert regroup_seconds(e, PARAMS) == 0.0
    both = Engine("inf", 32, 4, 1, 16)
    assert regroup_seconds(both, PARAMS) == pytest.approx(inits[2] / 8**0.5 * (4**0.5 + 16**0.5))
    with pytest.raises(ValueError, match="engine stage"):
        Engine("rollout", 32, 1, 1, 1)
    with pytest.raises(ValueError, match="degrees"):
        Engine("gen", 32, 0, 1, 1)
