"""Transition scheduling: the greedy (resource edges + list schedule) against the exact RCPSP in SCIP.

PPO, Llama-3.1-8B, responses of 2,048 tokens, on the Frontier-style ``mi250x-slingshot`` cluster
from 32 to 1,024 GCDs. At every size the planner plans a pool, then re-plans under drift (anchored
on the running plan, so placement keeps what does not move) and the transition between the two
is scheduled. Drifts: the pool doubles (50% → 100%), responses double (2,048 → 4,096 tokens), the
pool shrinks (100% → 75%, the leaving GPUs still readable). For every pair:

* what the controller pays to decide (``plan_ms``): ``price_transition``, the call admission
  makes (``DagEstimator``), median of repeats, wall and CPU time of the timing thread;
  ``plan_path`` says what ran: ``class`` (replica classes straight from the two plans,
  ``classplan.py``: no per-unit node) or ``per-unit`` (the exact greedy) where it does not apply.
  ``expand_ms``: what a class plan costs when the transition is executed (the per-unit DAG built
  and the class schedule laid onto it), paid after admission; ``executed_path`` says
  whether the per-unit groups were the classes (``class``) or the exact planner ran instead;
* the exact per-unit greedy (``greedy_*``): ``plan_transition`` end to end with ``grouped=False``
  (moves, DAG, schedule), and separately ``build_dag`` + ``best_schedule`` alone and
  ``best_schedule`` alone;
* the greedy makespan L_tran (seconds) and on integer ticks (the tick is chosen so that the
  greedy horizon has at most ``--slots`` slots; durations round up);
* SCIP's makespan of the same tick instance (``nereus.transition.rcpsp``: LOCAL precedence only,
  ports, per-GPU memory; greedy as starting solution), its status, bound and time, and the gap
  greedy / SCIP − 1 (and greedy / bound − 1, what the greedy can at most be off); SCIP's schedule
  is re-checked (precedence, ports, memory). When the builder finds the DAG infeasible, SCIP is
  run on a serial horizon to tell a true infeasibility from one the greedy builder missed;
* where the class plan ran: its makespan on the same ticks (each class ``rounds × ticks``,
  scheduled as admission schedules it), the expanded per-unit tick schedule checked like SCIP's
  (``class_valid``: precedence, ports, memory) and ``class_gap`` = class / SCIP − 1, SCIP on the
  class plan's own DAG (Split → Extend → Merge) where the greedy kept direct re-layouts
  (``class_dag_is_greedy_dag`` false; ``class_scip_ticks``);
* the target (greedy within 5% of SCIP) two ways: ``met.gap_vs_scip`` against SCIP's incumbent,
  and ``met.gap_vs_scip_proven`` with a certificate: where SCIP stopped at its time limit (its
  incumbent may be the greedy's own starting solution), against its lower bound instead;
* a diagnostic: the list schedule with commit-order priority alone (same DAG, same ticks), to
  show what the second, longest-remaining-path pass of ``best_schedule`` gains.

Writes ``benchmarks/results/dag_schedule.json`` and ``dag_schedule.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from pathlib import Path
from typing import Any

from common import RESULTS, write

from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import search
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.workload import STAGE_ORDER
from nereus.transition import plan_transition
from nereus.transition.between import ledger_capacity, price_transition, stage_moves
from nereus.transition.build import build_dag, initial_bytes
from nereus.transition.dag import TransitionDag
from nereus.transition.group import match, schedule_groups
from nereus.transition.links import LinkModel
from nereus.transition.rcpsp import available as scip_available
from nereus.transition.rcpsp import solve_rcpsp, verify
from nereus.transition.schedule import Schedule, best_schedule, list_schedule, lower_bound

GREEDY_MS_AT_1024 = 1.22  # plan_transition as admission calls it, median of repeats
GAP_VS_SCIP = 0.05  # greedy makespan / SCIP makespan − 1, same tick instance
TARGETS = {
    "greedy_ms_at_1024": GREEDY_MS_AT_1024,
    "gap_vs_scip": GAP_VS_SCIP,
    "paper": "greedy within 5% of SCIP makespan; greedy planning ≤ 1.22 ms at 1,024 GPUs",
    "plan_ms_at_1024": GREEDY_MS_AT_1024,
}
CLUSTER = "mi250x-slingshot"
MODEL = "llama-3.1-8b"
# name: (pool fraction before, response before, pool fraction after, response after)
DRIFTS = {
    "pool 50%→100%": (0.5, 2048, 1.0, 2048),
    "response 2048→4096": (1.0, 2048, 1.0, 4096),
    "pool 100%→75%": (1.0, 2048, 0.75, 2048),
}


def problem(gpus: int, response: int) -> PlanningProblem:
    model, workload = load_model(MODEL), load_workload("ppo")
    return PlanningProblem(
        workload,
        {r: model for r in Role},
        load_cluster(CLUSTER),
        tuple(range(gpus)),
        SeqStats.fixed(256, response),
        space=SearchSpace.engines(workload),  # generation at pp 1, as vLLM runs it
    )


def plans(gpus: int, drift: str) -> tuple[PlanningProblem, Plan, Plan]:
    f1, r1, f2, r2 = DRIFTS[drift]
    current = search(problem(int(gpus * f1), r1)).plan
    p2 = dataclasses.replace(problem(int(gpus * f2), r2), anchor=current)
    return p2, current, search(p2).plan


def median_ms(fn: Any, repeats: int, clock: Any = time.perf_counter) -> float:
    """Median time of ``fn`` in ms on ``clock`` (wall by default), garbage collector off while
    timing (as ``timeit`` does)."""
    fn()  # warm
    runs = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            started = clock()
            fn()
            runs.append(clock() - started)
    finally:
        gc.enable()
    return statistics.median(runs) * 1e3


def expand_ms(p: PlanningProblem, current: Plan, target: Plan, repeats: int) -> float | None:
    """Median wall ms of expanding a fresh class plan (built outside the timing) for execution."""
    runs = []
    for _ in range(max(3, repeats // 2)):
        priced = price_transition(p, current, target)
        if priced.classes is None:
            return None
        started = time.perf_counter()
        _ = priced.transition
        runs.append(time.perf_counter() - started)
    return statistics.median(runs) * 1e3


def class_ticks(
    tr: Any, durations: list[int], rank: dict[str, int], order_of: dict[str, int]
) -> tuple[int, list[int]] | None:
    """The class plan on integer ticks (a member ``durations[i]``, a class ``rounds ×`` that),
    scheduled as admission schedules it, and its expansion's per-node starts."""
    from nereus.transition.build import _CLASS, _RELEASE_FIRST

    plan, dag = tr.classes, tr.transition.dag
    found = match(dag.nodes, [e for e in dag.edges if e.kind.value == "local"], plan.signatures())
    if found is None:
        return None
    groups, to = found
    d = [0] * len(plan.nodes)
    for g, mine in enumerate(groups.members):
        d[to[g]] = durations[mine[0]]
    classes = plan.derived.classes
    nodes = [
        dataclasses.replace(n, est_s=float(d[i] * c.rounds))
        for i, (n, c) in enumerate(zip(plan.nodes, classes, strict=True))
    ]
    sched = schedule_groups(nodes, plan.edges, {}, rank, order_of, (_CLASS, _RELEASE_FIRST))
    starts = [
        round(sched.start[to[groups.of[i]]]) + groups.round[i] * durations[i] for i in range(len(dag.nodes))
    ]
    return round(sched.makespan), starts


def measure(gpus: int, drift: str, repeats: int, scip_limit_s: float | None, slots: int) -> dict[str, Any]:
    p, current, target = plans(gpus, drift)
    tr = plan_transition(p, current, target)
    moves = stage_moves(p, current, target)
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    links = LinkModel(p.cluster, p.efficiencies)
    cap = ledger_capacity(p)
    dag = tr.dag
    row: dict[str, Any] = {
        "gpus": gpus,
        "drift": drift,
        "from": {"pool": int(gpus * DRIFTS[drift][0]), "response": DRIFTS[drift][1]},
        "to": {"pool": len(p.pool), "response": DRIFTS[drift][3]},
        "nodes": len(dag.nodes),
        "edges": len(dag.edges),
        "resource_edges": dag.resource_edges,
        "moved_gib": tr.moved_bytes / 2**30,
        "feasible": dag.feasible,
        "reason": dag.reason,
        "greedy_plan_ms": median_ms(lambda: plan_transition(p, current, target), repeats),
        "greedy_plan_cpu_ms": median_ms(
            lambda: plan_transition(p, current, target), repeats, time.thread_time
        ),
        "greedy_dag_schedule_ms": median_ms(lambda: _scheduled(build_dag(moves, rank, links, cap)), repeats),
        "greedy_schedule_ms": median_ms(lambda: _scheduled(dag), repeats),
        "greedy_makespan_s": tr.l_tran_s if dag.feasible else None,
    }
    # what admission pays: the class plan where it applies (the per-unit DAG waits for execution)
    decided = price_transition(p, current, target)
    plan_makespan = decided.l_tran_s if decided.feasible else None
    row.update(
        {
            "plan_path": decided.path,
            "plan_ms": median_ms(lambda: price_transition(p, current, target), repeats),
            "plan_cpu_ms": median_ms(lambda: price_transition(p, current, target), repeats, time.thread_time),
            "plan_makespan_s": plan_makespan,
            "expand_ms": expand_ms(p, current, target, repeats),
            "class_nodes": len(decided.classes.nodes) if decided.classes is not None else None,
        }
    )
    executed = decided.transition
    row["executed_path"] = executed.path
    row["executed_makespan_s"] = executed.l_tran_s if executed.feasible else None
    row["plan_vs_executed"] = (
        plan_makespan / executed.l_tran_s - 1.0 if plan_makespan is not None and executed.feasible else None
    )
    row["plan_vs_greedy"] = (
        plan_makespan / tr.l_tran_s - 1.0
        if plan_makespan is not None and dag.feasible and tr.l_tran_s > 0
        else None
    )
    if not dag.nodes or scip_limit_s is None:
        return row
    init = initial_bytes(tr.moves)
    r = solve_rcpsp(dag, init, max_slots=slots, time_limit_s=scip_limit_s)
    row.update(
        {
            "tick_s": r.tick_s,
            "horizon_ticks": r.horizon_ticks,
            "greedy_ticks": r.greedy_ticks,
            "greedy_ticks_s": r.greedy_ticks * r.tick_s if r.greedy_ticks is not None else None,
            "scip": {
                "makespan_ticks": r.makespan_ticks,
                "makespan_s": r.makespan_s,
                "bound_ticks": r.bound_ticks if r.bound_ticks < 1e19 else None,
                "status": r.status,
                "seconds": r.seconds,
                "solve_seconds": r.solve_seconds,
                "variables": r.variables,
                "constraints": r.constraints,
                "valid": not verify(dag, init, r.durations, r.starts) if r.starts is not None else None,
            },
            "gap": r.gap,
            "gap_to_bound": r.gap_to_bound,
        }
    )
    if dag.feasible:
        durations = list(r.durations)
        row["greedy_commit_order_ticks"] = round(list_schedule(dag, [float(d) for d in durations]).makespan)
    if decided.classes is not None and executed.path == "class" and r.makespan_ticks:
        rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
        order_of = {ms.name: i for i, ms in enumerate(target.workflow.model_stages)}
        # the class plan plans Split → Extend → Merge; where the per-unit greedy kept direct
        # re-layouts (another DAG), SCIP solves the class plan's own DAG for its comparison
        same = executed.dag.nodes == dag.nodes and executed.dag.edges == dag.edges  # (not order, peak)
        own = r if same else solve_rcpsp(executed.dag, init, max_slots=slots, time_limit_s=scip_limit_s)
        row["class_dag_is_greedy_dag"] = same
        row["class_scip_ticks"] = own.makespan_ticks
        ct = class_ticks(decided, list(own.durations), rank, order_of) if own.makespan_ticks else None
        if ct is not None:
            ticks_, starts = ct
            row["class_ticks"] = ticks_
            row["class_valid"] = not verify(executed.dag, init, own.durations, starts, edges=None)
            row["class_gap"] = ticks_ / own.makespan_ticks - 1.0
    return row


def _scheduled(dag: TransitionDag) -> Schedule:
    """``best_schedule`` as the planner calls it: with the lower bound, so it samples only where
    its two schedules stay over 5% above it."""
    return best_schedule(dag, bound=lower_bound(dag))


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def per_scale(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for gpus in sorted({r["gpus"] for r in rows}):
        mine = [r for r in rows if r["gpus"] == gpus]
        gaps = [r["gap"] for r in mine if r.get("gap") is not None]
        class_gaps = [r["class_gap"] for r in mine if r.get("class_gap") is not None]
        out.append(
            {
                "gpus": gpus,
                "greedy_plan_ms_median": median([r["greedy_plan_ms"] for r in mine]),
                "greedy_plan_ms_max": max(r["greedy_plan_ms"] for r in mine),
                "greedy_plan_cpu_ms_median": median([r["greedy_plan_cpu_ms"] for r in mine]),
                "greedy_dag_schedule_ms_median": median([r["greedy_dag_schedule_ms"] for r in mine]),
                "greedy_schedule_ms_median": median([r["greedy_schedule_ms"] for r in mine]),
                "plan_ms_median": median([r["plan_ms"] for r in mine]),
                "plan_ms_max": max(r["plan_ms"] for r in mine),
                "plan_cpu_ms_median": median([r["plan_cpu_ms"] for r in mine]),
                "plan_paths": [r["plan_path"] for r in mine],
                "expand_ms_median": median([e for r in mine if (e := r["expand_ms"]) is not None]),
                "plan_vs_greedy_max": max(
                    (g for r in mine if (g := r["plan_vs_greedy"]) is not None), default=None
                ),
                "class_gap_max": max(class_gaps, default=None),
                "gap_max": max(gaps, default=None),
                "gap_mean": statistics.fmean(gaps) if gaps else None,
                "scip_status": [r["scip"]["status"] for r in mine if "scip" in r],
                "scip_seconds_max": max((r["scip"]["seconds"] for r in mine if "scip" in r), default=None),
            }
        )
    return out


def plot(rows: list[dict[str, Any]], scales: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    gpus = [s["gpus"] for s in scales]
    ax.plot(gpus, [s["greedy_plan_ms_median"] for s in scales], "o-", label="per-unit greedy (end to end)")
    ax.plot(
        gpus, [s["greedy_dag_schedule_ms_median"] for s in scales], "s--", label="build_dag + best_schedule"
    )
    ax.plot(gpus, [s["greedy_schedule_ms_median"] for s in scales], "^:", label="best_schedule")
    ax.plot(
        gpus, [s["plan_ms_median"] for s in scales], "d-.", label="admission's plan (class where it applies)"
    )
    ex = [(s["gpus"], s["expand_ms_median"]) for s in scales if s["expand_ms_median"] is not None]
    if ex:
        ax.plot(*zip(*ex, strict=True), "v:", label="class plan expanded for execution")
    sc = [(s["gpus"], s["scip_seconds_max"] * 1e3) for s in scales if s["scip_seconds_max"] is not None]
    if sc:
        ax.plot(*zip(*sc, strict=True), "kx-", label="SCIP RCPSP (slowest pair)")
    ax.plot([1024], [GREEDY_MS_AT_1024], "r*", ms=12, label="target 1.22 ms at 1,024")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (MI250X GCDs)")
    ax.set_ylabel("planning time (ms, median over drift pairs)")
    ax.set_title("Transition planning time")
    ax.legend(fontsize=8)
    markers = {d: m for d, m in zip(DRIFTS, "os^", strict=True)}
    for d, mk in markers.items():
        pts = [
            (r["gpus"], 100 * r["gap"], r["scip"]["status"])
            for r in rows
            if r["drift"] == d and r.get("gap") is not None
        ]
        for opt in (True, False):
            sel = [(g, v) for g, v, s in pts if (s == "optimal") == opt]
            if sel:
                color = f"C{list(DRIFTS).index(d)}"
                label = f"{d} ({'optimal' if opt else 'SCIP stopped'})"
                face = color if opt else "none"
                bx.scatter(*zip(*sel, strict=True), marker=mk, facecolors=face, edgecolors=color, label=label)
    bx.axhline(100 * GAP_VS_SCIP, color="grey", ls=":", lw=1, label="target 5%")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("GPUs (MI250X GCDs)")
    bx.set_ylabel("greedy / SCIP makespan − 1 (%)")
    bx.set_title("Greedy vs exact RCPSP (same tick instance)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "dag_schedule.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="32 and 128 GPUs, short SCIP limit (under a minute)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for dag_schedule.json/.png")
    ap.add_argument("--slots", type=int, default=None, help="at most this many ticks in the horizon")
    ap.add_argument(
        "--scip-limit", type=float, default=None,
        help="seconds SCIP may take per pair (default 300; --quick 3): 60 s left two pairs unproven "
        "that SCIP proves in about 70 s",
    )  # fmt: skip
    args = ap.parse_args()
    sizes = [32, 128] if args.quick else [32, 64, 128, 256, 512, 1024]
    repeats = 3 if args.quick else 11
    scip_limit = args.scip_limit if args.scip_limit is not None else (3.0 if args.quick else 300.0)
    slots = args.slots or (40 if args.quick else 80)
    rows = []
    for gpus in sizes:
        for drift in DRIFTS:
            row = measure(gpus, drift, repeats, scip_limit if scip_available() else None, slots)
            rows.append(row)
            s = row.get("scip", {})
            print(
                f"{gpus:5d} GPUs  {drift:20s} {row['nodes']:5d} nodes  plan {row['plan_ms']:6.2f} ms"
                f" ({row['plan_path']}, cpu {row['plan_cpu_ms']:5.2f})"
                f"  greedy {row['greedy_plan_ms']:7.2f} ms"
                f" (cpu {row['greedy_plan_cpu_ms']:6.2f}, dag+sched {row['greedy_dag_schedule_ms']:6.2f})"
                + (f"  ticks greedy {row['greedy_ticks']} scip {s['makespan_ticks']} [{s['status']}"
                   f" {s['seconds']:.1f} s]" if s else "")
                + (f" gap {row['gap']:+.1%}" if row.get("gap") is not None else ""),
                flush=True,
            )  # fmt: skip
    scales = per_scale(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, scales, args.out)
    gaps = [r["gap"] for r in rows if r.get("gap") is not None]
    proven = [r["gap"] for r in rows if r.get("gap") is not None and r["scip"]["status"] == "optimal"]
    unproven = [  # no bound at all (None): nothing is proven
        r.get("gap_to_bound") for r in rows if r.get("gap") is not None and r["scip"]["status"] != "optimal"
    ]
    bounded = [g for g in unproven if g is not None]
    unbounded = len(unproven) - len(bounded)
    at_1024 = next((s for s in scales if s["gpus"] == 1024), None)
    summary = {
        "greedy_ms_at_1024": at_1024["greedy_plan_ms_median"] if at_1024 else None,
        "greedy_ms_at_1024_max": at_1024["greedy_plan_ms_max"] if at_1024 else None,
        "greedy_cpu_ms_at_1024": at_1024["greedy_plan_cpu_ms_median"] if at_1024 else None,
        "dag_schedule_ms_at_1024": at_1024["greedy_dag_schedule_ms_median"] if at_1024 else None,
        "plan_ms_at_1024": at_1024["plan_ms_median"] if at_1024 else None,
        "plan_ms_at_1024_max": at_1024["plan_ms_max"] if at_1024 else None,
        "plan_cpu_ms_at_1024": at_1024["plan_cpu_ms_median"] if at_1024 else None,
        "plan_paths_at_1024": at_1024["plan_paths"] if at_1024 else None,
        "expand_ms_at_1024": at_1024["expand_ms_median"] if at_1024 else None,
        "class_gap_max": max((r["class_gap"] for r in rows if r.get("class_gap") is not None), default=None),
        "class_schedules_valid": all(r["class_valid"] for r in rows if "class_valid" in r),
        "class_pairs": sum(r["plan_path"] == "class" for r in rows),
        "class_executed_as_planned": all(
            r["executed_path"] == "class" for r in rows if r["plan_path"] == "class"
        ),
        "gap_vs_scip_max": max(gaps, default=None),
        "gap_vs_scip_mean": statistics.fmean(gaps) if gaps else None,
        "pairs_within_gap_target": sum(g <= GAP_VS_SCIP for g in gaps),
        "pairs_compared": len(gaps),
        # SCIP stopped at its time limit holds an incumbent (the greedy's own, at worst), no proof:
        # there the most the greedy can be off is its gap to SCIP's lower bound
        "pairs_unproven": len(unproven),
        "gap_to_bound_max_unproven": None if unbounded else max(bounded, default=None),
        "gap_proven_max": max(proven, default=None),
        "scip_optimal": sum(r.get("scip", {}).get("status") == "optimal" for r in rows),
        "scip_schedules_valid": all(r["scip"]["valid"] is not False for r in rows if "scip" in r),
        "builder_infeasible_scip_feasible": sum(
            1 for r in rows if not r["feasible"] and r.get("scip", {}).get("makespan_ticks") is not None
        ),
    }
    summary["met"] = {
        "greedy_ms_at_1024": summary["greedy_ms_at_1024"] is not None
        and summary["greedy_ms_at_1024"] <= GREEDY_MS_AT_1024,
        "plan_ms_at_1024": summary["plan_ms_at_1024"] is not None
        and summary["plan_ms_at_1024"] <= GREEDY_MS_AT_1024,
        "class_gap_vs_scip": summary["class_gap_max"] is None or summary["class_gap_max"] <= GAP_VS_SCIP,
        "gap_vs_scip": bool(gaps) and max(gaps) <= GAP_VS_SCIP,
        # met with a certificate: every pair within the target of SCIP's optimum, or of its bound
        "gap_vs_scip_proven": bool(gaps) and not unbounded and max(proven + bounded) <= GAP_VS_SCIP,
    }
    extra = {
        "summary": summary,
        "per_scale": scales,
        "mode": "quick" if args.quick else "full",
        "scip_time_limit_s": scip_limit,
        "max_slots": slots,
        "cluster": CLUSTER,
        "model": MODEL,
    }
    path = write("dag_schedule", TARGETS, rows, extra, out=args.out)
    print(f"wrote {path} and {args.out / 'dag_schedule.png'}")


if __name__ == "__main__":
    main()
