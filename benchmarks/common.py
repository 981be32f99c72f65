"""Shared plumbing for benchmarks: provenance, machine facts, JSON + PNG output (architecture §5)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _git(*args: str) -> str:
    out = subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
    )
    return out.stdout.strip()


def git_sha() -> str:
    """The commit measured, ``-dirty`` when code or configs differ from it, a new file that git
    does not ignore included (the results folder, which the benchmarks themselves rewrite, does
    not count)."""
    try:
        dirty = _git("status", "--porcelain", "--", ":/", ":(exclude,top)benchmarks/results")
        return _git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _script() -> str:
    """The benchmark's path from the repository's root, wherever it was run from."""
    script = Path(sys.argv[0]).resolve()
    root = RESULTS.parent.parent
    return str(script.relative_to(root)) if script.is_relative_to(root) else sys.argv[0]


def machine() -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": version("torch"),
        "numpy": version("numpy"),
        "pyscipopt": version("pyscipopt"),
        "device": _device(),
    }


def _device() -> str:
    """The GPU a benchmark that imported torch can see (``NVIDIA H200``), else ``cpu``; the
    planner's benchmarks, which never import torch, say ``cpu``."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} ×{torch.cuda.device_count()}"
    return "cpu"


def write(
    name: str,
    targets: dict[str, Any],
    results: Any,
    extra: dict[str, Any] | None = None,
    out: Path = RESULTS,
) -> Path:
    """Write ``<out>/<name>.json`` (atomically) with provenance, machine, targets and results."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "git_sha": git_sha(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, _script(), *sys.argv[1:]]),
        "machine": machine(),
        "targets": targets,
        "results": results,
        **(extra or {}),
    }
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def fork_server(namespace: dict[str, Any]) -> str:
    """The start method of a ``--quick`` run's measuring worlds: a fork server that imported the
    calling script's modules once (``mp.spawn`` has each process import the script, torch and the
    rest anew: ~3 CPU-s each, most of a quick run); "spawn" where there is none. ``namespace``:
    the script's ``globals()``. What the worlds time never includes a process's start."""
    from types import ModuleType

    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    # the modules the script's names come from, not the script: Python 3.11's server neither
    # imports "__main__" nor takes the caller's sys.path (it skips what it cannot import). Each
    # process re-runs the script as __mp_main__, at no cost once what it imports is there.
    names = {
        v.__name__ if isinstance(v, ModuleType) else getattr(v, "__module__", None)
        for v in namespace.values()
    }
    own = namespace.get("__name__")
    preload = sorted(n for n in names if isinstance(n, str) and n not in ("__main__", own))
    mp.get_context("forkserver").set_forkserver_preload(preload)
    return "forkserver"
