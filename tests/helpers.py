"""Builders shared by the tests (pure, no processes)."""

from __future__ import annotations

import dataclasses

from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.spec import Role, load_cluster, load_model, load_workload


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
