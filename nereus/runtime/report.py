"""``report.png`` from ``metrics.jsonl``: reward, step time, response length, plan timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_report(metrics: Path, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(steps, [r["reward"] for r in rows], marker="o", label="reward")
    axes[0].plot(steps, [r.get("accuracy", 0.0) for r in rows], marker=".", label="accuracy")
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="upper left")
    moved = [sum(t["seconds"] for t in r["transitions"]) for r in rows]
    axes[1].bar(steps, [r["step_time_s"] for r in rows], label="step")
    axes[1].bar(steps, moved, bottom=[r["step_time_s"] for r in rows], label="transition at boundary")
    axes[1].set_ylabel("seconds")
    axes[1].legend(loc="upper left")
    axes[2].plot(steps, [r["seq_len_mean"] for r in rows], marker="o")
    axes[2].set_ylabel("response tokens")
    stages = sorted({k for r in rows for k in r["plan"]})
    for i, name in enumerate(stages):
        axes[3].scatter(steps, [i] * len(steps), s=8, color="0.7")
        last = None
        for r in rows:
            layout = r["plan"].get(name)
            if layout != last:
                axes[3].annotate(
                    layout, (r["step"], i), fontsize=6, xytext=(2, 3), textcoords="offset points"
                )
                last = layout
    for r in rows:
        for t in r["transitions"]:
            axes[3].axvline(r["step"] + 0.5, color="tab:red", alpha=0.5)
            axes[3].annotate(f"{t['kind']} {t['seconds']:.1f}s", (r["step"] + 0.5, len(stages) - 0.5),
                             fontsize=6, rotation=90, color="tab:red")  # fmt: skip
    axes[3].set_yticks(range(len(stages)), stages, fontsize=7)
    axes[3].set_ylim(-0.5, len(stages) + 0.5)
    axes[3].set_xlabel("step")
    gpus = [r["gpus"] for r in rows]
    twin = axes[3].twinx()
    twin.step(steps, gpus, where="mid", color="tab:green", alpha=0.6)
    twin.set_ylabel("GPUs in plan", color="tab:green")
    fig.suptitle(f"{title}: adaptive run")
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
