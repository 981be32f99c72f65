"""Builders shared by the tests (pure, no processes)."""

from __future__ import annotations

import dataclasses
import importlib.util
import multiprocessing as mp
import random
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from nereus.errors import InfeasibleError
from nereus.plan.cache import PlanCache
from nereus.plan.layout import Candidate, Layout, Plan
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import SearchResult, search
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.workload import STAGE_ORDER


def make_problem(
    model: str = "llama-3.1-8b",
    cluster: str = "a100-64gb-hdr100",
    gpus: int = 16,
    response: int = 2048,
    algo: str = "ppo",
    prompt: int = 256,
    space: SearchSpace | None = None,
    **workload: object,
) -> PlanningProblem:
    w = load_workload(algo)
    if workload:
        w = dataclasses.replace(w, **workload)  # type: ignore[arg-type]
    m = load_model(model)
    return PlanningProblem(
        w,
        {r: m for r in Role},
        load_cluster(cluster),
        tuple(range(gpus)),
        SeqStats.fixed(prompt, response),
        space=space or SearchSpace(),
    )


def random_plan(rng: random.Random, problem: PlanningProblem, degrees: tuple[int, ...] = (1, 2, 4)) -> Plan:
    """Any valid plan: random layouts, dp and GPUs; concurrent model-stages on disjoint GPUs."""
    wf = problem.workflow
    cands = []
    for stage in STAGE_ORDER:
        members = wf.by_stage(stage)
        if not members:
            continue
        free = list(problem.pool)
        rng.shuffle(free)
        share = len(free) // len(members)
        for i, ms in enumerate(members):
            mine = free[i * share : (i + 1) * share]
            tp = rng.choice([t for t in degrees if t <= len(mine)])
            pp = rng.choice([p for p in degrees if tp * p <= len(mine)])
            dp = rng.randint(1, len(mine) // (tp * pp))
            cands.append(Candidate(ms.name, Layout(tp, pp), dp, tuple(mine[: tp * pp * dp])))
    return Plan(wf, tuple(cands), problem.pool)


def free_port() -> int:
    """A loopback TCP port nothing listens on now (for a test's rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def spawned(
    target: Callable[[int, int, str], None], ranks: int, out: Path, timeout_s: float = 90
) -> list[int | None]:
    """``target(rank, port, out)`` for ranks 0 … ``ranks`` − 1 in spawned processes sharing a
    free ``port``; their exit codes (None: still running after ``timeout_s``)."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, port, str(out))) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    return [p.exitcode for p in procs]


def benchmark_module(script: str) -> ModuleType:
    """``benchmarks/<script>.py`` imported as module ``script`` (registered, because dataclasses look
    their module up while a class is made), with ``benchmarks/`` on the path while it loads (a
    script may import its siblings)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(script, BENCHMARKS / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[script] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def search_outcome(problem: PlanningProblem, cache: PlanCache | None) -> SearchResult | str:
    """``search(problem, cache)``, or why it is infeasible: what a cached and a cold search compare."""
    try:
        return search(problem, cache)
    except InfeasibleError as exc:
        return f"infeasible: {exc}"


def assert_same_search(warm: SearchResult | str, cold: SearchResult | str) -> None:
    """A cached search equals a cold one: the plan, its step latency (exactly, not approximately)
    and its estimates — or the same infeasibility."""
    if isinstance(cold, str) or isinstance(warm, str):
        assert warm == cold
        return
    assert warm.plan == cold.plan
    assert warm.step_latency_s == cold.step_latency_s
    assert warm.estimates == cold.estimates
