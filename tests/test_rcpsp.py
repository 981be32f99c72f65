"""The exact RCPSP baseline of the transition schedule (SCIP) against the greedy, on ticks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import cache

import pytest

from nereus.plan.search import search
from nereus.transition import plan_transition
from nereus.transition.between import Transition
from nereus.transition.build import initial_bytes
from nereus.transition.dag import Edge, EdgeKind, Node, Primitive, TransitionDag
from nereus.transition.rcpsp import choose_tick, greedy_ticks, horizon, solve_rcpsp, ticks, verify
from nereus.transition.schedule import list_schedule
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

pytest.importorskip("pyscipopt")


# ------------------------------------------------------------------ an independent checker
def violations(
    dag: TransitionDag,
    initial: Mapping[int, int],
    durations: Sequence[int],
    starts: Sequence[int],
    all_edges: bool = False,
) -> list[str]:
    """Slot by slot: precedence (LOCAL, or every edge), one node per port, memory ≤ capacity."""
    out = []
    end = [s + d for s, d in zip(starts, durations, strict=True)]
    for e in dag.edges:
        if (all_edges or e.kind is EdgeKind.LOCAL) and starts[e.dst] < end[e.src]:
            out.append(f"{e.src}→{e.dst}")
    for t in range(max(end, default=0) + 1):
        running: dict[tuple[int, int], int] = {}
        level = dict(initial)
        for n in dag.nodes:
            if starts[n.id] <= t < end[n.id]:
                for p in set(n.ports):
                    running[p] = running.get(p, 0) + 1
            if starts[n.id] <= t:
                for g, b in n.acquire:
                    level[g] = level.get(g, 0) + b
            if end[n.id] <= t:
                for g, b in n.release:
                    level[g] = level.get(g, 0) - b
        out += [f"port {p} × {k} at {t}" for p, k in running.items() if k > 1]
        out += [f"GPU {g} at {t}" for g, b in level.items() if b > dag.capacity.get(g, 0)]
    return out


# ------------------------------------------------------------------ hand-made instances
def node(
    i: int,
    est: float,
    primitive: Primitive = Primitive.EXTEND,
    acquire: tuple[tuple[int, int], ...] = (),
    release: tuple[tuple[int, int], ...] = (),
    sends: tuple[int, ...] = (),
    recvs: tuple[int, ...] = (),
) -> Node:
    gpus = tuple(sorted({g for g, _ in acquire + release} | set(sends) | set(recvs)))
    return Node(
        id=i, primitive=primitive, model_stage="ms", gpus=gpus, bytes=0, est_s=est,
        acquire=acquire, release=release, sends=sends, recvs=recvs,
    )  # fmt: skip


def dag_of(
    nodes: list[Node],
    local: list[tuple[int, int]],
    resource: Sequence[tuple[int, int]] = (),
    capacity: int = 10,
    feasible: bool = True,
) -> TransitionDag:
    edges = [Edge(a, b, EdgeKind.LOCAL) for a, b in local] + [
        Edge(a, b, EdgeKind.RESOURCE) for a, b in resource
    ]
    gpus = {g for n in nodes for g in n.gpus}
    order = tuple(range(len(nodes))) if feasible else ()
    return TransitionDag(tuple(nodes), tuple(edges), {}, order, {}, dict.fromkeys(gpus, capacity), feasible)


def test_ticks_round_up_and_keep_acquirers_at_one_tick() -> None:
    d = dag_of(
        [node(0, 0.0, Primitive.DESTROY, release=((0, 1),)), node(1, 0.01, acquire=((0, 1),)), node(2, 2.5)],
        [],
    )
    assert ticks(d, 1.0) == (0, 1, 3)
    assert ticks(d, 0.5) == (0, 1, 5)
    assert horizon(d, ticks(d, 1.0)) == 3
    tick = choose_tick(d, 4)
    assert horizon(d, ticks(d, tick)) <= 4 < horizon(d, ticks(d, tick * 0.9))


def test_port_priority_misleads_commit_order_and_the_second_pass_fixes_it() -> None:
    # A and B share a receive port; C needs B. Commit order A, B, C makes the greedy run A first;
    # the longest-remaining-path pass starts B first and reaches SCIP's optimum.
    d = dag_of([node(0, 2.0, recvs=(0,)), node(1, 1.0, recvs=(0,)), node(2, 2.0, recvs=(1,))], [(1, 2)])
    assert list_schedule(d, [float(t) for t in ticks(d, 1.0)]).makespan == 5
    assert greedy_ticks(d, ticks(d, 1.0)).makespan == 3
    r = solve_rcpsp(d, {}, tick_s=1.0, time_limit_s=10)
    assert r.status == "optimal"
    assert (r.greedy_ticks, r.makespan_ticks) == (3, 3)
    assert r.starts == (1, 0, 1)
    assert r.gap == pytest.approx(0.0)
    assert not violations(d, {}, r.durations, r.starts)


def test_memory_forces_serialisation_and_greedy_resource_edges_cost_time() -> None:
    # X, Y stage 6 bytes each and Z 4 on GPU 0 (capacity 10): X and Y never overlap, Z fits with
    # either. The builder's edges X→Y, X→Z give 2 + 4; running Z beside X then Y gives 4.
    X = node(0, 2.0, acquire=((0, 6),), release=((0, 6),))
    Y = node(1, 2.0, acquire=((0, 6),), release=((0, 6),))
    Z = node(2, 4.0, acquire=((0, 4),), release=((0, 4),))
    d = dag_of([X, Y, Z], [], resource=[(0, 1), (0, 2)])
    g = greedy_ticks(d, ticks(d, 1.0))
    assert g.makespan == 6
    assert not violations(d, {}, ticks(d, 1.0), [round(s) for s in g.start], all_edges=True)
    r = solve_rcpsp(d, {}, tick_s=1.0, time_limit_s=10)
    assert r.status == "optimal"
    assert r.makespan_ticks == 4
    assert r.starts is not None
    assert {r.starts[0], r.starts[1]} == {0, 2} and r.starts[2] == 0
    assert not violations(d, {}, r.durations, r.starts)


def test_a_destroy_must_free_memory_before_an_extend_onto_its_gpu() -> None:
    # GPU 0 holds 6 of 10. E1 copies the old unit away (send port), D destroys it after the copy
    # (LOCAL), E2 needs 6 on GPU 0: it can only start once D has released, at 2.
    E1 = node(0, 2.0, acquire=((1, 6),), sends=(0,), recvs=(1,))
    D = node(1, 0.0, Primitive.DESTROY, release=((0, 6),))
    E2 = node(2, 2.0, acquire=((0, 6),), recvs=(0,))
    d = dag_of([E1, D, E2], [(0, 1)], resource=[(1, 2)])
    r = solve_rcpsp(d, {0: 6}, tick_s=1.0, time_limit_s=10)
    assert r.status == "optimal"
    assert r.makespan_ticks == 4
    assert r.starts == (0, 2, 2)
    assert r.durations == (2, 0, 2)
    assert not violations(d, {0: 6}, r.durations, r.starts)


def test_memory_that_never_fits_is_proved_infeasible() -> None:
    d = dag_of([node(0, 1.0, acquire=((0, 6),)), node(1, 1.0, acquire=((0, 6),))], [], feasible=False)
    r = solve_rcpsp(d, {}, tick_s=1.0, time_limit_s=10)
    assert r.status == "infeasible"
    assert r.starts is None and r.makespan_ticks is None and r.greedy_ticks is None
    assert r.horizon_ticks == 2  # the serial schedule's length
    # a node whose acquisition alone overflows: no start time helps
    d = dag_of([node(0, 1.0, acquire=((0, 12),))], [], feasible=False)
    r = solve_rcpsp(d, {}, tick_s=1.0, time_limit_s=10)
    assert r.status == "infeasible" and r.starts is None


# ------------------------------------------------------------------ planner transitions
@cache
def transition(cluster: str, g1: int, s1: int, g2: int, s2: int) -> Transition:
    a = search(make_problem(cluster=cluster, gpus=g1, response=s1)).plan
    p2 = dataclasses.replace(make_problem(cluster=cluster, gpus=g2, response=s2), anchor=a)
    return plan_transition(p2, a, search(p2).plan)


CASES = [
    ("a100-64gb-hdr100", 8, 2048, 16, 4096),  # pool ×2 and responses ×2 (resource edges)
    ("mi250x-slingshot", 8, 2048, 16, 4096),
    ("a100-64gb-hdr100", 16, 2048, 32, 2048),  # pool ×2
    ("a100-64gb-hdr100", 32, 2048, 24, 2048),  # pool −25%
    ("a100-64gb-hdr100", 8, 2048, 16, 2048),  # feasible only after a deferral retry
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}to{c[3]}-r{c[4]}")
def test_scip_schedule_is_valid_and_no_longer_than_greedy(case: tuple[str, int, int, int, int]) -> None:
    tr = transition(*case)
    assert tr.dag.nodes
    init = initial_bytes(tr.moves)
    r = solve_rcpsp(tr.dag, init, max_slots=30, time_limit_s=10)
    assert r.horizon_ticks <= 30
    if tr.dag.feasible:
        assert r.greedy_ticks == r.horizon_ticks
        # the greedy on ticks respects every edge, the ports and the memory (the builder's bound)
        g = greedy_ticks(tr.dag, r.durations)
        assert not violations(tr.dag, init, r.durations, [round(s) for s in g.start], all_edges=True)
        assert r.makespan_ticks is not None and r.makespan_ticks <= r.greedy_ticks
    else:
        assert r.horizon_ticks == sum(r.durations)
    if r.starts is not None:
        assert r.makespan_ticks is not None and r.bound_ticks <= r.makespan_ticks + 1e-6
        assert max(s + d for s, d in zip(r.starts, r.durations, strict=True)) == r.makespan_ticks
        assert not violations(tr.dag, init, r.durations, r.starts)
        assert not verify(tr.dag, init, r.durations, r.starts)
    else:
        assert r.status == "infeasible"
