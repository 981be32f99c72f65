"""Replans that cannot be urgent run beside the next step (``nereus.runtime.deferred``), end to end
on 4 local worker processes (gloo).

A ``periodic:2`` job (a replan after every second step, a move whenever it finds a better plan)
loses worker 3 before step 1 and regains it before step 3:

- the replan after step 1 (on 3 GPUs) runs beside step 2; the pool change before step 3 is
  urgent and drops it (logged), and that boundary decides afresh;
- the replan after step 3 (on 4 GPUs, the plan still on 3) runs beside step 4, and the move it
  admits is made at the boundary after step 4 — one boundary later than a decision on the
  boundary — its row saying which step's telemetry decided it;
- the training equals the run that never changed its plan (``test_runtime_e2e``'s reference).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_runtime_e2e import BASE, cli_run, metrics, untouched

pytestmark = pytest.mark.e2e
__all__ = ["untouched"]  # the reference run, a module fixture

DRIFT = """drift:
  - {step: 1, lose: [3]}
  - {step: 3, gain: [3]}
"""


@pytest.mark.timeout(400)
def test_a_deferred_move_lands_one_boundary_later_and_training_stays_exact(
    tmp_path: Path, untouched: Path
) -> None:
    exp = tmp_path / "deferred.yaml"
    base = BASE.format(name="deferred", steps=6).replace("policy: always", "policy: periodic:2")
    assert "policy: periodic:2" in base
    exp.write_text(base + DRIFT)
    out = tmp_path / "runs" / "deferred"
    proc = cli_run(exp, out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["gpus"] for r in rows] == [4, 3, 3, 3, 3, 4]

    # the replan after step 1 ran beside step 2 and was dropped for the pool change before step 3
    log = (out / "membership.log").read_text()
    # (its verdict, keep or admit, is the cost model's on these tiny plans; that it is dropped is the point)
    assert re.search(r"the decision deferred from step 1 \((keep|admit)\) is dropped: the pool changes", log)
    assert "deferred" in rows[2]["monitor_parts"]  # type: ignore[operator]
    assert rows[2]["decision"] is None
    # the replan after step 3 ran beside step 4; its move is made at the boundary after step 4
    assert rows[3]["decision"] is None and not rows[3]["transitions"]
    decision = rows[4]["decision"]
    assert isinstance(decision, dict) and decision["deferred"] == 3 and decision["verdict"] == "admit"
    assert [t["kind"] for t in rows[4]["transitions"]]  # type: ignore[union-attr]
    assert rows[4]["plan_s"] > 0 and rows[4]["monitor_parts"]["deferred"] > 0  # type: ignore[index,operator]
    assert all(r["decision"] is None or "deferred" in r["decision"] or r["step"] == 0 for r in rows)  # type: ignore[operator]

    a = load_file(str(out / "hf" / "actor" / "model.safetensors"))
    b = load_file(str(untouched / "hf" / "actor" / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        assert torch.allclose(a[name], b[name], atol=2e-4, rtol=0), name
    for r, s in zip(rows, metrics(untouched), strict=True):
        assert r["reward"] == pytest.approx(s["reward"], abs=1e-6)
        assert r["kl"] == pytest.approx(s["kl"], abs=1e-4)
        assert r["actor_loss"] == pytest.approx(s["actor_loss"], abs=1e-4)
