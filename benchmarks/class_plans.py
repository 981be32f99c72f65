"""Class plans against the per-unit greedy on seeded random drifts (the quality of what admission prices).

At scale admission prices a transition on replica classes (``classplan.py``): members of one class
start together, which the per-unit greedy (``plan_transition``, what the golden cases pin) does not
require. ``dag_schedule.py`` compares the two on its 18 fixed pairs; this benchmark draws random
drifts at 256–1,024 GPUs (cluster, model, pool fraction and response length before and after, a
fixed seed; a drift drawn twice counts once), replans anchored on the running plan as the
controller does, and for every pair
where the class plan applies records:

* ``class_s``: the class plan's makespan, ``bound_s`` its lower bound (no schedule of the per-unit
  DAG is shorter), ``floor_s`` the lesser of both variants' bounds (Split → Extend → Merge and
  straight: the per-unit planner plans both), ``direct``: whether it re-lays reshapes out straight
  from one replica
  (``class_direct.py``), ``ledger``: whether memory made some classes wait (``class_ledger.py``);
* ``per_unit_s``: the per-unit greedy's makespan on the same pair;
* ``priced_s`` / ``priced_path``: what ``price_transition`` (admission) prices, the class plan
  where it is within 5% of its bound, else also the per-unit greedy and the shorter;
  ``executed_s``: what runs when the move is admitted (its expansion).

No timing: deterministic. Writes ``benchmarks/results/class_plans.json`` and ``class_plans.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
from pathlib import Path
from typing import Any

from common import RESULTS, write

from nereus.errors import InfeasibleError
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.search import search
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.workload import STAGE_ORDER
from nereus.transition import plan_transition
from nereus.transition.between import ledger_capacity, price_transition
from nereus.transition.classplan import plan_classes
from nereus.transition.links import link_model

SLACK = 0.05  # a priced class plan this far above the per-unit greedy counts as off
TARGETS = {"priced_vs_per_unit": SLACK, "executed_as_priced": True}
CLUSTERS = (("mi250x-slingshot", 1024), ("a100-64gb-hdr100", 256))
MODELS = ("llama-3.1-8b", "qwen3-14b", "llama-2-13b")
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
RESPONSES = (1024, 2048, 4096)


def problem(model: str, cluster: str, gpus: int, response: int) -> PlanningProblem:
    m = load_model(model)
    return PlanningProblem(
        load_workload("ppo"),
        {r: m for r in Role},
        load_cluster(cluster),
        tuple(range(gpus)),
        SeqStats.fixed(256, response),
    )


def draw(rng: random.Random, sizes: tuple[int, ...]) -> dict[str, Any]:
    cluster, most = rng.choice(CLUSTERS)
    return {
        "cluster": cluster,
        "model": rng.choice(MODELS),
        "gpus": rng.choice([g for g in sizes if g <= most] or [most]),
        "before": (rng.choice(FRACTIONS), rng.choice(RESPONSES)),
        "after": (rng.choice(FRACTIONS), rng.choice(RESPONSES)),
    }


def measure(case: dict[str, Any]) -> dict[str, Any] | None:
    """The pair's row, or None where a pool has no plan."""
    (f1, r1), (f2, r2) = case["before"], case["after"]
    try:
        current = search(problem(case["model"], case["cluster"], int(case["gpus"] * f1), r1)).plan
        p = dataclasses.replace(
            problem(case["model"], case["cluster"], int(case["gpus"] * f2), r2), anchor=current
        )
        target = search(p).plan
    except InfeasibleError:
        return None
    rank = {ms.name: STAGE_ORDER.index(ms.stage) for ms in target.workflow.model_stages}
    links = link_model(p.cluster, p.efficiencies)
    plan = plan_classes(p, current, target, links, ledger_capacity(p), rank)
    row: dict[str, Any] = {**case, "class_plan": plan is not None}
    if plan is None:
        return row
    per_unit = plan_transition(p, current, target)
    priced = price_transition(p, current, target)
    executed = priced.transition
    row.update(
        {
            "direct": plan.direct,
            "ledger": plan.ledger is not None,
            "class_nodes": len(plan.nodes),
            "nodes": len(per_unit.dag.nodes),
            "class_s": plan.makespan,
            "bound_s": plan.lower_bound(),
            "floor_s": plan.floor,
            "per_unit_s": per_unit.l_tran_s,
            "priced_s": priced.l_tran_s,
            "priced_path": priced.path,
            "executed_s": executed.l_tran_s,
            "executed_path": executed.path,
            "class_vs_per_unit": plan.makespan / per_unit.l_tran_s - 1.0,
            "priced_vs_per_unit": priced.l_tran_s / per_unit.l_tran_s - 1.0,
        }
    )
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cls = [r for r in rows if "priced_s" in r]
    loose = [r["class_vs_per_unit"] for r in cls]
    above = [r for r in cls if r["class_s"] > (1 + SLACK) * r["floor_s"]]
    off = [r["priced_vs_per_unit"] for r in cls]
    return {
        "pairs": len(rows),
        "class_pairs": len(cls),
        "direct_pairs": sum(r["direct"] for r in cls),
        "ledger_pairs": sum(r["ledger"] for r in cls),
        "class_vs_per_unit_median": statistics.median(loose) if loose else None,
        "class_vs_per_unit_max": max(loose, default=None),
        "class_over_slack": sum(v > SLACK for v in loose),
        "over_floor_slack": len(above),  # each priced per unit too
        "priced_per_unit": sum(r["priced_path"] != "class" for r in cls),  # where that was shorter
        "priced_vs_per_unit_max": max(off, default=None),
        "priced_over_slack": sum(v > SLACK for v in off),
        "executed_as_priced": all(abs(r["executed_s"] - r["priced_s"]) <= 1e-9 * r["priced_s"] for r in cls),
    }


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cls = [r for r in rows if "priced_s" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = list(range(len(cls)))
    ax.scatter(x, [100 * r["class_vs_per_unit"] for r in cls], marker="o", label="class plan")
    ax.scatter(x, [100 * r["priced_vs_per_unit"] for r in cls], marker="x", label="priced and run")
    ax.axhline(100 * SLACK, color="grey", ls=":", lw=1, label="5%")
    ax.set_xlabel("random drift pair (class plan applies)")
    ax.set_ylabel("makespan / per-unit greedy − 1 (%)")
    ax.set_title("Class plans against the per-unit greedy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "class_plans.png", dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="4 pairs at 256 GPUs (seconds)")
    ap.add_argument("--pairs", type=int, default=60, help="random drifts where the class plan applies")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for class_plans.json/.png")
    args = ap.parse_args()
    wanted, sizes = (4, (256,)) if args.quick else (args.pairs, (256, 512, 1024))
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    tries = 0
    while sum("priced_s" in r for r in rows) < wanted and tries < 20 * wanted:
        tries += 1
        case = draw(rng, sizes)
        if repr(case) in seen:
            continue
        seen.add(repr(case))
        row = measure(case)
        if row is None:
            continue
        rows.append(row)
        if "priced_s" in row:
            print(
                f"{row['cluster']:18s} {row['model']:13s} {row['gpus']:5d} {row['before']}→{row['after']}"
                f"  class {row['class_vs_per_unit']:+.1%}  priced {row['priced_vs_per_unit']:+.1%}"
                f" ({row['priced_path']}{', direct' if row['direct'] else ''}"
                f"{', ledger' if row['ledger'] else ''})",
                flush=True,
            )
    summary = summarise(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out)
    path = write("class_plans", TARGETS, rows, {"summary": summary, "seed": args.seed}, out=args.out)
    print(summary)
    print(f"wrote {path} and {args.out / 'class_plans.png'}")


if __name__ == "__main__":
    main()
