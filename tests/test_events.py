"""The discrete-event executor: uncoordinated local DAGs vs the global DAG, on tiny cases."""

from __future__ import annotations

import math

import pytest

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import Head, Precision, Stage, load_cluster, load_model
from nereus.state.buffers import StatePolicy
from nereus.transition.build import build_dag, initial_bytes
from nereus.transition.dag import Edge, EdgeKind, Node, Primitive
from nereus.transition.events import MemoryBoundError, Policy, execute
from nereus.transition.links import LinkModel
from nereus.transition.local import StageMove

pytestmark = pytest.mark.pure

LOCAL, RESOURCE = EdgeKind.LOCAL, EdgeKind.RESOURCE


def node(
    i: int,
    stage: str,
    primitive: Primitive,
    acquire: tuple[tuple[int, int], ...] = (),
    release: tuple[tuple[int, int], ...] = (),
    est_s: float = 1.0,
    ports: tuple[int, ...] = (),
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] = (),
    frees: tuple[str, ...] = (),
) -> Node:
    gpus = tuple(sorted({g for g, _ in acquire + release} | set(ports)))
    return Node(
        id=i, primitive=primitive, model_stage=stage, gpus=gpus, bytes=0, est_s=est_s, inputs=inputs,
        outputs=outputs, frees=frees, acquire=acquire, release=release, sends=ports,
    )  # fmt: skip


def swap() -> tuple[list[Node], list[Edge]]:
    """Two model-stages swap the ranks of their 2-GPU units (30 B per rank, 100 B per GPU).

    Each copies rank 0 then rank 1 to the other GPU and destroys its old unit after both copies.
    Launched together, each lands its first copy and waits for the other's old unit to go: a
    deadlock. One resource edge (a's destroy before b's first copy) serialises them.
    """
    nodes = []
    for k, (stage, first, second) in enumerate((("a", 1, 0), ("b", 0, 1))):
        u = (f"{stage}/u",)
        nodes += [
            node(3 * k, stage, Primitive.EXTEND, ((first, 30),), inputs=u, outputs=(f"{stage}/r0",)),
            node(3 * k + 1, stage, Primitive.EXTEND, ((second, 30),), inputs=u, outputs=(f"{stage}/r1",)),
            node(
                3 * k + 2, stage, Primitive.DESTROY, release=((0, 30), (1, 30)), est_s=0.0, inputs=u, frees=u
            ),
        ]
    edges = [Edge(s, d, LOCAL) for s, d in ((0, 1), (1, 2), (3, 4), (4, 5))]
    return nodes, edges


INITIAL = {0: 60, 1: 60}  # each GPU holds a rank of a and a rank of b


def test_swap_deadlocks_independently() -> None:
    nodes, edges = swap()
    run = execute(nodes, edges, INITIAL, 100, Policy.INDEPENDENT)
    assert run.deadlock
    assert run.stalled == (1, 2, 4, 5)
    assert run.completion == {"a": math.inf, "b": math.inf}
    assert run.held == {0: 90, 1: 90}  # both first copies landed, nothing can leave


def test_swap_succeeds_with_the_global_dag() -> None:
    nodes, edges = swap()
    dag = [*edges, Edge(2, 3, RESOURCE)]
    run = execute(nodes, dag, INITIAL, 100, Policy.RESPECT_EDGES)
    assert not run.deadlock and not run.stalled
    assert run.start[3] >= run.finish[2]
    assert run.makespan == pytest.approx(4.0)
    assert run.peak == {0: 90, 1: 90}
    assert run.held == {0: 60, 1: 60}
    assert run.live == {"a/r0", "a/r1", "b/r0", "b/r1"}
    # the same resource edge is ignored by the baseline: it still deadlocks
    assert execute(nodes, dag, INITIAL, 100, Policy.INDEPENDENT).deadlock


def test_launch_timing_decides_the_baseline() -> None:
    nodes, edges = swap()
    late = execute(nodes, edges, INITIAL, 100, Policy.INDEPENDENT, launch={"a": 0.0, "b": 5.0})
    assert not late.deadlock
    assert late.start[3] == pytest.approx(5.0)
    assert late.completion == {"a": pytest.approx(2.0), "b": pytest.approx(7.0)}


def test_memory_bound_is_asserted_without_resource_edges() -> None:
    nodes, edges = swap()
    with pytest.raises(MemoryBoundError, match="GPU 0 would hold 120 B > capacity 100 B"):
        execute(nodes, edges, INITIAL, 100, Policy.RESPECT_EDGES)
    # with room for both, the same DAG runs concurrently in both policies
    for policy in Policy:
        run = execute(nodes, edges, INITIAL, 120, policy)
        assert not run.deadlock
        assert run.makespan == pytest.approx(2.0)


def test_edges_and_ports_are_respected() -> None:
    nodes = [
        node(0, "a", Primitive.SPLIT, ((0, 10),), ((0, 10),), est_s=2.0, ports=(0,)),
        node(1, "b", Primitive.EXTEND, ((1, 10),), est_s=1.0, ports=(0,)),  # shares GPU 0's send port
        node(2, "b", Primitive.MERGE, ((1, 5),), ((1, 5),), est_s=0.5),
        node(3, "a", Primitive.DESTROY, release=((0, 10),), est_s=0.0),
    ]
    edges = [Edge(1, 2, LOCAL), Edge(0, 3, LOCAL), Edge(3, 2, RESOURCE)]
    caps = {0: 100, 1: 100}
    run = execute(nodes, edges, {0: 10}, caps, Policy.RESPECT_EDGES, order=[1, 0, 2, 3])
    assert run.start[1] == 0.0 and run.start[0] == pytest.approx(1.0)  # priority, then the port
    assert run.start[3] == pytest.approx(run.finish[0])
    assert run.start[2] == pytest.approx(3.0)  # waits for the resource edge from node 3
    assert run.held == {0: 0, 1: 10}
    indep = execute(nodes, edges, {0: 10}, caps, Policy.INDEPENDENT, order=[1, 0, 2, 3])
    assert indep.start[2] == pytest.approx(1.0)  # the resource edge does not exist for the baseline


def test_baseline_waits_for_memory_first_come_first_served() -> None:
    nodes = [
        node(0, "a", Primitive.SPLIT, ((0, 60),), est_s=1.0),  # a's staging, then a's old state goes
        node(1, "a", Primitive.DESTROY, release=((0, 60),), est_s=0.0),
        node(2, "b", Primitive.EXTEND, ((0, 60),), est_s=1.0),  # b's new state, permanent
    ]
    edges = [Edge(0, 1, LOCAL)]
    a_first = execute(nodes, edges, {}, 100, Policy.INDEPENDENT, launch={"a": 0.0, "b": 0.5})
    assert not a_first.deadlock
    assert a_first.start[2] == pytest.approx(1.0)  # b waited for a's release
    b_first = execute(nodes, edges, {}, 100, Policy.INDEPENDENT, launch={"a": 0.5, "b": 0.0})
    assert b_first.deadlock and b_first.stalled == (0, 1)
    assert b_first.completion == {"a": math.inf, "b": pytest.approx(1.0)}


def test_real_swap_of_two_trainers() -> None:
    """Real local DAGs: a trainer moves onto the GPUs of another that moves onto its own."""
    model = load_model("tiny-llama")
    policy = StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED)
    critic = model.with_head(Head.VALUE)
    moves = [
        StageMove.between("actor.train", model, policy, Layout(1, 2), ((0, 3),), Layout(2, 1), ((2, 1),)),
        StageMove.between("critic.train", critic, policy, Layout(1, 2), ((2, 1),), Layout(1, 2), ((0, 3),)),
    ]
    links = LinkModel(load_cluster("h100-ib"), Efficiencies())
    rank = {m.name: 2 for m in moves}
    alone = max(max(build_dag([m], rank, links, 1 << 40).peak.values()) for m in moves)
    assert not build_dag(moves, rank, links, alone).feasible  # each vacates what the other needs
    lo, hi = alone, 1 << 40  # the least capacity the swap fits in: one of them waits for the other
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if build_dag(moves, rank, links, mid).feasible else (mid + 1, hi)
    cap = lo
    dag = build_dag(moves, rank, links, cap)
    assert dag.feasible and dag.resource_edges >= 1
    init = initial_bytes(moves)
    critic_first = {"critic.train": 0.0, "actor.train": 0.001}
    assert execute(dag.nodes, dag.edges, init, cap, Policy.INDEPENDENT, critic_first).deadlock
    for launch in ({}, critic_first, {"actor.train": 1.0}):
        run = execute(dag.nodes, dag.edges, init, cap, Policy.RESPECT_EDGES, launch, order=dag.order)
        assert not run.deadlock
        assert max(run.peak.values()) <= cap
        assert all(b <= dag.peak[g] for g, b in run.peak.items())
