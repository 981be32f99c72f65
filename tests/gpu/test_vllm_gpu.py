"""The vllm engine on a GPU (CUDA or ROCm): bf16 generation against the torch-native engine's
scores, a weight sync, and sleep/wake (vLLM's sleep mode frees the GPU for a trainer), built beside
a trainer's state; on two GPUs, a replica of one rank in a world of two. Skipped
cleanly without a GPU or without vLLM; run by ``tests/gpu/run.sh``. The CPU twin of each check
(``tests/vllm_checks.py``) runs in ``tests/test_device_twins_dist.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests import vllm_checks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vLLM is not installed (make install TORCH_SPEC=... installs vllm next to a GPU torch)",
    ),
]


@pytest.mark.timeout(600)
def test_vllm_generates_syncs_and_sleeps_on_the_gpu(tmp_path: Path) -> None:
    vllm_checks.run_isolated(vllm_checks.check_vllm_engine, "cuda", str(tmp_path), timeout=540)


@pytest.mark.timeout(600)
def test_vllm_slides_the_window_the_trainer_slides_on_the_gpu(tmp_path: Path) -> None:
    vllm_checks.run_isolated(vllm_checks.check_vllm_window, "cuda", str(tmp_path), timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (a replica smaller than its world)")
def test_a_vllm_replica_in_part_of_the_world_on_two_gpus(tmp_path: Path) -> None:
    vllm_checks.check_vllm_in_part_of_the_world("cuda", str(tmp_path), timeout=540)
