"""Planner search time vs scale, against the exhaustive oracle and SCIP (issue: planner core).

PPO, Llama-3.1-8B (actor, critic, reference, reward of one size), responses of 2,048 tokens, on the
Frontier-style ``mi250x-slingshot`` cluster from 8 to 1,024 GCDs. For every size:

* dp: the planner (``nereus.plan.search``) end to end — pricing every candidate, frontier, exact
  program, placement — median of repeats, with each phase's median; ``solve_ms`` is frontier +
  program (what the oracles below also do from the same priced candidates).
* exhaustive: every valid plan (``nereus.plan.exhaustive``) from the same priced candidates, until
  it exceeds its memory limit; the gap is dp / exhaustive − 1.
* scip: the same problem as a MIP (``nereus.plan.scip``), under a time limit; dp and scip are run
  alternately (A B A B) so machine noise hits both.

* replans: what the planner costs inside the controller (``Controller._options``: the target and
  its held-layout alternatives), warm (the controller's ``PlanCache``) against cold (no cache), per
  kind of change since the last replan: none, the lengths, the calibration, the pool. ``warm`` of a
  change is that replan's first search (the target), with the median of each of its phases
  (``warm_target_pricing_ms``, ...); ``options`` the whole replan.

Times are wall clock; ``*_cpu_ms`` beside them is this process's CPU time (``time.process_time``),
which other load on the machine inflates less. Also the peak Python/NumPy memory of one dp
search (tracemalloc). Writes
``benchmarks/results/planner.json`` and ``planner.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

from common import RESULTS, write

from nereus.control.controller import Controller
from nereus.plan.calibration import Efficiencies
from nereus.plan.cost import CostModel
from nereus.plan.exhaustive import ExhaustiveTooLargeError, exhaustive
from nereus.plan.opclass import PRIOR_EFFICIENCY
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.scip import available as scip_available
from nereus.plan.scip import solve_scip
from nereus.plan.search import build_tables, search
from nereus.spec import Role, load_cluster, load_model, load_workload

TARGETS = {
    "dp_search_ms_at_32_gpus": 0.2,
    "dp_search_ms_at_1024_gpus": 50.0,
    "gap_to_exhaustive": 0.0,
    "paper_ms": {"32": 0.17, "1024": 338.0},
    "paper_scip_s": {"32": 0.0034, "1024": 511.0},
}


def problem(gpus: int) -> PlanningProblem:
    model = load_model("llama-3.1-8b")
    return PlanningProblem(
        load_workload("ppo"),
        {r: model for r in Role},
        load_cluster("mi250x-slingshot"),
        tuple(range(gpus)),
        SeqStats(256, 2048, 2048),
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(gpus: int, repeats: int, run_exhaustive: bool, scip_limit_s: float | None) -> dict[str, Any]:
    p = problem(gpus)
    search(p)  # warm caches (imports, numpy)
    runs, scip_runs, cpu = [], [], []
    scip_result = None
    for _ in range(repeats):  # A B A B: dp, then scip on the same priced candidates
        started = time.process_time()
        runs.append(search(p))
        cpu.append((time.process_time() - started) * 1e3)
        if scip_limit_s is not None and (not scip_runs or scip_runs[-1] < 5.0):
            tables = build_tables(CostModel(p))
            started = time.perf_counter()
            scip_result = solve_scip(p, scip_limit_s, tables)
            scip_runs.append(time.perf_counter() - started)
    dp = runs[-1]
    phases = {k: median([r.timings[k] for r in runs]) for k in dp.timings}
    row: dict[str, Any] = {
        "gpus": gpus,
        "dp_search_ms": median([r.search_ms for r in runs]),
        "dp_search_cpu_ms": median(cpu),  # CPU time of this process: less sensitive to other load
        "dp_solve_ms": phases["frontier_ms"] + phases["program_ms"],
        "dp_phases_ms": phases,
        "dp_step_latency_s": dp.step_latency_s,
        "plan": {e.model_stage: str(e.shape) for e in dp.estimates},
    }
    tracemalloc.start()
    search(p)
    row["dp_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    if run_exhaustive:
        try:
            ex = exhaustive(p, build_tables(CostModel(p)))
            row["exhaustive"] = {
                "count": ex.count,
                "seconds": ex.seconds,
                "best_step_latency_s": ex.best_step_latency_s,
                "gap": dp.step_latency_s / ex.best_step_latency_s - 1.0 if ex.best_step_latency_s else None,
            }
        except ExhaustiveTooLargeError as exc:
            row["exhaustive"] = {"error": str(exc)}
    if scip_result is not None:
        row["scip"] = {
            "seconds": median(scip_runs),
            "status": scip_result.status,
            "objective_s": scip_result.objective_s,
            "gap": (dp.step_latency_s / scip_result.objective_s - 1.0) if scip_result.objective_s else None,
            "ratio_to_dp_search": median(scip_runs) * 1e3 / row["dp_search_ms"],
        }
    return row


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall ms, CPU ms of this process, what ``fn`` returned)."""
    started, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return (time.perf_counter() - started) * 1e3, (time.process_time() - cpu) * 1e3, out


def measure_replans(gpus: int, repeats: int) -> dict[str, Any]:
    """Median ms of one replan's planner work, warm (cached) and cold, after each kind of change."""
    p = problem(gpus)
    plan = search(p).plan
    warm = Controller(p.workload, p.models, p.cluster, plan)
    cold = Controller(p.workload, p.models, p.cluster, plan, planner=partial(search, cache=None))
    node = p.cluster.gpus_per_node
    out: dict[str, Any] = {"gpus": gpus}
    times: dict[str, dict[str, list[float]]] = {}
    for i in range(repeats):
        for what in ("target", "options"):  # each measured on a change of its own
            k = 2 * i + (what == "options")
            before = replace(p, seq=SeqStats(256, 2048 * (1.0 + 0.01 * k), 2048 * (1.0 + 0.01 * k)))
            longer = SeqStats(256, 2048 * (1.3 + 0.01 * k), 2048 * (1.3 + 0.01 * k))
            eta = {op: v * (0.9 - 0.01 * k) for op, v in PRIOR_EFFICIENCY.items()}
            cases = {
                "repeat": before,
                "length": replace(before, seq=longer),
                "calibration": replace(before, efficiencies=Efficiencies(MappingProxyType(eta))),
                "pool": replace(before, pool=tuple(g for g in p.pool if g // node != k % (gpus // node))),
            }
            for name, q in cases.items():
                for label, c in (("warm", warm), ("cold", cold)):
                    c._options(c.problem(before.pool, before.seq))  # the replan before: its prices cached
                    t = replace(c.problem(q.pool, q.seq), efficiencies=q.efficiencies)
                    run = c._options if what == "options" else c.planner
                    row = times.setdefault(name, {})
                    ms, cpu_ms, result = _timed(lambda r=run, t=t: r(t))
                    row.setdefault(f"{label}_{what}_ms", []).append(ms)
                    row.setdefault(f"{label}_{what}_cpu_ms", []).append(cpu_ms)
                    if label == "warm" and what == "target":  # where the warm target search went
                        for phase, v in result.timings.items():
                            row.setdefault(f"warm_target_{phase}", []).append(v)
    for name, row in times.items():
        out[name] = {k: median(v) for k, v in row.items()}
    return out


def _phases(replan: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kind of change, the median ms of each phase of the warm target search."""
    return {
        k: {
            p.removeprefix("warm_target_"): round(x, 4)
            for p, x in v.items()
            if p.startswith("warm_target_") and p.endswith("_ms") and "cpu" not in p and p != "warm_target_ms"
        }
        for k, v in replan.items()
        if k != "gpus"
    }


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    gpus = [r["gpus"] for r in rows]
    ax.plot(gpus, [r["dp_search_ms"] for r in rows], "o-", label="nereus dp (end to end)")
    ax.plot(gpus, [r["dp_solve_ms"] for r in rows], "o--", label="nereus dp (frontier + program)")
    ex = [(r["gpus"], r["exhaustive"]["seconds"] * 1e3) for r in rows if "seconds" in r.get("exhaustive", {})]
    if ex:
        ax.plot(*zip(*ex, strict=True), "s-", label="exhaustive (all plans)")
    sc = [(r["gpus"], r["scip"]["seconds"] * 1e3) for r in rows if "scip" in r]
    if sc:
        ax.plot(*zip(*sc, strict=True), "^-", label="SCIP (MIP)")
    ax.plot([32, 1024], [0.17, 338.0], "kx", label="paper (nereus)")
    ax.axhline(50.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (MI250X GCDs)")
    ax.set_ylabel("plan search time (ms)")
    ax.set_title("PPO Llama-3.1-8B plan search (median of repeats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "planner.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="8–128 GPUs, few repeats (under a minute)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for planner.json/.png")
    args = ap.parse_args()
    sizes = [8, 16, 32, 64, 128] if args.quick else [8, 16, 32, 64, 128, 256, 512, 1024]
    repeats = 5 if args.quick else 11
    exhaustive_upto = 32 if args.quick else 64
    scip_limit = 20.0 if args.quick else 300.0
    rows = []
    for gpus in sizes:
        row = measure(gpus, repeats, gpus <= exhaustive_upto, scip_limit if scip_available() else None)
        rows.append(row)
        ex = row.get("exhaustive", {})
        print(
            f"{gpus:5d} GPUs  dp {row['dp_search_ms']:8.2f} ms (solve {row['dp_solve_ms']:6.2f})"
            + (f"  exhaustive {ex['seconds']:7.2f} s gap {ex['gap']:+.2%}" if "seconds" in ex else "")
            + (f"  scip {row['scip']['seconds']:7.2f} s" if "scip" in row else ""),
            flush=True,
        )
    replans = [
        measure_replans(g, 3 if args.quick else 7) for g in (32, 1024) if args.quick is False or g <= 32
    ]
    for r in replans:
        print(
            f"{r['gpus']:5d} GPUs  replan target warm/cold ms: "
            + "  ".join(
                f"{k} {v['warm_target_ms']:.3f}/{v['cold_target_ms']:.2f}"
                for k, v in r.items()
                if k != "gpus"
            )
            + "\n            replan options warm/cold ms: "
            + "  ".join(
                f"{k} {v['warm_options_ms']:.3f}/{v['cold_options_ms']:.2f}"
                for k, v in r.items()
                if k != "gpus"
            ),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out)
    summary = {
        "dp_search_ms_at_32": next((r["dp_search_ms"] for r in rows if r["gpus"] == 32), None),
        "dp_search_ms_at_1024": next((r["dp_search_ms"] for r in rows if r["gpus"] == 1024), None),
        "max_gap_to_exhaustive": max(
            (r["exhaustive"]["gap"] for r in rows if "gap" in r.get("exhaustive", {})), default=None
        ),
        "exhaustive_tractable_upto_gpus": max(
            (r["gpus"] for r in rows if "seconds" in r.get("exhaustive", {})), default=None
        ),
        "max_dp_peak_mb": max(r["dp_peak_mb"] for r in rows),
        "replan_warm_target_ms_at_32": {k: v["warm_target_ms"] for k, v in replans[0].items() if k != "gpus"},
        "replan_cold_target_ms_at_32": {k: v["cold_target_ms"] for k, v in replans[0].items() if k != "gpus"},
        "replan_warm_target_cpu_ms_at_32": {
            k: v["warm_target_cpu_ms"] for k, v in replans[0].items() if k != "gpus"
        },
        # where a warm target search's time goes, per kind of change (median ms of each phase)
        "replan_warm_target_phases_ms_at_32": _phases(replans[0]),
    }
    if len(replans) > 1:
        summary["replan_warm_target_ms_at_1024"] = {
            k: v["warm_target_ms"] for k, v in replans[1].items() if k != "gpus"
        }
        summary["replan_warm_target_cpu_ms_at_1024"] = {
            k: v["warm_target_cpu_ms"] for k, v in replans[1].items() if k != "gpus"
        }
        summary["replan_warm_target_phases_ms_at_1024"] = _phases(replans[1])
    extra = {"summary": summary, "replans": replans, "mode": "quick" if args.quick else "full"}
    path = write("planner", TARGETS, rows, extra, out=args.out)
    print(f"wrote {path} and {args.out / 'planner.png'}")


if __name__ == "__main__":
    main()
