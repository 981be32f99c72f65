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


@pytest.fixture(scope="session")
def drifted_ppo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded 6-step PPO job of ``test_runtime_e2e`` (4 local workers) that loses worker 3
    before step 2 and regains it before step 4, run once per session: ``test_runtime_e2e``
    checks it against the run that never moved, ``test_runtime_stranger`` uses it as the calm run
    the attacked one must equal (the experiment's name is only a label)."""
    from tests.test_runtime_e2e import nereus_run

    out, proc = nereus_run(tmp_path_factory.mktemp("drifted"), "moved", 6, drift=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def finished_ppo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step tiny PPO run (4 local workers, seed 3) with checkpoints after steps 0
    and 1, run once per session. Tests copy it before they change or resume it: the checkpoint
    trust tests tamper with copies, ``test_runtime_e2e`` resumes one to 5 steps, and
    ``test_runtime_signals`` runs into a copy as a used folder."""
    import subprocess
    import sys

    from tests.test_runtime_checkpoint_trust import experiment

    tmp = tmp_path_factory.mktemp("finished")
    out = tmp / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(experiment(tmp, 2)), "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


pytest_plugins = ("tests.slurm_cluster",)  # the slurm_cluster fixture and the `slurm` marker
