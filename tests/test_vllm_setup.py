"""Where the vLLM engine keeps vLLM's cache (``nereus.backends.vllm.setup.cache_root``): the user's
``VLLM_CACHE_ROOT``, else a private per-user folder that outlives the run, else the run's folder."""

from __future__ import annotations

import math
import stat
from pathlib import Path

import pytest

from nereus.backends.vllm.setup import MAX_UTILIZATION, cache_root, environment, utilization

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


@pytest.mark.parametrize("free_gib", [80, 72, 40, 9.5, 1, 0.05])
def test_vllm_asks_for_no_more_of_a_gpu_than_is_free(free_gib: float) -> None:
    """vLLM refuses to start when less than ``gpu_memory_utilization`` × total is free (it checks
    ceil(total × share) ≤ free), though its KV room is given: beside a trainer's state, the share
    asked for is what is free, less a margin for its communicators; alone, its default."""
    total, free = 80 << 30, int(free_gib * (1 << 30))
    share = utilization(free, total)
    assert 0 < share <= MAX_UTILIZATION
    assert math.ceil(total * share) <= free or share == 0.001
    if free_gib >= 73:
        assert share == MAX_UTILIZATION
    elif free_gib >= 10:
        assert free - total * share <= (1 << 30) + total / 1000  # no more held back than the margin


def test_a_device_whose_memory_makes_no_sense_is_refused() -> None:
    with pytest.raises(ValueError, match="device memory"):
        utilization(2, 1)
