"""What makes a replan fast stays exact (issue 21): the one-pass frontier, the stage solver's
shortcuts, estimates read from the pricing's own terms, twin model-stages priced once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nereus.plan import frontier as frontier_module
from nereus.plan.cache import PlanCache
from nereus.plan.candidates import CandidateTable, Estimate, candidate_table, estimate
from nereus.plan.cost import CostModel
from nereus.plan.frontier import frontier
from nereus.plan.problem import PlanningProblem, SearchSpace
from nereus.plan.search import StageSolver
from nereus.spec.workload import Recompute
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

COLUMNS = ("layout_index", "dp", "micro_batch", "recompute_index", "gpus", "latency", "persistent", "active")


def _random_table(rng: np.random.Generator, n: int) -> CandidateTable:
    zero = np.zeros(n, dtype=np.int64)
    small = [int(rng.integers(1, 7)) for _ in range(4)]
    return CandidateTable(
        None,  # type: ignore[arg-type]
        (),
        (),
        np.arange(n, dtype=np.int64),
        zero,
        zero,
        zero,
        rng.integers(1, small[0] + 1, n).astype(np.int64),
        rng.integers(0, small[1] + 2, n).astype(np.float64),
        rng.integers(0, small[2], n).astype(np.float64),
        rng.integers(0, small[3] + 1, n).astype(np.float64),
    )


def _brute_frontier(table: CandidateTable, limit: float) -> list[int]:
    """Rows of the feasible, distinct (first of identical), non-dominated points, in the frontier's
    order: latency, then resident, active, GPUs."""
    rows = [i for i in range(len(table)) if table.active[i] <= limit]
    pts = {i: (table.persistent[i], table.active[i], table.gpus[i], table.latency[i]) for i in rows}
    first: dict[tuple[float, ...], int] = {}
    for i in rows:
        first.setdefault(pts[i], i)
    kept = [
        i
        for p, i in first.items()
        if not any(q != p and all(a <= b for a, b in zip(q, p, strict=True)) for q in first)
    ]
    return sorted(kept, key=lambda i: (pts[i][3], *pts[i][:3]))


@pytest.mark.parametrize("pairwise_upto", [1, 4, 16, 160])
def test_frontier_equals_the_brute_force_on_every_path(
    monkeypatch: pytest.MonkeyPatch, pairwise_upto: int
) -> None:
    monkeypatch.setattr(frontier_module, "PAIRWISE_UPTO", pairwise_upto)
    rng = np.random.default_rng(pairwise_upto)
    for _ in range(150):
        table = _random_table(rng, int(rng.integers(1, 90)))
        limit = float(rng.integers(0, 8))
        front = frontier(table, limit)
        assert front.layout_index.tolist() == _brute_frontier(table, limit)


def _equal_estimates(a: Estimate, b: Estimate) -> bool:
    if (a.model_stage, a.shape) != (
        b.model_stage,
        b.shape,
    ) or a.latency.parts.keys() != b.latency.parts.keys():
        return False
    for name, part in a.latency.parts.items():
        other = b.latency.parts[name].by_class
        if part.by_class.keys() != other.keys() or any(
            float(t) != float(other[op]) for op, t in part.by_class.items()
        ):
            return False
    fields = ("params", "optimizer", "grads", "activations", "kv_cache")
    same_memory = all(float(getattr(a.memory, f)) == float(getattr(b.memory, f)) for f in fields)
    return same_memory and a.memory.correction == b.memory.correction


def _spaces(problem: PlanningProblem) -> list[SearchSpace]:
    names = tuple(m.name for m in problem.workflow.model_stages)
    wide = SearchSpace(
        recompute=tuple(Recompute), shrink_micro_batch=True, overlap_dp_sync=names, paged_kv=names
    )
    return [SearchSpace(), wide]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_estimates_from_the_pricing_terms_equal_a_fresh_estimate(algo: str) -> None:
    base = make_problem(gpus=16, algo=algo)
    for space in _spaces(base):
        problem = dataclasses.replace(base, space=space)
        cost = CostModel(problem)
        for ms in problem.workflow.model_stages:
            table = candidate_table(cost, ms)
            front = frontier(table, problem.capacity_bytes - problem.reserved_bytes)
            for t in (table, front):
                for i in range(0, len(t), max(1, len(t) // 25)):
                    kept = t.estimate(t.shape(i))
                    assert kept is not None and _equal_estimates(kept, estimate(cost, ms, t.shape(i)))


def test_twin_model_stages_price_like_a_fresh_table() -> None:
    """PPO's actor.inf and ref.inf (critic.inf and reward.inf) differ only in the weight sync:
    the cache prices one and derives the other, bit for bit what pricing it alone gives."""
    base = make_problem(gpus=32)
    for space in _spaces(base):
        problem = dataclasses.replace(base, space=space)
        cache = PlanCache()
        priced = cache.priced(cache.price_key(problem))
        cost = CostModel(problem)

        def model(cost: CostModel = cost) -> CostModel:
            return cost

        for ms in problem.workflow.model_stages:
            cached = cache.table(problem, priced, model, ms, None)
            fresh = candidate_table(cost, ms)
            for column in COLUMNS:
                assert np.array_equal(getattr(cached, column), getattr(fresh, column)), (ms.name, column)
        assert cache.stats.hits.get("twin", 0) == 2


def _reference_solve(tables: list[CandidateTable], x: float, y: float, budget: int) -> float | None:
    """The stage's min-max latency by enumeration over every admissible combination."""
    best: float | None = None

    def walk(k: int, gpus: int, worst: float) -> None:
        nonlocal best
        if k == len(tables):
            best = worst if best is None else min(best, worst)
            return
        t = tables[k]
        for i in range(len(t)):
            ok = t.persistent[i] <= x and t.active[i] <= y and gpus + t.gpus[i] <= budget
            if ok:
                walk(k + 1, gpus + int(t.gpus[i]), max(worst, float(t.latency[i])))

    walk(0, 0, 0.0)
    return best


def test_stage_solver_and_its_batched_bounds_match_enumeration() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        tables = []
        for _ in range(int(rng.integers(1, 4))):
            t = _random_table(rng, int(rng.integers(1, 7)))
            tables.append(t.take(np.argsort(t.latency, kind="stable")))
        solver = StageSolver(tables)
        xs = solver.resident_levels()
        for y in (0.0, 2.0, 5.0):
            for budget in (1, 4, 9):
                bounds = solver.bounds(xs, y, budget)
                for x, b in zip(xs, bounds, strict=True):
                    choice = solver.solve(x, y, budget)
                    want = _reference_solve(tables, x, y, budget)
                    assert (choice is None) == (want is None) == (b == float("inf"))
                    if choice is not None:
                        assert choice.latency == want == b
                        picked = [t.gpus[i] for t, i in zip(tables, choice.picks, strict=True)]
                        assert sum(picked) <= budget
