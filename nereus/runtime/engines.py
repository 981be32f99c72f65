"""Which engine runs each model-stage of a job, decided once from the experiment and checked
against the models it has to serve; and the search-space limit that follows (an engine without
pipelining keeps its model-stage at pp = 1). Imports neither torch nor any engine: the preflight
checks use it before a process starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nereus.backends.registry import ENGINES, import_error, pipelines, refusal, requires
from nereus.errors import ConfigError
from nereus.plan.problem import SearchSpace
from nereus.spec.model import Head, ModelSpec
from nereus.spec.registry import load_role_models
from nereus.spec.workload import Role, WorkloadSpec


def job_models(workload: WorkloadSpec, actor: ModelSpec) -> dict[Role, ModelSpec]:
    """The model of every role: the workload's ``models:`` entry where it names one, else the
    experiment's ``model`` (``load_role_models``, as ``nereus plan`` prices it), with a value head
    for the critic and the reward model."""
    models = load_role_models(workload, actor)
    models[Role.CRITIC] = models[Role.CRITIC].with_head(Head.VALUE)
    models[Role.REWARD] = models[Role.REWARD].with_head(Head.VALUE)
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


def describe_engines(engines: Mapping[str, str]) -> str:
    """The engines of a job in one line, each with its model-stages in workflow order:
    ``engines: E1 (actor.gen), E2 (actor.inf, ref.inf, actor.train)``."""
    by: dict[str, list[str]] = {}
    for stage, engine in engines.items():
        by.setdefault(engine, []).append(stage)
    return "engines: " + ", ".join(f"{e} ({', '.join(stages)})" for e, stages in by.items())


def job_engines(spec: Any) -> dict[str, str]:
    """The engine of every model-stage of the experiment ``spec`` (``engines_of`` on its
    workload and models)."""
    from nereus.spec import load_model, load_workload

    workload = load_workload(spec.workload)
    return engines_of(spec, workload, job_models(workload, load_model(spec.model)))


def space_of(engines: Mapping[str, str]) -> SearchSpace:
    """The job's search space: model-stages on an engine without pipelining have pp = 1."""
    return SearchSpace(flat=tuple(sorted(n for n, e in engines.items() if not pipelines(e))))


def check_importable(engines: Mapping[str, str], cache: Path | None = None) -> None:
    """A one-line ConfigError unless every engine's package imports (a broken vLLM install, say).
    Imports them: run it in the preflight's child process. ``cache``: a file remembering the
    installs that imported (``install_key``); an engine whose install imported before and has
    not changed since is not imported again (importing vLLM costs seconds of CPU in a process
    that only checks it, before every run). Only successes are remembered."""
    known = _read_cache(cache)
    for name, engine in sorted(engines.items()):
        key = install_key(engine) if cache is not None else ""
        if key and known.get(engine) == key:
            continue
        why = import_error(engine)
        if why:
            raise ConfigError(
                f"engines.{name}: {engine} is installed but does not import ({why}); repair it "
                f"(make install) or name another engine (allowed: {', '.join(ENGINES)})"
            )
        if key and cache is not None:
            known[engine] = key
            _write_cache(cache, known)


def imports_known(engines: Mapping[str, str], cache: Path) -> bool:
    """Whether ``check_importable(engines, cache)`` would import nothing (every engine's install
    imported before, or it needs no package). Imports no engine."""
    known = _read_cache(cache)
    for engine in set(engines.values()):
        key = install_key(engine)
        if key and known.get(engine) != key:
            return False
    return True


def default_cache() -> Path:
    """Where ``check_importable`` remembers installs that import: the user's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nereus" / "engine-imports.json"


def install_key(engine: str) -> str:
    """A digest of what engine ``engine``'s import depends on here: the interpreter, the import
    path (but its first entry, the script's folder) and the modification time of every folder on
    it (installing or removing any package changes its site-packages folder's), and the engine's
    own package folder. "" when it needs
    no package (nothing to remember)."""
    module = requires(engine)
    if module is None:
        return ""
    import importlib.util

    found = importlib.util.find_spec(module.split(".")[0])
    if found is None or found.origin is None:
        return ""
    parts = [sys.executable, sys.version, engine, module]
    package = Path(found.origin).parent
    # Not sys.path[0], the script's folder or the working one (it differs between ``nereus
    # run`` and the preflight's child); the package's folder and the one holding it instead.
    for entry in [*sys.path[1:], str(package), str(package.parent)]:
        try:
            parts.append(f"{entry}:{os.stat(entry or '.').st_mtime_ns}")
        except OSError:
            parts.append(f"{entry}:-")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read_cache(cache: Path | None) -> dict[str, str]:
    if cache is None:
        return {}
    try:
        doc = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(doc, dict)
        else {}
    )


def _write_cache(cache: Path, known: dict[str, str]) -> None:
    """Best effort (a read-only home only costs the import next time), atomically."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, sort_keys=True))
        tmp.replace(cache)
    except OSError:
        pass
