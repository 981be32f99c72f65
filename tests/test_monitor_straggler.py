"""The leader's wait at a boundary for its slowest peer (``monitor.straggler_s``) is the step's
time on that peer, not the monitor's: every rank reports when it reached the boundary, the leader
takes the latest less its own (never more than its gather took), and ``e2e_local.py`` counts it
with the steps while still reporting the shares with it counted as monitoring."""

from __future__ import annotations

from typing import Any

import pytest

from nereus.runtime.monitor import RankReport, pack_report, straggler_s, unpack_report
from tests.helpers import benchmark_module

pytestmark = pytest.mark.pure

NAMES = ("actor.gen", "actor.train")


def _report(ready_at: float) -> RankReport:
    return RankReport({"actor.gen": 0.1}, {}, False, (), ready_at=ready_at)


def test_the_wait_is_the_latest_arrival_less_the_leaders() -> None:
    reports = [_report(100.0), _report(100.004), _report(100.0125), _report(99.99)]
    assert straggler_s(reports) == pytest.approx(0.0125)
    assert straggler_s(reports, me=2) == 0.0  # the last to arrive waited for nobody
    assert straggler_s([_report(5.0), _report(4.0)]) == 0.0  # the leader was last
    assert straggler_s([]) == 0.0


def test_the_arrival_travels_exactly_in_the_report() -> None:
    r = _report(1_796_000_000.123456)  # wall-clock seconds: a float64 keeps them to the microsecond
    assert unpack_report(pack_report(r, NAMES), NAMES).ready_at == r.ready_at


def _row(step: int, monitor_s: float, straggler: float, decision: str | None = None) -> dict[str, Any]:
    return {
        "step": step, "step_time_s": 0.5, "checkpoint_s": 0.1, "monitor_s": monitor_s, "plan_s": 0.0,
        "straggler_s": straggler, "monitor_parts": {"gather": straggler + 0.001}, "weight_sync_s": 0.0,
        "seq_len_mean": 2.0, "gpus": 4, "reward": 0.0, "accuracy": 0.0,
        "decision": {"verdict": decision} if decision else None, "transitions": [], "plan": {},
    }  # fmt: skip


def test_the_benchmark_counts_the_wait_with_the_steps_and_reports_both_shares() -> None:
    bench = benchmark_module("e2e_local")
    rows = [_row(0, 0.005, 0.010), _row(1, 0.004, 0.0), _row(2, 0.02, 0.005, "keep")]
    s = bench.summarise("nereus", rows, 10.0, 1)
    assert s["straggler_s"] == pytest.approx(0.015)
    assert s["seconds"]["steps"] == pytest.approx(1.5 + 0.015)  # the slowest rank's step
    assert s["seconds"]["monitoring"] == pytest.approx(0.029)
    assert s["accounted_s"] == pytest.approx(1.515 + 0.3 + 0.029)  # nothing lost from the total
    assert s["mean_step_time_s"] == pytest.approx(0.5)
    assert s["monitor_share_mean"] == pytest.approx(0.029 / 1.5)
    assert s["monitor_share_mean_with_straggler"] == pytest.approx(0.044 / 1.5)
    assert s["monitor_share_quiet_mean_with_straggler"] == pytest.approx((0.015 + 0.004) / 1.0)
    assert s["monitor_s_quiet_median_with_straggler"] == pytest.approx((0.015 + 0.004) / 2)
    assert s["per_step"][0]["straggler_s"] == 0.01
    assert "straggler_s" in bench.ACCOUNTING
