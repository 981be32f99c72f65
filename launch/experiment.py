"""The experiment as the launcher sees it: the YAML, where its workers go, and whether the planner
can use that many GPUs.

The config is read with ``yaml.safe_load`` and validated as a ``nereus.runtime.experiment
.ExperimentSpec`` (pure: it imports no torch). The resolved config written to the job folder is
that mapping dumped back, with ``name`` set and ``workers`` set to the job's task count.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from launch.inputs import read_yaml
from launch.render import job_name_error
from launch.site import Site
from nereus.errors import ConfigError, NereusError
from nereus.runtime.experiment import ExperimentSpec
from nereus.spec.schema import build

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Placement:
    """Tasks (one worker, one GPU each) laid out on nodes: ``nodes × tasks_per_node``."""

    nodes: int
    tasks_per_node: int

    def __post_init__(self) -> None:
        if self.nodes <= 0 or self.tasks_per_node <= 0:
            raise ValueError(f"a placement needs positive nodes and tasks, got {self}")

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True, slots=True)
class Experiment:
    """An experiment file: its mapping (as written) and the validated spec."""

    path: Path
    data: dict[str, Any]
    spec: ExperimentSpec

    @property
    def name(self) -> str:
        return self.spec.name

    def resolved(self, placement: Placement) -> Experiment:
        """The same experiment with ``workers`` = the job's tasks (validated again: drift events
        must still name workers that exist)."""
        data = {**self.data, "name": self.name, "workers": placement.tasks}
        return Experiment(self.path, data, build(ExperimentSpec, data, str(self.path)))

    def dump(self) -> str:
        return yaml.safe_dump(self.data, sort_keys=False)


def load_experiment(path: Path) -> Experiment:
    """Read and validate ``path``; ``name`` (the job's name) defaults to the file's stem."""
    data = read_yaml(path, "EXPERIMENT")
    stem = "name" not in data
    data.setdefault("name", path.stem)
    exp = Experiment(path, data, build(ExperimentSpec, data, str(path)))
    if why := job_name_error(exp.name):
        raise ConfigError(f"{path}: key 'name'{' (the file name)' if stem else ''}: {why}")
    return exp


def place(site: Site, workers: int, nodes: int | None, local: bool) -> Placement:
    """Where the tasks go. ``--local``: one machine, all workers. A CPU site: the experiment's
    workers split evenly over ``--nodes`` (default 1). A GPU site: one task per GPU on ``--nodes``
    nodes (default: enough for the experiment's workers)."""
    if nodes is not None and nodes <= 0:
        raise ConfigError(f"--nodes: expected a positive integer, got {nodes}")
    if local:
        if nodes not in (None, 1):
            raise ConfigError(f"--nodes: --local runs on this one machine, got {nodes}")
        return Placement(1, workers)
    if site.gpus_per_node == 0:
        n = nodes or 1
        if workers % n:
            divisors = [d for d in range(1, workers + 1) if workers % d == 0]
            raise ConfigError(
                f"--nodes: {n} does not divide the experiment's {workers} workers "
                f"(allowed: {', '.join(map(str, divisors))})"
            )
        placement = Placement(n, workers // n)
    else:
        placement = Placement(nodes or math.ceil(workers / site.gpus_per_node), site.gpus_per_node)
    check_node_limit(site, placement.nodes)
    return placement


def keyed(key: str, load: Callable[[str], T], name: str) -> T:
    """``load(name)``, its refusal naming the experiment's key (as ``nereus run`` names it)."""
    try:
        return load(name)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def check_node_limit(site: Site, nodes: int) -> None:
    if site.max_nodes and nodes > site.max_nodes:
        raise ConfigError(f"--nodes: {nodes} nodes exceed site {site.name}'s {site.max_nodes}")


def check_site(site: Site, spec: ExperimentSpec) -> None:
    """The experiment's cluster must describe the site's hardware: the planner sizes the plan for it."""
    from nereus.spec import load_cluster

    cluster = keyed("cluster", load_cluster, spec.cluster)
    if cluster.vendor != site.vendor:
        raise ConfigError(
            f"--site: site {site.name} runs {site.vendor.value} workers but the experiment's cluster "
            f"{cluster.name} is {cluster.vendor.value} (choose a site or a cluster that match)"
        )
    if site.gpus_per_node and cluster.gpus_per_node != site.gpus_per_node:
        raise ConfigError(
            f"--site: site {site.name} has {site.gpus_per_node} GPUs per node but the experiment's "
            f"cluster {cluster.name} has {cluster.gpus_per_node}"
        )


def check_plan(spec: ExperimentSpec, gpus: int, flag: str = "--nodes") -> None:
    """The planner must find a plan for the experiment's workload and model on ``gpus`` GPUs of its
    cluster, at the experiment's response length (what the job's first step plans for)."""
    from nereus.plan.problem import PlanningProblem, SeqStats
    from nereus.plan.search import search
    from nereus.runtime.engines import engines_of, job_models, space_of
    from nereus.spec import load_cluster, load_model, load_workload
    from nereus.spec.model import check_runnable

    workload = keyed("workload", load_workload, spec.workload)
    actor = keyed("model", load_model, spec.model)
    check_runnable(actor)
    cluster = keyed("cluster", load_cluster, spec.cluster)
    what = f"{spec.workload} on {spec.model}"
    if gpus > cluster.total_gpus:
        raise ConfigError(
            f"{flag}: {gpus} GPUs exceed the {cluster.total_gpus} of the experiment's cluster {cluster.name}"
        )
    models = job_models(workload, actor)  # each role's, as the job's leader plans it
    seq = SeqStats.fixed(workload.prompt_len, spec.max_new_tokens)
    space = space_of(engines_of(spec, workload, models))  # generation on vLLM: pp 1
    try:
        search(PlanningProblem(workload, models, cluster, tuple(range(gpus)), seq, space=space))
    except (NereusError, ValueError) as exc:
        raise ConfigError(f"{flag}: the planner cannot use {gpus} GPUs for {what}: {exc}") from None
