"""The plan's tables for a terminal: one row per model-stage (``nereus plan``) and the latency and
memory breakdown behind each (``nereus plan --explain``)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nereus.plan.problem import PlanningProblem
from nereus.plan.report import gpu_ranges, plan_json, stage_reports
from nereus.plan.search import SearchResult
from nereus.spec.cluster import GIB


def print_plan(problem: PlanningProblem, result: SearchResult, out: Console) -> None:
    """One row per model-stage (layout, GPUs, micro-batch, latency, peak memory), then the step."""
    c = problem.cluster
    gpus = f"{problem.gpus} × {escape(c.gpu_model)} ({escape(c.name)})"
    head = (
        f"[bold]{problem.workload.algorithm.value}[/] on {gpus}, "
        f"prompt {problem.seq.prompt_len:.0f} + response {problem.seq.response_len:.0f} tokens, "
        f"{problem.workload.mode.value}"
    )
    table = Table(title=head, title_justify="left")
    for col in ("model-stage", "stage", "tp", "pp", "dp", "GPUs", "micro", "latency s", "peak GiB"):
        table.add_column(col, justify="right" if col not in ("model-stage", "stage", "GPUs") else "left")
    for r in stage_reports(problem, result):
        cand = r.candidate
        micro = str(cand.micro_batch) + (
            "" if cand.recompute.value == "none" else f" rc={cand.recompute.value}"
        )
        table.add_row(
            r.name,
            r.stage.value,
            str(cand.layout.tp),
            str(cand.layout.pp),
            str(cand.dp),
            gpu_ranges(cand.gpus, in_rank_order=True),
            micro,
            f"{r.estimate.latency_s:.3f}",
            f"{r.peak_bytes / GIB:.1f}",
        )
    out.print(table)
    doc = plan_json(problem, result)
    out.print(
        f"step latency [bold]{result.step_latency_s:.3f} s[/] "
        f"(critical path {' → '.join(doc['critical_path'])}) · "
        f"capacity {problem.capacity_bytes / GIB:.1f} GiB per GPU after "
        f"{problem.headroom * 100:g}% headroom · "
        f"search {result.search_ms:.1f} ms ({result.solver})"
    )


def print_explain(problem: PlanningProblem, result: SearchResult, out: Console) -> None:
    """Each model-stage's latency terms and memory terms, as the planner summed them."""
    reports = stage_reports(problem, result)
    width = max(len(r.name) for r in reports)
    out.print("[bold]latency per step[/] (s): model-stage total = its terms, largest first")
    for r in reports:
        terms = sorted(r.estimate.latency.terms.items(), key=lambda kv: -float(kv[1]))
        parts = " + ".join(f"{k} {float(v):.3f}" for k, v in terms if float(v) > 0)
        out.print(f"  {r.name:<{width}}  {r.estimate.latency_s:8.3f} = {parts}")
    out.print(
        f"[bold]memory per GPU[/] (GiB): own terms × calibration, + idle state of other stages on "
        f"the GPU + runtime reserve = peak on this placement; bound = what the planner kept under "
        f"{problem.capacity_bytes / GIB:.1f}"
    )
    for r in reports:
        m = r.estimate.memory
        own = " + ".join(
            f"{name} {float(getattr(m, name)) / GIB:.2f}"
            for name in ("params", "optimizer", "grads", "activations", "kv_cache")
            if float(getattr(m, name)) > 0
        )
        co = r.peak_bytes - problem.reserved_bytes - r.estimate.active_bytes
        out.print(
            f"  {r.name:<{width}}  ({own}) × {m.correction:.2f} + co-resident {co / GIB:.2f} "
            f"+ reserve {problem.reserved_bytes / GIB:.2f} = {r.peak_bytes / GIB:.2f} "
            f"(bound {r.bound_bytes / GIB:.2f})"
        )
