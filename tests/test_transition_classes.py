"""Replica classes (``nereus.transition.classes``, ``class_moves``, ``classplan``): the classes
derived straight from two plans are the groups of the per-unit DAG, a class plan expands onto
that DAG with a valid schedule of the priced makespan, and admission prices a class plan without
building per-unit nodes; where the rules do not apply, the exact per-unit planner runs.

The pairs are the stored plans of ``tests/golden/transition_reference.json`` (no plan search).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections import Counter
from typing import Any

import numpy as np
import pytest

from nereus.control.transition_cost import DagEstimator
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.workload import STAGE_ORDER
from nereus.transition import plan_transition
from nereus.transition.between import _expand, ledger_capacity, price_transition, stage_moves
from nereus.transition.build import _Locals, initial_bytes
from nereus.transition.choose import SLACK
from nereus.transition.class_ledger import class_ledger
from nereus.transition.class_moves import derive, derive_both
from nereus.transition.classes import Derived
from nereus.transition.classplan import class_bound, plan_classes
from nereus.transition.dag import TransitionDag
from nereus.transition.group import Groups, match, signatures
from nereus.transition.links import link_model
from nereus.transition.rcpsp import verify
from nereus.transition.schedule import lower_bound
from tests.transition_cases import GOLDEN, _drift_case, plan_of, problem_of

pytestmark = pytest.mark.pure

TICK_S = 1e-6  # the verifier's integer ticks
GAP = 0.05  # class plan makespan / exact per-unit greedy makespan − 1

CASES = [c for c in json.loads(GOLDEN.read_text()) if "error" not in c["expect"] and "capacity" not in c]
INTACT = [c for c in CASES if not c.get("lost")]
BIG = [c for c in INTACT if c["name"].startswith("mi250x 1024")]


def _pair(case: dict[str, Any]) -> tuple[Any, Any, Any]:
    problem = problem_of(case)
    return problem, plan_of(case["current"], problem), plan_of(case["target"], problem)


def test_derived_classes_are_the_groups_of_the_per_unit_dag() -> None:
    """Wherever ``derive`` follows the moves, its classes are ``Groups`` of the DAG ``local.py``
    builds (Split → Extend → Merge, or ``direct``: straight from one replica), one for one:
    model-stage, primitive, seconds, bytes, acquisitions, members, rounds and predecessors."""
    derived = Counter[bool]()
    for case, direct in itertools.product(INTACT, (False, True)):
        problem, current, target = _pair(case)
        links = link_model(problem.cluster, problem.efficiencies)
        d = derive(problem, current, target, links, frozenset(), direct)
        if d is None:
            continue
        derived[direct] += bool(d.resharded) or not direct
        loc = _Locals(stage_moves(problem, current, target), links, ledger_capacity(problem), direct)
        mine = signatures(loc.nodes, Groups(loc.nodes, loc.edges))
        sigs: list[tuple[object, ...]] = []
        for c in d.classes:
            sigs.append((
                c.stage, c.primitive, c.est_s, c.bytes, c.acquires, c.count, c.rounds,
                frozenset(sigs[p] for p in c.preds),
            ))  # fmt: skip
        assert Counter(sigs) == Counter(mine), case["name"]
        assert d.nodes == len(loc.nodes)
        # the ledger: every GPU's state before and every acquisition, as the per-unit nodes say
        init = initial_bytes(stage_moves(problem, current, target))
        assert {g: b for g, b in enumerate(d.init.tolist()) if b} == {g: b for g, b in init.items() if b}
        acquired: dict[int, int] = {}
        for n in loc.nodes:
            for g, b in n.acquire:
                acquired[g] = acquired.get(g, 0) + b
        assert {g: b for g, b in enumerate(d.acquired.tolist()) if b} == {
            g: b for g, b in acquired.items() if b
        }
        # and class by class, what its members acquire and release on every GPU (the ledger's input)
        found = match(loc.nodes, loc.edges, sigs)
        assert found is not None
        groups, to = found
        size = len(d.init)
        for g, members in enumerate(groups.members):
            c = d.classes[to[g]]
            for kind, mem in (("acquire", c.acquire), ("release", c.release)):
                want = np.zeros(size, np.int64)
                for i in members:
                    for gpu, b in getattr(loc.nodes[i], kind):
                        want[gpu] += b
                got = mem.vector(size) if mem is not None else np.zeros(size, np.int64)
                assert (got == want).all(), (case["name"], c.stage, c.primitive, kind)
    assert derived[False] >= 20  # the benchmark's drifts at every size and most seeded ones
    assert derived[True] >= 20  # re-laid out straight from one replica (``local._direct``)


@pytest.mark.parametrize("case", BIG, ids=[c["name"] for c in BIG])
def test_a_class_plan_expands_to_a_valid_schedule_of_its_makespan(case: dict[str, Any]) -> None:
    problem, current, target = _pair(case)
    priced = price_transition(problem, current, target)
    assert priced.classes is not None and not priced.expanded
    assert len(priced.classes.nodes) * 20 < priced.classes.derived.nodes
    direct = priced.classes.direct  # re-laid out straight from one replica, or Split → Extend → Merge
    exact = plan_transition(problem, current, target, direct=direct)
    assert exact.schedule is not None
    tr = priced.transition
    assert tr.path == "class" and priced.expanded and tr.schedule is not None
    dag, sched = tr.dag, tr.schedule
    # the per-unit DAG the executor runs: the exact builder's nodes, local edges and units
    loc = _Locals(
        tr.moves, link_model(problem.cluster, problem.efficiencies), ledger_capacity(problem), direct
    )
    assert dag.nodes == tuple(loc.nodes) and dag.units == loc.units and set(dag.edges) == set(loc.edges)
    assert priced.moved_bytes == sum(n.bytes for n in loc.nodes) and priced.changed == exact.changed
    assert priced.resharded == exact.resharded
    assert priced.peak_max == tr.peak_max >= exact.peak_max
    # the schedule the controller priced is the one that runs, valid on every edge, port and GPU
    assert sched.makespan == pytest.approx(priced.l_tran_s, rel=1e-12)
    starts = [round(s / TICK_S) for s in sched.start]
    durations = [round(f / TICK_S) - s for f, s in zip(sched.finish, starts, strict=True)]
    assert not verify(dag, initial_bytes(tr.moves), durations, starts, edges=None)
    best = plan_transition(problem, current, target)  # the per-unit greedy, straight re-layouts too
    assert sched.makespan <= (1 + GAP) * best.l_tran_s + 1e-9
    done = priced.gpu_done()
    assert max(done.values()) == pytest.approx(priced.l_tran_s)
    assert all(done[g] >= t - 1e-9 for g, t in tr.gpu_done().items() if g in done)


def test_admission_prices_a_class_plan_and_the_move_runs_its_expansion() -> None:
    problem, current, target = _pair(BIG[0])
    est = DagEstimator().estimate(problem, current, target)
    assert est.feasible and est.priced is not None and est.priced.path == "class"
    assert not est.priced.expanded  # deciding built no per-unit node
    assert est.features[0] == est.priced.l_tran_s == est.seconds
    assert est.peak_bytes == est.priced.peak_max + problem.reserved_bytes
    assert max(est.per_gpu_seconds.values()) == pytest.approx(est.seconds)
    tr = est.transition  # what a Move carries: built now, once
    assert tr is not None and tr is est.transition and tr.path == "class"
    assert tr.l_tran_s == pytest.approx(est.seconds, rel=1e-12)


def test_where_the_class_plan_does_not_apply_the_exact_planner_runs() -> None:
    # lost GPUs, small transitions: the exact per-unit plan, priced and run as before
    problem, current, target = _pair(BIG[0])
    lost = frozenset({max(current.candidates, key=lambda c: c.dp).gpus[0]})  # one replica's GPU
    priced = price_transition(problem, current, target, lost)
    assert priced.classes is None and priced.transition == plan_transition(problem, current, target, lost)
    small = next(c for c in INTACT if c["name"].startswith("mi250x 32 "))
    problem, current, target = _pair(small)
    priced = price_transition(problem, current, target)
    assert priced.classes is None and priced.transition == plan_transition(problem, current, target)
    # memory for every acquisition at once, then one byte short: the class ledger orders some
    # acquisitions after releases, within the capacity; and none where nothing can free enough
    problem, current, target = _pair(BIG[0])
    links = link_model(problem.cluster, problem.efficiencies)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    plan = plan_classes(problem, current, target, links, ledger_capacity(problem), rank)
    assert plan is not None and plan.ledger is None
    roomy = plan_classes(problem, current, target, links, plan.peak_max, rank)
    assert roomy is not None and roomy.ledger is None and roomy.schedule == plan.schedule
    tight = plan_classes(problem, current, target, links, plan.peak_max - 1, rank)
    assert tight is not None and tight.ledger is not None and tight.ledger.edges
    assert tight.peak_max <= plan.peak_max - 1 and tight.makespan >= plan.makespan
    least = int(plan.derived.init.max())  # the state before the transition alone
    assert plan_classes(problem, current, target, links, least - 1, rank) is None
    # a fuller GPU that acquires nothing counts too (a ledgered plan never exceeds the capacity)
    for cap in (least - 1, least, (least + tight.peak_max) // 2):
        found = plan_classes(problem, current, target, links, cap, rank)
        assert found is None or found.peak_max <= cap


def test_skipped_model_stages_are_left_out_of_the_class_plan() -> None:
    problem, current, target = _pair(BIG[0])
    moving = price_transition(problem, current, target).changed
    skip = frozenset(moving[:1])
    priced = price_transition(problem, current, target, skip=skip)
    assert skip.isdisjoint(priced.changed)
    if priced.classes is not None:
        exact = plan_transition(problem, current, target, skip=skip, direct=priced.classes.direct)
        assert priced.changed == exact.changed
        moves = priced.transition.moves
        assert skip.isdisjoint(m.name for m in moves)
        links = link_model(problem.cluster, problem.efficiencies)
        loc = _Locals(moves, links, ledger_capacity(problem), priced.classes.direct)
        assert priced.transition.dag.nodes == tuple(loc.nodes)
        assert skip.isdisjoint(n.model_stage for n in loc.nodes)


def test_a_class_plan_is_a_pure_function_of_the_plans() -> None:
    """Repeated pricing (memoised geometry, link patterns and link model) gives equal plans."""
    problem, current, target = _pair(BIG[1])
    a, b = price_transition(problem, current, target), price_transition(problem, current, target)
    assert a.classes is not None and b.classes is not None
    assert a.classes.schedule == b.classes.schedule and a.classes.signatures() == b.classes.signatures()
    fresh = dataclasses.replace(problem)  # another problem object: a fresh link model, same plan
    c = price_transition(fresh, current, target)
    assert c.classes is not None and c.classes.schedule == a.classes.schedule


def test_the_class_lower_bound_is_the_per_unit_dags() -> None:
    """``ClassPlan.lower_bound`` (from the classes) equals ``schedule.lower_bound`` of the per-unit
    DAG the plan expands onto: its longest chain of members and its busiest port."""
    checked = 0
    for case in BIG + [c for c in INTACT if c["name"].startswith("drift")]:
        problem, current, target = _pair(case)
        priced = price_transition(problem, current, target)
        if priced.classes is None:
            continue
        loc = _Locals(
            stage_moves(problem, current, target),
            link_model(problem.cluster, problem.efficiencies),
            ledger_capacity(problem),
            priced.classes.direct,
        )
        dag = TransitionDag(tuple(loc.nodes), tuple(loc.edges), loc.units, (), {}, loc.cap, True)
        assert priced.classes.lower_bound() == pytest.approx(lower_bound(dag), rel=1e-9), case["name"]
        assert priced.classes.lower_bound() <= priced.l_tran_s + 1e-9
        checked += 1
    assert checked >= 4


def test_a_class_plan_re_lays_out_straight_from_one_replica_where_that_is_shorter() -> None:
    """1,024 GCDs, the pool doubled: the trainer's pipeline deepens (tp8·pp2 → tp8·pp4). Split →
    Extend → Merge copies whole T_sub shards first; straight from one replica each GPU acquires
    only its target shard. The class plan prices both and keeps the shorter: the per-unit
    greedy's makespan, not 53% above it."""
    problem, current, target = _pair(next(c for c in BIG if c["name"] == "mi250x 1024 grow"))
    priced = price_transition(problem, current, target)
    assert priced.classes is not None and priced.classes.direct
    links = link_model(problem.cluster, problem.efficiencies)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    split_extend_merge = plan_transition(problem, current, target, direct=False)
    assert priced.l_tran_s < split_extend_merge.l_tran_s
    assert priced.l_tran_s <= (1 + GAP) * plan_transition(problem, current, target).l_tran_s
    assert priced.peak_max < split_extend_merge.peak_max  # target shards only
    # memory for the straight re-layouts only: they run, where Split → Extend → Merge would wait
    assert plan_classes(problem, current, target, links, priced.peak_max, rank) is not None


def test_a_class_plan_far_above_its_bound_is_priced_per_unit_where_that_is_shorter() -> None:
    """Members of one class start together; where that leaves the class schedule more than
    ``SLACK`` above its lower bound, the per-unit greedy prices the transition too and the shorter
    is what admission prices and what runs. Within ``SLACK`` of the bound, no schedule of the
    per-unit DAG is more than ``SLACK`` shorter, and the class plan stands."""
    case = _drift_case("llama-3.1-8b", "mi250x-slingshot", 256, (0.25, 1024), (1.0, 1024))
    assert case is not None
    problem, current, target = _pair(case)
    links = link_model(problem.cluster, problem.efficiencies)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    plan = plan_classes(problem, current, target, links, ledger_capacity(problem), rank)
    assert plan is not None and plan.makespan > (1 + SLACK) * plan.lower_bound()
    priced = price_transition(problem, current, target)
    exact = plan_transition(problem, current, target)
    assert priced.classes is None and priced.path == "per-unit"
    assert priced.l_tran_s == exact.l_tran_s < plan.makespan
    assert priced.transition.dag == exact.dag
    for case in BIG:
        problem, current, target = _pair(case)
        priced = price_transition(problem, current, target)
        assert priced.classes is not None
        assert priced.l_tran_s <= (1 + SLACK) * priced.classes.lower_bound()


def test_memory_too_tight_for_every_acquisition_at_once_orders_classes_by_a_ledger() -> None:
    """1,024 GCDs, responses 2,048 → 4,096: both trainers re-laid out, and holding every
    acquisition at once would need 71 GB on a 64-GB GCD. The class ledger
    (``class_ledger.py``) makes some classes wait for others' releases; the plan it prices is the
    per-unit greedy's makespan, its expansion adds per-GPU resource edges and keeps the ledger's
    peak on every schedule: the priced one and random ones that respect the edges."""
    model, workload = load_model("llama-3.1-8b"), load_workload("ppo")

    def problem_at(pool: int, response: int) -> PlanningProblem:
        return PlanningProblem(
            workload, {r: model for r in Role}, load_cluster("mi250x-slingshot"), tuple(range(pool)),
            SeqStats.fixed(256, response), space=SearchSpace.engines(workload),
        )  # fmt: skip

    current = search(problem_at(1024, 2048)).plan
    problem = dataclasses.replace(problem_at(1024, 4096), anchor=current)
    target = search(problem).plan
    cap = ledger_capacity(problem)
    priced = price_transition(problem, current, target)
    plan = priced.classes
    assert plan is not None and plan.ledger is not None and plan.ledger.edges
    assert int((plan.derived.init + plan.derived.acquired).max()) > cap >= priced.peak_max
    exact = plan_transition(problem, current, target)
    assert priced.l_tran_s <= (1 + GAP) * exact.l_tran_s
    tr = priced.transition
    assert tr.path == "class" and tr.l_tran_s == pytest.approx(priced.l_tran_s, rel=1e-12)
    assert tr.dag.resource_edges > 0 and tr.peak_max == priced.peak_max <= cap
    init = initial_bytes(tr.moves)
    starts = [round(s / TICK_S) for s in tr.schedule.start]
    durations = [round(f / TICK_S) - s for f, s in zip(tr.schedule.finish, starts, strict=True)]
    assert not verify(tr.dag, init, durations, starts, edges=None)
    _random_schedules_keep_memory(tr, 20, 3)  # any durations and delays that keep the edges


def test_where_split_extend_merge_lacks_room_the_straight_re_layout_that_fits_is_weighed() -> None:
    """1,024 GCDs, Qwen3-14B, the pool shrinking from 768 to 512: Split → Extend → Merge would need
    83 GB per GPU at once (its ledgered schedule takes twice as long), the straight re-layouts fit
    without waiting. The class plan compares the two as they would run, keeps the straight one,
    and prices the per-unit greedy's makespan. ``floor``, the least bound of the two variants,
    is no longer than either per-unit plan."""
    case = _drift_case("qwen3-14b", "mi250x-slingshot", 1024, (0.75, 2048), (0.5, 2048))
    assert case is not None
    problem, current, target = _pair(case)
    links = link_model(problem.cluster, problem.efficiencies)
    cap = ledger_capacity(problem)
    d, straight = derive_both(problem, current, target, links, frozenset())
    assert d is not None and straight is not None
    assert int((d.init + d.acquired).max()) > cap >= int((straight.init + straight.acquired).max())
    priced = price_transition(problem, current, target)
    assert priced.classes is not None and priced.classes.direct and priced.classes.ledger is None
    exact = plan_transition(problem, current, target)
    assert priced.l_tran_s <= (1 + GAP) * exact.l_tran_s
    split_extend_merge = plan_transition(problem, current, target, direct=False)
    floor = priced.classes.floor
    assert floor == min(class_bound(d), class_bound(straight))
    assert floor <= min(exact.l_tran_s, split_extend_merge.l_tran_s) + 1e-9


def _random_schedules_keep_memory(tr: Any, rounds: int, seed: int) -> None:
    """Random durations and delays that keep every edge of ``tr``'s DAG never pass a GPU's capacity."""
    init = initial_bytes(tr.moves)
    preds: list[list[int]] = [[] for _ in tr.dag.nodes]
    for e in tr.dag.edges:
        preds[e.dst].append(e.src)
    rng = random.Random(seed)
    for _ in range(rounds):
        d = [rng.randint(0, 100) for _ in tr.dag.nodes]
        start = [0] * len(d)
        for i in tr.dag.order:
            start[i] = max((start[p] + d[p] for p in preds[i]), default=0) + rng.randint(0, 50)
        broken = verify(tr.dag, init, d, start, edges=None)
        assert not [b for b in broken if not b.startswith("port")], broken[:3]


def test_a_straight_re_layout_short_of_room_goes_through_the_ledger_too() -> None:
    """The 1,024-GCD pool doubling with a capacity 1 MiB short of the straight re-layouts' room
    for every acquisition at once (Split → Extend → Merge needs far more): the straight variant
    is ledgered too and wins; its expansion keeps the ledger's peak on every schedule."""
    problem, current, target = _pair(next(c for c in BIG if c["name"] == "mi250x 1024 grow"))
    links = link_model(problem.cluster, problem.efficiencies)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    d, straight = derive_both(problem, current, target, links, frozenset())
    assert d is not None and straight is not None
    need = int((straight.init + straight.acquired).max())
    room = need - 2**20 + problem.reserved_bytes
    tight = dataclasses.replace(problem, headroom=1.0 - room / problem.cluster.gpu_memory_bytes)
    cap = ledger_capacity(tight)
    assert cap < need < int((d.init + d.acquired).max())
    plan = plan_classes(tight, current, target, links, cap, rank)
    assert plan is not None and plan.direct and plan.ledger is not None and plan.peak_max <= cap
    assert plan.makespan < plan_transition(tight, current, target, direct=False).l_tran_s
    tr = _expand(tight, current, target, frozenset(), plan)
    assert tr.path == "class" and tr.dag.resource_edges > 0 and tr.peak_max <= cap
    starts = [round(s / TICK_S) for s in tr.schedule.start]
    durations = [round(f / TICK_S) - s for f, s in zip(tr.schedule.finish, starts, strict=True)]
    assert not verify(tr.dag, initial_bytes(tr.moves), durations, starts, edges=None)
    _random_schedules_keep_memory(tr, 10, 5)


def test_the_class_ledger_refuses_a_gpu_over_capacity_before_the_transition() -> None:
    """A GPU whose state before the transition is over the capacity refuses the plan, even where
    no class acquires on it (the ledger checks acquiring GPUs only); one byte less and it plans."""
    problem, current, target = _pair(BIG[0])
    links = link_model(problem.cluster, problem.efficiencies)
    d = derive(problem, current, target, links, frozenset())
    assert d is not None
    cap = int((d.init + d.acquired).max()) - 1  # too tight for every acquisition at once
    key = [(i,) for i in range(len(d.classes))]  # the classes' own topological order
    seconds = [c.est_s * c.rounds for c in d.classes]
    assert class_ledger(d, cap, key, seconds) is not None

    def with_idle_gpu(held: int) -> Derived:  # one more GPU, holding ``held``, that no class touches
        return dataclasses.replace(d, init=np.append(d.init, held), acquired=np.append(d.acquired, 0))

    assert class_ledger(with_idle_gpu(cap + 1), cap, key, seconds) is None
    led = class_ledger(with_idle_gpu(cap), cap, key, seconds)
    assert led is not None and int(led.peak.max()) <= cap
