"""Find shipped configs by name (``configs/<kind>/<name>.yaml``) or load a user's file by path."""

from __future__ import annotations

import os
from pathlib import Path

from nereus.errors import ConfigError
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Algorithm, WorkloadSpec

KINDS = ("models", "clusters", "workloads", "traces")


def config_root() -> Path:
    """``$NEREUS_CONFIGS`` if set, else the repository's ``configs/``."""
    env = os.environ.get("NEREUS_CONFIGS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs"


def names(kind: str) -> list[str]:
    """Names of the shipped configs of one kind, sorted."""
    if kind not in KINDS:
        raise ConfigError(f"unknown config kind {kind!r} (choices: {', '.join(KINDS)})")
    pattern = "*.json" if kind == "traces" else "*.yaml"
    return sorted(p.stem for p in (config_root() / kind).glob(pattern))


def _resolve(kind: str, name_or_path: str, what: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_dir() or os.sep in name_or_path:
        if not path.exists():
            raise ConfigError(f"{what} file {name_or_path} does not exist")
        return path
    shipped = config_root() / kind / f"{name_or_path}.yaml"
    if not shipped.exists():
        raise ConfigError(f"unknown {what} {name_or_path!r} (choices: {', '.join(names(kind))})")
    return shipped


def load_model(name_or_path: str) -> ModelSpec:
    """A shipped model name, our YAML, a Hugging Face ``config.json``, or a directory holding one."""
    path = _resolve("models", name_or_path, "model")
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"model directory {name_or_path} has no config.json")
        return ModelSpec.from_hf_config(path, name=path.parent.name)
    if path.suffix == ".json":
        return ModelSpec.from_hf_config(path)
    return ModelSpec.from_yaml(path)


def load_cluster(name_or_path: str) -> ClusterSpec:
    return ClusterSpec.from_yaml(_resolve("clusters", name_or_path, "cluster"))


def load_workload(algo_or_path: str) -> WorkloadSpec:
    """The default workload of an algorithm (``ppo``, ``grpo``, ``remax``), another shipped
    workload (``configs/workloads/<name>.yaml``, e.g. ``ppo-tiny``) or a workload YAML."""
    shipped = config_root() / "workloads" / f"{algo_or_path}.yaml"
    if algo_or_path in {a.value for a in Algorithm} or ("/" not in algo_or_path and shipped.is_file()):
        return WorkloadSpec.from_yaml(shipped)
    if not algo_or_path.endswith((".yaml", ".yml")):
        choices = ", ".join(a.value for a in Algorithm)
        raise ConfigError(
            f"unknown algorithm {algo_or_path!r} (choices: {choices}, a shipped workload, or a workload YAML)"
        )
    return WorkloadSpec.from_yaml(_resolve("workloads", algo_or_path, "workload"))


def trace_path(name_or_path: str) -> Path:
    """A shipped GPU-availability trace (``configs/traces/<name>.json``) or a trace file."""
    path = Path(name_or_path)
    if path.suffix == ".json" or os.sep in name_or_path:
        if not path.exists():
            raise ConfigError(f"trace file {name_or_path} does not exist")
        return path
    shipped = config_root() / "traces" / f"{name_or_path}.json"
    if not shipped.exists():
        raise ConfigError(
            f"unknown trace {name_or_path!r} (choices: {', '.join(names('traces'))}, or a JSON file)"
        )
    return shipped
