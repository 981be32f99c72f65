"""The planner cache (issue 21): a cached search is a cold search, whatever came before it."""

from __future__ import annotations

import dataclasses
import random
from functools import partial
from types import MappingProxyType

import pytest

from nereus.control.controller import Controller
from nereus.errors import InfeasibleError
from nereus.plan.cache import PlanCache
from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.spec.workload import ExecutionMode, Stage
from tests.helpers import assert_same_search, make_problem, search_outcome

pytestmark = pytest.mark.pure


def _drift(rng: random.Random, p: PlanningProblem, base: PlanningProblem) -> PlanningProblem:
    """One random change of what a replan sees: lengths, pool, calibration, space or anchor."""
    what = rng.choice(["length", "pool", "calibration", "memory", "space", "hold", "anchor", "same"])
    if what == "length":
        response = rng.choice([256, 1024, 2048, 3000, 4096, 8192])
        p95 = response * rng.choice([1.0, 1.2, 1.5])
        return dataclasses.replace(p, seq=SeqStats(p.seq.prompt_len, response, p95))
    if what == "pool":
        total = base.cluster.total_gpus
        size = rng.choice([4, 6, 8, 12, 16, 24, 31, 32])
        return dataclasses.replace(p, pool=tuple(sorted(rng.sample(range(total), min(size, total)))))
    if what == "calibration":
        eta = {op: min(1.0, PRIOR_EFFICIENCY[op] * rng.uniform(0.5, 2.0)) for op in OpClass}
        return dataclasses.replace(p, efficiencies=Efficiencies(MappingProxyType(eta)))
    if what == "memory":
        corr = {s: rng.choice([0.8, 1.0, 1.3, 2.0]) for s in Stage}
        eff = Efficiencies(p.efficiencies.eta, MappingProxyType(corr))
        return dataclasses.replace(p, efficiencies=eff)
    if what == "space":
        return dataclasses.replace(p, space=rng.choice([SearchSpace(), SearchSpace.urgent()]))
    if what == "hold":
        names = [m.name for m in p.workflow.model_stages]
        held = {n: Layout(rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])) for n in rng.sample(names, 2)}
        return dataclasses.replace(p, space=p.space.holding(held))
    if what == "anchor":
        try:
            return dataclasses.replace(p, anchor=search(p).plan)
        except InfeasibleError:
            return p
    return p


@pytest.mark.parametrize(
    ("seed", "mode", "cluster"),
    [
        (0, ExecutionMode.SYNC, "a100-64gb-hdr100"),
        (1, ExecutionMode.ASYNC, "a100-64gb-hdr100"),
        (2, ExecutionMode.SYNC, "mi250x-slingshot"),
    ],
)
def test_cached_search_equals_cold_search_on_random_drifts(
    seed: int, mode: ExecutionMode, cluster: str
) -> None:
    rng = random.Random(seed)
    base = make_problem("llama-3.1-8b", cluster, 32, 2048, mode=mode)
    cache = PlanCache(keep=3, results=16)
    p = base
    for _ in range(40):
        p = _drift(rng, p, base)
        assert_same_search(search_outcome(p, cache), search_outcome(p, None))
    assert sum(cache.stats.hits.values()) > 0  # the drifts did reuse something
    assert cache.stats.hits.get("frontier", 0) > 0


def test_a_smaller_pool_reuses_the_tables_of_a_larger_one() -> None:
    p32 = make_problem(gpus=32)
    cache = PlanCache()
    search(p32, cache)
    before = dict(cache.stats.misses)
    for gpus in (24, 16, 8):
        p = dataclasses.replace(p32, pool=tuple(range(gpus)))
        assert_same_search(search_outcome(p, cache), search_outcome(p, None))
    assert cache.stats.misses.get("table", 0) == before.get("table", 0)  # nothing re-priced
    assert cache.stats.misses.get("frontier", 0) == before.get("frontier", 0)


def test_a_calibration_update_invalidates_prices() -> None:
    p = make_problem(gpus=16)
    cache = PlanCache()
    first = search(p, cache)
    slow_gemm = {**p.efficiencies.eta, OpClass.GEMM: p.efficiencies[OpClass.GEMM] / 4}
    q = dataclasses.replace(p, efficiencies=Efficiencies(MappingProxyType(slow_gemm)))
    misses = cache.stats.misses.get("table", 0)
    second = search(q, cache)
    assert cache.stats.misses.get("table", 0) > misses  # re-priced, not served from the old key
    assert second.step_latency_s > first.step_latency_s
    assert_same_search(second, search(q))
    # an equal snapshot (a new object with the same values) is the same key
    same = dataclasses.replace(p, efficiencies=Efficiencies(MappingProxyType(dict(p.efficiencies.eta))))
    hits = cache.stats.hits.get("result", 0)
    assert_same_search(search(same, cache), first)
    assert cache.stats.hits.get("result", 0) == hits + 1


def test_another_job_clears_the_cache() -> None:
    cache = PlanCache()
    search(make_problem(gpus=16), cache)
    other = make_problem("tiny-llama", "local-cpu", 4, 64, prompt=32)
    assert_same_search(search_outcome(other, cache), search_outcome(other, None))
    assert len(cache._priced) == 1


def test_infeasible_searches_are_remembered_as_infeasible() -> None:
    p = make_problem("llama-3.3-70b", gpus=1)
    cache = PlanCache()
    for _ in range(2):
        with pytest.raises(InfeasibleError):
            search(p, cache)
    assert cache.stats.hits.get("result", 0) == 1


def test_the_controller_passes_its_cache_to_the_planner() -> None:
    p = make_problem(gpus=16)
    plan = search(p).plan
    controller = Controller(p.workload, p.models, p.cluster, plan)
    options = controller._options(controller.problem(p.pool, p.seq))
    assert options and controller.plan_cache.stats.hits.get("table", 0) > 0  # held layouts reuse prices
    cold = Controller(p.workload, p.models, p.cluster, plan, planner=partial(search, cache=None))
    assert [o.plan for o in cold._options(cold.problem(p.pool, p.seq))] == [o.plan for o in options]
