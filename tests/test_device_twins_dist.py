"""The CPU twin of the GPU runner's transition on the device (``tests/gpu/test_runtime_gpu.py``):
the same function (``tests/device_checks.py``) in a one-rank gloo world formed in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.devices import CPU, Devices
from tests import device_checks as checks

pytestmark = pytest.mark.dist


@pytest.mark.timeout(120)
def test_a_transition_in_a_world_of_one_on_the_cpu(tmp_path: Path) -> None:
    checks.check_transition_in_a_world_of_one(Devices(CPU), tmp_path)
