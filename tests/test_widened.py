"""Urgent replans also search the wider space (``nereus.control.widened``): smaller micro-batches
shrink a pipelined trainer's bubble, so a plan that must change anyway may get faster, not only
smaller. Opportunistic replans of a plan in the narrow space stay in it, as the paper's do."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.control.controller import Controller
from nereus.control.telemetry import Telemetry
from nereus.control.widened import is_widened
from nereus.plan.layout import Plan
from nereus.plan.search import search
from nereus.spec.workload import Recompute
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

RESPONSE = 1800


def _job(gpus: int) -> tuple[Controller, Plan]:
    problem = make_problem(cluster="mi250x-slingshot", gpus=gpus, response=RESPONSE, prompts_per_step=16384)
    plan = search(problem).plan
    return Controller(problem.workload, problem.models, problem.cluster, plan), plan


def _tel(step: int, gpus: int) -> Telemetry:
    return Telemetry(step, 100.0 * step, RESPONSE, RESPONSE, tuple(range(gpus)))


def test_a_plan_is_widened_by_recomputation_or_a_trainers_smaller_micro_batch() -> None:
    ctl, plan = _job(64)
    w = ctl.workload
    assert not is_widened(plan, w)  # the narrow search's: each trainer at its largest micro-batch
    trainer = next(c for c in plan.candidates if c.model_stage == "actor.train")
    assert trainer.micro_batch > 1
    for changed in (
        dataclasses.replace(trainer, micro_batch=1),
        dataclasses.replace(trainer, recompute=Recompute.FULL),
    ):
        other = dataclasses.replace(
            plan, candidates=tuple(changed if c is trainer else c for c in plan.candidates)
        )
        assert is_widened(other, w)


def test_an_urgent_replan_takes_the_wider_spaces_faster_plan() -> None:
    """512 → 384 GCDs: the narrow space's best keeps micro-batch 4, two per replica through the
    pipeline; micro-batch 1 is faster, and the urgent replan takes it."""
    ctl, _ = _job(512)
    ctl.observe(_tel(0, 512))
    d = ctl.observe(_tel(1, 384))
    assert d is not None and d.urgent and d.target is not None and d.target_latency_s is not None
    narrow = search(ctl.problem(tuple(range(384)), ctl._seq(_tel(1, 384))))
    assert d.target_label == "widened"
    assert any(c.micro_batch < 4 for c in d.target.candidates if "train" in c.model_stage)
    assert d.target_latency_s < 0.95 * narrow.step_latency_s, (d.target_latency_s, narrow.step_latency_s)


def test_an_opportunistic_replan_of_a_narrow_plan_stays_narrow() -> None:
    ctl, plan = _job(384)
    ctl.observe(_tel(0, 384))
    d = ctl.observe(_tel(1, 512))  # the pool grows: not urgent
    assert d is not None and not d.urgent
    assert d.target_label != "widened"
    assert d.target is None or not is_widened(d.target, ctl.workload)
    assert not is_widened(plan, ctl.workload)
