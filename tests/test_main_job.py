"""The main job (``make run``: ``configs/experiments/main.yaml``) does what its README says.

From a model folder, tokenizer and verl data set built by ``nereus.rl.assets`` (as ``make run``
builds them), GRPO on 4 local workers loses a worker and regains it. Checked: the reward rises by
at least 0.2 (mean of the last 3 steps against the first 3); the loss is recovered in place; on the
regain the controller admits an opportunistic in-place transition whose predicted payback is
within γ·H, and ``nereus run`` ends with that payback, predicted and measured; the exported actor
loads in ``transformers``, with its tokenizer.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nereus.rl.assets import build

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.2
WINDOW = 3


@pytest.mark.timeout(600)
def test_the_main_job_learns_and_admits_a_transition_that_pays_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("pyarrow")
    assets = build(tmp_path / "main-job")
    exp = yaml.safe_load((ROOT / "configs" / "experiments" / "main.yaml").read_text())
    assert exp["model"] == "build/main-job/model" and exp["data"]["train"] == "build/main-job/train.parquet"
    exp["model"], exp["data"]["train"] = str(assets.model), str(assets.train)
    path = tmp_path / "main.yaml"
    path.write_text(yaml.safe_dump(exp))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(path), "--out", str(out)],
        capture_output=True, text=True, timeout=560, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(exp["steps"]))
    rewards = [float(r["reward"]) for r in rows]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last - first >= MARGIN, " ".join(f"{x:.2f}" for x in rewards)

    kinds = [t["kind"] for r in rows for t in r["transitions"]]
    assert "restart" not in kinds, kinds  # the loss and the regain both move state in place
    decisions = [r["decision"] for r in rows if r["decision"]]
    urgent = [d for d in decisions if d["urgent"]]
    assert urgent and urgent[0]["verdict"] == "admit" and "gpu-loss" in urgent[0]["triggers"][0]
    paid = [d for d in decisions if d["verdict"] == "admit" and not d["urgent"]]
    assert paid, [d["reason"] for d in decisions]
    d = paid[0]
    assert d["delta_s"] > 0 and d["payback_steps"] == pytest.approx(d["l_tran_s"] / d["delta_s"])
    assert d["payback_steps"] <= 0.5 * d["horizon_steps"]  # γ = 0.5, the nereus policy's
    assert d["sunk_rebuilds"]  # a regain re-forms the world: rebuilds are not the move's to pay
    step = next(r["step"] for r in rows if r["decision"] is d)
    assert rows[step + 1]["gpus"] == exp["workers"]
    assert f"step {step}: admitted (pool 3→4 GPUs), predicted ΔL" in proc.stdout
    assert "measured: moved in" in proc.stdout and "reward: 0.0" in proc.stdout
    # the start-up builds the controller prices a move's rebuilds at, until one is measured
    built = re.search(
        r"start-up built a generation engine ([\d.]+) s, another engine ([\d.]+) s",
        (out / "membership.log").read_text(),
    )
    assert built and float(built[1]) > 0 and float(built[2]) > 0

    actor = transformers.AutoModelForCausalLM.from_pretrained(out / "hf" / "actor")
    assert actor.config.vocab_size == len(transformers.AutoTokenizer.from_pretrained(assets.model))
    # the export carries its tokenizer (chat template included), so it serves as it is
    exported = transformers.AutoTokenizer.from_pretrained(out / "hf" / "actor")
    original = transformers.AutoTokenizer.from_pretrained(assets.model)
    chat = [{"role": "user", "content": "What is 12 plus 30?"}]
    assert exported.apply_chat_template(chat) == original.apply_chat_template(chat)
