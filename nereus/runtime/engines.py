"""Which engine runs each model-stage of a job, decided once from the experiment and checked
against the models it has to serve; and the search-space limit that follows (an engine without
pipelining keeps its model-stage at pp = 1). Imports neither torch nor any engine: the preflight
checks use it before a process starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nereus.backends.registry import ENGINES, import_error, pipelines, refusal
from nereus.errors import ConfigError
from nereus.plan.problem import SearchSpace
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Role, WorkloadSpec


def job_models(actor: ModelSpec) -> dict[Role, ModelSpec]:
    """The model of every role: the actor's, with a value head for the critic and reward model."""
    models = {role: actor for role in Role}
    models[Role.CRITIC] = actor.with_head(Head.VALUE)
    models[Role.REWARD] = actor.with_head(Head.VALUE)
    return models


def engines_of(spec: Any, workload: WorkloadSpec, models: Mapping[Role, ModelSpec]) -> dict[str, str]:
    """The engine of every model-stage (named in the experiment, else the default); a one-line
    ConfigError naming the model-stage when its engine cannot serve its model."""
    out = {}
    for ms in workload.workflow().model_stages:
        model = models[ms.role].with_head(ms.head)
        engine = out[ms.name] = spec.engine_of(ms.name, model)
        why = refusal(engine, model)
        if why:
            raise ConfigError(
                f"engines.{ms.name}: {engine} cannot serve it: {why}; name another engine "
                f"(allowed: {', '.join(ENGINES)})"
            )
    return out


def space_of(engines: Mapping[str, str]) -> SearchSpace:
    """The job's search space: model-stages on an engine without pipelining have pp = 1."""
    return SearchSpace(flat=tuple(sorted(n for n, e in engines.items() if not pipelines(e))))


def check_importable(engines: Mapping[str, str]) -> None:
    """A one-line ConfigError unless every engine's package imports (a broken vLLM install, say).
    Imports them: run it in the preflight's child process."""
    for name, engine in sorted(engines.items()):
        why = import_error(engine)
        if why:
            raise ConfigError(
                f"engines.{name}: {engine} is installed but does not import ({why}); repair it "
                f"(make install) or name another engine (allowed: {', '.join(ENGINES)})"
            )
