"""Admission under drift: nereus vs static, always (DynaRL-style), periodic:3, and the two
references static-best and oracle — and a γ sweep.

PPO Llama-3.1-8B, responses growing like the paper's trace 1 (mean 1,147 → 3,722 tokens over 25
steps, p95 12% above), GPU supply from both shipped AWS spot traces (random revocations, seeded):

* ``a100-8-32``: a100-64gb-hdr100, 2 GPUs per instance, 8 reserved, at most 32 (paper-notes §4.7);
* ``mi250x-256`` and ``mi250x-1024``: mi250x-slingshot, 16 / 64 GCDs per instance;
* ``a100-8-32-async`` and ``mi250x-256-async``: the same supply and lengths, asynchronous GRPO
  (8 samples per prompt, as many sequences per step as the PPO scenario): generation on GPUs of
  its own runs one batch ahead of inference and training (one-step off-policy). The simulator's
  truth models the overlap, the staleness wait, the weight sync that ends each step and the
  rollouts a crash drops (``nereus.sim.truth.asynchrony``); the planner prices async plans with
  its own max(L_gen, L_inf + L_train). Quick mode runs them without the references.

Trace time runs faster than simulated time so that the pool changes every few steps, as in the
paper (≈ 860 s steps on 300 s ticks with a change every ~11 ticks); larger pools process more
prompts per step (512, 4,096, 16,384), as jobs at those scales do. Every policy replays the same
windows (trace offsets) with the same seeds; a scenario's figure is the mean over its windows.
Every policy knows the failure domains: the trace's reserved floor (``min`` GPUs, never revoked)
and its revocation history (rate, event sizes, and how the rate falls as the pool stays
unchanged), so placement keeps a replica of each trainer on reserved GPUs when it fits and
admission prices the work a step loses with a revoked GPU and the restart a plan risks. The
references: ``static-best`` (static on the TP/PP best in hindsight) and ``oracle`` (the best
plan every step, moves and restarts free — see ``nereus.sim.engine.simulate``). Each policy's
*share of the oracle's gain* is (static − policy) / (static − oracle), reported only where the
oracle beats static.
Writes ``benchmarks/results/admission.json`` and ``admission.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from common import RESULTS, write

from nereus.sim import GpuSupply, Scenario, SeqCurve, SpotTrace, simulate
from nereus.spec import Role, load_cluster, load_model, load_workload, names
from nereus.spec.registry import trace_path
from nereus.spec.workload import ExecutionMode

TRACES = [trace_path(name) for name in names("traces")]  # the AWS spot traces shipped in configs/traces
POLICIES = ("nereus", "static", "always", "periodic:3", "static-best", "oracle")
GAMMAS = (0.0, 0.25, 0.5, 0.75, 1.0)
QUICK_ASYNC = ("nereus", "static", "always", "periodic:3")  # quick mode beyond A100 PPO: no references (slow)
ASYNC_KEYS = ("mean_overlap_s", "mean_gen_wait_s", "mean_train_wait_s", "mean_sync_s", "mean_staleness")
TARGETS = {
    "nereus_vs_static": "≥ 25% lower mean step time (paper −27.7%)",
    "nereus_vs_always": "≥ 5% lower (paper −8.3%)",
    "nereus_vs_periodic3": "no slower (paper −2.5%)",
    "nereus_vs_static-best": "reported (no paper figure)",
    "nereus_vs_oracle": "reported: the oracle bounds what admission can gain",
    "nereus_oom_steps": 0,
}
SCENARIOS = {
    # name: (cluster, GPUs per instance, min, max, trace speedup, sequences per step, workload)
    "a100-8-32": ("a100-64gb-hdr100", 2, 8, 32, 5.0, 512, "ppo"),
    "mi250x-256": ("mi250x-slingshot", 16, 64, 256, 10.0, 4096, "ppo"),
    "mi250x-1024": ("mi250x-slingshot", 64, 256, 1024, 10.0, 16384, "ppo"),
    # asynchronous GRPO (8 samples per prompt, as many sequences per step), one-step off-policy
    "a100-8-32-async": ("a100-64gb-hdr100", 2, 8, 32, 5.0, 512, "grpo-async"),
    "mi250x-256-async": ("mi250x-slingshot", 16, 64, 256, 10.0, 4096, "grpo-async"),
}


def scenario(name: str, trace: Path, offset: int, steps: int, seed: int) -> Scenario:
    cluster, per_instance, lo, hi, speedup, sequences, workload = SCENARIOS[name]
    algo, _, mode = workload.partition("-")
    w = load_workload(algo)
    model = load_model("llama-3.1-8b")
    return Scenario(
        dataclasses.replace(
            w, prompts_per_step=sequences // w.samples_per_prompt, mode=ExecutionMode(mode or "sync")
        ),
        {r: model for r in Role},
        load_cluster(cluster),
        GpuSupply(SpotTrace.load(trace), per_instance, hi, lo, offset, speedup, seed),
        SeqCurve.growth(1147.5, 3722.0, 25, 1.12),
        steps,
        seed,
    )


Unit = tuple[str, str, int, int, str, float]  # scenario, trace file, offset, steps, policy, γ


def units(
    name: str,
    offsets: list[int],
    steps: int,
    sweep: bool,
    policies: tuple[str, ...],
    traces: tuple[Path, ...] = tuple(TRACES),
) -> list[Unit]:
    """One simulation per trace, window and policy (and γ of the sweep), in report order."""
    runs = [(p, 0.5) for p in policies] + ([("nereus", g) for g in GAMMAS if g != 0.5] if sweep else [])
    return [(name, str(t), o, steps, p, g) for t in traces for o in offsets for p, g in runs]


def simulate_unit(unit: Unit) -> dict[str, Any]:
    """One window under one policy: its summary, where its time went and the model's error."""
    name, trace, offset, steps, policy, gamma = unit
    s = simulate(scenario(name, Path(trace), offset, steps, seed=offset), policy, gamma)
    row = {"trace": Path(trace).stem, "offset": offset, **s.to_json()}
    row.update(breakdown=s.breakdown(), model=s.model_error())
    return row


def _weight(unit: Unit) -> float:
    """A simulation's rough cost: steps × largest pool, times the runs static-best makes."""
    name, _, _, steps, policy, _ = unit
    return steps * SCENARIOS[name][3] * (6.0 if policy == "static-best" else 1.0)


def run(
    name: str,
    offsets: list[int],
    steps: int,
    sweep: bool,
    policies: tuple[str, ...] = POLICIES,
    done: dict[Unit, dict[str, Any]] | None = None,
    traces: tuple[Path, ...] = tuple(TRACES),
) -> dict[str, Any]:
    """A scenario's report; ``done``: its windows already simulated (a parallel run), else here."""
    per: dict[str, list[dict[str, Any]]] = {}
    for unit in units(name, offsets, steps, sweep, policies, traces):
        policy, gamma = unit[4], unit[5]
        label = f"nereus(γ={gamma:g})" if policy == "nereus" and gamma != 0.5 else policy
        per.setdefault(label, []).append(done[unit] if done is not None else simulate_unit(unit))
    summary = {}
    for label, rows in per.items():
        summary[label] = {
            "mean_step_s": statistics.mean(r["mean_step_s"] for r in rows),
            "transitions": statistics.mean(r["transitions"] for r in rows),
            "tp_pp_transitions": statistics.mean(r["tp_pp_transitions"] for r in rows),
            "restarts": statistics.mean(r["restarts"] for r in rows),
            "oom_steps": sum(r["oom_steps"] for r in rows),
            "dropped_rollouts": statistics.mean(r["dropped_rollouts"] for r in rows),
            **{k: statistics.mean(r[k] for r in rows) for k in ASYNC_KEYS if all(k in r for r in rows)},
            "breakdown": {k: statistics.mean(r["breakdown"][k] for r in rows) for k in rows[0]["breakdown"]},
            "model": _model(rows),
            "windows": rows,
        }
    ref = summary["nereus"]["mean_step_s"]
    ratios = {
        f"nereus_vs_{p.replace(':', '')}": ref / summary[p]["mean_step_s"] - 1.0
        for p in policies
        if p != "nereus"
    }
    shares: dict[str, float | None] = {}
    if "oracle" in summary:
        static, oracle = summary["static"]["mean_step_s"], summary["oracle"]["mean_step_s"]
        shares = {
            p: (static - summary[p]["mean_step_s"]) / (static - oracle) if static > oracle else None
            for p in policies
            if p not in ("static", "oracle")
        }
    return {
        "policies": summary,
        "nereus_relative": ratios,
        "share_of_oracle_gain": shares,
        "breakdown": {
            f"{a}_minus_{b}": _gap(summary[a], summary[b])
            for a, b in (("nereus", "static"), ("oracle", "static-best"), ("oracle", "static"))
            if a in summary and b in summary
        },
    }


def _mean(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.mean(got) if got else None


def _model(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's model against the truth over a policy's windows (``Summary.model_error``):
    mean predicted / true step and its MAPE on the plans run, per model-stage; for the
    opportunistic moves admitted the predicted latency gain and cost per move against the
    realized ones, and the risk change ΔL also held (``urgent_moves``: the rest, whose plan left
    could not run); and the steps the risk priced, try by try: lost tries expected against lost
    (summed over the windows) and the seconds per try expected against lost."""
    models = [r["model"] for r in rows]
    stages = sorted({n for m in models for n in m["stage_ratio"]})
    counts = ("moves", "urgent_moves", "priced_tries", "lost_tries", "lost_tries_predicted")
    keys = [k for k in models[0] if k != "stage_ratio" and k not in counts]
    return {
        **{k: _mean([m[k] for m in models]) for k in keys},
        **{k: sum(m.get(k, 0) for m in models) for k in counts},
        "stage_ratio": {n: _mean([m["stage_ratio"].get(n) for m in models]) for n in stages},
    }


def _gap(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where policy a's mean step differs from policy b's, seconds per step by component
    (``Summary.breakdown``): ``plan`` (the truth's time of the steps that completed: plan
    quality, on the pools each run saw), ``lost`` (steps preempted or out of memory), ``moves``,
    ``restarts``, ``stalled``, ``startup`` (the start-up collective sweep; the oracle's is free); and
    each one's share of the gap."""
    parts = {
        "plan": a["breakdown"]["useful_s"] - b["breakdown"]["useful_s"],
        "lost": a["breakdown"]["lost_s"] - b["breakdown"]["lost_s"],
        "moves": a["breakdown"]["moves_s"] - b["breakdown"]["moves_s"],
        "restarts": a["breakdown"]["restarts_s"] - b["breakdown"]["restarts_s"],
        "stalled": a["breakdown"]["stalled_s"] - b["breakdown"]["stalled_s"],
        "startup": a["breakdown"].get("startup_s", 0.0) - b["breakdown"].get("startup_s", 0.0),
    }
    gap = a["mean_step_s"] - b["mean_step_s"]
    return {
        "gap_s": gap,
        "by_component_s": parts,
        "share": {k: (v / gap if gap else None) for k, v in parts.items()},
    }


def plot(results: dict[str, Any], out: Path, stem: str = "admission") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    sweeps = {}  # γ → nereus / static mean step, per scenario that ran the sweep
    for name in names:
        pol = results[name]["policies"]
        keys = {g: "nereus" if g == 0.5 else f"nereus(γ={g:g})" for g in GAMMAS}
        pts = [(g, pol[k]["mean_step_s"] / pol["static"]["mean_step_s"]) for g, k in keys.items() if k in pol]
        if len(pts) > 1:
            sweeps[name] = pts
    panels = len(names) + (1 if sweeps else 0)  # no empty γ panel for a run without the sweep
    fig, grid = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    axes = list(grid[0])
    for ax, name in zip(axes, names, strict=False):
        pol = results[name]["policies"]
        labels = [p for p in POLICIES if p in pol]
        values = [pol[p]["mean_step_s"] for p in labels]
        bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
        for b, p in zip(bars, labels, strict=True):
            ax.text(
                b.get_x() + b.get_width() / 2,
                b.get_height(),
                f"{pol[p]['transitions']:.1f} tr",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("mean step time (s)")
        ax.tick_params(axis="x", labelsize=7)
    if sweeps:
        ax = axes[-1]
        for name, pts in sweeps.items():
            ax.plot([g for g, _ in pts], [v for _, v in pts], "o-", label=name)
        ax.set_xlabel("γ")
        ax.set_ylabel("nereus / static mean step")
        ax.set_title("γ sweep", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one window of the first trace, 12 steps, no 1,024-GPU scenario, the references"
        " (static-best, oracle) at A100 PPO only",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument(
        "--jobs", type=int, default=1, help="simulations run side by side in worker processes (same results)"
    )
    ap.add_argument("--no-sweep", action="store_true", help="leave out the γ sweep")
    ap.add_argument(
        "--scenarios", default="", help="comma-separated scenarios to run (default: all of the mode)"
    )
    ap.add_argument("--name", default="admission", help="result file stem (admission: admission.json/.png)")
    args = ap.parse_args()
    plan: dict[str, tuple[list[int], int, bool, tuple[str, ...]]]
    if args.quick:
        plan = {
            "a100-8-32": ([0], 12, True, POLICIES),
            "mi250x-256": ([0], 12, False, QUICK_ASYNC),
            "a100-8-32-async": ([0], 12, False, QUICK_ASYNC),
            "mi250x-256-async": ([0], 12, False, QUICK_ASYNC),
        }
    else:
        plan = {
            "a100-8-32": ([0, 800, 1600, 2400], 40, True, POLICIES),
            "mi250x-256": ([0, 1200], 40, True, POLICIES),
            "mi250x-1024": ([0, 1200], 30, True, POLICIES),
            "a100-8-32-async": ([0, 800, 1600, 2400], 40, False, POLICIES),
            "mi250x-256-async": ([0, 1200], 40, False, POLICIES),
        }
    traces = tuple(TRACES[:1]) if args.quick else tuple(TRACES)
    if args.jobs < 1:
        ap.error("--jobs must be a positive integer")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        ap.error(f"--name: a file stem of letters, digits, '_', '.', '-', got {args.name!r}")
    if args.scenarios:
        chosen = args.scenarios.split(",")
        unknown = [n for n in chosen if n not in plan]
        if unknown:
            ap.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(plan)})")
        plan = {n: plan[n] for n in chosen}
    if args.no_sweep:
        plan = {
            name: (offsets, steps, False, policies) for name, (offsets, steps, _, policies) in plan.items()
        }
    done: dict[Unit, dict[str, Any]] | None = None
    if args.jobs > 1:
        todo = [u for name, spec in plan.items() for u in units(name, *spec, traces)]
        todo.sort(key=_weight, reverse=True)  # the longest first: they set the critical path
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            done = dict(zip(todo, pool.map(simulate_unit, todo), strict=True))
    results = {}
    for name, (offsets, steps, sweep, policies) in plan.items():
        results[name] = run(name, offsets, steps, sweep, policies, done, traces)
        rel = results[name]["nereus_relative"]
        pol = results[name]["policies"]
        print(
            f"{name:16s} "
            + "  ".join(f"{p} {pol[p]['mean_step_s']:.1f}s/{pol[p]['transitions']:.1f}tr" for p in policies)
            + "  |  nereus "
            + "  ".join(f"{k[10:]} {v:+.1%}" for k, v in rel.items())
            + f"  | nereus OOM {pol['nereus']['oom_steps']}",
            flush=True,
        )
        for gap_name, gap in results[name]["breakdown"].items():
            parts = "  ".join(f"{k} {v:+.1f}s" for k, v in gap["by_component_s"].items())
            print(f"{'':16s} {gap_name}: {gap['gap_s']:+.1f}s/step = {parts}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out, args.name)
    summary = {
        name: {
            **r["nereus_relative"],
            "nereus_oom_steps": r["policies"]["nereus"]["oom_steps"],
            "breakdown_s": {k: g["by_component_s"] for k, g in r["breakdown"].items()},
            "model_step_ratio": {p: v["model"]["step_ratio"] for p, v in r["policies"].items()},
            **(
                {
                    "oracle_vs_static": r["policies"]["oracle"]["mean_step_s"]
                    / r["policies"]["static"]["mean_step_s"]
                    - 1.0,
                    "nereus_share_of_oracle_gain": r["share_of_oracle_gain"]["nereus"],
                }
                if "oracle" in r["policies"]
                else {}
            ),
        }
        for name, r in results.items()
    }
    path = write(
        args.name,
        TARGETS,
        results,
        {"summary": summary, "mode": "quick" if args.quick else "full", "sweep": not args.no_sweep},
        out=args.out,
    )
    print(f"wrote {path} and {args.out / f'{args.name}.png'}")


if __name__ == "__main__":
    main()
