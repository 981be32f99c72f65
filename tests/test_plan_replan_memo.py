"""The warm replan's memos and fast paths decide what a fresh computation decides (issue 21):
``bestfit.anchored`` memoised on (running plan, pool), the vectorised ``placed_spans``, the
node-grouped ``FreeGpus``, and the planner cache keyed per model-stage by where the running plan
keeps it — a controller's replans of one running plan on drifting lengths, calibration and
(fragmented) pools equal cold searches."""

from __future__ import annotations

import bisect
import dataclasses
import random
from collections.abc import Sequence
from types import MappingProxyType

import numpy as np
import pytest

from nereus.errors import InfeasibleError
from nereus.plan import bestfit, candidates, placement
from nereus.plan import frontier as frontier_module
from nereus.plan.bestfit import FreeGpus, anchored, placed_spans
from nereus.plan.cache import PlanCache
from nereus.plan.calibration import Efficiencies
from nereus.plan.candidates import Shape
from nereus.plan.layout import Candidate, Layout
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass
from nereus.plan.problem import SearchSpace, SeqStats
from nereus.plan.search import SearchResult, search
from nereus.spec.workload import ExecutionMode
from tests.helpers import assert_same_search, make_problem, search_outcome

pytestmark = pytest.mark.pure


def _nodes(gpus: Sequence[int], gpn: int) -> int:
    return len({g // gpn for g in gpus})


def _span(nodes: int, inside: float, gpn: int) -> float:
    return float(nodes * gpn) if nodes > 1 else float(min(inside, gpn))


def _reference_spans(c: Candidate, gpn: int) -> tuple[float, float, float]:
    """``placed_spans`` group by group, as it was written before it was vectorised."""
    size = c.layout.size
    tp_n = max(_nodes(g, gpn) for g in c.tp_groups())
    rep_n = max(_nodes(c.replica_gpus(r), gpn) for r in range(c.dp))
    dp_n = max(_nodes(c.gpus[i::size], gpn) for i in range(size)) if c.dp > 1 else -(-size // gpn)
    return _span(tp_n, c.layout.tp, gpn), _span(rep_n, size, gpn), _span(dp_n, size * c.dp, gpn)


def test_vectorised_placed_spans_equal_the_group_by_group_count() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        gpn = rng.choice([4, 8])
        lay = Layout(rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4]))
        dp = rng.randint(1, 6)
        n = lay.size * dp
        gpus = rng.sample(range(256), n) if rng.random() < 0.6 else list(range(n))
        c = Candidate("x", lay, dp, tuple(gpus))
        assert placed_spans(c, gpn) == _reference_spans(c, gpn)


class _ReferenceFree:
    """``FreeGpus`` GPU by GPU, as it was written before its nodes were grouped."""

    def __init__(self, gpus: Sequence[int], gpn: int) -> None:
        self.gpn = gpn
        self.nodes: dict[int, list[int]] = {}
        for g in sorted(gpus):
            self.nodes.setdefault(g // gpn, []).append(g)
        self.free = len(gpus)
        self.buckets: list[list[int]] = [[] for _ in range(gpn + 1)]
        for node in sorted(self.nodes):
            self.buckets[len(self.nodes[node])].append(node)

    def take_exactly(self, gpus: Sequence[int]) -> bool:
        if not all(g // self.gpn in self.nodes and g in self.nodes[g // self.gpn] for g in gpus):
            return False
        for g in gpus:
            node = g // self.gpn
            free = self.nodes[node]
            self.buckets[len(free)].remove(node)
            free.remove(g)
            self.free -= 1
            if free:
                bisect.insort(self.buckets[len(free)], node)
            else:
                del self.nodes[node]
        return True


def test_grouped_free_gpus_track_the_reference_gpu_by_gpu() -> None:
    rng = random.Random(1)
    for _ in range(300):
        gpn = rng.choice([4, 8])
        pool = rng.sample(range(16 * gpn), rng.randint(0, 16 * gpn))
        fast, slow = FreeGpus(pool, gpn), _ReferenceFree(pool, gpn)
        for _ in range(12):
            state = (fast.nodes, fast.buckets, fast.free)
            assert state == (slow.nodes, slow.buckets, slow.free)
            if rng.random() < 0.5 and fast.free:
                size = rng.choice([1, 2, 4, 8, 16])
                if size > fast.free:
                    continue
                taken = fast.take(size)  # the reference has no take: mirror it exactly
                assert slow.take_exactly(taken)
            else:
                ask = rng.sample(range(16 * gpn), rng.randint(1, 2 * gpn))
                assert fast.take_exactly(ask) == slow.take_exactly(ask)


def _fragmented(rng: random.Random, total: int, gpn: int) -> tuple[int, ...]:
    """A pool of whole and part nodes (spot instances smaller than a node)."""
    pool = [
        g for node in range(total // gpn) for g in range(node * gpn, node * gpn + rng.choice([gpn, gpn // 2]))
    ]
    drop = rng.sample(pool, rng.randint(0, len(pool) // 4))
    return tuple(sorted(set(pool) - set(drop)))


def test_anchored_memo_equals_a_fresh_computation() -> None:
    rng = random.Random(2)
    base = make_problem(gpus=32)
    gpn = base.cluster.gpus_per_node
    plans = []
    for _ in range(4):
        pool = _fragmented(rng, 32, gpn)
        try:
            plans.append(search(dataclasses.replace(base, pool=pool)).plan)
        except InfeasibleError:
            continue
    assert plans
    found_any = False
    for _ in range(60):
        plan = rng.choice(plans)
        pool = rng.choice([plan.pool, _fragmented(rng, 32, gpn)])
        p = dataclasses.replace(base, pool=pool, anchor=plan)
        memo = anchored(p)
        assert memo == bestfit._anchored(plan, gpn, tuple(pool))
        assert anchored(p) is memo  # served from the memo
        # an equal plan that is another object is its own entry, with the same answer
        twin = dataclasses.replace(plan)
        assert anchored(dataclasses.replace(p, anchor=twin)) == memo
        found_any |= bool(memo)
    assert found_any  # some anchors priced where they run (the per-model-stage keys are exercised)
    assert len(bestfit._ANCHORED) <= bestfit.ANCHORED_KEEP


@pytest.mark.parametrize(("seed", "mode"), [(3, ExecutionMode.SYNC), (4, ExecutionMode.ASYNC)])
def test_replans_of_one_running_plan_equal_cold_searches(seed: int, mode: ExecutionMode) -> None:
    """The controller's sequence: one running plan (the anchor), then lengths, calibration and
    pools drifting; on fragmented pools some model-stages are priced where they run, keyed
    per model-stage, so a pool change re-prices only the model-stages whose anchor moved."""
    rng = random.Random(seed)
    base = make_problem(gpus=32, mode=mode)
    gpn = base.cluster.gpus_per_node
    cache = PlanCache(keep=3, results=8)
    anchor = None
    for _ in range(12):
        try:
            anchor = search(dataclasses.replace(base, pool=_fragmented(rng, 32, gpn))).plan
            break
        except InfeasibleError:
            continue
    assert anchor is not None
    p = dataclasses.replace(base, pool=anchor.pool, anchor=anchor)
    priced_where_run = 0
    for _ in range(30):
        what = rng.choice(["length", "calibration", "pool", "pool", "anchor"])
        if what == "length":
            mean = rng.choice([1024, 2048, 2600, 3000, 4096])
            p = dataclasses.replace(p, seq=SeqStats(256, mean, mean * rng.choice([1.0, 1.3])))
        elif what == "calibration":
            eta = {op: min(1.0, PRIOR_EFFICIENCY[op] * rng.uniform(0.6, 1.5)) for op in OpClass}
            p = dataclasses.replace(p, efficiencies=Efficiencies(MappingProxyType(eta)))
        elif what == "pool":
            p = dataclasses.replace(p, pool=rng.choice([anchor.pool, _fragmented(rng, 32, gpn)]))
        else:
            found = search_outcome(p, None)
            if isinstance(found, SearchResult):
                anchor = found.plan
                p = dataclasses.replace(p, anchor=anchor)
        priced_where_run += bool(anchored(p))
        assert_same_search(search_outcome(p, cache), search_outcome(p, None))
    assert priced_where_run > 0
    assert cache.stats.hits.get("frontier", 0) > 0  # the replans did reuse prices


def test_anchored_replicas_are_taken_as_one_by_one() -> None:
    """``placement._anchored`` takes the first ``want`` wholly free replicas of the running plan
    at once; taking each in turn leaves the same replicas and the same free list."""
    rng = random.Random(5)
    base = make_problem(gpus=32)
    gpn = base.cluster.gpus_per_node
    plan = search(base).plan
    for _ in range(200):
        c = rng.choice(plan.candidates)
        shape = Shape(c.layout, c.dp, c.micro_batch, c.recompute)
        pool = rng.sample(range(32), rng.randint(0, 32))
        want = rng.randint(0, c.dp + 1)
        fast, slow = FreeGpus(pool, gpn), FreeGpus(pool, gpn)
        kept = placement._anchored(c.model_stage, shape, fast, plan, want)
        expected = []
        for r in range(c.dp):
            if len(expected) >= want:
                break
            if slow.take_exactly(c.replica_gpus(r)):
                expected.append(c.replica_gpus(r))
        assert kept == expected
        assert (fast.nodes, fast.buckets, fast.free) == (slow.nodes, slow.buckets, slow.free)


def test_dense_rank_of_gpu_counts_by_table_equals_unique() -> None:
    rng = np.random.default_rng(6)
    for _ in range(300):
        values = rng.integers(1, int(rng.integers(2, 3000)), size=int(rng.integers(1, 3000)))
        rank, count = frontier_module._dense_rank(values)
        distinct, inverse = np.unique(values, return_inverse=True)
        assert count == len(distinct)
        assert np.array_equal(rank, inverse)


def test_model_of_keeps_one_headed_spec_per_model() -> None:
    p = make_problem(gpus=8)
    for ms in p.workflow.model_stages:
        model = p.model_of(ms)
        assert model == p.models[ms.role].with_head(ms.head)
        assert p.model_of(ms) is model


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_rows_enumerated_once_equal_rows_per_layout(algo: str) -> None:
    """``enumerate_rows`` enumerates the DP degrees once and gives each layout the prefix it has
    GPUs for: the rows of enumerating every layout on its own."""
    for gpus in (1, 3, 8, 12, 24, 32, 64):
        for space in (SearchSpace(), SearchSpace.urgent()):
            p = make_problem(gpus=gpus, algo=algo, space=space)
            for ms in p.workflow.model_stages:
                rows = candidates.enumerate_rows(p, ms)
                parts = [candidates._shape_options(p, ms, lay) for lay in candidates.layouts(p, ms)]
                dp = np.concatenate([d for d, _ in parts] or [np.zeros(0, np.int64)])
                micro = np.concatenate([m for _, m in parts] or [np.zeros(0, np.int64)])
                assert np.array_equal(rows.dp, dp)
                assert np.array_equal(rows.micro_batch, micro)


def test_pairwise_in_latency_order_equals_all_four_comparisons() -> None:
    """On distinct points in the frontier's order, "an earlier point ≤ in resident, active and
    GPUs" is "another point ≤ in all four coordinates"."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 200))
        cols = [rng.integers(0, int(rng.integers(1, 6)), size=n).astype(float) for _ in range(3)]
        lat = rng.integers(0, int(rng.integers(1, 30)), size=n).astype(float)
        pers, act, gpus = cols[0], cols[1], cols[2].astype(np.int64)
        order = np.lexsort((gpus, act, pers, lat))
        pers, act, gpus, lat = pers[order], act[order], gpus[order], lat[order]
        fresh = frontier_module._starts(lat, pers, act, gpus)  # distinct points only
        pers, act, gpus, lat = pers[fresh], act[fresh], gpus[fresh], lat[fresh]
        le = (pers[:, None] <= pers) & (act[:, None] <= act) & (gpus[:, None] <= gpus) & (lat[:, None] <= lat)
        np.fill_diagonal(le, False)
        assert np.array_equal(frontier_module._pairwise(pers, act, gpus, lat), le.any(axis=0))
