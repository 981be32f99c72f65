"""Where the vLLM engine keeps vLLM's cache (``nereus.backends.vllm.setup.cache_root``): the user's
``VLLM_CACHE_ROOT``, else a private per-user folder that outlives the run, else the run's folder."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from nereus.backends.vllm.setup import cache_root, environment

pytestmark = pytest.mark.pure


def test_the_users_vllm_cache_root_wins(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    env = {"VLLM_CACHE_ROOT": str(mine), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert cache_root(tmp_path / "run", env) == mine


def test_a_private_per_user_folder_outlives_the_run(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first, second = cache_root(tmp_path / "run1", env), cache_root(tmp_path / "run2", env)
    assert first == second == tmp_path / "xdg" / "nereus" / "vllm"
    assert first.is_dir() and stat.S_IMODE(first.stat().st_mode) == 0o700


def test_a_file_in_the_way_falls_back_to_the_runs_folder(tmp_path: Path) -> None:
    (tmp_path / "xdg").write_text("not a folder")
    assert (
        cache_root(tmp_path / "run", {"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "run" / "cache"
    )


def test_sockets_stay_in_the_runs_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env = environment(tmp_path / "run")
    assert env["VLLM_RPC_BASE_PATH"] == str(tmp_path / "run" / "rpc")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "xdg" / "nereus" / "vllm")
    assert (tmp_path / "run" / "rpc").is_dir()
