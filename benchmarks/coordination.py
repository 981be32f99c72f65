"""Cross-model-stage coordination (paper Table 5): the global DAG vs independent local DAGs.

Llama-3.1-8B (critic and reward with a value head), bf16 mixed precision, ``h100-ib`` links. Three
types of trial, each a transition between two random plans: every model-stage draws a GPU count
and a layout for each plan, and each plan is a random partition of the full pool (GPU ids shuffled
across nodes), so model-stages hand GPUs to each other:

* ``SM-CS`` (same model, cross stage): actor.gen + actor.train on 32 GPUs;
* ``CM-SS`` (cross model, same stage): actor.train + critic.train on 48 GPUs;
* ``CM-CS`` (cross model, cross stage, the paper's Fig. 6): reward.inf + actor.train +
  critic.train on 48 GPUs.

Memory is tight: every GPU has the same capacity, ``1 + margin`` (default 5%) times the most any
model-stage's own transition needs on one GPU when it runs alone (its local DAG's ledger peak,
Split staging included), so on a GPU that changes hands the newcomer's state often fits only
once the previous owner's state, or its Split/Merge staging, is gone. Full mode also reruns the
same trials (seeded by index) at margins 0, 15% and 30% (summaries only).

Each model-stage launches at a random offset in [0, 2] s. Two uncoordinated baselines run each
local DAG on its own: a node starts when its local predecessors are done and what it acquires is
free at that instant (``Policy.INDEPENDENT``). *independent* uses our local DAGs as they are
(releases that nothing waits on go first); *make-before-break* is per-component migration as a
naive system does it (DynaRL-style: every release of a model-stage waits until all of its copies
are in place). Nereus runs the global DAG of ``build_dag`` (``Policy.RESPECT_EDGES``, which
raises if memory is ever exceeded). A run succeeds when every model-stage finishes within 20 s of
the trigger and ends with exactly its target units and bytes.

Only trials where a memory-valid order exists count: ``build_dag`` says feasible, or an
uncoordinated run completes (the trial's own launch, each model-stage order run one after the
other, random launches). The latter with the builder infeasible is a *builder miss*: counted as a
Nereus failure, and the success rates are also given over the builder-feasible trials alone.
Trials with neither are excluded and counted. Each feasible DAG is also run under random
durations, launches and priorities: any memory violation, deadlock, wrong final state or peak
above the DAG's ``peak`` there (or in the main run) is a bug of the builder.

Writes ``benchmarks/results/coordination.json`` and ``coordination.png``.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import RESULTS, write

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import STAGE_ORDER, Head, Precision, Stage, load_cluster, load_model
from nereus.spec.cluster import GIB
from nereus.state.buffers import StatePolicy, rank_buffers
from nereus.transition.build import build_dag, initial_bytes
from nereus.transition.dag import Edge, EdgeKind, Primitive, TransitionDag
from nereus.transition.events import Execution, MemoryBoundError, Policy, execute
from nereus.transition.links import LinkModel
from nereus.transition.local import StageMove

DEADLINE_S = 20.0
LAUNCH_S = 2.0
MODEL_STAGES = {
    "actor.gen": (Stage.GEN, Head.LM),
    "reward.inf": (Stage.INF, Head.VALUE),
    "actor.train": (Stage.TRAIN, Head.LM),
    "critic.train": (Stage.TRAIN, Head.VALUE),
}
LAYOUTS = {
    Stage.TRAIN: (Layout(2, 1), Layout(4, 1), Layout(8, 1), Layout(2, 2), Layout(4, 2)),
    Stage.INF: (Layout(1, 1), Layout(2, 1), Layout(4, 1)),
    Stage.GEN: (Layout(1, 1), Layout(2, 1), Layout(4, 1)),
}
# type: (GPUs, model-stages in workflow order, GPU counts per model-stage to draw from)
TYPES: dict[str, tuple[int, tuple[str, ...], tuple[tuple[int, ...], ...]]] = {
    "SM-CS": (32, ("actor.gen", "actor.train"), ((8, 24), (16, 16))),
    "CM-SS": (48, ("actor.train", "critic.train"), ((16, 32), (24, 24), (32, 16))),
    "CM-CS": (48, ("reward.inf", "actor.train", "critic.train"), ((8, 16, 24), (8, 24, 16), (16, 16, 16))),
}
PAPER_BASELINE = {"SM-CS": 0.62, "CM-SS": 0.56, "CM-CS": 0.34}
PAPER = {
    "baseline_success": PAPER_BASELINE,
    "nereus_success": 1.0,
    "resource_edges": "1–2",
    "completion_s": "8–13",
}
TARGETS = {"nereus_success": 1.0, "nereus_memory_violations": 0, "builder_misses": 0, "paper": PAPER}
RANK = {name: STAGE_ORDER.index(stage) for name, (stage, _) in MODEL_STAGES.items()}
LINKS = LinkModel(load_cluster("h100-ib"), Efficiencies())
MODEL = load_model("llama-3.1-8b")


@dataclass(frozen=True, slots=True)
class Trial:
    kind: str
    index: int
    moves: tuple[StageMove, ...]
    capacity: int
    launch: tuple[tuple[str, float], ...]

    def describe(self) -> dict[str, Any]:
        return {
            m.name: f"{m.current_layout}×{len(m.current)} → {m.target_layout}×{len(m.target)}"
            for m in self.moves
        }


def standalone_peak(move: StageMove) -> int:
    """The most bytes one GPU holds when ``move`` runs alone, in any order of its local DAG."""
    return max(build_dag([move], RANK, LINKS, 1 << 60).peak.values(), default=0)


def make_trial(kind: str, index: int, margin: float) -> Trial:
    rng = random.Random(f"coordination:{kind}:{index}")
    n, names, counts = TYPES[kind]

    def plan(sizes: tuple[int, ...]) -> list[tuple[Layout, tuple[tuple[int, ...], ...]]]:
        gpus = rng.sample(range(n), n)  # a random partition of the pool, across nodes
        out, at = [], 0
        for name, size in zip(names, sizes, strict=True):
            lay = rng.choice([x for x in LAYOUTS[MODEL_STAGES[name][0]] if size % x.size == 0])
            units = tuple(tuple(gpus[at + k : at + k + lay.size]) for k in range(0, size, lay.size))
            out.append((lay, units))
            at += size
        return out

    current, target = plan(rng.choice(counts)), plan(rng.choice(counts))
    moves = []
    for name, (cl, cu), (tl, tu) in zip(names, current, target, strict=True):
        stage, head = MODEL_STAGES[name]
        policy = StatePolicy.of(stage, Precision.BF16_MIXED)
        moves.append(StageMove.between(name, MODEL.with_head(head), policy, cl, cu, tl, tu))
    capacity = int((1.0 + margin) * max(standalone_peak(m) for m in moves))
    launch = tuple((name, rng.uniform(0.0, LAUNCH_S)) for name in names)
    return Trial(kind, index, tuple(moves), capacity, launch)


def target_bytes(moves: tuple[StageMove, ...]) -> dict[int, int]:
    held: dict[int, int] = defaultdict(int)
    for m in moves:
        for v in m.target:
            for g, t, p in v.ranks():
                held[g] += rank_buffers(m.model, v.layout, t, p, m.policy).nbytes()
    return dict(held)


def reached(trial: Trial, dag: TransitionDag, run: Execution) -> bool:
    """Every model-stage holds exactly its target units, and every GPU exactly their bytes."""
    want = target_bytes(trial.moves)
    if any(run.held.get(g, 0) != want.get(g, 0) for g in set(run.held) | set(want)):
        return False
    live: dict[str, set[tuple[Layout, tuple[int, ...]]]] = defaultdict(set)
    seen: dict[str, set[tuple[Layout, tuple[int, ...]]]] = defaultdict(set)
    for u in dag.units.values():
        seen[u.model_stage].add((u.layout, u.gpus))
    for uid in run.live:
        u = dag.units[uid]
        live[u.model_stage].add((u.layout, u.gpus))
    for m in trial.moves:  # a current unit no node touches stays as it is
        live[m.name] |= {(u.layout, u.gpus) for u in m.current} - seen[m.name]
    return all(live[m.name] == {(v.layout, v.gpus) for v in m.target} for m in trial.moves)


def outcome(trial: Trial, dag: TransitionDag, run: Execution) -> dict[str, Any]:
    ok = not run.deadlock and run.makespan <= DEADLINE_S and reached(trial, dag, run)
    return {
        "success": ok,
        "deadlock": run.deadlock,
        "timeout": not run.deadlock and run.makespan > DEADLINE_S,
        "completion_s": round(run.makespan, 3) if ok else DEADLINE_S,
        "makespan_s": None if run.deadlock else round(run.makespan, 3),
    }


def independent(trial: Trial, dag: TransitionDag, launch: dict[str, float]) -> Execution:
    init = initial_bytes(trial.moves)
    return execute(dag.nodes, dag.edges, init, trial.capacity, Policy.INDEPENDENT, launch)


def make_before_break(trial: Trial, dag: TransitionDag, launch: dict[str, float]) -> Execution:
    """Per-component migration as a naive system does it: every release of a model-stage waits
    until all of its acquisitions are done (copy everything, then free), local DAGs uncoordinated."""
    extra = [
        Edge(a.id, d.id, EdgeKind.LOCAL)
        for d in dag.nodes
        if d.primitive is Primitive.DESTROY
        for a in dag.nodes
        if a.model_stage == d.model_stage and a.acquires and a.id != d.id
    ]
    init = initial_bytes(trial.moves)
    return execute(dag.nodes, (*dag.edges, *extra), init, trial.capacity, Policy.INDEPENDENT, launch)


def coordinated(
    trial: Trial,
    dag: TransitionDag,
    launch: dict[str, float],
    durations: list[float] | None = None,
    order: list[int] | None = None,
) -> Execution:
    """The global DAG (raises MemoryBoundError if an execution exceeds a GPU's capacity)."""
    init = initial_bytes(trial.moves)
    order = order if order is not None else list(dag.order)
    return execute(dag.nodes, dag.edges, init, trial.capacity, Policy.RESPECT_EDGES, launch, durations, order)


def witness(trial: Trial, dag: TransitionDag, rng: random.Random) -> str:
    """An uncoordinated launch under which every node runs within memory ("" when none found)."""
    names = [m.name for m in trial.moves]
    tries = {"own launch": dict(trial.launch)}
    for perm in itertools.permutations(names):
        tries[" then ".join(perm)] = {name: 1e3 * k for k, name in enumerate(perm)}
    for k in range(8):
        tries[f"random launch {k}"] = {name: rng.uniform(0.0, 5.0) for name in names}
    return next(
        (label for label, launch in tries.items() if not independent(trial, dag, launch).deadlock), ""
    )


def stress(trial: Trial, dag: TransitionDag, rng: random.Random, runs: int) -> list[str]:
    """Run the global DAG under random durations, launches and priorities; what went wrong."""
    problems = []
    for _ in range(runs):
        durations = [n.est_s * rng.uniform(0.2, 3.0) for n in dag.nodes]
        launch = {m.name: rng.uniform(0.0, 5.0) for m in trial.moves}
        order = rng.sample(range(len(dag.nodes)), len(dag.nodes))
        try:
            r = coordinated(trial, dag, launch, durations, order)
        except MemoryBoundError as exc:
            problems.append(f"memory: {exc}")
            continue
        problems += check(trial, dag, r)
    return problems


def check(trial: Trial, dag: TransitionDag, run: Execution) -> list[str]:
    """What a run of the global DAG got wrong: a deadlock, a final state, a peak above ``dag.peak``."""
    if run.deadlock:
        return [f"deadlock: nodes {run.stalled} never started"]
    out = [] if reached(trial, dag, run) else ["wrong final state"]
    over = {g: b for g, b in run.peak.items() if b > dag.peak.get(g, 0)}
    return out + ([f"peak above the builder's bound on GPUs {sorted(over)}"] if over else [])


def run_trial(trial: Trial, stress_runs: int) -> dict[str, Any]:
    rng = random.Random(f"coordination:stress:{trial.kind}:{trial.index}")
    dag = build_dag(trial.moves, RANK, LINKS, trial.capacity)
    launch = dict(trial.launch)
    base = independent(trial, dag, launch)
    row: dict[str, Any] = {
        "index": trial.index,
        "moves": trial.describe(),
        "capacity_gib": round(trial.capacity / GIB, 2),
        "launch_s": {k: round(v, 3) for k, v in launch.items()},
        "nodes": len(dag.nodes),
        "feasible": dag.feasible,
        "baseline": outcome(trial, dag, base),
        "make_before_break": outcome(trial, dag, make_before_break(trial, dag, launch)),
    }
    if not dag.feasible:
        row["reason"] = dag.reason
        row["witness"] = "own launch" if not base.deadlock else witness(trial, dag, rng)
        row["counted"] = bool(row["witness"])
        row["nereus"] = {"success": False, "deadlock": False, "timeout": False, "completion_s": DEADLINE_S}
        return row
    row["counted"] = True
    row["resource_edges"] = dag.resource_edges
    try:
        run = coordinated(trial, dag, launch)
        row["nereus"] = outcome(trial, dag, run)
        row["nereus"]["peak_gib"] = round(max(run.peak.values()) / GIB, 2)
        row["stress_problems"] = check(trial, dag, run)
    except MemoryBoundError as exc:
        row["nereus"] = {"success": False, "deadlock": False, "timeout": False, "completion_s": DEADLINE_S}
        row["memory_violation"] = str(exc)
    row["stress_problems"] = row.get("stress_problems", []) + stress(trial, dag, rng, stress_runs)
    return row


def mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def summarize(rows: list[dict[str, Any]], generated: int) -> dict[str, Any]:
    counted = [r for r in rows if r["counted"]]
    feasible = [r for r in counted if r["feasible"]]

    def rate(key: str, among: list[dict[str, Any]]) -> float | None:
        return statistics.mean(r[key]["success"] for r in among) if among else None

    def mean_time(key: str) -> float | None:
        return statistics.mean(r[key]["completion_s"] for r in counted) if counted else None

    return {
        "trials": len(counted),
        "generated": generated,
        "excluded_infeasible_for_both": sum(1 for r in rows if not r["counted"]),
        "baseline_success": rate("baseline", counted),
        "make_before_break_success": rate("make_before_break", counted),
        "make_before_break_deadlocks": sum(r["make_before_break"]["deadlock"] for r in counted),
        "nereus_success": rate("nereus", counted),
        "nereus_success_where_builder_feasible": rate("nereus", feasible),
        "baseline_success_where_builder_feasible": rate("baseline", feasible),
        "baseline_mean_completion_s": mean_time("baseline"),
        "nereus_mean_completion_s": mean_time("nereus"),
        "nereus_mean_completion_s_successes": mean(
            [r["nereus"]["completion_s"] for r in counted if r["nereus"]["success"]]
        ),
        "mean_resource_edges": mean([r["resource_edges"] for r in feasible]),
        "max_resource_edges": max((r["resource_edges"] for r in feasible), default=None),
        "baseline_deadlocks": sum(r["baseline"]["deadlock"] for r in counted),
        "baseline_timeouts": sum(r["baseline"]["timeout"] for r in counted),
        "nereus_deadlocks": sum(r["nereus"]["deadlock"] for r in counted),
        "nereus_timeouts": sum(r["nereus"]["timeout"] for r in counted),
        "nereus_slower_than_successful_baseline": sum(
            1
            for r in feasible
            if r["baseline"]["success"] and r["nereus"]["completion_s"] > r["baseline"]["completion_s"] + 1e-9
        ),
        "builder_misses": sum(1 for r in counted if not r["feasible"]),
        "builder_misses_baseline_succeeded": sum(
            1 for r in counted if not r["feasible"] and r["baseline"]["success"]
        ),
        "memory_violations": sum(1 for r in feasible if "memory_violation" in r),
        "stress_problems": sum(len(r["stress_problems"]) for r in feasible),
    }


def plot(summary: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(summary)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))

    def col(key: str) -> list[float | None]:
        return [summary[k][key] for k in kinds]

    hatched = {"hatch": "//", "alpha": 0.6}
    bars: list[tuple[str, list[float | None], dict[str, Any]]] = [
        ("independent (our local DAGs)", col("baseline_success"), {"color": "C0"}),
        ("independent, make-before-break", col("make_before_break_success"), {"color": "C2"}),
        ("nereus", col("nereus_success"), {"color": "C1"}),
        (
            "nereus | builder feasible",
            col("nereus_success_where_builder_feasible"),
            {"color": "C1", **hatched},
        ),
        ("DynaRL-style (paper)", [PAPER_BASELINE[k] for k in kinds], {"color": "grey", "alpha": 0.5}),
    ]
    w = 0.16
    for j, (label, values, style) in enumerate(bars):
        xs = [i + (j - 2) * w for i in range(len(kinds))]
        a.bar(xs, [100 * (v or 0.0) for v in values], w, label=label, **style)
    a.axhline(100, color="k", lw=0.8, ls=":")
    a.set_xticks(range(len(kinds)), kinds)
    a.set_ylabel("success rate (%)")
    a.set_title("trials finishing at the target within 20 s")
    a.legend(fontsize=7, loc="lower left")
    for j, key in enumerate(("baseline_mean_completion_s", "nereus_mean_completion_s")):
        xs = [i + (j - 0.5) * w for i in range(len(kinds))]
        b.bar(xs, [summary[k][key] for k in kinds], w, label=key.split("_")[0])
    for i, k in enumerate(kinds):
        label = f"{summary[k]['mean_resource_edges'] or 0:.1f} re"
        b.text(i + w / 2, summary[k]["nereus_mean_completion_s"], label, ha="center", va="bottom", fontsize=7)
    b.axhspan(8, 13, color="grey", alpha=0.15, label="paper nereus 8–13 s")
    b.set_xticks(range(len(kinds)), kinds)
    b.set_ylabel("mean completion (s, failures = 20 s)")
    b.set_title("transition time (re: mean resource edges added)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "coordination.png", dpi=120)
    plt.close(fig)


def run_type(kind: str, trials: int, margin: float, stress_runs: int) -> tuple[list[dict[str, Any]], int]:
    """Trials of ``kind`` until ``trials`` count (a valid order exists); the rows and how many ran."""
    rows: list[dict[str, Any]] = []
    while sum(r["counted"] for r in rows) < trials:
        rows.append(run_trial(make_trial(kind, len(rows), margin), stress_runs))
    return rows, len(rows)


def line(kind: str, s: dict[str, Any]) -> str:
    def f(x: float | None, spec: str) -> str:
        return "–" if x is None else format(x, spec)

    return (
        f"{kind}: {s['trials']} trials ({s['excluded_infeasible_for_both']} excluded)  "
        f"baseline {f(s['baseline_success'], '.0%')} ({s['baseline_deadlocks']} deadlocks, "
        f"{s['baseline_timeouts']} timeouts, {f(s['baseline_mean_completion_s'], '.1f')} s)  "
        f"make-before-break {f(s['make_before_break_success'], '.0%')} "
        f"({s['make_before_break_deadlocks']} deadlocks)  "
        f"nereus {f(s['nereus_success'], '.0%')} ({f(s['nereus_success_where_builder_feasible'], '.0%')} "
        f"where the builder is feasible, {s['nereus_timeouts']} timeouts, "
        f"{f(s['nereus_mean_completion_s'], '.1f')} s, {f(s['mean_resource_edges'], '.1f')} resource edges)  "
        f"builder misses {s['builder_misses']}  "
        f"memory violations {s['memory_violations']}  stress problems {s['stress_problems']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="20 trials per type, 2 stress runs, no sweep")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for coordination.json/.png")
    ap.add_argument("--trials", type=int, default=None, help="counted trials per type (default 100)")
    ap.add_argument("--margin", type=float, default=0.05, help="capacity above the largest standalone peak")
    args = ap.parse_args()
    trials = args.trials or (20 if args.quick else 100)
    stress_runs = 2 if args.quick else 8
    sweep_margins = () if args.quick else (0.0, 0.15, 0.3)
    results, summary = {}, {}
    for kind in TYPES:
        rows, generated = run_type(kind, trials, args.margin, stress_runs)
        summary[kind] = summarize(rows, generated)
        results[kind] = {"summary": summary[kind], "trials": rows}
        print(line(kind, summary[kind]), flush=True)
    sweep: dict[str, dict[str, Any]] = {}
    for margin in sweep_margins:  # the same trials (seeded by index) under other capacities
        sweep[f"{margin:g}"] = {}
        for kind in TYPES:
            s = summarize(*run_type(kind, trials, margin, stress_runs=1))
            sweep[f"{margin:g}"][kind] = s
            print(f"  margin {margin:g}  " + line(kind, s), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(summary, args.out)
    extra = {
        "summary": summary,
        "margin_sweep": sweep,
        "mode": "quick" if args.quick else "full",
        "setup": {
            "model": MODEL.name,
            "cluster": LINKS.cluster.name,
            "deadline_s": DEADLINE_S,
            "launch_offsets_s": [0.0, LAUNCH_S],
            "capacity_margin": args.margin,
            "stress_runs_per_trial": stress_runs,
        },
    }
    path = write("coordination", TARGETS, results, extra, out=args.out)
    print(f"wrote {path} and {args.out / 'coordination.png'}")


if __name__ == "__main__":
    main()
