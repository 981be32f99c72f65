"""What a step boundary costs, and what it is counted as (issue 21: monitoring under 2% of a step).

- The controller keeps its last memory check ahead (the running plan at the next step's lengths)
  and answers a repeat from it: its decisions are those of a controller that prices every step,
  on random length drifts with memory peaks (which change the calibration) and out-of-memory
  errors in between.
- ``e2e_local.py``'s accounting: a transition's own planning (``plan_s``) is counted with the
  transitions, not as monitoring, and is reported beside the monitoring share.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from nereus.control.admission import Verdict
from nereus.control.controller import Controller
from nereus.control.telemetry import Telemetry
from nereus.plan import evaluate
from nereus.plan.layout import Plan
from nereus.plan.problem import SeqStats
from nereus.plan.search import search
from nereus.runtime.metrics import StepRecord
from tests.helpers import benchmark_module, make_problem, random_plan

pytestmark = pytest.mark.pure

# the controller's modules that price the running plan at a boundary
PRICING = ("nereus.control.ahead", "nereus.control.guard", "nereus.control.memory_fit")


class Fresh(Controller):
    """A controller that prices the running plan ahead at every step (no kept answer)."""

    def _over_capacity_ahead(self, seq: SeqStats, headroom: float | None = None) -> bool:
        held = self.plan_headroom if headroom is None else headroom
        ahead = replace(self.problem(self.plan.pool, seq), headroom=held)
        return bool(evaluate.price(ahead, evaluate.shapes_of(self.plan)).over_capacity(ahead))


def _follow(ctl: Controller, t: Telemetry) -> dict[str, Any] | None:
    """One boundary: the decision, and the runtime's answer to it."""
    d = ctl.observe(t)
    if d is None:
        return None
    if d.verdict is Verdict.ADMIT:
        ctl.transition_done(1.0)
    elif d.verdict is Verdict.RESTART and d.target is not None:
        ctl.restarted(d.target)
    return d.to_json()


@pytest.mark.parametrize(("seed", "prepared"), [(0, False), (1, False), (0, True), (1, True)])
def test_a_kept_memory_check_decides_as_pricing_every_step(
    seed: int, prepared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepared``: as the runtime's leader does, the plan is priced ahead while the reports
    arrive (``Controller.prepare``), so that a boundary without a calibration change prices
    nothing itself."""
    problem = make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=16, response=2048)
    plan: Plan = search(problem).plan
    kept = Controller(problem.workload, problem.models, problem.cluster, plan)
    fresh = Fresh(problem.workload, problem.models, problem.cluster, plan)
    priced = {"n": 0}
    real = evaluate.price

    def counting(*args: Any, **kwargs: Any) -> Any:
        priced["n"] += 1
        return real(*args, **kwargs)

    kinds: set[str] = set()
    rng = random.Random(seed)
    length, steps = 2048.0, 40
    for step in range(steps):
        if rng.random() < 0.3:  # the lengths drift (a run of equal lengths repeats the question)
            length = max(64.0, length * rng.choice((0.5, 0.8, 1.25, 2.0, 4.0)))
        kind = rng.random()
        peaks = {"actor.train": rng.uniform(1e9, 6e10)} if kind < 0.1 else {}
        oom = 0.1 <= kind < 0.15
        t = Telemetry(
            step, 10.0 * step, length, length * 1.2, plan.pool, peak_memory=peaks, oom=oom,
            oom_stage="actor.train" if oom else "",
        )  # fmt: skip
        if prepared:
            kept.prepare(t.seq_len_mean, t.seq_len_p95)
        for module in PRICING:
            monkeypatch.setattr(f"{module}.price", counting)
        before = priced["n"]
        got = _follow(kept, t)
        for module in PRICING:
            monkeypatch.setattr(f"{module}.price", real)
        assert got == _follow(fresh, t), f"step {step}"
        kinds |= {str(f).split(":")[0] for f in (got or {}).get("triggers", [])}
        if got is None and not peaks and not oom and step and priced["n"] == before:
            priced["hits"] = priced.get("hits", 0) + 1
        assert kept.plan == fresh.plan and kept.state == fresh.state
    assert priced.get("hits", 0) >= (10 if prepared else 5), "the kept answer was never used"
    assert "memory" in kinds, "no step was predicted over capacity: the check was never tested"


@pytest.mark.parametrize(
    ("model", "cluster", "gpus", "algo"),
    [("llama-3.1-8b", "h200-ib", 16, "ppo"), ("llama-3.1-8b", "a100-64gb-hdr100", 32, "grpo"),
     ("tiny-llama", "local-cpu", 4, "ppo-tiny")],
)  # fmt: skip
def test_a_plans_memory_grows_with_the_lengths(model: str, cluster: str, gpus: int, algo: str) -> None:
    """The premise of the kept memory checks: under one calibration, a plan's per-GPU bound is
    non-decreasing in the mean and the p95 response length, for searched and random plans."""
    rng = random.Random(7)
    problem = make_problem(model=model, cluster=cluster, gpus=gpus, response=1024, algo=algo)
    plans = [search(problem).plan, *(random_plan(rng, problem) for _ in range(6))]
    for plan in plans:
        shapes = evaluate.shapes_of(plan)
        for _ in range(8):
            mean = rng.uniform(1.0, 8192.0)
            a = SeqStats(problem.seq.prompt_len, mean, mean * rng.uniform(1.0, 2.0))
            grow = rng.uniform(1.0, 3.0)
            b = SeqStats(a.prompt_len, a.response_len * grow, max(a.response_p95, a.response_len * grow))
            b = SeqStats(b.prompt_len, b.response_len, b.response_p95 * rng.uniform(1.0, 1.5))
            lo = evaluate.price(replace(problem, seq=a), shapes).bound
            hi = evaluate.price(replace(problem, seq=b), shapes).bound
            assert all(lo[n] <= hi[n] for n in lo), (plan, a, b)


def _row(step: int, monitor_s: float, plan_s: float, moved: float | None) -> dict[str, Any]:
    moves = [] if moved is None else [{"kind": "restart", "seconds": moved}]
    return {
        "step": step, "step_time_s": 1.0, "checkpoint_s": 0.0, "monitor_s": monitor_s, "plan_s": plan_s,
        "weight_sync_s": 0.0, "seq_len_mean": 2.0, "gpus": 4, "reward": 0.0, "accuracy": 0.0,
        "decision": {"verdict": "restart"} if moved is not None else None, "transitions": moves, "plan": {},
    }  # fmt: skip


def test_a_transitions_own_planning_is_counted_with_the_transitions() -> None:
    bench = benchmark_module("e2e_local")
    rows = [_row(0, 0.01, 0.0, None), _row(1, 0.01, 0.5, 2.0), _row(2, 0.01, 0.0, None)]
    s = bench.summarise("nereus", rows, 10.0, 1)
    assert s["seconds"]["transitions"] == pytest.approx(2.5)  # the restart and its planning
    assert s["transition_planning_s"] == pytest.approx(0.5)
    assert s["seconds"]["monitoring"] == pytest.approx(0.03)
    assert s["accounted_s"] == pytest.approx(3.0 + 2.5 + 0.03)
    assert s["monitor_share_mean"] == pytest.approx(0.01)
    assert s["monitor_share_mean_with_planning"] == pytest.approx((0.03 + 0.5) / 3)
    assert s["per_step"][1]["plan_s"] == 0.5
    assert "transition's own planning" in bench.ACCOUNTING


def test_a_record_carries_its_overheads_apart() -> None:
    plan = search(make_problem(gpus=8, response=512)).plan
    m = {"reward": 0.0, "accuracy": 0.0, "kl": 0.0, "actor_loss": 0.0}
    record = StepRecord.of(3, m, 1.0, 2.0, plan, 0.1, {})
    r = record.with_overheads(0.004, 0.2, 0.05)
    assert (r.monitor_s, r.checkpoint_s, r.plan_s) == (0.004, 0.2, 0.05)
    assert record.with_overheads(0.004, 0.2).plan_s == 0.0  # a boundary that keeps its plan


def test_decisions_deferred_beside_a_step_are_counted_apart() -> None:
    """A replan run beside the next step: its seconds (``monitor_parts["deferred"]``, in the row
    of the boundary that took it) are reported apart, not as monitoring; a move it admitted, made
    one boundary later, is counted."""
    bench = benchmark_module("e2e_local")
    rows = [_row(0, 0.01, 0.0, None), _row(1, 0.01, 0.0, None), _row(2, 0.01, 0.2, None)]
    rows[1]["monitor_parts"] = {"deferred": 0.03}  # a keep, taken at the boundary after step 1
    rows[2]["monitor_parts"] = {"deferred": 0.05}  # a move, made at the boundary after step 2
    rows[2]["decision"] = {"verdict": "admit", "deferred": 1}
    rows[2]["transitions"] = [{"kind": "extend", "seconds": 1.0}]
    s = bench.summarise("nereus", rows, 10.0, 1)
    assert s["deferred_decisions"] == 2 and s["deferred_moves"] == 1
    assert s["deferred_s"] == pytest.approx(0.08)
    assert s["seconds"]["monitoring"] == pytest.approx(0.03)
    assert s["seconds"]["transitions"] == pytest.approx(1.2)
