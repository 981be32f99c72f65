"""Rule-based rewards: a response's text (decoded up to eos) checked against the task's answer.

``exact_answer`` shapes the accuracy reward with format credit (as DeepSeek-R1's rule-based reward
adds a format reward, Guo et al. 2025 §2.2.2), so that a randomly initialised policy, which first
emits a digit about 2% of the time (10 of 512 ids), has something to climb:

* 1.0: the response is the answer (the answer then eos, or cut at ``max_new_tokens``)
* 0.5: the answer followed by more text (the right answer, not stopped)
* 0.1: another numeral as long as the answer (for a one-digit answer: a wrong digit first)
* 0:   anything else

``exact_match`` is the unshaped 1/0. Verifiers are looked up by name (a workload with
``reward_model: false`` names one); an unknown name is a ``ConfigError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from nereus.errors import ConfigError

Verifier = Callable[[str, str], float]
"""``verifier(response_text, answer) -> reward``"""

CORRECT = 1.0
UNSTOPPED = 0.5
WELL_FORMED = 0.1
_NUMERAL = re.compile(r"-?[0-9]+")


def well_formed(response_text: str, answer: str) -> bool:
    """A numeral (optional minus sign, then digits) exactly as long as the answer."""
    return len(response_text) == len(answer) and _NUMERAL.fullmatch(response_text) is not None


def exact_answer(response_text: str, answer: str) -> float:
    """1.0 for the answer, 0.5 for the answer followed by more, 0.1 for another numeral, else 0."""
    if response_text == answer:
        return CORRECT
    head = response_text[: len(answer)]
    if head == answer:
        return UNSTOPPED
    return WELL_FORMED if well_formed(head, answer) else 0.0


def exact_match(response_text: str, answer: str) -> float:
    """1.0 if the response is the answer, else 0 (no format credit)."""
    return CORRECT if response_text == answer else 0.0


def no_verifier(response_text: str, answer: str) -> float:
    """No rule-based reward (a reward model scores alone)."""
    return 0.0


VERIFIERS: Mapping[str, Verifier] = {
    "exact_answer": exact_answer,
    "exact_match": exact_match,
    "none": no_verifier,
}


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name``."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ConfigError(f"unknown verifier {name!r} (allowed: {', '.join(sorted(VERIFIERS))})") from None


def score(verifier: Verifier, responses: Sequence[str], answers: Sequence[str]) -> Tensor:
    """Rewards (B,) fp32 of each response against the answer of its row."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses for {len(answers)} answers")
    return torch.tensor(
        [verifier(r, a) for r, a in zip(responses, answers, strict=True)], dtype=torch.float32
    )
