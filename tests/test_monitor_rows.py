"""A real run's boundaries, as its metrics rows tell them: the leader's wait for its slowest rank
(``straggler_s``) is part of its gather, never more; monitoring (``monitor_s``) is what is left of
the boundary's window once that wait, the pool change and a transition's own planning are taken
out, so it holds the gather's remainder and the notice's travel; and the early work that began
when the step generated is reported beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist


@pytest.mark.timeout(900)
def test_every_boundary_accounts_for_its_parts(drifted_ppo_run: Path) -> None:
    rows = [json.loads(line) for line in (drifted_ppo_run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) >= 6
    for r in rows:
        parts, straggler, monitor = r["monitor_parts"], r["straggler_s"], r["monitor_s"]
        assert {"gather", "straggler", "beside", "decide", "notice"} <= parts.keys(), r["step"]
        assert 0.0 <= straggler == parts["straggler"] <= parts["gather"], r["step"]
        assert monitor >= 0.0, r["step"]
        quiet = r["decision"] is None and not r["transitions"]
        if quiet:  # the window holds the gather (less the wait) and the notice, nothing taken out
            assert monitor + 1e-6 >= parts["gather"] - straggler + parts["notice"], r["step"]
            assert parts["decide"] <= monitor, r["step"]
    assert any(r["monitor_parts"]["beside"] > 0 for r in rows)  # the early work ran
