"""pytest configuration: the test layers, hypothesis profiles, and the engine tests' oracle checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")

LAYERS = ("pure", "dist", "e2e", "slurm", "gpu")  # markers, declared in setup.cfg


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is in exactly one layer, so ``-m pure`` (``make test-fast``) and the others
    partition the suite: a test without one (or with two) stops the run before anything runs."""
    wrong = [
        f"{item.nodeid}: {names or 'no layer'}"
        for item in items
        if len(names := sorted({m.name for m in item.iter_markers() if m.name in LAYERS})) != 1
    ]
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one layer marker " + str(LAYERS) + ":\n" + "\n".join(wrong)
        )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """The engine tests' oracle checkpoints: kind -> (save_pretrained directory, transformers model)."""
    from tests.engine_oracle import write_checkpoints

    return write_checkpoints(tmp_path_factory.mktemp("hf"))


pytest_plugins = ("tests.slurm_cluster",)  # the slurm_cluster fixture and the `slurm` marker
