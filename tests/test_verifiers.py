"""Rule-based math verifiers: GSM8K number extraction (marker and flexible), MATH boxes and their
normal form, whitespace-insensitive exact match, routing by verl data_source, and the existing
``exact_answer``/``exact_match`` unchanged."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from nereus.errors import ConfigError
from nereus.rl.math_answers import (
    gsm8k_ground_truth,
    gsm8k_number,
    last_boxed,
    math_equal,
    math_number,
    normalize_math,
    numbers,
)
from nereus.rl.verifiers import (
    VERIFIERS,
    answer_math,
    boxed_math,
    by_source,
    exact,
    exact_answer,
    exact_match,
    get_verifier,
    gsm8k,
    gsm8k_flexible,
    math_verify,
    score,
    score_by_source,
    verifier_for_source,
)

pytestmark = pytest.mark.pure

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


# ------------------------------------------------------------------ GSM8K
@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("#### 1,234", "1234"),  # thousands commas
        ("#### 1234", "1,234"),
        ("The total is $1,234.", "1234"),  # $ and a sentence's period
        ("#### $18", "18"),
        ("#### 3.50", "3.5"),  # decimals by value
        ("It costs 3.5 dollars", "3.50"),
        ("#### -0", "0"),
        ("#### +7", "7"),
        ("The answer is -3.", "-3"),  # a negative number
        ("#### −12", "-12"),  # a Unicode minus
        ("#### 72", GSM8K_SOLUTION),  # the ground truth's number follows its last ####
        ("First 10, then 20. So 72", GSM8K_SOLUTION),  # flexible: the last number
        ("10 - 4 = 6", "6"),  # a binary minus is not a sign
        ("Answer:\n#### 42\nBecause 6*7 is 42 and 2 more is 44", "42"),  # the marker beats the last number
        ("#### 5 #### 42", "42"),  # the last marker counts
    ],
)
def test_gsm8k_right_answers(response: str, answer: str) -> None:
    """``gsm8k_flexible`` reads them all; strict ``gsm8k`` (verl's default) those with ``####``."""
    assert gsm8k_flexible(response, answer) == 1.0
    assert gsm8k(response, answer) == (1.0 if "####" in response else 0.0)


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("#### 12", "1234"),
        ("#### 3.51", "3.5"),
        ("#### 3", "-3"),  # the sign matters
        ("The answer is 3.", "-3"),
        ("10 - 4", "-4"),  # a binary minus: the last number is 4
        ("#### 42 ... no wait, 41", "41"),  # the number after the marker counts, not the last
        ("#### the answer", "42"),  # a marker followed by no number
        ("I do not know", "42"),  # no number at all
        ("", "42"),
        ("#### 42", "no number here"),  # an answer without a number matches nothing
        ("#### 4,2", "42"),  # 4,2 is not a grouped number: the first is 4
        ("#### 5 #### 42", "5"),
    ],
)
def test_gsm8k_wrong_answers_score_zero(response: str, answer: str) -> None:
    assert gsm8k(response, answer) == 0.0


def test_gsm8k_extraction() -> None:
    assert gsm8k_number("so 3 apples and $1,234.50 in all.") == Fraction("1234.5")
    assert gsm8k_number("#### 7 then 9") == 7
    assert gsm8k_number("only 9", flexible=False) is None
    assert gsm8k_number("#### 9", flexible=False) == 9
    assert gsm8k_ground_truth(GSM8K_SOLUTION) == 72
    assert gsm8k_ground_truth(" 1,000 ") == 1000
    assert numbers("x is -3, 10 -4, x-5, (2)-6, =-7") == ["-3", "10", "4", "5", "2", "6", "-7"]


# ------------------------------------------------------------------ MATH boxes
@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{1}{2}}}", r"\sqrt{\frac{1}{2}}"),  # nested braces
        (r"\boxed{1} or rather \boxed{2}", "2"),  # the last box counts
        (r"\fbox{3}", "3"),
        (r"\boxed {4}", "4"),
        (r"$\boxed 5$", "5"),  # TeX's one-token argument
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"\boxed{}", ""),
    ],
)
def test_last_boxed(text: str, content: str) -> None:
    assert last_boxed(text) == content


@pytest.mark.parametrize(
    "text",
    ["no box", r"\boxed{\frac{1}{2}", r"\boxed{1} then \boxed{2", r"\boxed", r"\boxed{\}", r"\boxedx{1}"],
)
def test_missing_or_unclosed_last_box(text: str) -> None:
    assert last_boxed(text) is None
    assert boxed_math(text, "1") == 0.0
    assert boxed_math(text, "2") == 0.0


# ------------------------------------------------------------------ MATH normal form
@pytest.mark.parametrize(
    ("got", "want"),
    [
        (r"\frac{1}{2}", r"\frac12"),
        (r"\frac{1}{2}", "1/2"),
        (r"\frac{1}{2}", "0.5"),
        ("0.5", ".5"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", "0.75"),
        (r"\sqrt{\frac{1}{2}}", r"\sqrt{\frac12}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\frac{\frac12}{3}", r"\frac{\frac{1}{2}}{3}"),
        (r"5\text{ cm}", "5"),  # a unit is dropped
        (r"5 \text{cm}^2", "5"),
        (r"\frac{3}{4}\text{ inches}", "0.75"),
        (r"\text{(A)}", "(A)"),  # a non-unit \text is its content
        (r"\textbf{Monday}", "Monday"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"30^\circ", "30"),
        (r"30^{\circ}", "30"),
        ("30°", "30"),
        (r"50\%", "50"),
        (r"\$18", "18"),
        ("x = 3", "3"),
        (r"\theta = \frac{\pi}{2}", r"\frac{\pi}{2}"),
        ("3.0", "3"),
        ("3.50", "3.5"),
        ("-0", "0"),
        (r"10,\!000", "10000"),
        ("1,234", "1234"),
        ("5.", "5"),
        (r"-\frac{1}{2}", "-0.5"),
        (r"\frac{-1}{2}", "-1/2"),
        (r"\\frac{1}{2}", r"\frac{1}{2}"),  # a doubled backslash
        ("0.3333333", r"\frac{1}{3}"),  # numbers within a relative 1e-6
    ],
)
def test_math_equal_answers(got: str, want: str) -> None:
    assert math_equal(got, want)
    assert math_equal(want, got)


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (r"\frac{1}{2}", r"\frac{1}{3}"),
        (r"\frac{1}{2}", "-0.5"),
        ("0.333", r"\frac{1}{3}"),  # outside the tolerance
        (r"\sqrt{2}", "2"),
        ("(1,2)", "(2,1)"),
        ("1,2", "12"),  # not a grouped number: a list
        (r"x\text{-axis}", "x"),  # not a unit: the value does not end in a digit
        ("2x+3", "2x+4"),
        ("", ""),  # an empty answer equals nothing
        (r"\frac{1}{0}", r"\frac{2}{0}"),  # no number: string comparison
    ],
)
def test_math_different_answers(got: str, want: str) -> None:
    assert not math_equal(got, want)


def test_math_normal_form_and_numbers() -> None:
    assert normalize_math(r"\left( \dfrac12, 10{,}000 \right)") == r"(\frac{1}{2},10,000)"
    assert normalize_math(r"a \rightarrow b") == r"a\rightarrowb"  # \right removed only as a word
    assert normalize_math(r"\sqrt[3]{8}") == r"\sqrt[3]{8}"
    assert normalize_math("3.050") == "3.05"
    assert math_number(r"\frac{3}{4}") == Fraction(3, 4)
    assert math_number("-7/2") == Fraction(-7, 2)
    assert math_number(r"\frac{1}{0}") is None
    assert math_number(r"\sqrt{2}") is None


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        (r"Thus $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"\boxed{\dfrac{1}{2}}", r"The answer is $\boxed{\frac12}$.", 1.0),  # a boxed ground truth
        (r"\boxed{\frac{1}{3}} no, \boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),  # the last box counts
        (r"\boxed{\frac{1}{2}} no, \boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{12\text{ cm}}", r"12 \text{ cm}", 1.0),
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        ("The answer is 1/2.", "1/2", 0.0),  # no box
        (r"\boxed{\frac{1}{2}", "1/2", 0.0),  # unclosed
        (r"\boxed{}", "", 0.0),
    ],
)
def test_boxed_math_verifier(response: str, answer: str, reward: float) -> None:
    assert boxed_math(response, answer) == reward


# ------------------------------------------------------------------ exact, registry, routing
def test_exact_ignores_surrounding_whitespace_only() -> None:
    assert exact(" 42\n", "42") == 1.0
    assert exact("42", "\t42 ") == 1.0
    assert exact("4 2", "42") == 0.0
    assert exact("42.", "42") == 0.0
    assert exact_match(" 42", "42") == 0.0  # exact_match stays strict


def test_existing_verifiers_are_unchanged() -> None:
    """(``exact_answer``'s shaping is tested in ``test_rl_data.py``.)"""
    assert exact_answer(" 12", "12") == 0.0  # no whitespace stripping, unlike ``exact``
    assert [exact_match(r, "7") for r in ("7", "7x", "3", "")] == [1.0, 0.0, 0.0, 0.0]
    assert get_verifier("exact_answer") is exact_answer
    assert get_verifier("exact_match") is exact_match
    assert get_verifier("none")("7", "7") == 0.0
    got = score(exact_answer, ["1", "2", "1x", "?"], ["1", "1", "1", "1"])
    assert torch.equal(got, torch.tensor([1.0, 0.1, 0.5, 0.0]))


def test_registry_names_and_error() -> None:
    assert get_verifier("gsm8k") is gsm8k
    assert get_verifier("gsm8k_flexible") is gsm8k_flexible
    assert get_verifier("math") is boxed_math
    assert get_verifier("boxed") is boxed_math
    assert get_verifier("exact") is exact
    assert get_verifier("by_source") is by_source
    assert get_verifier("answer_line") is answer_math
    assert get_verifier("math_verify") is math_verify
    allowed = (
        "answer_line, boxed, by_source, exact, exact_answer, exact_match, gsm8k, gsm8k_flexible, math, "
        "math_verify, none"
    )
    assert ", ".join(sorted(VERIFIERS)) == allowed
    with pytest.raises(ConfigError, match=rf"^unknown verifier 'regex' \(allowed: {allowed}\)$"):
        get_verifier("regex")


def test_by_source_placeholder_names_score_by_source() -> None:
    with pytest.raises(ConfigError, match=r"score_by_source\(texts, answers, sources\)"):
        by_source("1", "1")
    with pytest.raises(ConfigError, match="score_by_source"):
        score(get_verifier("by_source"), ["1"], ["1"])


@pytest.mark.parametrize(
    ("source", "verifier"),
    [
        ("openai/gsm8k", gsm8k),
        ("gsm8k", gsm8k),
        ("DigitalLearningGmbH/MATH-lighteval", boxed_math),
        ("lighteval/MATH", boxed_math),
        ("HuggingFaceH4/MATH-500", boxed_math),
        ("math", answer_math),  # as verl routes it (its DAPO recipe's data)
        ("math_dapo", answer_math),
        ("math_dapo_reasoning", answer_math),
        ("numina_synthetic_math", math_verify),
        ("numina_cn_k12", math_verify),
        ("aime2024", answer_math),
        ("AIME_2024", answer_math),
    ],
)
def test_verifier_for_source(source: str, verifier: object) -> None:
    assert verifier_for_source(source) is verifier


@pytest.mark.parametrize(
    "source",
    ["hellaswag", "my-gsm8k-train", "MyOrg/Hard-Math", "BytedTsinghua-SIA/DAPO-Math-17k", "numina_x"],
)
def test_a_source_verl_does_not_know_is_refused_not_guessed(source: str) -> None:
    """A name that merely contains "math" may ask for a box or an "Answer:" line: a guess could
    score every response 0, so it is refused, as verl refuses it."""
    with pytest.raises(ConfigError, match="name a verifier instead of by_source"):
        verifier_for_source(source)


def test_unknown_source_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown data_source 'hellaswag' \(known: openai/gsm8k, ") as e:
        verifier_for_source("hellaswag")
    assert "\n" not in str(e.value)
    assert "HuggingFaceH4/MATH-500" in str(e.value)


def test_score_by_source_routes_each_row() -> None:
    texts = ["#### 1,234", r"\boxed{\frac12}", "The answer is 1234", r"\boxed{0.5}", "Answer: 0.5", "0.5"]
    answers = ["1234", "0.5", "1234", "0.5", "0.5", "0.5"]
    sources = ["openai/gsm8k", "lighteval/MATH", "lighteval/MATH", "gsm8k", "math", "math_dapo"]
    got = score_by_source(texts, answers, sources)
    assert got.dtype == torch.float32
    # gsm8k needs its marker, MATH a box, math_dapo ("math" too) its "Answer:" line
    assert got.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_numina_sources_are_compared_symbolically_as_verls_prime_math_compares_them() -> None:
    texts = [r"so \boxed{(x+1)^2}", r"\boxed{\frac{\sqrt{2}}{2}}", r"so \boxed{(x+1)^2}"]
    answers = ["x^2+2x+1", r"\frac{1}{\sqrt{2}}", "x^2+2x+1"]
    got = score_by_source(texts, answers, ["numina_olympiads", "numina_cn_k12", "lighteval/MATH"])
    assert got.tolist() == [1.0, 1.0, 0.0]  # MATH's string normal forms (verl's math) do not


def test_score_by_source_checks_every_source_and_length_first() -> None:
    with pytest.raises(ConfigError, match="unknown data_source 'squad'"):
        score_by_source(["#### 1", "#### 2"], ["1", "2"], ["gsm8k", "squad"])
    with pytest.raises(ValueError, match="2 responses, 2 answers and 1 sources"):
        score_by_source(["1", "2"], ["1", "2"], ["gsm8k"])


# ------------------------------------------------------------------ answers real models write
MATRIX = "\\begin{pmatrix} 3 \\\\ -1 \\end{pmatrix}"


@pytest.mark.parametrize(
    ("verifier", "response", "answer", "reward"),
    [
        # a later markdown heading after the answer's marker (verl's strict pattern takes 18)
        (gsm8k, "#### 18\n\n#### Step 2: verify 9*2", "18", 1.0),
        (gsm8k, "#### The answer is 18", "18", 1.0),
        # TeX thousands separators, an en dash for minus
        (gsm8k_flexible, "\\boxed{1{,}234}", "1234", 1.0),
        (gsm8k, "#### 1,\\!234", "1234", 1.0),
        (gsm8k_flexible, "so \\boxed{1\\,234}", "1,234", 1.0),
        (gsm8k_flexible, "The answer is \u20133", "-3", 1.0),
        (gsm8k_flexible, "pages 3\u20135", "5", 1.0),  # after a digit a dash is an operator
        # integers compare exactly; a decimal within 1e-6 of a fraction still counts
        (boxed_math, "\\boxed{1048575}", "1048576", 0.0),
        (boxed_math, "\\boxed{999999}", "1000000", 0.0),
        (boxed_math, "\\boxed{0.333333}", "\\frac{1}{3}", 1.0),
        (boxed_math, "\\boxed{\\frac{4}{2}}", "2", 0.0),  # MATH wants lowest terms, as verl's grader
        (boxed_math, "\\boxed{\\frac{2}{4}}", "\\frac12", 0.0),
        (boxed_math, "\\boxed{\\frac{-1}{2}}", "-\\frac12", 1.0),
        # a matrix's rows, spaced or not; a two-letter left-hand side
        (boxed_math, f"\\boxed{{{MATRIX}}}", "\\begin{pmatrix}3\\\\-1\\end{pmatrix}", 1.0),
        (boxed_math, f"\\boxed{{{MATRIX}}}", "\\begin{pmatrix}3-1\\end{pmatrix}", 0.0),
        (boxed_math, "\\boxed{BC=12}", "12", 1.0),
        # DAPO-Math and AIME: the final "Answer:" line (else the last box)
        (answer_math, "Let me think.\nAnswer: 42", "42", 1.0),
        (answer_math, "... \\boxed{41}\nAnswer: 42", "42", 1.0),
        (answer_math, "Answer: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        (answer_math, "no line, but \\boxed{42}", "42", 1.0),
        (answer_math, "Answer: 41", "42", 0.0),
        (answer_math, "Answer: 42" + " more reasoning" * 40, "42", 0.0),  # not near the end
        (answer_math, "nothing", "42", 0.0),
        # units and articles models append, dropped as verl's math_dapo drops them; hedges stay
        (answer_math, "Answer: 42 minutes", "42", 1.0),
        (answer_math, "Answer: 5 square units.", "5", 1.0),
        (answer_math, "Answer: a 5", "5", 1.0),
        (answer_math, "Answer: 5 or 6", "5", 0.0),
        (answer_math, "Answer: $42$ is right", "42", 1.0),  # the math span of the line
        (answer_math, "Answer: 2/4", "\\frac12", 0.0),
        (answer_math, "Answer: a + b", "a + b", 1.0),  # an article only before a number
        (answer_math, "Answer: \\pi r^2 h", "\\pi r^2 h", 1.0),  # h is a variable here, not hours
        (answer_math, "Answer: $5$ or $6$", "5", 1.0),  # the first span, as verl
    ],
)  # fmt: skip
def test_answers_real_models_write(verifier: object, response: str, answer: str, reward: float) -> None:
    assert verifier(response, answer) == reward  # type: ignore[operator]


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 0." + "3" * 5000,  # cut off in a run of digits: past Python's 4,300-digit limit
        "3." + "1415926535" * 450,
        "\\boxed{" + "5" * 5000 + "}",
        "\\boxed{\\frac{" + "1" * 5000 + "}{2}}",
        "\\boxed{" + "1+\\frac{1}{" * 500 + "2" + "}" * 500 + "}",  # deeper than Python recurses
        "\\boxed{" + "\\text{" * 16000 + "a" + "}" * 16000 + "}",  # quadratic when normalised
        "Answer: " + "9" * 5000,
        "\\boxed{" + "2^" * 300 + "2}",  # a tower of powers wedges sympy
        "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}",
        "so $" + "2^{" * 40 + "2" + "}" * 40 + "$",  # no box: Math-Verify's own timeout bounds it
        "x" * 100_000,
    ],
)
def test_degenerate_responses_score_zero_and_never_raise(response: str) -> None:
    """One response must not stop a step: a verifier scores it 0 (quickly), whatever it holds;
    Math-Verify within its timeouts (a parse and a comparison of ``MATH_VERIFY_TIMEOUT_S`` each)."""
    import time

    from nereus.rl.verifiers import MATH_VERIFY_TIMEOUT_S

    for verifier in (gsm8k, boxed_math, answer_math):
        assert verifier(response, "5") == 0.0
    started = time.perf_counter()
    assert math_verify(response, "5") == 0.0
    assert time.perf_counter() - started < 2 * MATH_VERIFY_TIMEOUT_S + 1.0


@pytest.mark.parametrize(
    ("response", "answer", "want"),
    [
        ("The answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),  # a decimal equals the fraction
        ("so $x^{2}$, i.e. \\boxed{x^{2}}", "x^2", 1.0),  # the same power, braced or not
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # not in lowest terms: still equal
        ("\\boxed{(1, 2)}", "\\boxed{(1,2)}", 1.0),  # a boxed answer is unboxed first
        ("\\boxed{\\frac{\\sqrt2}{2}}", "\\sqrt{2}/2", 1.0),
        ("Natalia sold 48/2 = 24 clips in May. #### 72", "72", 1.0),  # a plain number, no box
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("I do not know.", "5", 0.0),  # nothing to compare
        ("\\boxed{4}", "\\frac{1}{", 0.0),  # an answer that does not parse scores 0, no error
    ],
)
def test_math_verify_compares_answers_symbolically(response: str, answer: str, want: float) -> None:
    """Math-Verify (NeMo-RL's math environment, verl's ``math_verify``): equal values in another
    form score 1, where ``math``'s normal form compares strings."""
    assert math_verify(response, answer) == want


def test_math_verify_in_a_thread_runs_without_its_alarm() -> None:
    """Math-Verify's timeout is a SIGALRM, main thread only: in another thread it is not set (a
    call there would raise and score every response 0)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_verify, "\\boxed{0.5}", "\\frac{1}{2}").result(timeout=60) == 1.0
