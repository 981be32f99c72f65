"""Startup cost: the preflight imports an engine's package once per install, not before every
run (``check_importable``'s cache), and a broken install is never remembered as good."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from nereus.backends import registry
from nereus.errors import ConfigError
from nereus.runtime.engines import check_importable, install_key

pytestmark = pytest.mark.pure


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The modules the registry imports (vllm's import counted, not run)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is installed by `make install`")
    seen: list[str] = []
    real = importlib.import_module

    def counted(name: str, *args: object) -> object:
        seen.append(name)
        return object() if name == "vllm" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(registry.importlib, "import_module", counted)
    return seen


def test_an_install_that_imported_is_not_imported_again(imports: list[str], tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "engine-imports.json"
    engines = {"actor.gen": "vllm", "actor.train": "torch_native"}
    check_importable(engines, cache)
    assert imports == ["vllm"]
    assert json.loads(cache.read_text()) == {"vllm": install_key("vllm")}
    check_importable(engines, cache)
    assert imports == ["vllm"], "the same install was imported twice"
    check_importable(engines)  # without a cache: always imported
    assert imports == ["vllm", "vllm"]


def test_a_changed_install_is_imported_again(
    imports: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "engine-imports.json"
    check_importable({"actor.gen": "vllm"}, cache)
    before = install_key("vllm")
    extra = tmp_path / "site"
    extra.mkdir()
    monkeypatch.setattr(sys, "path", [sys.path[0], str(extra), *sys.path[1:]])  # a new folder on the path
    assert install_key("vllm") != before
    check_importable({"actor.gen": "vllm"}, cache)
    assert imports == ["vllm", "vllm"]
    after = install_key("vllm")
    (extra / "pkg.dist-info").mkdir()  # a package installed into a folder on the path
    assert install_key("vllm") != after
    assert install_key("torch_native") == ""


def test_a_broken_install_is_not_remembered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is installed by `make install`")
    real = importlib.import_module
    calls = []

    def broken(name: str, *args: object) -> object:
        if name == "vllm":
            calls.append(name)
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(registry.importlib, "import_module", broken)
    cache = tmp_path / "engine-imports.json"
    cache.write_text(json.dumps({"vllm": "an older install"}))
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"^engines\.actor\.gen: vllm is installed but does not import"):
            check_importable({"actor.gen": "vllm"}, cache)
    assert calls == ["vllm", "vllm"]
    assert json.loads(cache.read_text()) == {"vllm": "an older install"}


def test_the_fork_server_preloads_the_runtime_but_no_engine_package() -> None:
    """The initial workers fork from a server that imported ``PRELOAD``: every module a worker
    needs before its engines are built, and nothing that reads the settings a worker puts in its
    environment first (vLLM), nor what only the supervisor uses (matplotlib), nor the main
    module a worker re-runs (``nereus.cli``: runpy would warn on every worker's stderr)."""
    import subprocess
    import sys

    from nereus.runtime import local

    ctx = local._context()
    assert ctx.get_start_method() == "forkserver"
    code = (
        "import sys; from nereus.runtime.local import PRELOAD\n"
        "for m in PRELOAD: __import__(m)\n"
        "names = ('torch', 'nereus.runtime.loop', 'vllm', 'matplotlib', 'nereus.cli')\n"
        "print(sorted(m for m in names if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.stdout.strip() == "['nereus.runtime.loop', 'torch']", out.stderr[-2000:]
