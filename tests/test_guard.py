"""The memory guard (the headroom the running plan is held to) and the length forecast."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.control.guard import TOLERATED_SHARE, MemoryGuard
from nereus.control.lengths import LengthForecast
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.problem import SeqStats
from nereus.plan.search import search
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def test_a_plan_kept_past_the_headroom_keeps_its_share_then_the_memory_itself() -> None:
    problem = make_problem(gpus=8)
    plan, other = search(problem).plan, search(make_problem(gpus=16)).plan
    guard = MemoryGuard(0.1)
    assert guard.held(plan) == 0.1 and not guard.tolerates(plan)
    guard.kept_past(plan, urgent=False)  # a margin replan kept it
    assert guard.tolerates(plan) and guard.held(plan) == pytest.approx(0.1 * TOLERATED_SHARE)
    assert guard.held(other) == 0.1  # any other plan is held to the job's headroom
    guard.kept_past(plan, urgent=False)  # kept again, not urgently: still the share
    assert guard.held(plan) == pytest.approx(0.05)
    guard.kept_past(plan, urgent=True)  # kept again urgently past the share: nothing else fits
    assert guard.held(plan) == 0.0
    guard.kept_past(other, urgent=True)  # a plan tolerated for the first time gets the share
    assert guard.held(other) == pytest.approx(0.05) and not guard.tolerates(plan)


def test_a_restart_without_the_headroom_is_tolerated_and_one_with_it_is_not() -> None:
    plan = search(make_problem(gpus=8)).plan
    guard = MemoryGuard(0.1)
    guard.restarted(plan, 0.0)
    assert guard.tolerates(plan) and guard.held(plan) == 0.0
    guard.restarted(plan, None)
    assert not guard.tolerates(plan) and guard.held(plan) == 0.1
    with pytest.raises(ValueError, match="headroom"):
        MemoryGuard(1.0)


def test_the_running_plan_is_classed_by_the_headroom_it_is_held_to() -> None:
    """Within the headroom: its latency; past it inside the memory: its latency, marked; over the
    memory: None. Found by growing the lengths under one searched plan."""
    problem = make_problem(gpus=8, response=256)
    plan = search(problem).plan
    # the headroom just past what the plan needs at the shortest lengths: longer ones cross it
    peak = max(price(problem, shapes_of(plan)).bound.values()) + problem.reserved_bytes
    headroom = 1.0 - 1.01 * peak / problem.cluster.gpu_memory_bytes
    guard = MemoryGuard(headroom)
    seen = set()
    for k in range(40):
        length = 256 * 1.25**k
        seq = SeqStats(problem.seq.prompt_len, length, length)
        at = dataclasses.replace(problem, seq=seq, headroom=headroom)
        latency, margin = guard.running(plan, at)
        cost = price(at, shapes_of(plan))
        fits = not cost.over_capacity(at)
        inside = not cost.over_capacity(dataclasses.replace(at, headroom=0.0))
        assert (latency is not None) == inside and margin == (inside and not fits)
        assert latency is None or latency == cost.step_latency_s
        seen.add("fits" if fits else "margin" if inside else "over")
    assert seen == {"fits", "margin", "over"}, seen


def test_the_length_forecast_grows_by_an_ema_within_the_cap() -> None:
    f = LengthForecast(prompt_len=256, max_response_len=4096)
    assert f.ahead(1000, 1200) == SeqStats(256, 1000, 1200)  # no growth seen yet
    f.observe(1000)
    assert f.growth == 1.0 and f.grown(2000) == pytest.approx(1.5)
    f.observe(2000)
    assert f.growth == pytest.approx(1.5) and f.last == 2000
    assert f.ahead(2000, 2400) == SeqStats(256, 3000, 3600)
    assert f.ahead(2000, 2400, steps=0.0) == SeqStats(256, 2000, 2400)
    assert f.ahead(3000, 3100) == SeqStats(256, 4096, 4096)  # capped, the p95 never under the mean
    f.observe(0.0)
    assert f.grown(500) == f.growth  # no ratio from a zero mean
