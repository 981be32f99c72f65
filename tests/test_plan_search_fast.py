"""The search's fast paths decide what the slow ones decide (issue 21): the frontier's sorted
pairwise test against its bitset and grid paths, the stage solver's latency-only answer against
its full one, and the exact program over stages against enumerating every assignment."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from nereus.errors import InfeasibleError
from nereus.plan import frontier as frontier_module
from nereus.plan.cache import PlanCache
from nereus.plan.candidates import CandidateTable
from nereus.plan.frontier import frontier
from nereus.plan.problem import SeqStats
from nereus.plan.program import SolverMemo, StageSolver, solve_coupled
from nereus.plan.search import SOLVERS, search
from tests.helpers import make_problem
from tests.test_plan_speed import _brute_frontier, _random_table, _reference_solve

pytestmark = pytest.mark.pure
INF = math.inf


def _numpy_brute_frontier(table: CandidateTable, limit: float) -> list[int]:
    """``_brute_frontier`` by one all-pairs comparison (for tables too large for the loops)."""
    rows = np.flatnonzero(table.active <= limit)
    cols = [table.persistent[rows], table.active[rows], table.gpus[rows], table.latency[rows]]
    same = np.ones((len(rows), len(rows)), dtype=bool)
    le = np.ones_like(same)
    for c in cols:
        le &= c[:, None] <= c[None, :]
        same &= c[:, None] == c[None, :]
    earlier_twin = np.triu(same, 1).any(axis=0)  # identical to an earlier row: not the first
    dominated = (le & ~same).any(axis=0)
    kept = rows[~earlier_twin & ~dominated]
    return sorted(
        kept.tolist(),
        key=lambda i: (table.latency[i], table.persistent[i], table.active[i], table.gpus[i], i),
    )


@pytest.mark.parametrize("pairwise_upto", [1, 7, 40, 160])
def test_the_block_sweep_on_large_tables_equals_the_brute_force(
    monkeypatch: pytest.MonkeyPatch, pairwise_upto: int
) -> None:
    """Many blocks, with survivors decided pairwise and by bitsets, ties in every coordinate."""
    monkeypatch.setattr(frontier_module, "PAIRWISE_UPTO", pairwise_upto)
    monkeypatch.setattr(frontier_module, "BLOCK_UPTO", max(pairwise_upto, 64))
    monkeypatch.setattr(frontier_module, "SURVIVORS_PAIRWISE_UPTO", pairwise_upto)
    rng = np.random.default_rng(pairwise_upto)
    for _ in range(25):
        table = _random_table(rng, int(rng.integers(100, 700)))
        table = dataclasses.replace(table, latency=table.latency * rng.integers(1, 40, len(table)))
        limit = float(rng.integers(2, 8))
        assert frontier(table, limit).layout_index.tolist() == _numpy_brute_frontier(table, limit)


def test_the_numpy_brute_force_is_the_loop_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(60):
        table = _random_table(rng, int(rng.integers(1, 60)))
        limit = float(rng.integers(0, 8))
        assert _numpy_brute_frontier(table, limit) == _brute_frontier(table, limit)


def _tables(rng: np.random.Generator, count: int, rows: int, shuffle: bool) -> list[CandidateTable]:
    out = []
    for _ in range(count):
        t = _random_table(rng, int(rng.integers(1, rows + 1)))
        out.append(t if shuffle else t.take(np.argsort(t.latency, kind="stable")))
    return out


def test_latency_alone_equals_the_full_answer() -> None:
    """``latency`` (no picks, asked first or after ``solve``) is ``solve``'s latency, and both are
    the enumeration's; a single table need not come sorted."""
    rng = np.random.default_rng(11)
    for case in range(80):
        tables = _tables(rng, int(rng.integers(1, 4)), 7, shuffle=case % 2 == 0)
        if len(tables) > 1:
            tables = [t.take(np.argsort(t.latency, kind="stable")) for t in tables]
        first, second = StageSolver(tables), StageSolver(tables)
        for x in first.resident_levels():
            for y in (0.0, 1.0, 3.0, 6.0):
                for budget in (1, 3, 8):
                    fast = first.latency(x, y, budget)  # before any full solve
                    choice = second.solve(x, y, budget)
                    want = _reference_solve(tables, x, y, budget)
                    assert fast == second.latency(x, y, budget) == (INF if want is None else want)
                    assert (choice is None) == (want is None)
                    if choice is not None:
                        assert choice.latency == fast
                        assert all(
                            t.persistent[i] <= x and t.active[i] <= y and t.latency[i] <= fast
                            for t, i in zip(tables, choice.picks, strict=True)
                        )
                        assert (
                            sum(int(t.gpus[i]) for t, i in zip(tables, choice.picks, strict=True)) <= budget
                        )


def _brute_coupled(stages: list[list[CandidateTable]], budget: int, limit: float) -> float:
    """min Σ_s max latency over every pick of one row per table, with each stage's GPUs within the
    budget and each row's active memory plus the other stages' largest resident within the limit."""
    best = INF
    per_stage = [list(itertools.product(*[range(len(t)) for t in tables])) for tables in stages]
    for picks in itertools.product(*per_stage):
        resident = [
            max(t.persistent[i] for t, i in zip(ts, p, strict=True))
            for ts, p in zip(stages, picks, strict=True)
        ]
        total, ok = 0.0, True
        for s, (tables, pick) in enumerate(zip(stages, picks, strict=True)):
            others = sum(resident) - resident[s]
            gpus = sum(int(t.gpus[i]) for t, i in zip(tables, pick, strict=True))
            if gpus > budget or any(t.active[i] + others > limit for t, i in zip(tables, pick, strict=True)):
                ok = False
                break
            total += max(float(t.latency[i]) for t, i in zip(tables, pick, strict=True))
        if ok:
            best = min(best, total)
    return best


def test_the_exact_program_equals_enumeration() -> None:
    rng = np.random.default_rng(5)
    for _ in range(60):
        stages = [
            _tables(rng, int(rng.integers(1, 3)), 5, shuffle=False) for _ in range(int(rng.integers(1, 4)))
        ]
        budget, limit = int(rng.integers(2, 10)), float(rng.integers(4, 14))
        got = solve_coupled([StageSolver(ts) for ts in stages], budget, limit)
        want = _brute_coupled(stages, budget, limit)
        assert (got is None) == (want == INF)
        if got is None:
            continue
        assert got.latency == pytest.approx(want, rel=1e-12, abs=1e-12)
        resident = sum(got.caps)
        for tables, cap, choice in zip(stages, got.caps, got.stages, strict=True):
            rows = list(zip(tables, choice.picks, strict=True))
            assert all(t.persistent[i] <= cap and t.active[i] + resident - cap <= limit for t, i in rows)
            assert sum(int(t.gpus[i]) for t, i in rows) <= budget


def test_a_kept_stage_solver_answers_as_a_fresh_one() -> None:
    """``SolverMemo`` hands back the solver of the same tables (by identity), whose memo then
    holds answers to other budgets and caps: every answer equals a fresh solver's."""
    rng = np.random.default_rng(17)
    memo = SolverMemo(keep=3)
    sets = [_tables(rng, int(rng.integers(1, 4)), 7, shuffle=False) for _ in range(5)]
    for _ in range(4):
        for tables in sets:
            kept = memo.solver(tables)
            assert len(memo) <= 3
            fresh = StageSolver(tables)
            for x in fresh.resident_levels():
                for y in (1.0, 4.0):
                    budget = int(rng.integers(1, 9))
                    assert kept.latency(x, y, budget) == fresh.latency(x, y, budget)
                    assert kept.solve(x, y, budget) == fresh.solve(x, y, budget)
        newest = memo.solver(sets[-1])
        assert memo.solver(sets[-1]) is newest  # kept
        assert memo.solver([t.take(np.arange(len(t))) for t in sets[-1]]) is not newest  # other tables


def test_held_layout_searches_through_one_cache_equal_cold_searches() -> None:
    """The controller's replan: a target and its held-layout options under one set of prices share
    stage solvers; each equals its cold search."""
    problem = make_problem(gpus=32)
    cache = PlanCache()
    target = search(problem, cache)
    current = {e.model_stage: e.shape.layout for e in target.estimates}
    wf = problem.workflow
    holds = [dict(current)] + [
        {n: lay for n, lay in current.items() if wf.get(n).stage is not stage} for stage in wf.stages
    ]
    feasible = 0
    for seq in (problem.seq, SeqStats(256, 2048 * 1.3, 2048 * 1.3)):
        for hold in holds:
            q = dataclasses.replace(problem, seq=seq, space=problem.space.holding(hold))
            outcomes = []
            for c in (cache, None):
                try:
                    found = search(q, c)
                    outcomes.append((found.plan.candidates, found.step_latency_s))
                except InfeasibleError as exc:  # a held layout may not fit the longer responses
                    outcomes.append(str(exc))
            assert outcomes[0] == outcomes[1]
            feasible += not isinstance(outcomes[0], str)
    solvers = next(iter(cache._priced.values())).programs[SOLVERS]
    assert feasible >= len(holds)
    assert len(solvers) < len(holds) * len(wf.stages)  # some were shared
