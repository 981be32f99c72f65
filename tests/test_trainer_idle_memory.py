"""A trainer's idle state keeps its fp32 gradient buffer (issue 19's A100 8–32 out-of-memory step).

The admission benchmark's nereus run (us-east-2b, offset 2400, step 11: 8 GPUs, responses of
1,926 tokens, p95 2,157) ran ``actor.gen`` tp4·dp2 over all 8 GPUs, sharing GPUs 0–3 with the
idle ``actor.train`` tp4 and GPUs 0–1 with the idle ``actor.inf``. The truth keeps a trainer's
fp32 gradient buffer between steps (Megatron-style DDP: one contiguous main-grad buffer for the
model's lifetime), 33.7 GiB of idle state per GPU; the planner counted weights and optimizer
state only (26.2 GiB), predicted 55.7 GiB for generation's GPUs against a 56.1 GiB limit, and
the truth's 64.4 GiB ran out of memory. Counting the buffer, that plan is over capacity.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from nereus.plan.calibration import Efficiencies
from nereus.plan.candidates import Shape
from nereus.plan.evaluate import price
from nereus.plan.layout import Layout
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.replica import stage_params
from nereus.sim.truth.params import TRAIN_GRAD_B, TRAIN_OPTIM_B, TRAIN_WEIGHT_B
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.workload import Stage

pytestmark = pytest.mark.pure

GIB = 2**30


def _case() -> tuple[PlanningProblem, dict[str, Shape]]:
    w = load_workload("ppo")
    w = dataclasses.replace(w, prompts_per_step=512 // w.samples_per_prompt)
    model = load_model("llama-3.1-8b")
    problem = PlanningProblem(
        w,
        {r: model for r in Role},
        load_cluster("a100-64gb-hdr100"),
        tuple(range(8)),
        SeqStats(256, 1925.76, 2156.86),
        # the controller's memory corrections at that step, learned from 11 steps of telemetry
        Efficiencies(
            memory_correction=MappingProxyType({Stage.GEN: 0.9532, Stage.INF: 1.4554, Stage.TRAIN: 1.0798})
        ),
    )
    shapes = {
        "actor.gen": Shape(Layout(4, 1), 2, 256),
        "actor.inf": Shape(Layout(1, 2), 1, 1),
        "ref.inf": Shape(Layout(1, 2), 1, 1),
        "reward.inf": Shape(Layout(1, 2), 1, 1),
        "critic.inf": Shape(Layout(1, 2), 1, 1),
        "actor.train": Shape(Layout(4, 1), 1, 2),
        "critic.train": Shape(Layout(4, 1), 1, 4),
    }
    return problem, shapes


def test_trainer_idle_state_keeps_the_gradient_buffer() -> None:
    problem, shapes = _case()
    cost = price(problem, shapes)
    params = float(stage_params(load_model("llama-3.1-8b"), Layout(4, 1))[0])
    # the truth's idle trainer: bf16 weights + fp32 grad buffer + fp32 master and Adam m, v
    assert cost.resident["actor.train"] == pytest.approx(
        (TRAIN_WEIGHT_B + TRAIN_GRAD_B + TRAIN_OPTIM_B) * params, rel=1e-9
    )
    assert cost.resident["actor.train"] / GIB == pytest.approx(33.66, abs=0.05)
    # a restart reads weights and optimizer state back, not the gradient buffer
    assert cost.checkpoint["actor.train"] == pytest.approx((TRAIN_WEIGHT_B + TRAIN_OPTIM_B) * params)
    # forward-only and generation replicas keep no gradients: resident is what a restart reads
    for name in ("actor.gen", "actor.inf", "critic.inf"):
        assert cost.checkpoint[name] == cost.resident[name]


def test_the_plan_that_ran_out_of_memory_is_over_capacity() -> None:
    problem, shapes = _case()
    cost = price(problem, shapes)
    limit = problem.capacity_bytes - problem.reserved_bytes
    # generation's GPUs 0-3 hold the idle actor trainer and the idle actor.inf beside its KV pool
    assert cost.bound["actor.gen"] == pytest.approx(
        cost.active["actor.gen"] + cost.resident["actor.train"] + cost.resident["actor.inf"]
    )
    # without the buffer: 22.0 + 26.2 + 7.5 = 55.7 GiB, under the limit; with it 63.1 GiB
    assert cost.bound["actor.gen"] - (cost.resident["actor.train"] - cost.checkpoint["actor.train"]) < limit
    assert cost.bound["actor.gen"] / GIB == pytest.approx(63.1, abs=0.1)
    assert cost.bound["actor.gen"] > limit  # the search no longer picks it
    assert "actor.gen" in cost.over_capacity(problem)
