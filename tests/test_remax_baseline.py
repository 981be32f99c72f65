"""ReMax's greedy baseline is scored exactly as the sampled responses are: with a reward model,
``reward_coef`` × the model's score of the baseline's last token joins the verifier's score.

One ``algorithm_step`` of a ReMax workload with a reward model, on a stand-in worker that records
what the step asks of it: sampling returns one token, greedy decoding another, and the reward
model scores the greedy token 2.0 and the sampled one 0.0 (the verifier scores both 0). The
advantage of every sampled token is then r(sampled) − r(greedy) = 0 − 2·coef; before the fix the
baseline was the verifier's alone and the advantage 0.

Also of the step's setup: a worker's generation engines hold the longest response the experiment
asks for (a drift may raise ``max_new_tokens`` past the workload's ``max_response_len``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from nereus.backends.protocol import SamplingParams
from nereus.devices import CPU, Devices
from nereus.plan.layout import Plan
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import JobSetup, algorithm_step
from nereus.runtime.rollout import Rollouts, assemble

pytestmark = pytest.mark.pure

SAMPLED, GREEDY = 40, 41  # the one token each kind of decoding returns
COEF = 0.5


class StandIn:
    """The worker's interface as ``algorithm_step`` uses it, with fixed outputs."""

    def __init__(self, setup: JobSetup) -> None:
        self.workflow = setup.workload.workflow()
        self.trained: dict[str, Mapping[str, Tensor]] = {}

    def generate_part(
        self, plan: Plan, ids: Tensor, valid: Tensor, sample_ids: list[int], params: SamplingParams
    ) -> tuple[int, list[Tensor]]:
        token = GREEDY if params.greedy else SAMPLED
        rows = ids.shape[0]
        return 0, [torch.full((rows, 1), token), torch.ones(rows, 1, dtype=torch.long)]

    @staticmethod
    def collect(
        part: tuple[int, list[Tensor]], ids: Tensor, valid: Tensor, sample_ids: list[int], pad_id: int
    ) -> Rollouts:
        start, (tokens, ok) = part
        return assemble(ids, valid, [(start, tokens, ok, None)], sample_ids, pad_id)

    def infer(self, plan: Plan, name: str, r: Rollouts) -> Tensor:
        if name != "reward.inf":
            return torch.zeros(r.ids.shape)
        head = torch.where(r.ids == GREEDY, 2.0, 0.0) * r.mask  # the head at each response token
        return torch.nn.functional.pad(head[:, :-1], (1, 0))  # aligned as an engine's: entry i is i − 1's

    def train(self, plan: Plan, name: str, r: Rollouts, fields: Mapping[str, Tensor], loss: Any) -> float:
        self.trained[name] = dict(fields)
        return 0.0


def test_the_greedy_baseline_is_scored_by_the_reward_model_too(tmp_path: Path) -> None:
    spec = ExperimentSpec(name="remax-rm", workload="remax-tiny", model="tiny-llama", reward_coef=COEF)
    setup = JobSetup.build(spec, tmp_path)
    setup = dataclasses.replace(setup, workload=dataclasses.replace(setup.workload, reward_model=True))
    assert any(ms.name == "reward.inf" for ms in setup.workload.workflow().model_stages)
    worker = StandIn(setup)
    r, scores, metrics = algorithm_step(worker, None, setup, step=0, max_new=1)  # type: ignore[arg-type]
    assert torch.equal(scores, torch.zeros(r.rows))  # the samples: verifier 0, reward model 0
    adv = worker.trained["actor.train"]["advantages"]
    on = r.mask.bool()
    assert torch.allclose(adv[on], torch.full_like(adv[on], -2.0 * COEF)), adv[on]
    assert bool((adv[~on] == 0).all())
    assert metrics["rm_score"] == 0.0


def test_a_generation_engine_holds_the_longest_response_asked_for(tmp_path: Path) -> None:
    """vLLM's max_model_len: the workload's longest prompt plus the longest response the
    experiment asks for at any step (drift included): past the workload's max_response_len when
    asked, and below it when the run asks for less (that limit is what the planner prices; a
    model whose context holds the run's responses but not it runs)."""
    from nereus.runtime.drift import DriftEvent
    from nereus.runtime.job import make_worker

    spec = ExperimentSpec(
        name="long", workload="ppo-tiny", model="tiny-llama", max_new_tokens=4,
        drift=(DriftEvent(step=2, max_new_tokens=40),),
    )  # fmt: skip
    assert spec.longest_response() == 40
    setup = JobSetup.build(spec, tmp_path)
    worker = make_worker(0, setup, Devices(CPU), tmp_path)
    assert worker.longest_response == 40 > setup.workload.max_response_len
    short = make_worker(
        0, JobSetup.build(dataclasses.replace(spec, drift=()), tmp_path), Devices(CPU), tmp_path
    )
    assert short.longest_response == 4 < setup.workload.max_response_len
