"""A local job on a cluster whose YAML marks revocable nodes learns their revocation rate from
its own pool (``nereus.control.revocations``): a worker lost without a drain is a revocation, and
the decision that answers it is priced at the rate it implies (the YAML gave none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nereus.spec.registry import config_root

pytestmark = pytest.mark.e2e

EXPERIMENT = """
name: revoked
workload: ppo-tiny
model: tiny-llama
cluster: {cluster}
workers: 4
steps: 4
seed: 3
policy: nereus
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, critic_lr: 0.01, kl_coef: 0.01}}
checkpoint_every: 1
drift:
  - {{step: 2, lose: [3]}}
"""


@pytest.mark.timeout(300)
def test_a_lost_revocable_worker_is_priced_as_a_revocation(tmp_path: Path) -> None:
    text = (config_root() / "clusters" / "local-cpu.yaml").read_text()
    text = text.replace("nodes: 1\n", "nodes: 4\n").replace("gpus_per_node: 8\n", "gpus_per_node: 1\n")
    cluster = tmp_path / "spot-cpu.yaml"
    cluster.write_text(text + "reserved_nodes: 2\n")  # workers 2 and 3 are revocable, rate unknown
    exp = tmp_path / "revoked.yaml"
    exp.write_text(EXPERIMENT.format(cluster=cluster))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    decisions = [(r["step"], r["decision"]) for r in rows if r.get("decision")]
    lost = [d for _, d in decisions if any(t.startswith("gpu-loss") for t in d["triggers"])]
    assert lost and lost[0]["revocation_rate"] > 0, decisions  # one revocable node lost
    assert lost[0]["revocation_rate"] < 1 / 24 + 1e-9  # one loss against the 24-node-hour prior
