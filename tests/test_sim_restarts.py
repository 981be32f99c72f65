"""A restart counts when it runs: the summary's ``restarts`` are the step records' restarts, and a
replan with nowhere to go keeps a plan that still holds its GPUs instead of asking for one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from nereus.control.action import RecordKind
from nereus.control.admission import Decision, Verdict
from nereus.control.controller import Controller
from nereus.control.telemetry import Telemetry
from nereus.control.triggers import Trigger, TriggerKind
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.problem import DEFAULT_HEADROOM, PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.sim import GpuSupply, Scenario, SeqCurve, SpotTrace, simulate
from nereus.sim.records import Summary
from nereus.spec import Role, load_cluster, load_model, load_workload

pytestmark = pytest.mark.pure


def _scenario(tmp_path: Path, steps: int) -> Scenario:
    """PPO with a 70B reward model on one 8-GPU A100-80GB node that never changes: the first plan
    (priced before any calibration) fills the actor trainer's GPUs to the planner's memory budget,
    the first measured peaks put it just over, and nothing else fits the 8 GPUs — while the
    truth's peaks stay well inside the GPUs' memory."""
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [1] * 8}))
    small, large = load_model("llama-3.1-8b"), load_model("llama-3.3-70b")
    models = {r: large if r is Role.REWARD else small for r in Role}
    supply = GpuSupply(SpotTrace.load(trace), 8, 8, 8)
    cluster = load_cluster("a100-80gb-dgx")
    return Scenario(load_workload("ppo"), models, cluster, supply, SeqCurve.growth(), steps, 0)


def _ran(s: Summary) -> int:
    return sum(1 for r in s.records if any(t.kind is RecordKind.RESTART for t in r.transitions))


@pytest.mark.parametrize("policy", ["static", "nereus"])
def test_restarts_are_the_ones_the_step_records_show(policy: str, tmp_path: Path) -> None:
    s = simulate(_scenario(tmp_path, 4), policy)
    assert s.oom_steps == 0 and s.replans == 1  # the deviation answered once (below)
    assert s.restarts == _ran(s), [r.decision for r in s.records]
    memory = [r.decision for r in s.records if r.decision and r.decision["verdict"] == "keep"]
    # past the headroom, within the memory: the plan is priced, not urgent, and kept (no move pays)
    assert memory and all(not d["urgent"] and d["current_latency_s"] is not None for d in memory)
    past = "memory: next step predicted past the headroom, within capacity"
    assert all(d["triggers"] == [past] for d in memory)
    assert all(d["verdict"] != "restart" or d["target"] is not None for r in s.records if (d := r.decision))
    if policy == "static":  # it holds its layouts: nowhere to restart to, ever
        assert s.restarts == 0 and all(r.restart_s == 0.0 for r in s.records)


@pytest.mark.parametrize("policy", ["static", "nereus"])
def test_a_memory_deviation_nothing_else_answers_replans_once_then_at_the_memory_itself(
    policy: str, tmp_path: Path
) -> None:
    """The plan the job keeps because nothing else fits is checked ahead against the share of
    the headroom a tolerated plan keeps, not the headroom it is already known to exceed; kept
    again past that (urgent, nothing else fits), against the GPUs' memory itself: no replan every
    step while the responses grow from 620 to 1,740 tokens, and the memory trigger fires again
    once they have grown far enough to put it over the memory itself (the truth's peaks stay
    inside)."""
    scenario = replace(_scenario(tmp_path, 10), curve=SeqCurve.growth(500, 4000, 10))
    s = simulate(scenario, policy)
    decided = {r.step: r.decision for r in s.records if r.decision}
    fired = [k for k, d in decided.items() if any(t.startswith("memory") for t in d["triggers"])]
    between = [k for k in fired if 1 < k <= 6]  # past the tolerated headroom: once, urgent, kept
    assert fired[0] == 1 and len(between) <= 1 and fired[-1] > 6, fired
    assert all(decided[k]["urgent"] and decided[k]["verdict"] == "keep" for k in between)
    lengths = {r.step: r.seq_len_mean for r in s.records}
    assert lengths[6] > 2.5 * lengths[1]
    assert s.oom_steps == 0 and s.restarts == 0


def test_a_restart_verdict_the_job_carries_on_from_is_no_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that asks for a restart with no target while the plan holds its GPUs: the
    simulator carries on with the plan as it is (no reload charged, nothing in the records), so
    the summary counts no restart — the replans still count."""
    memory = Trigger(TriggerKind.MEMORY, "memory", 1.0, 0.0, 1.0)

    def triggers(self: Controller, t: Telemetry) -> list[Trigger]:
        self._fold(t)
        return [memory]

    def replan(self: Controller, t: Telemetry, fired: list[Trigger], rebuilt: frozenset[str]) -> Decision:
        return Decision(t.step, t.time_s, tuple(fired), True, Verdict.RESTART, "no option", None)

    monkeypatch.setattr(Controller, "triggers", triggers)
    monkeypatch.setattr(Controller, "replan", replan)
    s = simulate(_scenario(tmp_path, 3), "static")
    assert s.replans == 2 and [r.decision["verdict"] for r in s.records if r.decision] == ["restart"] * 2
    assert _ran(s) == 0 and all(r.restart_s == 0.0 and not r.lost for r in s.records)
    assert s.restarts == 0 and s.to_json()["restarts"] == 0


def test_a_plan_whose_gpus_died_within_the_step_is_reloaded_not_carried_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller that asks for a restart with no target after its GPUs were revoked and
    replaced within the step (the pool is whole again at the boundary): the plan's state is
    gone, so the simulator reloads the checkpoint (charged, in the records) instead of carrying
    on with the plan as if its GPUs still held it."""
    loss = Trigger(TriggerKind.GPU_LOSS, "pool", 32.0, 32.0, 1.0)
    real = Controller.triggers

    def triggers(self: Controller, t: Telemetry) -> list[Trigger]:
        return [loss] if t.lost else real(self, t)

    def replan(self: Controller, t: Telemetry, fired: list[Trigger], rebuilt: frozenset[str]) -> Decision:
        return Decision(t.step, t.time_s, tuple(fired), True, Verdict.RESTART, "no option", None)

    monkeypatch.setattr(Controller, "triggers", triggers)
    monkeypatch.setattr(Controller, "replan", replan)
    trace = tmp_path / "dip.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [16] * 5 + [4] + [16] * 100}))
    model = load_model("llama-3.1-8b")
    supply = GpuSupply(SpotTrace.load(trace), 2, 32, 8, speedup=30.0, seed=0)
    s = simulate(
        Scenario(load_workload("ppo"), {r: model for r in Role}, load_cluster("a100-64gb-hdr100"), supply,
                 SeqCurve.growth(1147, 3722, 20), 6, 0),
        "static",
    )  # fmt: skip
    assert any(r.preempted for r in s.records) and all(r.gpus == 32 for r in s.records)
    assert _ran(s) == 1 and s.restarts == 1


def test_a_plan_restarted_without_the_headroom_is_checked_ahead_at_none() -> None:
    """A restart that took a plan without the headroom (the calibrated model within the GPUs'
    memory, before waiting for more GPUs): the memory trigger holds it to the memory itself, not
    to the headroom it was knowingly chosen without — and still fires when the lengths put it
    over that. A plain restart onto the same plan fires at once, not urgently: it is past the
    headroom, within the memory."""
    small, large = load_model("llama-3.1-8b"), load_model("llama-3.3-70b")
    models = {r: large if r is Role.REWARD else small for r in Role}
    cluster, workload, pool = load_cluster("a100-80gb-dgx"), load_workload("ppo"), tuple(range(8))
    seq = SeqStats(workload.prompt_len, 1000, 1100)
    bare = PlanningProblem(workload, models, cluster, pool, seq, headroom=0.0, space=SearchSpace.urgent())
    plan = search(bare).plan
    kept = replace(bare, headroom=DEFAULT_HEADROOM)
    assert price(kept, shapes_of(plan)).over_capacity(kept)  # within the memory, over the headroom

    def memory(headroom: float | None, length: float) -> list[TriggerKind]:
        ctl = Controller(workload, models, cluster, plan, space=SearchSpace.urgent())
        ctl.restarted(plan, headroom)
        fired = ctl.triggers(Telemetry(0, 1.0, length, 1.1 * length, pool))
        return [f.kind for f in fired if f.signal == "memory"]

    # held to the headroom: past it, within the memory (a replan that must pay back, not urgent)
    assert memory(None, 1000) == [TriggerKind.MARGIN] and memory(0.0, 1000) == []
    assert memory(0.0, 6000) == memory(None, 6000) == [TriggerKind.MEMORY]  # over the memory itself


def test_a_tolerated_plan_on_a_grown_pool_is_left_only_for_a_move_that_pays() -> None:
    """The pool grows under a plan restarted without the headroom: the replan searches the other
    plans at the headroom, but the running plan is priced within the memory itself, so it is a
    valid current plan (no urgent move to whatever fits, however much slower) until it changes."""
    small, large = load_model("llama-3.1-8b"), load_model("llama-3.3-70b")
    models = {r: large if r is Role.REWARD else small for r in Role}
    cluster, workload = load_cluster("a100-80gb-dgx"), load_workload("ppo")
    seq = SeqStats(workload.prompt_len, 1000, 1100)
    plan = search(
        PlanningProblem(
            workload, models, cluster, tuple(range(8)), seq, headroom=0.0, space=SearchSpace.urgent()
        )
    ).plan
    ctl = Controller(workload, models, cluster, plan, space=SearchSpace.urgent())
    ctl.restarted(plan, 0.0)
    decision = ctl.observe(Telemetry(0, 1.0, 1000, 1100, tuple(range(16))))
    assert decision is not None and decision.current_latency_s is not None and not decision.urgent
    assert ctl.plan is plan and ctl.plan_headroom == 0.0  # still held to the memory itself
