"""pytest configuration: hypothesis profiles, and the engine tests' oracle checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """The engine tests' oracle checkpoints: kind -> (save_pretrained directory, transformers model)."""
    from tests.engine_oracle import write_checkpoints

    return write_checkpoints(tmp_path_factory.mktemp("hf"))


pytest_plugins = ("tests.slurm_cluster",)  # the slurm_cluster fixture and the `slurm` marker
