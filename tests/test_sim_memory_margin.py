"""A plan past the memory headroom but within the GPUs' memory is kept unless a move pays back.

The headroom (10% of GPU memory) guards plans the job has not run yet against the model's error;
the running plan's memory is measured every step. Qwen3-14B PPO on 16 A100-64GB (2 GPUs per
instance), responses growing from 2,000 tokens: the first measured peaks put the running plan a
little past the headroom, well within the memory (the truth's peaks stay inside it). An urgent
move there, profitability waived, went to the fastest plan that fits the headroom: smaller
generation batches and micro-batches, each step 30-60% slower than staying, and again at every
length the headroom was crossed (nereus 1,925 s per step against static's 996 s over 40 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.cli import _parse
from nereus.sim import Scenario, simulate
from nereus.sim.command import scenario_from

pytestmark = pytest.mark.pure


def _scenario(tmp_path: Path, steps: int) -> Scenario:
    """``nereus simulate --model qwen3-14b --cluster a100-64gb-hdr100 --gpus-per-instance 2``,
    16 GPUs that never change, responses growing from 2,000 to 8,000 tokens over 40 steps."""
    trace = tmp_path / "flat.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [8] * 200}))
    args = _parse(
        ["simulate", "--trace", str(trace), "--model", "qwen3-14b", "--algo", "ppo", "--cluster",
         "a100-64gb-hdr100", "--gpus-per-instance", "2", "--seq-curve", "growth:2000:8000:40",
         "--steps", str(steps), "--seed", "2"]
    )  # fmt: skip
    return scenario_from(args)


def test_a_plan_past_the_headroom_within_the_memory_is_not_left_for_a_slower_one(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path, 8)
    nereus, static = simulate(scenario, "nereus"), simulate(scenario, "static")
    assert nereus.oom_steps == static.oom_steps == 0
    assert nereus.mean_step_s <= 1.02 * static.mean_step_s, (nereus.mean_step_s, static.mean_step_s)
    past = "memory: next step predicted past the headroom, within capacity"
    margin = [r.decision for r in nereus.records if r.decision and past in r.decision["triggers"]]
    assert margin and all(not d["urgent"] and d["current_latency_s"] is not None for d in margin)
    assert all(d["verdict"] == "keep" for d in margin)
