"""What a run shows from ``metrics.jsonl`` alone: ``report.png`` (reward, step time, response
length, plan timeline) and ``summary``, the lines ``nereus run`` ends with (how the reward moved,
and for every transition the controller admitted because it pays back, the payback it predicted
against the one the measured step times give)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WINDOW = 3  # steps averaged at each end of the reward curve, and around a transition


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def measured_payback(rows: list[dict[str, Any]], i: int, sunk: bool) -> str:
    """The measured side of the move at the boundary after ``rows[i]``: its seconds (joining
    workers not counted; ``sunk``: less the engine rebuilds a re-formed world needs whatever the
    plan, as admission priced it), against the median step time of the ``WINDOW`` steps up to it
    and of all steps after."""
    moves = [t for t in rows[i]["transitions"] if t["kind"] != "membership"]
    moved = sum(t["seconds"] for t in moves)
    charged = moved - sum(t.get("rebuild_s", 0.0) for t in moves) if sunk else moved
    cost = f"moved in {moved:.2f} s"
    if sunk:
        cost += f" ({moved - charged:.2f} s of it rebuilding engines the re-formed world needed anyway)"
    before = [r["step_time_s"] for r in rows[max(0, i - WINDOW + 1) : i + 1]]
    after = [r["step_time_s"] for r in rows[i + 1 :]]
    if not after:
        return f"{cost}, at the last step: nothing after it to measure"
    b, a = sorted(before)[len(before) // 2], sorted(after)[len(after) // 2]
    line = f"{cost}; median step {b:.2f} s before, {a:.2f} s after"
    if a >= b:
        return f"{line}: no measured gain (not paid back on this machine)"
    steps = charged / (b - a)
    verdict = "paid back" if steps <= len(after) else "not yet paid back"
    return f"{line}: measured payback {steps:.3g} steps, {verdict} within the {len(after)} steps left"


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """The reward's first and last ``WINDOW``-step means, then one line per admitted transition
    that had to pay back (not an urgent one): predicted ΔL, L_tran and payback, and measured."""
    if not rows:
        return []
    n = min(WINDOW, len(rows))
    first, last = _mean([r["reward"] for r in rows[:n]]), _mean([r["reward"] for r in rows[-n:]])
    lines = [f"reward: {first:.2f} (first {n} steps) → {last:.2f} (last {n}), {last - first:+.2f}"]
    for i, r in enumerate(rows):
        d = r.get("decision")
        if not d or d["verdict"] != "admit" or d.get("urgent", True) or d.get("payback_steps") is None:
            continue
        lines.append(
            f"step {r['step']}: admitted ({', '.join(d['triggers'])}), "
            f"predicted ΔL {d['delta_s']:.3g} s/step, L_tran {d['l_tran_s']:.3g} s: {d['reason']}; "
            f"measured: {measured_payback(rows, i, bool(d.get('sunk_rebuilds')))}"
        )
    return lines


def write_report(metrics: Path, out: Path, title: str, policy: str = "nereus") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics)
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(steps, [r["reward"] for r in rows], marker="o", label="reward")
    if any(r.get("accuracy") is not None for r in rows):  # none under verifier: none
        accuracy = [r["accuracy"] if r.get("accuracy") is not None else float("nan") for r in rows]
        axes[0].plot(steps, accuracy, marker=".", label="accuracy")
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
    fig.suptitle(f"{title}: policy {policy}", parse_math=False)  # a run name is text, "$" too
    fig.tight_layout()
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
