"""``nereus transition --from A.json --to B.json``: the global DAG between two printed plans.

Plans are what ``nereus plan --json`` prints; their ``problem`` section names the model, workload
and cluster, so the transition is priced with the same models the planner used. Bad input (plans
for different models or clusters, GPU ids beyond the pool, concurrent model-stages sharing GPUs)
exits 2; a target that cannot be reached in place exits 3 with the reason. ``--json`` reports
``plan_ms``, the wall time of planning the transition (moves, DAG, schedule) inside the command,
and ``price_ms``, the wall time of pricing it as admission does (``price_transition``: on replica
classes where that applies, ``price_path``), with the priced L_tran ``price_l_tran_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nereus.errors import ConfigError, InfeasibleError
from nereus.plan.layout import Candidate, Layout, Plan, is_power_of_two
from nereus.plan.problem import PlanningProblem
from nereus.plan.report import PLAN_KEYS, STAGE_REPORT_KEYS, gpu_ranges
from nereus.plan.rules import batch_refusal, layout_refusal
from nereus.spec.cluster import GIB
from nereus.spec.files import brief, load_json, shorten
from nereus.spec.registry import load_cluster, load_model, load_workload
from nereus.spec.schema import build
from nereus.spec.workload import MAX_TOKENS, ExecutionMode, ModelStage, Recompute, Stage
from nereus.transition.between import (
    NoSourceError,
    Transition,
    fit_staging,
    plan_transition,
    price_transition,
)

# what must agree between the two plans (the pool, lengths and headroom may differ)
SAME = ("model", "algo", "cluster", "mode")
_LOADERS: dict[str, Callable[[str], Any]] = {
    "model": load_model,
    "algo": load_workload,
    "cluster": load_cluster,
}


def same_setting(key: str, a: object, b: object) -> bool:
    """Whether two plans' ``key`` (one of ``SAME``) name the same thing: the same text, or a
    name and a path (``h200-ib``, ``configs/clusters/h200-ib.yaml``; a copy under another file
    name) that load the same spec but for its name."""
    if a == b:
        return True
    load = _LOADERS.get(key)
    if load is None:
        return False
    try:
        x, y = load(str(a)), load(str(b))
        return bool(x == y or x == dataclasses.replace(y, name=x.name))
    except (ConfigError, ValueError, TypeError):
        return False


PROBLEM_KEYS = ("model", "algo", "cluster", "gpus", "seq_len", "seq_len_p95", "prompt_len", "mode",
                "max_tp", "headroom", "urgent", "calibration", "pipelined_gen")  # fmt: skip
MAX_GPUS = 1 << 20  # --gpus, a plan's pool
MAX_PLAN_BYTES = 64 << 20  # a plan file: ``plan --exhaustive --all --json`` lists up to 100,000 plans
MAX_TP = 1024  # --max-tp, a plan's tp and pp
MAX_STAGES = 64  # model-stages in a plan


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanProblem:
    """The ``problem`` section of a printed plan: the ``nereus plan`` flags it was found with."""

    model: str
    algo: str
    cluster: str
    gpus: int
    seq_len: int
    seq_len_p95: int | None
    prompt_len: int | None
    mode: ExecutionMode
    max_tp: int | None
    headroom: float
    urgent: bool
    calibration: str | None
    pipelined_gen: bool = False  # absent from plans printed before the flag: generation at pp 1

    def check(self, path: Path) -> None:
        """Every value in range (types are ``build``'s); errors name ``path`` and the key."""
        checks = [
            ("gpus", self.gpus, 1 <= self.gpus <= MAX_GPUS, f"an integer in [1, {MAX_GPUS}]"),
            ("seq_len", self.seq_len, 1 <= self.seq_len <= MAX_TOKENS, f"an integer in [1, {MAX_TOKENS}]"),
            ("headroom", self.headroom, 0.0 <= self.headroom < 1.0, "a number in [0, 1)"),
        ]
        if self.seq_len_p95 is not None:
            ok = self.seq_len <= self.seq_len_p95 <= MAX_TOKENS
            checks.append(
                ("seq_len_p95", self.seq_len_p95, ok, f"null or an integer in [seq_len, {MAX_TOKENS}]")
            )
        if self.prompt_len is not None:
            ok = 1 <= self.prompt_len <= MAX_TOKENS
            checks.append(("prompt_len", self.prompt_len, ok, f"null or an integer in [1, {MAX_TOKENS}]"))
        if self.max_tp is not None:
            ok = is_power_of_two(self.max_tp) and self.max_tp <= MAX_TP
            checks.append(("max_tp", self.max_tp, ok, f"null or a power of two up to {MAX_TP}"))
        for name, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"{path}: key 'problem.{name}': expected {allowed}, got {brief(value)}")

    def namespace(self, origin: Path) -> argparse.Namespace:
        """What ``nereus plan``'s parser would have produced; ``origin`` names the file in errors."""
        values = {k: getattr(self, k) for k in PROBLEM_KEYS}
        values["mode"] = self.mode.value
        return argparse.Namespace(**values, origin=str(origin))


@dataclass(frozen=True, slots=True, kw_only=True)
class StageEntry:
    """One entry of a printed plan's ``stages`` (its other keys are reports, not read back)."""

    name: str
    tp: int
    pp: int
    dp: int
    gpus: tuple[int, ...]
    micro_batch: int = 1
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not (is_power_of_two(value) and value <= MAX_TP):
                raise ValueError(f"{name} must be a power of two up to {MAX_TP}, got {brief(value)}")
        for name in ("dp", "micro_batch"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_GPUS:
                raise ValueError(f"{name} must be an integer in [1, {MAX_GPUS}], got {brief(value)}")


_STAGE_KEYS = {f.name for f in fields(StageEntry)}


@dataclass(frozen=True, slots=True)
class PlanDoc:
    """A printed plan (``nereus plan --json``), its shape checked."""

    path: Path
    problem: PlanProblem
    stages: tuple[StageEntry, ...]
    kinds: Mapping[str, object] = field(default_factory=dict)  # each stage's "stage" as written


def add_parser(sub: Any) -> None:
    p = sub.add_parser("transition", help="the transition DAG between two plans (from nereus plan --json)")
    p.add_argument("--from", dest="source", required=True, type=Path, help="current plan JSON")
    p.add_argument("--to", dest="target", required=True, type=Path, help="target plan JSON")
    p.add_argument("--lost", help="GPU ids lost before the transition, e.g. 3,8-11")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def read_plan(path: Path) -> PlanDoc:
    """A printed plan from ``path``: every field typed and in range, or one ``ConfigError`` line."""
    doc = load_json(path, "plan", MAX_PLAN_BYTES)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a plan JSON (expected an object; write it with nereus plan --json)")
    for key in ("problem", "stages"):
        if key not in doc:
            raise ConfigError(f"{path}: missing key '{key}' (write it with nereus plan --json)")
    unknown = sorted(str(k) for k in doc if k not in PLAN_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key {brief(unknown[0])} (allowed: {', '.join(sorted(PLAN_KEYS))})"
        )
    problem = doc["problem"]
    if not isinstance(problem, dict):
        raise ConfigError(f"{path}: key 'problem': expected a mapping of {', '.join(PROBLEM_KEYS)}")
    stages = doc["stages"]
    if not isinstance(stages, list) or not 1 <= len(stages) <= MAX_STAGES:
        raise ConfigError(f"{path}: key 'stages': expected a list of 1 to {MAX_STAGES} model-stages")
    entries, kinds = [], {}
    for i, s in enumerate(stages):
        if not isinstance(s, dict):
            raise ConfigError(f"{path}: key 'stages[{i}]': expected a mapping, got {brief(s)}")
        unknown = sorted(str(k) for k in s if k not in _STAGE_KEYS | STAGE_REPORT_KEYS)
        if unknown:
            allowed = ", ".join(sorted(_STAGE_KEYS | STAGE_REPORT_KEYS))
            raise ConfigError(
                f"{path}: key 'stages[{i}]': unknown key {brief(unknown[0])} (allowed: {allowed})"
            )
        entries.append(
            build(StageEntry, {k: v for k, v in s.items() if k in _STAGE_KEYS}, str(path), f"stages[{i}].")
        )
        name = entries[-1].name
        if name in kinds:
            first = next(j for j, e in enumerate(entries) if e.name == name)
            raise ConfigError(
                f"{path}: key 'stages[{i}].name': {brief(name)} names the model-stage of stages[{first}] "
                "again (each model-stage once)"
            )
        kinds[name] = s.get("stage")
    parsed = build(PlanProblem, problem, str(path), "problem.")
    parsed.check(path)
    return PlanDoc(path, parsed, tuple(entries), kinds)


def parse_gpus(text: str, pool: int, source: Path) -> frozenset[int]:
    """``"3,8-11"`` → {3, 8, 9, 10, 11}; every id must lie in the pool of ``source`` (0…pool-1),
    checked before a range is expanded."""
    out: set[int] = set()
    if not text.replace(",", "").strip():  # given, but naming none ('', ' ', ',,')
        raise ConfigError(f"--lost: expected GPU ids like 3,8-11, got {brief(text)}")
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d{1,9})(?:-(\d{1,9}))?", part)
        if match is None:
            raise ConfigError(f"--lost: expected GPU ids like 3,8-11, got {brief(part)}")
        a, b = int(match.group(1)), int(match.group(2) or match.group(1))
        if b < a:
            raise ConfigError(f"--lost: bad range {brief(part)} (expected LOW-HIGH)")
        if b >= pool:
            raise ConfigError(f"--lost: GPU {b} is outside the pool of {source} (0-{pool - 1})")
        out.update(range(a, b + 1))
    return frozenset(out)


def _share_refusal(problem: PlanningProblem, ms: ModelStage, dp: int, micro: int) -> str:
    """Why an inference or generation replica cannot take micro-batch ``micro`` ("" when it can):
    the planner writes none above a replica's share of the step's sequences."""
    if ms.stage is Stage.TRAIN:
        return ""
    share = -(-problem.workload.sequences(ms) // dp)
    return f"micro_batch {micro} exceeds a replica's {share} sequences" if micro > share else ""


def plan_from_json(doc: PlanDoc, problem: PlanningProblem) -> Plan:
    """The ``Plan`` a printed plan describes, validated against ``problem``'s workflow and pool."""
    path = doc.path
    pool = tuple(range(doc.problem.gpus))
    cands = []
    for i, s in enumerate(doc.stages):
        where = f"{path}: stages[{i}]"
        written = doc.kinds.get(s.name)
        if s.name in {m.name for m in problem.workflow.model_stages}:
            ms = problem.workflow.get(s.name)
            if written is not None and written != ms.stage.value:
                raise ConfigError(
                    f"{where} ({shorten(s.name, 30)}): key 'stage' is {brief(written)}, not {ms.stage.value}"
                )
            # a layout and split the runtime can run (the rules --fix holds a user's layout to)
            refusal = layout_refusal(s.name, Layout(s.tp, s.pp), problem.model_of(ms), problem.space,
                                     problem.cluster)  # fmt: skip
            refusal = refusal or batch_refusal(problem.workload, ms, s.dp, s.micro_batch, "micro_batch")
            refusal = refusal or _share_refusal(problem, ms, s.dp, s.micro_batch)
            if refusal:
                raise ConfigError(f"{where} ({shorten(s.name, 30)}): {refusal}")
        bad = sorted(g for g in s.gpus if not 0 <= g < len(pool))
        if bad:
            raise ConfigError(
                f"{where} ({shorten(s.name, 30)}): gpus {brief(bad)} outside the pool 0-{len(pool) - 1}"
            )
        try:
            cands.append(Candidate(s.name, Layout(s.tp, s.pp), s.dp, s.gpus, s.micro_batch, s.recompute))
        except ValueError as exc:
            raise ConfigError(f"{where}: {shorten(str(exc), 200)}") from None
    try:
        return Plan(problem.workflow, tuple(cands), pool, doc.problem.mode)
    except ValueError as exc:
        raise ConfigError(f"{path}: {shorten(str(exc), 300)}") from None


def load_plan(
    path: Path,
    build_problem: Callable[[argparse.Namespace], PlanningProblem],
    expect: dict[str, str] | None = None,
    flag: str = "--anchor",
) -> Plan:
    """A printed plan, rebuilt against its own problem; with ``expect`` (e.g. ``{"cluster":
    "h200-ib"}``), a plan for another model, algorithm, cluster or mode is refused first. Errors
    start with ``flag``."""
    try:
        doc = read_plan(path)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {str(exc).removeprefix('plan ')}") from None
    for key, value in (expect or {}).items():
        theirs = getattr(doc.problem, key)
        theirs = theirs.value if isinstance(theirs, ExecutionMode) else theirs
        if not same_setting(key, theirs, value):
            raise ConfigError(
                f"{flag} {path}: the plan is for {key} {brief(theirs)}, not {brief(value)} "
                f"(allowed: a plan of the same {', '.join(SAME)})"
            )
    try:
        return plan_from_json(doc, build_problem(doc.problem.namespace(path)))
    except ConfigError as exc:
        raise ConfigError(f"{flag} {exc}") from None


def run(
    args: argparse.Namespace, out: Console, build_problem: Callable[[argparse.Namespace], PlanningProblem]
) -> int:
    a_doc, b_doc = read_plan(args.source), read_plan(args.target)
    for key in SAME:
        a, b = getattr(a_doc.problem, key), getattr(b_doc.problem, key)
        if not same_setting(key, a, b):
            raise ConfigError(
                f"plans are for different {key}s: {brief(str(a))} ({args.source}) vs "
                f"{brief(str(b))} ({args.target})"
            )
    lost = parse_gpus(args.lost, a_doc.problem.gpus, args.source) if args.lost is not None else frozenset()
    problem = build_problem(b_doc.problem.namespace(args.target))
    current = plan_from_json(a_doc, build_problem(a_doc.problem.namespace(args.source)))
    target = plan_from_json(b_doc, problem)
    reused = sorted(lost & {g for c in target.candidates for g in c.gpus})
    if reused:
        lost_gpus = shorten(gpu_ranges(tuple(reused)))
        raise ConfigError(f"--lost: the target plan {args.target} places state on lost GPUs {lost_gpus}")
    started = time.perf_counter()
    try:
        tr = plan_transition(problem, current, target, lost)
    except NoSourceError as exc:
        raise InfeasibleError(str(exc)) from None
    plan_ms = (time.perf_counter() - started) * 1e3
    tr = fit_staging(problem, tr)  # the zero-copy staging counted too
    if not tr.feasible:
        raise InfeasibleError(f"target is not reachable in place: {tr.dag.reason}")
    started = time.perf_counter()
    priced = price_transition(problem, current, target, lost)
    price_ms = (time.perf_counter() - started) * 1e3
    doc = transition_json(tr, plan_ms)
    # what admission prices (``DagEstimator.estimate``): the class plan's makespan, else the
    # per-unit DAG with its staging fitted (``fit_staging``, which may plan it again) — ``tr``
    price_l_tran_s = priced.l_tran_s if priced.classes is not None else tr.l_tran_s
    doc.update({"price_ms": price_ms, "price_path": priced.path, "price_l_tran_s": price_l_tran_s})
    if args.json:
        print(json.dumps(doc))
        return 0
    _print(tr, doc, out)
    return 0


def transition_json(tr: Transition, plan_ms: float | None = None) -> dict[str, Any]:
    """The DAG, its schedule and L_tran; ``plan_ms``: wall time ``plan_transition`` took (moves,
    DAG, schedule), measured by the caller."""
    assert tr.schedule is not None
    doc = tr.dag.to_json()
    doc["critical_path"] = list(tr.schedule.critical_path)
    doc["l_tran_s"] = tr.l_tran_s
    doc["moved_bytes"] = tr.moved_bytes
    doc["resource_edges"] = tr.dag.resource_edges
    doc["peak_gib"] = max(tr.dag.peak.values(), default=0) / GIB  # state, and staging where counted
    doc["staging_budget_mib"] = tr.staging_budget / 2**20
    for n, start in zip(doc["nodes"], tr.schedule.start, strict=True):
        n["start_s"] = start
    if plan_ms is not None:
        doc["plan_ms"] = plan_ms
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
            gpu_ranges(tuple(set(n.gpus))),
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
        f" (staging in batches of {doc['staging_budget_mib']:g} MiB a peer)"
        + (f" · planned in {doc['plan_ms']:.2f} ms" if "plan_ms" in doc else "")
        + (
            f" · priced in {doc['price_ms']:.2f} ms"
            f" ({doc['price_path']}, L_tran {doc['price_l_tran_s']:.3f} s)"
            if "price_ms" in doc
            else ""
        )
    )
