"""Rule-based rewards: a response's text (decoded up to eos) checked against the task's answer.

``exact_answer`` shapes the accuracy reward with format credit (as DeepSeek-R1's rule-based reward
adds a format reward, Guo et al. 2025 §2.2.2), so that a randomly initialised policy, which first
emits a digit about 2% of the time (10 of 512 ids), has something to climb:

* 1.0: the response is the answer (the answer then eos, or cut at ``max_new_tokens``)
* 0.5: the answer followed by more text (the right answer, not stopped)
* 0.1: another numeral as long as the answer (for a one-digit answer: a wrong digit first)
* 0:   anything else

``exact_match`` is the unshaped 1/0; ``exact`` the same with surrounding whitespace ignored. For
real data sets (answer extraction and normal forms in ``nereus.rl.math_answers``), 1.0 or 0:

* ``gsm8k``: the number after the response's last ``####`` equals the answer's (a number, or a
  full GSM8K solution ending ``#### <number>``); no marker scores 0, as verl's strict default
  (``gsm8k_flexible`` reads a response without one at its last number)
* ``math`` (alias ``boxed``): the response's last ``\\boxed{...}`` equals the answer (itself boxed
  or plain) under the MATH normal form, or as the same number (within a relative 1e-6 where
  either is written with decimals); no box scores 0
* ``answer_line`` (DAPO-Math, AIME: verl's ``math_dapo``): the last ``Answer: ...`` line near the
  response's end (else its last box) equals the answer as ``math`` compares them
* ``math_verify``: Hugging Face's Math-Verify (``math-verify``) decides, as NeMo-RL's math
  environment and verl's ``math_verify`` reward call it: the answer (its box, or itself) parsed as
  LaTeX, the response's answer (its last box, else a LaTeX or plain expression) compared with it
  symbolically in sympy (``x^2`` and ``x^{2}``, ``1/2`` and ``0.5``, ``(1, 2)`` and ``(1,2)``)

Verifiers are looked up by name (a workload with ``reward_model: false`` names one); an unknown
name is a ``ConfigError``. A data set that mixes sources names ``by_source``: ``get_verifier``
accepts the name (so a config naming it validates) and returns ``by_source``, a placeholder that
raises ``ConfigError`` when called. Score it with ``score_by_source``, which routes each row to
``verifier_for_source`` of the row's verl ``data_source``; a caller dispatches on
``verifier is by_source``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from nereus.errors import ConfigError
from nereus.rl.math_answers import answer_line, gsm8k_ground_truth, gsm8k_number, last_boxed, math_equal

if TYPE_CHECKING:
    from torch import Tensor

    from nereus.rl.tasks import TaskRecord

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


def exact(response_text: str, answer: str) -> float:
    """1.0 if the response is the answer once both are stripped of surrounding whitespace, else 0."""
    return CORRECT if response_text.strip() == answer.strip() else 0.0


def gsm8k(response_text: str, answer: str) -> float:
    """1.0 if the number after the response's last ``####`` equals the answer's, else 0 (also with
    no ``####``, as verl's default strict GSM8K score: its prompt asks for the marker, and a
    response without one earns nothing; and when the answer holds no number)."""
    want = gsm8k_ground_truth(answer)
    return CORRECT if want is not None and gsm8k_number(response_text, flexible=False) == want else 0.0


def gsm8k_flexible(response_text: str, answer: str) -> float:
    """``gsm8k``, but a response without ``####`` is read at its last number (verl's "flexible")."""
    want = gsm8k_ground_truth(answer)
    return CORRECT if want is not None and gsm8k_number(response_text) == want else 0.0


def boxed_math(response_text: str, answer: str) -> float:
    """1.0 if the response's last box holds the answer (the answer's last box, or the whole answer
    if it has none) under ``math_equal``, else 0 (also when the response has no closed box)."""
    got = last_boxed(response_text)
    if got is None:
        return 0.0
    want = last_boxed(answer)
    return CORRECT if math_equal(got, answer if want is None else want) else 0.0


def answer_math(response_text: str, answer: str) -> float:
    """DAPO-Math and AIME rows, whose prompt asks for a final "Answer: X" line (verl's
    ``math_dapo``): 1.0 if that line's answer (``answer_line``: the last ``Answer:`` line near the
    end, else the last box) equals the answer under ``math_equal``, else 0. verl scores these
    +1/−1; 1/0 here, as every verifier (the same advantages under GRPO's group normalisation)."""
    got = answer_line(response_text)
    if got is None:
        return 0.0
    want = last_boxed(answer)
    return CORRECT if math_equal(got, answer if want is None else want) else 0.0


MATH_VERIFY_TIMEOUT_S = 2  # per parse and per comparison: a wedged sympy call (Math-Verify's is 5)
MATH_VERIFY_TAIL = 4000  # the response's last characters, where its final answer is
MAX_SYMBOLIC_CHARS = 300  # a final box longer than this is not handed to sympy (scores 0)
MAX_POWERS = 8  # nor one with more exponents than this (a tower of powers wedges sympy)


def math_verify(response_text: str, answer: str) -> float:
    """1.0 if Math-Verify finds the response's answer — its last box, else (several boxes, or
    none) what Math-Verify extracts from its text — equal to ``answer``, else 0 (also when either
    does not parse, or a parse or a comparison takes longer than ``MATH_VERIFY_TIMEOUT_S``).
    Bounded before any sympy runs, so a batch of degenerate responses cannot stall a step: only
    the last ``MATH_VERIFY_TAIL`` characters are read, and a final box longer than
    ``MAX_SYMBOLIC_CHARS`` or with more than ``MAX_POWERS`` exponents scores 0. Math-Verify times
    out with ``SIGALRM``, which works in the main thread only; in another thread only these
    bounds hold."""
    import logging

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs each timeout, response and all
    text = response_text[-MATH_VERIFY_TAIL:]
    final = last_boxed(text)
    if final is not None and (len(final) > MAX_SYMBOLIC_CHARS or final.count("^") > MAX_POWERS):
        return 0.0
    limit = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    boxed = last_boxed(answer)
    try:
        gold = parse(f"\\boxed{{{answer if boxed is None else boxed}}}", (LatexExtractionConfig(),),
                     parsing_timeout=limit)  # fmt: skip
        # the last box first (Math-Verify reads every box of a text as one set: a response that
        # corrects itself, "\boxed{5} ... no, \boxed{6}", matched neither), then, where there are
        # several, the text as Math-Verify reads it (an answer given as boxes: "\boxed{1}, \boxed{2}")
        boxes = text.count("\\boxed") + text.count("\\fbox")  # the whole text only within the bounds
        several = [text] if boxes > 1 and text.count("^") <= MAX_POWERS else []
        reads = [text] if final is None else [f"\\boxed{{{final}}}", *several]
        found = False
        for read in reads:
            got = parse(read, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=limit)
            found = bool(gold) and bool(got) and verify(gold, got, timeout_seconds=limit)
            if found:
                break
    except Exception:  # Math-Verify's timeouts and sympy's errors: not a match (as verl scores them)
        return 0.0
    return CORRECT if found else 0.0


def by_source(response_text: str, answer: str) -> float:
    """The ``by_source`` placeholder: a row's verifier depends on its data source, which this
    signature lacks, so calling it is an error naming ``score_by_source``."""
    raise ConfigError(
        "verifier 'by_source' needs each row's data_source: "
        "score with score_by_source(texts, answers, sources)"
    )


VERIFIERS: Mapping[str, Verifier] = {
    "exact_answer": exact_answer,
    "exact_match": exact_match,
    "exact": exact,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "math": boxed_math,
    "boxed": boxed_math,
    "answer_line": answer_math,
    "math_verify": math_verify,
    "by_source": by_source,
    "none": no_verifier,
}

SOURCES: Mapping[str, Verifier] = {
    "openai/gsm8k": gsm8k,
    "gsm8k": gsm8k,
    "DigitalLearningGmbH/MATH-lighteval": boxed_math,
    "lighteval/MATH": boxed_math,
    "HuggingFaceH4/MATH-500": boxed_math,
    "math": answer_math,  # verl routes "math" to math_dapo, as its DAPO recipe's data names it
    "math_dapo": answer_math,
    "math_dapo_reasoning": answer_math,
    "numina_aops_forum": math_verify,
    "numina_synthetic_math": math_verify,
    "numina_amc_aime": math_verify,
    "numina_synthetic_amc": math_verify,
    "numina_cn_k12": math_verify,
    "numina_olympiads": math_verify,
}
"""verl ``data_source`` values and their verifiers, as verl's ``default_compute_score`` routes them
(its ``prime_math`` sources, ``numina_*``, whose answers verl compares symbolically in sympy, are
scored by ``math_verify``, Math-Verify's sympy comparison: ``(x+1)^2`` equals ``x^2+2x+1`` there, as
in prime_math, and not in ``math``'s string normal forms)."""


def verifier_for_source(data_source: str) -> Verifier:
    """The verifier of a verl ``data_source``: one of ``SOURCES``, or ``answer_line`` for a name
    starting ``aime`` (verl routes AIME to ``math_dapo``). Any other source is a ``ConfigError``,
    as verl refuses it: a name that merely contains "math" may ask for a box or an "Answer:" line,
    and the wrong guess would score every response 0."""
    if (verifier := SOURCES.get(data_source)) is not None:
        return verifier
    if data_source.lower().startswith("aime"):
        return answer_math
    raise ConfigError(
        f"unknown data_source {data_source!r} (known: {', '.join(SOURCES)}, or a name starting with "
        "'aime'; for another source name a verifier instead of by_source)"
    )


def unscorable(name: str, records: Sequence[TaskRecord]) -> list[TaskRecord]:
    """The records whose answer the verifier ``name`` (``by_source``: each record's source's) can
    match with no response: under ``gsm8k``, a ground truth with no one number after its last
    ``####``. A run on them trains on rewards of 0 whatever the model answers."""
    verifier = get_verifier(name)

    def of(r: TaskRecord) -> Verifier:
        return verifier_for_source(r.source) if verifier is by_source else verifier

    return [r for r in records if of(r) in (gsm8k, gsm8k_flexible) and gsm8k_ground_truth(r.answer) is None]


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
    import torch  # the registry and its names without torch (the preflight checks a name)

    return torch.tensor(
        [verifier(r, a) for r, a in zip(responses, answers, strict=True)], dtype=torch.float32
    )


def score_by_source(responses: Sequence[str], answers: Sequence[str], sources: Sequence[str]) -> Tensor:
    """Rewards (B,) fp32, each row scored by ``verifier_for_source`` of its ``data_source``; every
    source is resolved (an unknown one is a ``ConfigError``) before any row is scored."""
    if not len(responses) == len(answers) == len(sources):
        raise ValueError(f"{len(responses)} responses, {len(answers)} answers and {len(sources)} sources")
    verifiers = {source: verifier_for_source(source) for source in dict.fromkeys(sources)}
    import torch

    return torch.tensor(
        [verifiers[s](r, a) for r, a, s in zip(responses, answers, sources, strict=True)],
        dtype=torch.float32,
    )
