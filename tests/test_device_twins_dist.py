"""The CPU twins of the GPU runner's transition on the device (``tests/gpu/test_runtime_gpu.py``)
and vLLM checks (``tests/gpu/test_vllm_gpu.py``): the same functions (``tests/device_checks.py``,
``tests/vllm_checks.py``) in one-rank gloo worlds, the transition's formed in this process, the
vLLM engine's in a spawned one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from nereus.devices import CPU, Devices
from tests import device_checks as checks
from tests import vllm_checks

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_a_transition_in_a_world_of_one_on_the_cpu(tmp_path: Path) -> None:
    checks.check_transition_in_a_world_of_one(Devices(CPU), tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make install`")
def test_the_vllm_engine_on_the_cpu(tmp_path: Path) -> None:
    """Generation against the torch-native engine, a weight sync, no sleep on the CPU."""
    vllm_checks.run_isolated(vllm_checks.check_vllm_engine, "cpu", str(tmp_path))
