"""Verifier edge cases an exploratory tester found scored wrongly: a GSM8K ground truth that is
not one number, the Unicode minus in MATH answers, units after TeX spacing, and Math-Verify on a
response that corrects itself."""

from __future__ import annotations

import pytest

from nereus.rl.tasks import TaskRecord
from nereus.rl.verifiers import answer_math, boxed_math, gsm8k, gsm8k_flexible, math_verify, unscorable

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    ("truth", "response"),
    [
        (r"\frac{1}{2}", "#### 1"),
        ("1/2", "#### 1"),
        ("3:30", "#### 3"),
        ("1e3", "#### 1"),
        ("5\u00a0000", "#### 5"),  # a French thousands separator
        ("12-15", "#### 12"),
        ("10^{6}", "#### 10"),
    ],
)
def test_a_ground_truth_that_is_not_one_number_rewards_no_response(truth: str, response: str) -> None:
    """Its first number was the answer: ``#### 1`` was rewarded for ½ (verl compares strings)."""
    assert gsm8k(response, truth) == 0.0 and gsm8k_flexible(response, truth) == 0.0
    assert unscorable("gsm8k", [TaskRecord("q", truth, "7")]) == [TaskRecord("q", truth, "7")]


@pytest.mark.parametrize(
    ("truth", "response"),
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "#### 72"),
        ("1000", "#### 1,000"),
        ("−5", "#### -5"),
        (" 72. ", "#### 72"),
        ("$72", "#### 72"),
        ("1{,}234", "#### 1234"),
        ("The answer is: 72", "#### 72"),  # MetaMath's: one number, words around it
        ("#### 18 dollars", "#### 18"),
        (r"\boxed{72}", "#### 72"),
    ],
)
def test_one_number_in_its_forms_is_still_a_ground_truth(truth: str, response: str) -> None:
    assert gsm8k(response, truth) == 1.0
    assert unscorable("gsm8k", [TaskRecord("q", truth)]) == []


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{−5}", "-5"),
        (r"\boxed{-7}", "−7"),
        (r"\boxed{5\,\text{cm}}", "5"),
        (r"\boxed{5~\text{cm}}", "5"),
        (r"\boxed{5\ \text{cm}}", "5"),
        (r"\boxed{5\;\mathrm{cm}}", "5"),
        (r"\boxed{5\quad\text{cm}}", "5"),
        (r"\boxed{\dfrac{3}{4}\,\text{cup}}", r"\frac{3}{4}"),
        (r"\boxed{18\ \text{square units}}", "18"),  # several unit words
        (r"\boxed{60\,\text{km/h}}", "60"),
        (r"\boxed{12\,\text{cubic feet}}", "12"),
    ],
)
def test_a_unicode_minus_and_a_unit_after_tex_spacing_are_the_answer(response: str, truth: str) -> None:
    assert boxed_math(response, truth) == 1.0
    line = "Answer: " + response.removeprefix(r"\boxed{").removesuffix("}")
    assert answer_math(line, truth) == 1.0


@pytest.mark.parametrize(
    ("response", "truth"),
    [
        (r"\boxed{x\text{cm}}", "x"),  # no space before the text: a name, not a unit
        (r"\boxed{5\,\text{and}\,6}", "5"),  # not a unit word
        (r"\boxed{-5}", "5"),
        (r"\boxed{3\,\mathrm{i}}", "3"),  # i after spacing is the imaginary unit, no unit of measure
        (r"\boxed{5\,\text{or}}", "5"),
    ],
)
def test_what_is_not_a_unit_or_a_sign_still_counts(response: str, truth: str) -> None:
    assert boxed_math(response, truth) == 0.0


def test_a_complex_answer_keeps_its_imaginary_unit_and_text_after_spacing_its_spacing() -> None:
    assert boxed_math(r"\boxed{1+2\,\mathrm{i}}", "1+2i") == 1.0
    assert boxed_math(r"\boxed{4\quad\text{apples}}", "4 apples") == 1.0  # was 4\quadapples


def test_math_verify_reads_the_last_box_of_a_response_that_corrects_itself() -> None:
    """Math-Verify reads every box of a text as one set: it matched neither 5 nor 6 here; an
    answer given as several boxes is still read as Math-Verify reads it."""
    text = r"So \boxed{5}. Wait, no: the count doubles. So \boxed{6}"
    assert math_verify(text, "6") == 1.0 and math_verify(text, "5") == 0.0
    assert math_verify("the answer is 6", "6") == 1.0  # no box: what Math-Verify extracts
    assert math_verify(r"The roots are \boxed{1}, \boxed{2}", "1, 2") == 1.0
    tower = "\\boxed{" + "9^" * 40 + "9} or rather \\boxed{1}"  # the whole text: not within the bounds
    assert math_verify(tower, "7") == 0.0 and math_verify(tower, "1") == 1.0
