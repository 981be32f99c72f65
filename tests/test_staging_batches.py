"""Staging bounded by batches (issue 19's refused moves, issue 21's ledger): a zero-copy round
whose staged chunks pass ``wire.budget`` with one peer runs in batches. Both GPUs of a pair put
every chunk in the same batch, no batch stages more than the budget with a peer unless one chunk
alone does, and the ledger's staging (``staging_bytes``) shrinks with the budget to the largest
batch — so a capacity that refuses the unbounded transition can admit the bounded one."""

from __future__ import annotations

from collections import defaultdict

import pytest

from nereus.state.buffers import staged
from nereus.transition import Transition
from nereus.transition.between import plan_transition
from nereus.transition.dag import Primitive
from nereus.transition.wire import (
    STAGING_BUDGET,
    Carry,
    WirePlan,
    batches,
    kinds_of,
    rounds,
    staging_bytes,
    takes_part,
    waves,
)
from tests.test_ledger_staging import _staged
from tests.test_transition_classes import INTACT, _pair

pytestmark = pytest.mark.pure


def _loads(plan: WirePlan, tr: Transition, j: int, wave: list[int], gpu: int) -> dict[tuple[int, int], int]:
    """(peer, batch) → staging bytes ``gpu`` holds for that peer in that batch, by the chunks."""
    nodes = [tr.dag.nodes[i] for i in wave if takes_part(tr.dag.nodes[i], gpu)]
    cut = batches(plan, nodes, gpu, j)
    load: dict[tuple[int, int], int] = defaultdict(int)
    for node in nodes:
        if node.primitive is Primitive.DESTROY:
            continue
        receiver, provider = plan.policies(node)
        kinds = kinds_of(receiver)
        if j >= len(kinds):
            continue
        part = plan.part(node, gpu)
        for x in [*part.sends, *(part.receive.transfers if part.receive else ())]:
            if x.carry is not Carry.PACKED:
                continue
            sending = x.src == gpu
            width = dict((provider if sending else receiver).kinds)[kinds[j]].itemsize
            for i, c in enumerate(x.chunks):
                if (c.src if sending else c.dst) is None:
                    b = cut.of[(x.node, x.src, x.dst, i)]
                    assert 0 <= b < cut.count
                    load[(x.dst if sending else x.src, b)] += staged(c.numel * width)
    return load


def _largest_chunk(plan: WirePlan, tr: Transition) -> int:
    return max(
        (
            staged(c.numel * 4)
            for n in tr.dag.nodes
            for g in n.gpus
            for x in (plan.part(n, g).sends)
            for c in x.chunks
        ),
        default=0,
    )


@pytest.mark.parametrize("budget", [1, 4096, 65536])
def test_both_sides_of_a_pair_put_each_chunk_in_the_same_batch_within_the_budget(budget: int) -> None:
    split = 0
    for tr in _staged():
        plan = WirePlan(tr.dag, tr.moves, budget=budget)
        gpus = sorted({g for n in tr.dag.nodes for g in (*n.gpus, *n.sends)})
        biggest = _largest_chunk(plan, tr)
        for wave in waves(tr.dag):
            for j in range(4):
                seen: dict[tuple[int, int, int, int], int] = {}
                for g in gpus:
                    nodes = [tr.dag.nodes[i] for i in wave if takes_part(tr.dag.nodes[i], g)]
                    cut = batches(plan, nodes, g, j)
                    split += cut.count > 1
                    for key, b in cut.of.items():
                        assert seen.setdefault(key, b) == b, (key, g)  # the pair agrees
                    for (peer, _), n in _loads(plan, tr, j, wave, g).items():
                        assert n <= max(budget, biggest), (g, peer, n)
                        assert n <= cut.need[peer]
                    # the pool holds the largest batch per peer, nothing more
                    per_peer: dict[int, int] = defaultdict(int)
                    for (peer, _), n in _loads(plan, tr, j, wave, g).items():
                        per_peer[peer] = max(per_peer[peer], n)
                    assert dict(per_peer) == cut.need
    assert split > 0  # some rounds did run in several batches


def test_the_ledger_staging_shrinks_with_the_budget_and_a_large_one_is_one_batch() -> None:
    for tr in _staged():
        whole = staging_bytes(tr.dag, tr.moves, budget=2**62)
        assert staging_bytes(tr.dag, tr.moves) == whole  # these rounds stage far below the default
        assert whole and sum(whole.values()) < STAGING_BUDGET
        small = staging_bytes(tr.dag, tr.moves, budget=1)
        assert set(small) <= set(whole)
        assert all(small[g] <= whole[g] for g in small)
        plan = WirePlan(tr.dag, tr.moves, budget=2**62)
        for wave in waves(tr.dag):
            for g in {g for n in tr.dag.nodes for g in n.gpus}:
                nodes = [tr.dag.nodes[i] for i in wave if takes_part(tr.dag.nodes[i], g)]
                assert batches(plan, nodes, g, 0).count == 1
    assert any(
        sum(staging_bytes(tr.dag, tr.moves, budget=1).values())
        < sum(staging_bytes(tr.dag, tr.moves).values())
        for tr in _staged()
    )


def test_a_budget_below_one_byte_is_refused() -> None:
    tr = _staged()[0]
    with pytest.raises(ValueError, match="staging budget"):
        WirePlan(tr.dag, tr.moves, budget=0)


def _each_gpus_own(tr: Transition, budget: int) -> dict[int, int]:
    """``staging_bytes`` as every GPU's executor computes its part: per wave, its own nodes, per
    round its ``batches``' need per peer; each peer's largest, summed."""
    plan = WirePlan(tr.dag, tr.moves, budget=budget)
    largest: dict[int, dict[int, int]] = defaultdict(dict)
    for wave in waves(tr.dag):
        nodes = [tr.dag.nodes[i] for i in wave if tr.dag.nodes[i].primitive is not Primitive.DESTROY]
        for g in sorted({g for n in nodes for g in (*n.gpus, *n.sends)}):
            mine = [n for n in nodes if takes_part(n, g)]
            for j in range(rounds(plan, mine)):
                for peer, n in batches(plan, mine, g, j).need.items():
                    largest[g][peer] = max(largest[g].get(peer, 0), n)
    return {g: sum(per.values()) for g, per in sorted(largest.items()) if sum(per.values())}


def test_the_ledger_staging_is_what_each_gpus_executor_prepares() -> None:
    """``staging_bytes`` (one pass per pair of GPUs) equals what each GPU's executor cuts for
    itself (``batches`` over its own nodes), at every budget, on random reshards and on the
    transition goldens' plans (several model-stages, trainers' optimizer state, up to 64 GPUs)."""
    transitions = list(_staged())
    for case in INTACT:
        problem, current, target = _pair(case)
        if len(problem.pool) <= 64:
            tr = plan_transition(problem, current, target)
            if tr.dag.feasible:
                transitions.append(tr)
    assert len(transitions) > len(_staged()) + 3
    staging = 0
    for tr in transitions:
        for budget in (1, 4096, 1 << 20, STAGING_BUDGET, 2**62):
            mine = staging_bytes(tr.dag, tr.moves, budget)
            assert mine == _each_gpus_own(tr, budget)
            staging += bool(mine)
    assert staging > 10
