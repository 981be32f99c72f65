"""``docs/configuration.md`` lists every key the experiment, workload, cluster and model loaders
accept, each in its own section's table: a key added to a spec without a line there fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nereus.runtime.drift import DriftEvent
from nereus.runtime.experiment import DataSpec, ExperimentSpec, InitSpec, RlSpec, TaskSpec
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import WorkloadSpec

pytestmark = pytest.mark.pure

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SECTIONS = {
    "## Experiment file": ExperimentSpec,
    "### `task:`": TaskSpec,
    "### `data:`": DataSpec,
    "### `init:`": InitSpec,
    "### `rl:`": RlSpec,
    "### `drift:`": DriftEvent,
    "## Workload file": WorkloadSpec,
    "## Cluster file": ClusterSpec,
    "## Model file": ModelSpec,
}


def _sections() -> dict[str, list[str]]:
    """Each section's table keys (the first column), by its heading's start."""
    found: dict[str, list[str]] = {}
    current = None
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            current = next((h for h in SECTIONS if line.startswith(h)), None)
            continue
        m = re.match(r"\| `([a-z0-9_]+)` \|", line)
        if current is not None and m:
            found.setdefault(current, []).append(m[1])
    return found


@pytest.mark.parametrize("heading", list(SECTIONS))
def test_every_key_a_loader_accepts_is_documented_once(heading: str) -> None:
    keys = [f.name for f in dataclasses.fields(SECTIONS[heading]) if f.init]  # type: ignore[arg-type]
    listed = _sections().get(heading, [])
    assert sorted(listed) == sorted(keys), (
        f"{DOC.name} {heading}: missing {sorted(set(keys) - set(listed))}, "
        f"not a key {sorted(set(listed) - set(keys))}"
    )
