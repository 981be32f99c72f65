"""Class plans against the per-unit greedy on seeded random drifts (the quality of what admission prices).

At scale admission prices a transition on replica classes (``classplan.py``): members of one class
start together, which the per-unit greedy (``plan_transition``, what the golden cases pin) does not
require. ``dag_schedule.py`` compares the two on its 18 fixed pairs; this benchmark draws random
drifts at 256–1,024 GPUs (cluster, model, pool fraction and response length before and after, a
fixed seed), replans anchored on the running plan as the controller does, and for every pair
where the class plan applies records:

* ``priced_s``: the class plan's makespan (what admission prices), ``direct``: whether it re-lays
  reshapes out straight from one replica (``class_direct.py``), ``bound_s``: its lower bound;
* ``per_unit_s``: the per-unit greedy's makespan on the same pair;
* ``executed_s`` / ``executed_path``: what runs when the move is admitted (the class schedule laid
  onto the per-unit DAG, or the per-unit greedy where the class schedule is over 5% above its
  bound and the greedy is shorter).

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
from nereus.transition import plan_transition
from nereus.transition.between import price_transition

SLACK = 0.05  # a priced class plan this far above the per-unit greedy counts as off
TARGETS = {"priced_vs_per_unit": SLACK, "executed_never_longer_than_priced": True}
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
    priced = price_transition(p, current, target)
    row: dict[str, Any] = {**case, "path": priced.path}
    if priced.classes is None:
        return row
    per_unit = plan_transition(p, current, target)
    executed = priced.transition
    row.update(
        {
            "direct": priced.classes.direct,
            "class_nodes": len(priced.classes.nodes),
            "nodes": len(per_unit.dag.nodes),
            "priced_s": priced.l_tran_s,
            "bound_s": priced.classes.lower_bound(),
            "per_unit_s": per_unit.l_tran_s,
            "executed_s": executed.l_tran_s,
            "executed_path": executed.path,
            "priced_vs_per_unit": priced.l_tran_s / per_unit.l_tran_s - 1.0,
            "executed_vs_per_unit": executed.l_tran_s / per_unit.l_tran_s - 1.0,
        }
    )
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cls = [r for r in rows if "priced_s" in r]
    off = [r["priced_vs_per_unit"] for r in cls]
    ran = [r["executed_vs_per_unit"] for r in cls]
    return {
        "pairs": len(rows),
        "class_pairs": len(cls),
        "direct_pairs": sum(r["direct"] for r in cls),
        "priced_vs_per_unit_median": statistics.median(off) if off else None,
        "priced_vs_per_unit_max": max(off, default=None),
        "priced_over_slack": sum(v > SLACK for v in off),
        "executed_vs_per_unit_max": max(ran, default=None),
        "executed_over_slack": sum(v > SLACK for v in ran),
        "refined_at_execution": sum(r["executed_path"] != "class" for r in cls),
        "executed_never_longer_than_priced": all(r["executed_s"] <= r["priced_s"] + 1e-9 for r in cls),
    }


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cls = [r for r in rows if "priced_s" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = list(range(len(cls)))
    ax.scatter(x, [100 * r["priced_vs_per_unit"] for r in cls], marker="o", label="priced (class plan)")
    ax.scatter(x, [100 * r["executed_vs_per_unit"] for r in cls], marker="x", label="executed")
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
    tries = 0
    while sum("priced_s" in r for r in rows) < wanted and tries < 20 * wanted:
        tries += 1
        row = measure(draw(rng, sizes))
        if row is None:
            continue
        rows.append(row)
        if "priced_s" in row:
            print(
                f"{row['cluster']:18s} {row['model']:13s} {row['gpus']:5d} {row['before']}→{row['after']}"
                f"  priced {row['priced_vs_per_unit']:+.1%}  executed {row['executed_vs_per_unit']:+.1%}"
                f" ({row['executed_path']}{', direct' if row['direct'] else ''})",
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
