"""Learning through the real runtime: on the bundled task, reward rises by a stated margin within N
steps for PPO, GRPO and ReMax.

``nereus run configs/experiments/<algo>-learn.yaml`` from random weights on local worker processes
(gloo): the copy task at difficulty 2 (answers 0–2) with one new token, a tiny Llama, no drift and
a static policy. The mean reward of the last 3 steps must exceed that of the first 3 by
``MARGIN``; a random model scores ~0.005 (it emits a digit ~2% of the time), emitting an in-range
digit at random scores 0.4 (1/3 · 1.0 + 2/3 · 0.1 format credit). The margin held for seeds 0–5 of
every config with room to spare (smallest margin: 0.35); each run is deterministic in its seed, and
the test runs seed 0 (the config's). Each run took 15–30 s of wall time on two CPU cores (up to
~70 s while other jobs loaded the machine); the three run side by side.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from nereus.runtime.experiment import ExperimentSpec
from tests.background import Run, finished, start

pytestmark = pytest.mark.e2e

EXPERIMENTS = Path(__file__).resolve().parents[1] / "configs" / "experiments"
MARGIN = 0.2  # mean reward, last 3 steps minus first 3
WINDOW = 3
ALGORITHMS = ("ppo", "grpo", "remax")


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """The three experiments, started together, side by side (none depends on another's timing;
    each alone leaves a core idle part of the time): each test waits for its own. Runs still
    going at the module's end are killed with their workers."""
    tmp = tmp_path_factory.mktemp("learn")
    runs = {a: start([str(EXPERIMENTS / f"{a}-learn.yaml")], tmp / a) for a in ALGORITHMS}
    yield runs
    for run in runs.values():
        run.kill()


@pytest.mark.timeout(400)  # the first test waits while all three run
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reward_rises_by_the_margin(learning_runs: dict[str, Run], algorithm: str) -> None:
    exp = EXPERIMENTS / f"{algorithm}-learn.yaml"
    steps = ExperimentSpec.load(exp).steps
    [out] = finished([learning_runs[algorithm]], 380)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
    rewards = [float(r["reward"]) for r in rows]
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    curve = " ".join(f"{x:.2f}" for x in rewards)
    accuracy = " ".join(f"{float(r['accuracy']):.2f}" for r in rows)
    assert last - first >= MARGIN, (
        f"{algorithm}: reward rose {last - first:+.3f} in {steps} steps (first {WINDOW}: {first:.3f}, "
        f"last {WINDOW}: {last:.3f}), expected ≥ {MARGIN}\nreward:   {curve}\naccuracy: {accuracy}"
    )
