"""PNG timeline of simulated runs: GPUs, lengths, step time and transitions per policy (edge)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nereus.sim.engine import Summary


def timeline(summaries: Sequence[Summary], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 9), sharex=True)
    first = summaries[0].records
    axes[1].plot([r.step for r in first], [r.seq_len_mean for r in first], label="mean")
    axes[1].plot([r.step for r in first], [r.seq_len_p95 for r in first], "--", label="p95")
    axes[1].set_ylabel("response tokens")
    axes[1].legend(fontsize=7)
    for s in summaries:
        steps = [r.step for r in s.records]
        (line,) = axes[0].step(steps, [r.gpus for r in s.records], where="post", label=s.policy)
        axes[2].plot(steps, [r.wall_s for r in s.records], label=f"{s.policy} ({s.mean_step_s:.0f} s/step)")
        marks = [(r.step, r.wall_s) for r in s.records if r.transition_s > 0 or r.restart_s > 0]
        if marks:
            axes[2].plot(*zip(*marks, strict=True), "o", color=line.get_color(), ms=4)
        axes[3].plot(steps, _cumulative([r.wall_s for r in s.records]), label=s.policy)
    axes[0].set_ylabel("GPUs at step start")
    axes[0].legend(fontsize=7, ncol=4)
    axes[2].set_ylabel("step wall time (s)\n(o: transition/restart)")
    axes[2].legend(fontsize=7)
    axes[3].set_ylabel("cumulative time (s)")
    axes[3].set_xlabel("step")
    fig.suptitle(title, fontsize=10, parse_math=False)  # a trace or model name is text, "$" too
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cumulative(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v
        out.append(total)
    return out
