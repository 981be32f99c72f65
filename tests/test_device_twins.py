"""The CPU twins of the GPU runner's device checks (``tests/gpu/test_runtime_gpu.py``): the same
functions (``tests/device_checks.py``), run with the CPU."""

from __future__ import annotations

import pytest

from nereus.devices import CPU, Devices
from tests import device_checks as checks

pytestmark = pytest.mark.pure

CPU_DEVICES = Devices(CPU)


def test_snapshot_on_the_cpu() -> None:
    checks.check_snapshot(CPU_DEVICES)


def test_stage_memory_on_the_cpu() -> None:
    checks.check_stage_memory(CPU_DEVICES)


def test_out_of_memory_on_the_cpu() -> None:
    checks.check_out_of_memory(CPU_DEVICES)


def test_health_check_on_the_cpu() -> None:
    checks.check_health(CPU_DEVICES)
