"""Engines behind one protocol (``protocol.Backend``): ``torch_native`` now; Megatron-core
(training) and vLLM (generation) adapters later, on GPU nodes only.

Importing this package does not import torch; ``backend_class`` does, for the engine asked for.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from nereus.errors import ConfigError

BACKENDS = ("torch_native", "megatron", "vllm")
_GPU_MODULES = {"megatron": "megatron.core", "vllm": "vllm"}


def backend_class(name: str) -> Any:
    """The engine class registered as ``name``, or a ConfigError saying why it is unavailable."""
    if name == "torch_native":
        from nereus.backends.torch_native import TorchNativeEngine

        return TorchNativeEngine
    if name in _GPU_MODULES:
        module = _GPU_MODULES[name]
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ConfigError(
                f"backend '{name}' is unavailable: {module} is not installed (extra nereus[gpu])"
            )
        raise ConfigError(
            f"backend '{name}' is unavailable: its adapter is not implemented yet; use torch_native"
        )
    raise ConfigError(f"backend: expected one of {', '.join(BACKENDS)}, got {name!r}")
