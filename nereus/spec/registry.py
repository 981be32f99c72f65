"""Find shipped configs by name (``configs/<kind>/<name>.yaml``) or load a user's file by path."""

from __future__ import annotations

import os
from pathlib import Path

from nereus.errors import ConfigError
from nereus.spec.cluster import ClusterSpec
from nereus.spec.files import brief, shorten
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Algorithm, ExecutionMode, Role, WorkloadSpec

KINDS = ("models", "clusters", "workloads", "traces")


def config_root() -> Path:
    """``$NEREUS_CONFIGS`` if set, else the repository's ``configs/``."""
    env = os.environ.get("NEREUS_CONFIGS")
    if env and not Path(env).is_dir():
        raise ConfigError(
            f"NEREUS_CONFIGS={shorten(env, 200)}: not a folder (unset it for the shipped configs/)"
        )
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs"


def offered(kind: str) -> str:
    """The shipped names of ``kind`` as an error offers them."""
    return ", ".join(names(kind)) or "none shipped"


def names(kind: str) -> list[str]:
    """Names of the shipped configs of one kind, sorted."""
    if kind not in KINDS:
        raise ConfigError(f"unknown config kind {kind!r} (choices: {', '.join(KINDS)})")
    pattern = "*.json" if kind == "traces" else "*.yaml"
    folder = config_root() / kind
    env = os.environ.get("NEREUS_CONFIGS")
    if env and not folder.is_dir():
        raise ConfigError(
            f"NEREUS_CONFIGS={shorten(env, 200)}: no {kind}/ folder in it (it replaces the shipped "
            f"configs/, whose layout it needs: {', '.join(f'{k}/' for k in KINDS)}; unset it for those)"
        )
    # what a name resolves to: a file (a folder, a broken link or a hidden file is not offered)
    return sorted(p.stem for p in folder.glob(pattern) if not p.name.startswith(".") and _is_file(p))


def _exists(path: Path) -> bool:
    """``path.exists()``, False for names the OS refuses (too long, an embedded NUL)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _shipped_name(text: str) -> bool:
    """Whether ``text`` could name a shipped config (no path separator, not hidden, not empty)."""
    return bool(text) and os.sep not in text and "/" not in text and not text.startswith(".")


def lasting_name(name_or_path: str) -> str:
    """``name_or_path`` as a saved file keeps it: a shipped name as it is, a path (what
    ``_resolve`` reads as one) that exists made absolute, since a relative one names another file,
    or none, from another folder."""
    path = Path(name_or_path)
    as_path = path.suffix in (".yaml", ".yml", ".json") or _is_dir(path) or os.sep in name_or_path
    return str(path.resolve()) if as_path and _exists(path) else name_or_path


def _read_from(path: Path) -> str:
    """For an error about relative ``path``: where it was looked for (the working folder, not the
    folder of the file that named it)."""
    if path.is_absolute():
        return ""
    try:
        return f" (relative paths are read from the working folder, {shorten(os.getcwd(), 120)})"
    except OSError:
        return ""


def _resolve(kind: str, name_or_path: str, what: str) -> Path:
    if not name_or_path.strip():  # Path("") is the working folder
        raise ConfigError(f"{what}: empty name (choices: {offered(kind)}, or a YAML file)")
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json") or _is_dir(path) or os.sep in name_or_path:
        if not _exists(path):
            raise ConfigError(f"{what} file {shorten(name_or_path, 200)} does not exist{_read_from(path)}")
        return path
    shipped = config_root() / kind / f"{name_or_path}.yaml"
    if not _shipped_name(name_or_path) or not _is_file(shipped):
        if _is_file(path):  # a file of another kind, not a misspelt name
            raise ConfigError(
                f"{what} file {shorten(name_or_path, 200)}: expected a .yaml, .yml or .json file "
                f"(or a shipped {what}: {offered(kind)})"
            )
        raise ConfigError(f"unknown {what} {brief(name_or_path)} (choices: {offered(kind)})")
    return shipped


def load_model(name_or_path: str) -> ModelSpec:
    """A shipped model name, our YAML, a Hugging Face ``config.json``, or a directory holding one."""
    if not name_or_path.strip():
        raise ConfigError(
            "model: empty name (allowed: a shipped model, a model YAML, a config.json or its folder)"
        )
    path = _resolve("models", name_or_path, "model")
    if _is_dir(path):
        path = path / "config.json"
        if not _exists(path):
            raise ConfigError(f"model directory {shorten(name_or_path, 200)} has no config.json")
        return ModelSpec.from_hf_config(path, name=path.parent.name)
    if path.suffix == ".json":
        return ModelSpec.from_hf_config(path)
    return ModelSpec.from_yaml(path)


def load_cluster(name_or_path: str) -> ClusterSpec:
    return ClusterSpec.from_yaml(_resolve("clusters", name_or_path, "cluster"))


def load_workload(algo_or_path: str, mode: ExecutionMode | None = None) -> WorkloadSpec:
    """The default workload of an algorithm (``ppo``, ``grpo``, ``remax``), another shipped
    workload (``configs/workloads/<name>.yaml``, e.g. ``ppo-tiny``) or a workload YAML; ``mode``
    overrides its execution mode."""
    shipped = config_root() / "workloads" / f"{algo_or_path}.yaml"
    if algo_or_path in {a.value for a in Algorithm} or (_shipped_name(algo_or_path) and _is_file(shipped)):
        return WorkloadSpec.from_yaml(shipped, mode)
    if not algo_or_path.endswith((".yaml", ".yml")):
        choices = ", ".join(a.value for a in Algorithm)
        raise ConfigError(
            f"unknown algorithm {brief(algo_or_path)} "
            f"(choices: {choices}, a shipped workload, or a workload YAML)"
        )
    return WorkloadSpec.from_yaml(_resolve("workloads", algo_or_path, "workload"), mode)


def trace_path(name_or_path: str) -> Path:
    """A shipped GPU-availability trace (``configs/traces/<name>.json``) or a trace file."""
    if not name_or_path.strip():
        raise ConfigError(f"trace: empty name (choices: {offered('traces')}, or a JSON file)")
    path = Path(name_or_path)
    if path.suffix == ".json" or os.sep in name_or_path or _is_dir(path):
        if not _exists(path):
            raise ConfigError(f"trace file {shorten(name_or_path, 200)} does not exist{_read_from(path)}")
        return path
    shipped = config_root() / "traces" / f"{name_or_path}.json"
    if not _shipped_name(name_or_path) or not _is_file(shipped):
        if _is_file(path):  # a file of another kind, not a misspelt name
            raise ConfigError(
                f"trace file {shorten(name_or_path, 200)}: expected a .json file "
                f"(or a shipped trace: {offered('traces')})"
            )
        raise ConfigError(
            f"unknown trace {brief(name_or_path)} (choices: {offered('traces')}, or a JSON file)"
        )
    return shipped


def load_role_models(workload: WorkloadSpec, model: ModelSpec) -> dict[Role, ModelSpec]:
    """Each role's model: the workload's ``models:`` entry where it names one (the reference
    follows the actor's, ``WorkloadSpec.model_of``), else ``model`` (the job's, ``--model``); an
    entry that does not load names its key."""
    out: dict[Role, ModelSpec] = {}
    for role in Role:
        name = workload.model_of(role.value)
        try:
            out[role] = load_model(name) if name else model
        except ConfigError as exc:
            raise ConfigError(
                f"{workload.name}: key 'models.{workload.model_key(role.value)}': {exc}"
            ) from None
    actor = out[Role.ACTOR]
    for role, m in out.items():  # every role reads the actor's token ids
        if m.vocab_size == actor.vocab_size:
            continue
        if role.value in workload.models:
            raise ConfigError(
                f"{workload.name}: key 'models.{role.value}': {m.name}'s vocabulary ({m.vocab_size}) is "
                f"not the actor {actor.name}'s ({actor.vocab_size}); every role reads the actor's tokens"
            )
        # the role runs the job's model (--model); the actor is the workload's own
        roles = [r.value for r, x in out.items() if x is m and r.value not in workload.models]
        runs = f"{', '.join(roles)} {'runs' if len(roles) == 1 else 'run'}"
        raise ConfigError(
            f"{workload.name}: key 'models.actor': {actor.name}'s vocabulary ({actor.vocab_size}) is not "
            f"that of the job's model {m.name} ({m.vocab_size}), which {runs}; every role reads "
            "the actor's tokens (name their models under models:, or pick another --model)"
        )
    return out


def hf_folder(name: str) -> Path | None:
    """The Hugging Face folder a model name is: the folder itself, or the folder of a
    ``config.json`` named directly; None for a shipped model or a model YAML."""
    path = Path(name)
    if _is_dir(path):
        return path
    return path.parent if path.name == "config.json" and _is_file(path) else None


def weights_folder(folder: Path | None) -> str:
    """``folder`` when it holds safetensors weights, else ""."""
    return str(folder) if folder is not None and any(folder.glob("*.safetensors")) else ""
