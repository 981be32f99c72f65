"""End to end on 4 local workers: asynchronous against synchronous GRPO, the same samples.

``nereus run`` (a subprocess on a snapshot of the code, as ``e2e_local.py`` runs it) of one GRPO
job twice per repeat: ``mode: sync`` (generation, inference and training one after another on
the shared pool) and ``mode: async`` with ``max_staleness: 1`` (generation on GPUs of its own,
one batch ahead of training; ``nereus.runtime.asynchrony``). Same model, seed, prompts and
steps; the static policy, so each mode keeps the plan the planner gives it. Runs alternate
(sync, async, sync, …) so that slow phases of a shared machine hit both modes alike; figures
are medians over the repeats, ratios async / sync are per back-to-back pair.

Per run, from ``metrics.jsonl``: the median step time (after the first step, which builds the
engines), generated tokens/s (Σ response tokens / Σ step time), and for async the overlap share
(Σ seconds generation and training ran at the same time / Σ step time) and each side's waits.
``e2e_local.py`` runs this comparison too (``--async-only`` runs only it and writes
``e2e_async.json`` / ``.png``).

On a 2-core machine the 4 worker processes share two cores: two sides that overlap in time also
compete for the same cores, so overlap here shows that the runtime runs them concurrently, not
the speedup disjoint GPUs would give; the load average around every run is recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKERS, STEPS, REPEATS = 4, 10, 3
PROMPTS, SAMPLES = 8, 4  # per step: the generated sequences are their product
WORKLOAD = """algorithm: grpo
mode: {mode}{staleness}
prompts_per_step: {prompts}
samples_per_prompt: {samples}
prompt_len: 8
max_prompt_len: 32
max_response_len: 16
global_batch: 16
micro_batch: 4
inference_micro_batch: 16
max_num_seqs: 32
precision: fp32
sequence_parallel: false
flash_attention: false
reward_model: false
"""
EXPERIMENT = """name: {name}
workload: {workload}
model: tiny-llama
workers: {workers}
steps: {steps}
seed: 0
policy: static
task: {{kind: copy, n: 4096, difficulty: 2, length: 2}}
max_new_tokens: 8
rl: {{lr: 0.002, kl_coef: 0.01}}
"""
TARGETS = {
    "issue": "async vs sync for the same samples on the 4-worker CPU job: overlap share, step time "
    "and tokens/s side by side (medians, alternating runs)",
}


def workload_text(mode: str) -> str:
    """The GRPO workload in ``mode`` (one step off-policy when async; a sync workload may not
    name ``max_staleness``)."""
    staleness = "\nmax_staleness: 1" if mode == "async" else ""
    return WORKLOAD.format(mode=mode, staleness=staleness, prompts=PROMPTS, samples=SAMPLES)


def run_once(mode: str, tmp: Path, tag: str, code: Path, steps: int) -> dict[str, Any]:
    """One ``nereus run`` in ``mode`` on the code snapshot ``code``: its rows, wall time, load."""
    wl = tmp / f"{tag}-workload.yaml"
    wl.write_text(workload_text(mode))
    exp = tmp / f"{tag}.yaml"
    exp.write_text(EXPERIMENT.format(name=tag, workload=wl, workers=WORKERS, steps=steps))
    out = tmp / tag
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    path = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)],
        capture_output=True, text=True, cwd=code, timeout=900, check=False,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"nereus run ({mode}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return {"rows": rows, "wall_s": wall, "load_average": {"before": load_before, "after": os.getloadavg()}}


def summarise(run: dict[str, Any], sequences: int) -> dict[str, Any]:
    rows = run["rows"]
    steady = rows[1:] or rows
    step_s = sum(r["step_time_s"] for r in rows)
    tokens = sum(r["seq_len_mean"] * sequences for r in rows)
    out: dict[str, Any] = {
        "steps": len(rows),
        "median_step_s": statistics.median(r["step_time_s"] for r in steady),
        "sum_step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s else 0.0,
        "wall_s": run["wall_s"],
        "final_reward": rows[-1]["reward"],
        "plan": rows[0]["plan"],
        "load_average": run["load_average"],
    }
    if rows[0].get("asynchrony") is not None:
        a = [r["asynchrony"] for r in rows]
        out["overlap_s"] = sum(x["overlap_s"] for x in a)
        out["overlap_share"] = out["overlap_s"] / step_s if step_s else 0.0
        out["gen_wait_s"] = sum(x["gen_wait_s"] for x in a)
        out["train_wait_s"] = sum(x["train_wait_s"] for x in a)
        out["staleness"] = sorted({x["staleness"] for x in a})
    return out


def compare(code: Path, repeats: int = REPEATS, steps: int = STEPS) -> dict[str, Any]:
    """Alternating sync and async runs on ``code``; per-mode medians and per-pair ratios."""
    sequences = PROMPTS * SAMPLES
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="nereus-e2e-async-") as d:
        tmp = Path(d)
        for i in range(repeats):
            for mode in ("sync", "async"):
                runs[mode].append(summarise(run_once(mode, tmp, f"{mode}-{i}", code, steps), sequences))
                print(f"  {mode} #{i}: median step {runs[mode][-1]['median_step_s']:.3f} s", flush=True)
    keys = (
        "median_step_s",
        "tokens_per_s",
        "wall_s",
        "overlap_share",
        "overlap_s",
        "gen_wait_s",
        "train_wait_s",
    )
    medians = {
        mode: {k: statistics.median(r[k] for r in rs) for k in keys if k in rs[0]}
        for mode, rs in runs.items()
    }
    pairs = list(zip(runs["async"], runs["sync"], strict=True))
    ratios = {
        "step_time_async_over_sync": statistics.median(
            a["median_step_s"] / s["median_step_s"] for a, s in pairs
        ),
        "tokens_per_s_async_over_sync": statistics.median(
            a["tokens_per_s"] / s["tokens_per_s"] for a, s in pairs
        ),
    }
    return {"steps": steps, "repeats": repeats, "medians": medians, "ratios": ratios, "runs": runs}


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    m = result["medians"]
    modes = ["sync", "async"]
    axes[0].bar(modes, [m[x]["median_step_s"] for x in modes], color=["#888", "#2a7"])
    axes[0].set_title("median step time (s)")
    axes[1].bar(modes, [m[x]["tokens_per_s"] for x in modes], color=["#888", "#2a7"])
    axes[1].set_title("generated tokens/s")
    a = m["async"]
    axes[2].bar(["overlap", "gen wait", "train wait"], [a["overlap_s"], a["gen_wait_s"], a["train_wait_s"]])
    axes[2].set_title(f"async: seconds over {result['steps']} steps")
    fig.suptitle("GRPO on 4 local CPU workers: async (max_staleness 1) vs sync, same samples")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
