"""What ``nereus run`` ends with (``nereus.runtime.report.summary``): the reward's move and, for
each transition admitted because it pays back, the payback predicted and the one measured."""

from __future__ import annotations

from typing import Any

import pytest

from nereus.runtime.metrics import describe_decision
from nereus.runtime.report import summary

pytestmark = pytest.mark.pure


def row(step: int, seconds: float, reward: float = 0.0, **kw: Any) -> dict[str, Any]:
    return {"step": step, "reward": reward, "step_time_s": seconds, "transitions": [], "decision": None, **kw}


def decision(urgent: bool = False, sunk: bool = True) -> dict[str, Any]:
    return {
        "verdict": "admit", "urgent": urgent, "triggers": ["pool 3→4 GPUs"],
        "reason": "target: payback 1.1 ≤ γ·H = 3.5 steps", "delta_s": 0.2, "l_tran_s": 0.22,
        "payback_steps": 1.1, "horizon_steps": 7.0, "sunk_rebuilds": sunk,
    }  # fmt: skip


def test_the_reward_and_a_transition_that_paid_back() -> None:
    moved = [{"kind": "membership", "seconds": 3.0}, {"kind": "extend", "seconds": 5.0, "rebuild_s": 4.5}]
    rows = [row(0, 2.0, 0.0), row(1, 2.0, 0.1), row(2, 2.0, 0.2, transitions=moved, decision=decision())]
    rows += [row(s, 1.0, 0.5) for s in range(3, 8)]
    first, second = summary(rows)
    assert first == "reward: 0.10 (first 3 steps) → 0.50 (last 3), +0.40"
    assert second.startswith("step 2: admitted (pool 3→4 GPUs), predicted ΔL 0.2 s/step, L_tran 0.22 s")
    # 5 s moving, 4.5 s of it rebuilds the re-formed world needed anyway: 0.5 s over 1 s/step saved
    assert "moved in 5.00 s (4.50 s of it rebuilding engines" in second
    assert "measured payback 0.5 steps, paid back within the 5 steps left" in second


def test_no_measured_gain_is_said_and_urgent_moves_are_not_listed() -> None:
    moved = [{"kind": "extend", "seconds": 5.0, "rebuild_s": 1.0}]
    rows = [row(0, 1.0), row(1, 1.0, transitions=moved, decision=decision(sunk=False)), row(2, 1.2)]
    rows.append(row(3, 1.0, transitions=moved, decision=decision(urgent=True)))
    lines = summary(rows)
    assert len(lines) == 2 and "moved in 5.00 s; median step 1.00 s before, 1.20 s after" in lines[1]
    assert lines[1].endswith("no measured gain (not paid back on this machine)")
    assert summary([]) == []


def test_a_replan_reads_as_one_line() -> None:
    line = describe_decision(decision())
    assert line == (
        "replan (pool 3→4 GPUs): admit: target: payback 1.1 ≤ γ·H = 3.5 steps (ΔL 0.2 s/step, L_tran 0.22 s)"
    )
    keep = {
        "verdict": "keep",
        "triggers": ["seq_len 2→4"],
        "reason": "the current plan is the planner's target",
    }
    assert describe_decision(keep) == "replan (seq_len 2→4): keep: the current plan is the planner's target"
