"""Does the calibrated planner rank trainer TP/PP as the simulator's truth does? (issue 19)

The admission benchmark's oracle plans with the planner's model; where the model ranks layouts
differently from the truth, the oracle loses to the best fixed layout. This isolates that ranking
from admission, transitions and supply: for a scenario's job at a fixed pool (GPU ids 0…G−1,
whole nodes) and fixed lengths, both trainers (``actor.train``, ``critic.train``) are held at each
power-of-two (tp, pp) in turn and the planner chooses the rest.

Telemetry: the quiet truth (``nereus.sim.observe.quiet_truth``: no noise, no episodes) of plans
the planner chose under its priors, paired with the planner's ideal seconds exactly as the
simulator pairs them every step (``pair``, generation's roofline classes as one). Two probes:
``one`` (the priors' best plan only, as the admission oracle probes) and ``all`` (the priors'
plan under every hold). Each probe feeds two stores with the same seconds: ``flat``
(measurements without their shape: one η per op class, as before) and ``shape`` (with it:
``nereus.plan.shapefit``). Then, per hold, the calibrated planner's own plan is priced (its
predicted step time) and run on the quiet truth.

Reported per case and calibration: Spearman's ρ between predicted and true step times over the
holds, the regret of the planner's pick (true step of the hold it predicts fastest over the
fastest true step, − 1), and the mean absolute error of the predicted step times.
Writes ``benchmarks/results/admission_ranking.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import admission
from common import RESULTS, write

from nereus.errors import InfeasibleError
from nereus.plan.calibration import CalibrationStore, Efficiencies
from nereus.plan.evaluate import ideal_shapes, price, shapes_of
from nereus.plan.layout import Layout, Plan
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.search import search
from nereus.sim.observe import pair, quiet_truth
from nereus.sim.truth.asynchrony import sync_step
from nereus.spec.workload import Stage

CASES = [  # scenario, pool GPUs, mean response tokens
    ("a100-8-32", 16, 1500.0),
    ("a100-8-32", 32, 3000.0),
    ("mi250x-256", 128, 1500.0),
    ("mi250x-256", 256, 3000.0),
    ("mi250x-1024", 512, 3000.0),
]
QUICK = CASES[:1] + CASES[2:3]
DEGREES = (1, 2, 4, 8)
TRAINERS = ("actor.train", "critic.train")


def _truth_s(problem: PlanningProblem, plan: Plan) -> tuple[float, dict[str, Any]]:
    w = problem.workload
    quiet = quiet_truth(w, problem.models, problem.cluster, plan, problem.seq)
    wf = plan.workflow
    return sync_step([[quiet[m.name].total for m in wf.by_stage(s)] for s in wf.stages]), quiet


def _feed(stores: dict[str, CalibrationStore], problem: PlanningProblem, plan: Plan) -> None:
    """The quiet truth of ``plan`` as one step's telemetry, into both stores."""
    shapes = shapes_of(plan)
    ideal = price(dataclasses.replace(problem, efficiencies=Efficiencies.unit()), shapes)
    sized = ideal_shapes(problem, shapes)
    _, quiet = _truth_s(problem, plan)
    for name, r in quiet.items():
        gen = plan.workflow.get(name).stage is Stage.GEN
        stores["flat"].update(pair(ideal.by_class[name], r.seconds, None, gen))
        stores["shape"].update(pair(ideal.by_class[name], r.seconds, sized[name], gen))


def _rank(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for r, i in enumerate(order):
        out[i] = r
    return out


def spearman(a: list[float], b: list[float]) -> float:
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = _rank(a), _rank(b)
    return 1.0 - 6.0 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def case(name: str, gpus: int, response: float) -> dict[str, Any]:
    sc = admission.scenario(name, admission.TRACES[0], 0, 2, seed=0)
    seq = SeqStats(sc.workload.prompt_len, response, response * 1.12)
    base = PlanningProblem(sc.workload, sc.models, sc.cluster, tuple(range(gpus)), seq, space=sc.space)
    holds: dict[tuple[int, int], PlanningProblem] = {}
    priors: dict[tuple[int, int], Plan] = {}
    for tp in DEGREES:
        for pp in DEGREES:
            if tp > sc.cluster.gpus_per_node:
                continue
            held = base.space.holding(dict.fromkeys(TRAINERS, Layout(tp, pp)))
            problem = dataclasses.replace(base, space=held)
            try:
                priors[tp, pp] = search(problem).plan
            except InfeasibleError:
                continue
            holds[tp, pp] = problem
    first = search(base).plan
    out: dict[str, Any] = {"scenario": name, "gpus": gpus, "response": response, "holds": len(holds)}
    for probe in ("one", "all"):
        stores = {k: CalibrationStore(sc.cluster.name, window=1024) for k in ("flat", "shape")}
        for _ in range(4):  # a few steps of the same telemetry, as a store would see them
            for key in [None] if probe == "one" else list(holds):
                _feed(stores, base if key is None else holds[key], first if key is None else priors[key])
        for label, store in stores.items():
            eff = store.efficiencies()
            keys, predicted, true = [], [], []
            for key, problem in holds.items():
                calibrated = dataclasses.replace(problem, efficiencies=eff)
                try:
                    plan = search(calibrated).plan
                except InfeasibleError:
                    continue
                keys.append(key)
                predicted.append(price(calibrated, shapes_of(plan)).step_latency_s)
                true.append(_truth_s(calibrated, plan)[0])
            pick = min(range(len(keys)), key=lambda i: predicted[i])
            best = min(range(len(keys)), key=lambda i: true[i])
            out[f"{probe}/{label}"] = {
                "spearman": spearman(predicted, true),
                "pick": list(keys[pick]),
                "pick_true_s": true[pick],
                "best": list(keys[best]),
                "best_true_s": true[best],
                "regret": true[pick] / true[best] - 1.0,
                "step_mape": statistics.mean(abs(p / t - 1.0) for p, t in zip(predicted, true, strict=True)),
                "curves": sorted(op.value for op in eff.curves),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two cases only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = []
    for name, gpus, response in QUICK if args.quick else CASES:
        row = case(name, gpus, response)
        rows.append(row)
        cells = "  ".join(
            f"{k} ρ {v['spearman']:+.2f} regret {v['regret']:+.1%} mape {v['step_mape']:.1%}"
            for k, v in row.items()
            if isinstance(v, dict)
        )
        print(f"{name:12s} {gpus:4d} GPUs {response:5.0f} tok  {cells}", flush=True)
    summary = {
        f"{probe}/{label}": {
            "mean_spearman": statistics.mean(r[f"{probe}/{label}"]["spearman"] for r in rows),
            "mean_regret": statistics.mean(r[f"{probe}/{label}"]["regret"] for r in rows),
            "mean_step_mape": statistics.mean(r[f"{probe}/{label}"]["step_mape"] for r in rows),
        }
        for probe in ("one", "all")
        for label in ("flat", "shape")
    }
    targets = {"shape_vs_flat": "reported: ranking of held trainer TP/PP against the truth"}
    extra = {"summary": summary, "mode": "quick" if args.quick else "full"}
    path = write("admission_ranking", targets, rows, extra, out=args.out)
    for k, v in summary.items():
        print(f"{k:11s} mean ρ {v['mean_spearman']:+.2f}  regret {v['mean_regret']:+.1%}  "
              f"step MAPE {v['mean_step_mape']:.1%}")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
