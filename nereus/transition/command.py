"""``nereus transition --from A.json --to B.json``: the global DAG between two printed plans.

Plans are what ``nereus plan --json`` prints; their ``problem`` section names the model, workload
and cluster, so the transition is priced with the same models the planner used. Bad input (plans
for different models or clusters, GPU ids beyond the pool, concurrent model-stages sharing GPUs)
exits 2; a target that cannot be reached in place exits 3 with the reason.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nereus.errors import ConfigError, InfeasibleError
from nereus.plan.layout import Candidate, Layout, Plan
from nereus.plan.problem import PlanningProblem
from nereus.plan.report import gpu_ranges
from nereus.spec.cluster import GIB
from nereus.spec.workload import ExecutionMode, Recompute
from nereus.transition.between import NoSourceError, Transition, plan_transition

# what must agree between the two plans (the pool, lengths and headroom may differ)
SAME = ("model", "algo", "cluster", "mode")
PROBLEM_KEYS = ("model", "algo", "cluster", "gpus", "seq_len", "seq_len_p95", "prompt_len", "mode",
                "max_tp", "headroom", "urgent", "calibration")  # fmt: skip


def add_parser(sub: Any) -> None:
    p = sub.add_parser("transition", help="the transition DAG between two plans (from nereus plan --json)")
    p.add_argument("--from", dest="source", required=True, type=Path, help="current plan JSON")
    p.add_argument("--to", dest="target", required=True, type=Path, help="target plan JSON")
    p.add_argument("--lost", default="", help="GPU ids lost before the transition, e.g. 3,8-11")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a plan JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a plan JSON (expected an object)")
    for key in ("problem", "stages"):
        if key not in doc:
            raise ConfigError(f"{path}: missing field '{key}' (write it with nereus plan --json)")
    problem = doc["problem"]
    if not isinstance(problem, dict) or set(PROBLEM_KEYS) - set(problem):
        raise ConfigError(f"{path}: field 'problem' must hold {', '.join(PROBLEM_KEYS)}")
    return doc


def parse_gpus(text: str) -> frozenset[int]:
    """``"3,8-11"`` → {3, 8, 9, 10, 11}."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"--lost: expected GPU ids like 3,8-11, got {part!r}") from None
        if a < 0 or b < a:
            raise ConfigError(f"--lost: bad range {part!r}")
        out.update(range(a, b + 1))
    return frozenset(out)


def plan_from_json(path: Path, doc: dict[str, Any], problem: PlanningProblem) -> Plan:
    """The ``Plan`` a printed plan describes, validated against ``problem``'s workflow and pool."""
    wf = problem.workflow
    pool = tuple(range(int(doc["problem"]["gpus"])))
    cands = []
    for i, s in enumerate(doc["stages"]):
        where = f"{path}: stages[{i}]"
        try:
            name = str(s["name"])
            gpus = tuple(int(g) for g in s["gpus"])
            bad = sorted(g for g in gpus if g not in pool)
            if bad:
                raise ConfigError(f"{where} ({name}): gpus {bad} outside the pool 0-{len(pool) - 1}")
            cands.append(
                Candidate(
                    name,
                    Layout(int(s["tp"]), int(s["pp"])),
                    int(s["dp"]),
                    gpus,
                    int(s.get("micro_batch", 1)),
                    Recompute(s.get("recompute", "none")),
                )
            )
        except KeyError as exc:
            raise ConfigError(f"{where}: missing field {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
    try:
        return Plan(wf, tuple(cands), pool, ExecutionMode(doc["problem"]["mode"]))
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load_plan(path: Path, build: Callable[[argparse.Namespace], PlanningProblem]) -> Plan:
    """A printed plan, rebuilt against its own problem."""
    doc = _read(path)
    return plan_from_json(path, doc, build(argparse.Namespace(**doc["problem"])))


def run(
    args: argparse.Namespace, out: Console, build: Callable[[argparse.Namespace], PlanningProblem]
) -> int:
    a_doc, b_doc = _read(args.source), _read(args.target)
    for key in SAME:
        if a_doc["problem"][key] != b_doc["problem"][key]:
            raise ConfigError(
                f"plans are for different {key}s: {a_doc['problem'][key]!r} ({args.source}) vs "
                f"{b_doc['problem'][key]!r} ({args.target})"
            )
    problem = build(argparse.Namespace(**b_doc["problem"]))
    current = plan_from_json(args.source, a_doc, build(argparse.Namespace(**a_doc["problem"])))
    target = plan_from_json(args.target, b_doc, problem)
    lost = parse_gpus(args.lost)
    reused = sorted(lost & {g for c in target.candidates for g in c.gpus})
    if reused:
        raise ConfigError(f"--lost: the target plan {args.target} places state on lost GPUs {reused}")
    try:
        tr = plan_transition(problem, current, target, lost)
    except NoSourceError as exc:
        raise InfeasibleError(str(exc)) from None
    if not tr.feasible:
        raise InfeasibleError(f"target is not reachable in place: {tr.dag.reason}")
    doc = transition_json(tr)
    if args.json:
        print(json.dumps(doc))
        return 0
    _print(tr, doc, out)
    return 0


def transition_json(tr: Transition) -> dict[str, Any]:
    assert tr.schedule is not None
    doc = tr.dag.to_json()
    doc["critical_path"] = list(tr.schedule.critical_path)
    doc["l_tran_s"] = tr.l_tran_s
    doc["moved_bytes"] = tr.moved_bytes
    doc["resource_edges"] = tr.dag.resource_edges
    doc["peak_gib"] = max(tr.dag.peak.values(), default=0) / GIB
    for n, start in zip(doc["nodes"], tr.schedule.start, strict=True):
        n["start_s"] = start
    return doc


def _print(tr: Transition, doc: dict[str, Any], out: Console) -> None:
    dag, sched = tr.dag, tr.schedule
    assert sched is not None
    preds = dag.preds()
    kinds = {(e.src, e.dst): e.kind.value for e in dag.edges}
    on_path = set(sched.critical_path)
    table = Table(title="transition DAG (* on the critical path)", title_justify="left")
    for col in ("id", "primitive", "model-stage", "GPUs", "GiB moved", "est s", "start s", "after"):
        table.add_column(col, justify="right" if col in ("id", "GiB moved", "est s", "start s") else "left")
    for n in dag.nodes:
        after = ", ".join(
            f"{p}" + ("ʳ" if kinds.get((p, n.id)) == "resource" else "") for p in sorted(preds[n.id])
        )
        table.add_row(
            f"{'*' if n.id in on_path else ''}{n.id}",
            n.primitive.value + (f" ← {n.source}" if n.source else ""),
            n.model_stage,
            gpu_ranges(n.gpus),
            f"{n.bytes / GIB:.2f}",
            f"{n.est_s:.3f}",
            f"{sched.start[n.id]:.3f}",
            after,
        )
    out.print(table)
    path = " → ".join(map(str, sched.critical_path)) or "—"
    out.print(
        f"L_tran [bold]{tr.l_tran_s:.3f} s[/] · critical path {path} · "
        f"{len(dag.nodes)} nodes, {len(dag.edges)} edges ({dag.resource_edges} resource, ʳ) · "
        f"{tr.moved_bytes / GIB:.2f} GiB moved · peak {doc['peak_gib']:.2f} GiB per GPU"
    )
