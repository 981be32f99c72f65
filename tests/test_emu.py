"""EMUs and logical state: data position, RNG derivation, valid collections."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nereus.plan.layout import Layout
from nereus.plan.search import search
from nereus.spec.workload import Stage
from nereus.state.emu import Emu, Holding, LogicalState, rng_seed, sample_range, units_of, validate
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


@given(st.lists(st.integers(0, 6), min_size=1, max_size=8))
def test_samples_are_never_repeated_or_skipped_when_dp_changes(dps: list[int]) -> None:
    """Whatever dp each minibatch runs at, the replicas together consume the global order exactly."""
    batch = 64
    seen: list[int] = []
    for p, k in enumerate(dps):
        dp = min(2**k, batch)
        for r in range(dp):
            seen += list(sample_range(batch, dp, r, p))
    assert sorted(seen) == list(range(batch * len(dps)))


def test_rng_seed_is_stable_and_distinct() -> None:
    a = rng_seed(7, "actor.gen", 0, 3)
    assert a == rng_seed(7, "actor.gen", 0, 3)
    others = {rng_seed(7, "actor.gen", r, p) for r in range(8) for p in range(8)}
    assert len(others) == 64 and a in others
    assert rng_seed(8, "actor.gen", 0, 3) != a


def test_a_searched_plan_is_a_valid_collection() -> None:
    problem = make_problem(gpus=16)
    plan = search(problem).plan
    units = units_of(plan, {"actor.train": LogicalState(updates=5, version=5, minibatch=20, seed=1)})
    stage_of = {m.name: m.stage for m in problem.workflow.model_stages}
    assert validate(units, stage_of) == []
    assert sum(1 for u in units if u.model_stage == "actor.train") == plan.candidate("actor.train").dp


def test_invalid_collections_are_reported() -> None:
    stage_of = {"actor.train": Stage.TRAIN, "critic.train": Stage.TRAIN, "actor.gen": Stage.GEN}
    s = LogicalState(updates=1, version=1, minibatch=4)
    a = Emu("actor.train", Layout(2, 1), (0, 1), s)
    b = Emu("critic.train", Layout(1, 1), (1,), s)  # concurrent with a, shares GPU 1
    c = Emu("actor.train", Layout(1, 1), (2,), s)  # replica with another layout
    d = Emu("actor.train", Layout(2, 1), (4, 5), LogicalState(updates=2, version=2, minibatch=8))
    gen = Emu("actor.gen", Layout(2, 1), (0, 1))  # serialized stage: may share GPUs
    problems = validate([a, b, c, d, gen], stage_of)
    text = "\n".join(problems)
    assert "share GPUs [1]" in text
    assert "layouts" in text
    assert "logical state" in text
    assert not any("actor.gen" in p for p in problems)


def test_holdings_check_every_rank() -> None:
    stage_of = {"actor.train": Stage.TRAIN}
    s = LogicalState(updates=1)
    u = Emu("actor.train", Layout(2, 1), (0, 1), s)
    numel = {("actor.train", Layout(2, 1), 0, 0): 10, ("actor.train", Layout(2, 1), 1, 0): 10}
    good = [
        Holding(0, "actor.train", Layout(2, 1), 0, 0, 10, s),
        Holding(1, "actor.train", Layout(2, 1), 1, 0, 10, s),
    ]
    assert validate([u], stage_of, holdings=good, numel=numel) == []
    bad = [Holding(0, "actor.train", Layout(2, 1), 1, 0, 10, s)]  # wrong rank; GPU 1 missing
    problems = validate([u], stage_of, holdings=bad, numel=numel)
    assert any("GPU 1 holds no shard" in p for p in problems)
    assert any("GPU 0 holds rank" in p for p in problems)
    short = [
        Holding(0, "actor.train", Layout(2, 1), 0, 0, 9, s),
        Holding(1, "actor.train", Layout(2, 1), 1, 0, 10, s),
    ]
    assert any("9 elements" in p for p in validate([u], stage_of, holdings=short, numel=numel))
