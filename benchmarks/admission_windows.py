"""One policy over many windows, against the same policy at another commit (issue 19).

``admission.py`` compares policies on a few windows per scenario; a change to one policy moves
its figure by more than the change is worth, because runs diverge at their first differing
decision and then meet different revocations (the per-window standard error is ~5%). This runs
one policy (default ``nereus``) on many windows of both shipped traces — A100 offsets 0, 400, …,
2,800, MI250X 0, 600, 1,200, 1,800 — and, with ``--against REV``, the same windows on the code at
``REV`` (a temporary ``git worktree``, its ``nereus`` imported in a subprocess; the scenarios are
this file's, from ``admission.py``). Per scenario: the mean step, the steps lost to revocations
and the useful seconds per step, and the geometric-mean ratio this/REV with its standard error
over windows. Simulated seconds are deterministic, so the two sides need not run at once.

``--versus P1,P2``: the same windows under other policies at this commit, and the policy against
each (the ratio, its standard error and the windows where it is faster). ``--held-out``: windows
``admission.py`` never runs (A100 offsets 100, 300, …, 3,100; MI250X 150, 450, …, 2,850), so a
figure there is not one any change was made on. ``--quick``: A100 PPO, two windows of the first
trace, 12 steps. Writes ``benchmarks/results/<--name>.json`` and ``.png`` (default
``admission-windows``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from admission import SCENARIOS, TRACES, scenario
from common import RESULTS, write

from nereus.control.policy import policy_config
from nereus.errors import ConfigError
from nereus.sim import simulate
from nereus.sim.engine import STATIC_BEST

OFFSETS = {"a100": list(range(0, 3200, 400)), "mi250x": [0, 600, 1200, 1800]}
# offsets admission.py never runs (it runs A100 0, 800, 1,600, 2,400 and MI250X 0, 1,200)
HELD_OUT = {"a100": list(range(100, 3200, 200)), "mi250x": list(range(150, 3000, 300))}
STEPS = {"mi250x-1024": 30}  # as admission.py; every other scenario runs 40 steps


def windows(names: list[str], quick: bool, held_out: bool = False) -> list[tuple[str, str, int, int]]:
    """(scenario, trace, offset, steps) of every window."""
    if quick:
        return [(n, str(TRACES[0]), o, 12) for n in names for o in ((100, 300) if held_out else (0, 400))]
    offsets = HELD_OUT if held_out else OFFSETS
    return [(n, str(t), o, STEPS.get(n, 40)) for n in names for t in TRACES for o in offsets[n.split("-")[0]]]


def run_window(args: tuple[str, str, int, int, str]) -> dict[str, Any]:
    name, trace, offset, steps, policy = args
    s = simulate(scenario(name, Path(trace), offset, steps, seed=offset), policy, 0.5)
    b = s.breakdown()
    return {
        "scenario": name, "trace": Path(trace).stem, "offset": offset, "policy": policy,
        "mean_step_s": s.mean_step_s, "lost_s": b["lost_s"], "useful_s": b["useful_s"],
        "preempted_steps": s.preempted_steps, "oom_steps": s.oom_steps,
    }  # fmt: skip


def run_all(
    names: list[str], policies: list[str], jobs: int, quick: bool, held_out: bool = False
) -> list[dict[str, Any]]:
    """Every window under every policy, in one pool (rows in the order of ``policies``)."""
    todo = [(*w, p) for p in policies for w in windows(names, quick, held_out)]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_window, todo))


def run_at(
    rev: str, names: list[str], policy: str, jobs: int, quick: bool, held_out: bool = False
) -> tuple[str, list[dict[str, Any]]]:
    """The same windows on the code at ``rev``: a detached worktree, this script in a subprocess
    importing that tree's ``nereus``."""
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=root, check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree, out = Path(tmp) / "tree", Path(tmp) / "rows.json"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), sha], cwd=root, check=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, __file__, "--inner", str(out), "--policy", policy, "--jobs", str(jobs)]
            cmd += ["--scenarios", ",".join(names), *(["--quick"] if quick else [])]
            cmd += ["--held-out"] if held_out else []
            subprocess.run(cmd, cwd=tree, env=env, check=True)
            return sha, json.loads(out.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=False)


def compare(rows: list[dict[str, Any]], base: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Per scenario: means of this side (and the base), and the ratio's geometric mean ± SE."""
    key = lambda r: (r["scenario"], r["trace"], r["offset"])  # noqa: E731
    old = {key(r): r for r in base or []}
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == name]
        entry: dict[str, Any] = {"windows": len(mine)}
        for field in ("mean_step_s", "lost_s", "useful_s"):
            entry[field] = sum(r[field] for r in mine) / len(mine)
            if base is not None:
                entry[f"base_{field}"] = sum(old[key(r)][field] for r in mine) / len(mine)
        if base is not None:
            logs = [math.log(r["mean_step_s"] / old[key(r)]["mean_step_s"]) for r in mine]
            m = sum(logs) / len(logs)
            sd = math.sqrt(sum((x - m) ** 2 for x in logs) / max(1, len(logs) - 1))
            entry["ratio"], entry["ratio_se"] = math.exp(m) - 1.0, sd / math.sqrt(len(logs))
            entry["faster_windows"] = sum(1 for x in logs if x < 0)
        out[name] = entry
    return out


def plot(
    summary: dict[str, Any], path: Path, sha: str, base: str | None, versus: dict[str, Any], policy: str
) -> None:
    """The ratio against ``base`` per scenario; else the ratio against each ``versus`` policy
    (grouped per scenario); else the mean step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    if base is None and versus:
        width = 0.8 / len(versus)
        for i, (other, per) in enumerate(versus.items()):
            xs = [j + (i - (len(versus) - 1) / 2) * width for j in range(len(names))]
            ratios = [100 * per[n]["ratio"] for n in names]
            ses = [100 * per[n]["ratio_se"] for n in names]
            ax.bar(xs, ratios, width, yerr=ses, capsize=3, label=f"vs {other}")
        ax.set_xticks(range(len(names)), names)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel(f"{policy} mean step vs policy (%)")
        ax.legend(fontsize=7)
    elif base is not None:
        ratios = [100 * summary[n]["ratio"] for n in names]
        ses = [100 * summary[n]["ratio_se"] for n in names]
        ax.bar(names, ratios, yerr=ses, capsize=4, color="tab:blue")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel(f"mean step, {sha} vs {base} (%)")
    else:
        ax.bar(names, [summary[n]["mean_step_s"] for n in names], color="tab:blue")
        ax.set_ylabel(f"mean step (s), {sha}")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--against", default=None, help="a commit to run the same windows at (default: none)")
    ap.add_argument("--policy", default="nereus")
    ap.add_argument("--versus", default="", help="other policies on the same windows, comma-separated")
    ap.add_argument("--held-out", action="store_true", help="only windows admission.py never runs")
    ap.add_argument("--name", default="admission-windows", help="the result's file stem")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--quick", action="store_true", help="A100 PPO, two windows, 12 steps")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--inner", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = ["a100-8-32"] if args.quick else args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or args.jobs < 1:
        ap.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(SCENARIOS)})" if unknown
                 else "--jobs must be a positive integer")  # fmt: skip
    versus = [p for p in args.versus.split(",") if p]
    for p in [args.policy, *versus]:
        if p != STATIC_BEST:
            try:
                policy_config(p)
            except ConfigError as exc:
                ap.error(f"--policy/--versus: {exc}")
    if args.policy in versus or len(set(versus)) != len(versus):
        ap.error(f"--versus: each policy once, and not --policy {args.policy!r}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        ap.error(f"--name: a file stem of letters, digits, '_', '.', '-', got {args.name!r}")
    if args.inner is not None:  # the --against side: rows only
        args.inner.write_text(json.dumps(run_all(names, [args.policy], args.jobs, args.quick, args.held_out)))
        return
    every = run_all(names, [args.policy, *versus], args.jobs, args.quick, args.held_out)
    rows = [r for r in every if r["policy"] == args.policy]
    base_sha, base = (
        run_at(args.against, names, args.policy, args.jobs, args.quick, args.held_out)
        if args.against
        else (None, None)
    )
    summary = compare(rows, base)
    against = {p: compare(rows, [r for r in every if r["policy"] == p]) for p in versus}
    for p, per in against.items():
        for name, e in per.items():
            print(
                f"{name:18s} {args.policy} {e['mean_step_s']:7.1f} s vs {p} {e['base_mean_step_s']:7.1f} s"
                f"  {100 * e['ratio']:+.1f}% ± {100 * e['ratio_se']:.1f}"
                f"  faster in {e['faster_windows']} of {e['windows']}",
                flush=True,
            )
    for name, e in summary.items():
        line = (
            f"{name:18s} {e['windows']:2d} windows  mean {e['mean_step_s']:7.1f} s  lost {e['lost_s']:5.1f}"
        )
        if base is not None:
            line += (
                f"  (at {base_sha}: {e['base_mean_step_s']:.1f} s, lost {e['base_lost_s']:.1f})"
                f"  {100 * e['ratio']:+.1f}% ± {100 * e['ratio_se']:.1f}"
            )
        print(line, flush=True)
    targets = {
        "ratio": "reported: this policy's mean step against the same at --against, per scenario",
        "versus": "reported: this policy against each --versus policy on the same windows, per scenario",
    }
    results = {"summary": summary, "versus": against, "windows": every, "base_windows": base}
    meta = {"policy": args.policy, "against": base_sha, "held_out": args.held_out, "versus_policies": versus}
    path = write(args.name, targets, results, meta, out=args.out)
    sha = json.loads(path.read_text())["git_sha"]
    plot(summary, path.with_suffix(".png"), sha, base_sha, against, args.policy)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
