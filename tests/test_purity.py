"""Pure packages import no side-effect modules; the planner does not even import torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import nereus

pytestmark = pytest.mark.pure

PURE = ("spec", "plan", "control", "state", "transition", "sim")
EDGES = {"transition/execute.py", "state/checkpoint.py"}  # runs a DAG on torch.distributed (architecture §2)
# The engine's pure parts: the model, the grid value, sampling, the optimizer, the protocol, HF files.
PURE_BACKEND_FILES = ("grid.py", "model.py", "sampling.py", "optim.py", "protocol.py", "hf.py")
FORBIDDEN = ("torch.distributed", "subprocess", "submitit")
ROOT = Path(nereus.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_pure_packages_import_no_side_effect_modules() -> None:
    files = [f for pkg in PURE for f in (ROOT / pkg).rglob("*.py") if str(f.relative_to(ROOT)) not in EDGES]
    files += [ROOT / "backends" / name for name in PURE_BACKEND_FILES]
    assert files
    for f in files:
        bad = sorted(n for n in _imports(f) if any(n == b or n.startswith(b + ".") for b in FORBIDDEN))
        assert not bad, f"{f.relative_to(ROOT.parent)} imports {bad}"


def test_planner_cli_does_not_load_torch() -> None:
    code = (
        "import sys, nereus.cli, nereus.plan, nereus.spec, nereus.transition, nereus.control, "
        "nereus.backends, nereus.runtime.command; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "False", out.stderr


def test_the_runtime_reaches_engines_only_through_the_protocol_and_the_registry() -> None:
    """Adding an engine touches ``nereus/backends/`` and the registry, never ``nereus/runtime``:
    the runtime imports the Backend protocol and the registry (and the engine-agnostic Hugging
    Face checkpoint reader for its preflight checks), no engine module."""
    allowed = ("nereus.backends.protocol", "nereus.backends.registry", "nereus.backends.hf")
    for f in sorted((ROOT / "runtime").rglob("*.py")):
        used = {n for n in _imports(f) if n.startswith("nereus.backends.")}
        bad = sorted(n for n in used if not any(n == a or n.startswith(a + ".") for a in allowed))
        assert not bad, f"{f.relative_to(ROOT.parent)} imports {bad}"
    text = "\n".join(f.read_text() for f in (ROOT / "runtime").rglob("*.py"))
    assert "TorchNativeEngine" not in text and "torch_native" not in text


def test_the_launcher_and_the_pool_format_load_no_torch() -> None:
    code = (
        "import sys, launch.cli, nereus.runtime.pool, nereus.backends.registry; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "False", out.stderr
