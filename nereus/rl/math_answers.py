"""Final answers in model text (pure: stdlib only): the number a GSM8K solution ends with, the last
``\\boxed{}`` of a MATH solution, and when two MATH answers are the same.

GSM8K (``gsm8k_number``): the number right after the last ``####`` that one follows (a later
``#### Step 2`` heading does not count), or (flexible extraction, as verl's and lm-eval's
"flexible-extract") the last number in the text when there is no marker. A number may carry a
sign (a Unicode minus or an en dash too), a ``$``, thousands commas (TeX's ``{,}`` and ``\\,``
as well) and decimals; ``1,234``, ``$1234`` and ``1234.`` are the same, and numbers compare by
exact value (``3.50 == 3.5``, ``-0 == 0``). A number of more than ``MAX_NUMBER_CHARS`` characters
(a response cut off in a run of digits) is not read.

MATH (``last_boxed``, ``normalize_math``, ``math_equal``): the content of the last ``\\boxed{...}``
or ``\\fbox{...}`` with nested braces balanced. Two answers are equal when their normal forms are
the same string, or when both are the same number (an integer, a decimal, ``\\frac{a}{b}`` or
``a/b``): exactly, or within a relative 1e-6 when either is written with decimals. DAPO-style
"Answer: X" lines are read by ``answer_line``. The normal form follows Hendrycks et al.'s MATH
``strip_string``, in order:

* ``\\\\frac`` (a doubled backslash before a command name) → ``\\frac``
* ``\\$``, ``$``, ``\\left``, ``\\right``, ``\\displaystyle``, degree signs (``^\\circ``,
  ``^{\\circ}``, ``°``) and percent signs (``\\%``, ``%``) removed; ``\\dfrac``, ``\\tfrac`` → ``\\frac``
* a Unicode minus or en dash → ``-``
* ``\\text{...}`` (``\\mbox``, ``\\mathrm``, ...) after a value is a unit and dropped when its content
  starts with a space, the value ends in a digit (``5\\text{ cm}``, ``5\\,\\text{cm}`` → ``5``), or
  spacing separates a unit word from the value (``\\frac{3}{4}\\,\\text{cup}``); any other is reduced
  to its content (``\\text{(A)}`` → ``(A)``)
* spacing (``\\!``, ``\\,``, ``\\;``, ``\\quad``, ``~``, ...) and all whitespace removed
* a short variable (one or two letters, ``a_1``, ``\\theta``) on the left of the only ``=``
  removed (``x = 3``, ``BC = 12`` → ``3``, ``12``); a matrix's row break ``\\\\`` kept
* ``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt2`` → ``\\sqrt{2}`` (TeX's one-token arguments braced)
* ``{,}`` → ``,``; thousands commas in a lone number dropped (``10,000`` → ``10000``)
* a trailing ``.`` dropped; ``.5`` → ``0.5``; trailing decimal zeros dropped (``3.50`` → ``3.5``,
  ``2.0`` → ``2``)
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

GSM8K_MARKER = "####"
REL_TOL = Fraction(1, 10**6)
# a number of more digits is no answer (a response cut off inside a run of digits): it is not
# read, so Python's 4,300-digit conversion limit is never met
MAX_NUMBER_CHARS = 100
# a box holding more is no answer either: it is compared as written, not normalised (a deeply
# nested one would recurse past Python's limit, a long ``\text`` chain take quadratic time)
MAX_ANSWER_CHARS = 1000

# ------------------------------------------------------------------ GSM8K numbers
_MINUS = "\u2212\u2013"  # Unicode minus, en dash (as typeset answers write a negative number)
_NUMBER = re.compile(rf"[-+{_MINUS}]?\$?(?:(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?|\.\d+)")
# TeX's thousands separators between digits: ``1{,}234``, ``1,\!234`` → ``1,234``; ``1\,234`` → ``1234``
_TEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|,\\!|(\\[,!]))(?=\d{3}(?!\d))")


def numbers(text: str) -> list[str]:
    """The numbers in ``text`` as written, in order. A sign is an operator, not part of the number,
    after a digit or closing bracket (spaces between) or right after a letter: ``10 -4`` and ``x-4``
    hold 4, ``is -4`` holds -4."""
    found = []
    for m in _NUMBER.finditer(text):
        s, j = m.group(), m.start() - 1
        while j >= 0 and text[j].isspace():
            j -= 1
        operator = j >= 0 and (text[j].isdigit() or text[j] in ")]}")
        if j == m.start() - 1 >= 0:  # nothing between: right after a letter is an operator too
            operator = operator or text[j].isalpha() or text[j] == "_"
        if s[0] in "-+" + _MINUS and operator:
            s = s[1:]
        found.append(s)
    return found


_TO_HYPHEN = str.maketrans(dict.fromkeys(_MINUS, "-"))


def _untex_thousands(text: str) -> str:
    return _TEX_THOUSANDS.sub(lambda m: "" if m.group(1) else ",", text)


def to_number(text: str) -> Fraction | None:
    """The value of one number written with optional sign, ``$``, thousands commas, decimals and a
    trailing period (``" -$1,234.50. "`` → -1234.5), or None if ``text`` is not one."""
    s = text.strip().translate(_TO_HYPHEN).replace("$", "").replace(",", "").rstrip(".")
    s = s.removeprefix("+")
    if len(s) > MAX_NUMBER_CHARS or re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s) is None:
        return None
    return Fraction(s)


_MARKED = re.compile(re.escape(GSM8K_MARKER) + r"[ \t]*")


def gsm8k_number(text: str, flexible: bool = True) -> Fraction | None:
    """The number right after the last ``####`` that a number follows (as verl's strict
    ``#### (-?[0-9.,]+)``: a later ``#### Step 2`` heading does not hide it); else the first
    number after the last ``####``; with no marker, the last number in ``text`` if ``flexible``,
    else None. None also when no marker is followed by a number. TeX thousands separators
    (``1{,}234``, ``1\\,234``) read as in print."""
    text = _untex_thousands(text)
    for m in reversed(list(_MARKED.finditer(text))):
        number = _NUMBER.match(text, m.end())  # right after the marker: a sign is the number's
        if number is not None:
            return to_number(number.group())
    _, marker, tail = text.rpartition(GSM8K_MARKER)
    if marker:
        after = numbers(tail)
        return to_number(after[0]) if after else None
    found = numbers(text) if flexible else []
    return to_number(found[-1]) if found else None


def gsm8k_ground_truth(answer: str) -> Fraction | None:
    """A GSM8K answer: a number, or a full solution ending ``#### <number>``: the one number after
    the last marker (``#### 18 dollars``, ``The answer is: 72`` read 18 and 72); None where there
    is none or more than one (``1e3``, ``\\frac{1}{2}``, ``12-15``, ``5 000``: the first of them
    would have rewarded ``1``, ``1``, ``12`` and ``5``), which nothing matches."""
    found = numbers(_untex_thousands(answer).rpartition(GSM8K_MARKER)[2])
    return to_number(found[0]) if len(found) == 1 else None


# ------------------------------------------------------------------ boxes and braces
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def closing_brace(text: str, open_at: int) -> int | None:
    """The index of the ``}`` matching the ``{`` at ``open_at``, or None if it is never closed.
    Escaped braces (``\\{``, ``\\}``) do not count."""
    depth, i = 0, open_at
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (``\\boxed 5``, TeX's
    one-token form, gives ``5``); None if there is no box or the last one is never closed."""
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    start = boxes[-1].end()
    rest = text[start:].lstrip()
    if rest.startswith("{"):
        open_at = len(text) - len(rest)
        close = closing_brace(text, open_at)
        return None if close is None else text[open_at + 1 : close]
    token = re.match(r"\s+([^\s$]+)", text[start:])
    return token.group(1) if token else None


# ------------------------------------------------------------------ "Answer: ..." lines
ANSWER_TAIL_CHARS = 300  # verl's math_dapo reads the line within the response's last 300 characters
_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


_MATH_SPAN = re.compile(r"\$([^$]+)\$")
# words a model appends to a count or a measure ("Answer: 42 minutes"), dropped from the end of an
# answer line when a number remains (verl's math_dapo drops a list of such words); "or", "and"
# are not among them ("5 or 6" stays)
_UNITS = """mm cm m km in inch inches ft foot feet yd yard mi mile meter metre centimeter centimetre
    kilometer kilometre millimeter millimetre g gram kg kilogram lb lbs pound oz ounce ton l liter sq
    litre ml gallon cup s sec second min minute h hr hour day week month year mph kph degree
    radian dollar cent percent unit square cubic way student people person child children point
    digit integer number time step term page item object value solution pair element
    arrangement"""
UNIT_WORDS = frozenset(_UNITS.split())


def answer_line(text: str) -> str | None:
    """The final answer of a DAPO-style response ("... Answer: 42"): the content of the last
    ``Answer:`` line within its last ``ANSWER_TAIL_CHARS`` characters — a box there gives its
    content, else its first ``$...$`` span (as verl reads it), else the line, less a leading
    article and trailing unit words (``UNIT_WORDS``) where a number remains — or, with no such
    line, the response's last box (a choice: verl's math_dapo scores a box without the line 0;
    here the answer counts, the format not); None if it has neither."""
    found = _ANSWER_LINE.findall(text[-ANSWER_TAIL_CHARS:])
    if not found:
        return last_boxed(text)
    line = found[-1].strip()
    boxed = last_boxed(line)
    if boxed is not None:
        return boxed
    spans: list[str] = _MATH_SPAN.findall(line)
    if spans:
        return spans[0].strip()
    return _without_units(line.rstrip("."))


def _without_units(answer: str) -> str:
    """``a 5 ways`` → ``5``: a leading article and trailing unit words off, when a number is what
    remains (``a + b``, ``\\pi r^2 h`` stay as they are)."""
    words = answer.split()
    if len(words) > 1 and words[0].lower() in ("a", "an"):
        words = words[1:]
    while len(words) > 1 and _is_unit(words[-1]):
        words.pop()
    kept = " ".join(words)
    return kept if math_number(normalize_math(kept)) is not None else answer


def _is_unit(word: str) -> bool:
    w = word.lower().rstrip(".,;")
    return (
        w in UNIT_WORDS
        or (w.endswith("s") and w[:-1] in UNIT_WORDS)
        or (w.endswith("es") and w[:-2] in UNIT_WORDS)
    )


# ------------------------------------------------------------------ MATH normal form
_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|mathit)\s*\{")
_UNIT_TAIL = re.compile(r"\s*(?:\^\{?\d\}?)?\s*\.?\s*")  # what may follow a unit: a power, a period
_REMOVED = re.compile(
    r"\\\$|\$|\\(?:left|right|displaystyle)(?![A-Za-z])|\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\%|%"
)
_SPACING = re.compile(r"\\(?:qquad|quad)(?![A-Za-z])|\\[!,;: ]|~|\s+")
_TEX_SPACES = ("\\qquad", "\\quad", "\\!", "\\,", "\\;", "\\:", "\\ ", "~")
_VARIABLE = re.compile(r"[A-Za-z]{1,2}(?:_\{?\w+\}?)?|\\[A-Za-z]+")  # x, BC, a_1, \theta
_ROW = "\x00"  # ``\\`` while the spacing rules run
_BRACED_COMMAND = re.compile(r"\\(frac|sqrt)(?![A-Za-z])")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_TRAILING_ZEROS = re.compile(r"(\d)\.(\d*[1-9])?0+(?!\d)")


def _without_tex_spacing(s: str) -> str:
    """``s`` less the TeX spacing and whitespace it ends with (linear: from the end)."""
    while True:
        cut = next((t for t in _TEX_SPACES if s.endswith(t)), None)  # before whitespace: "\\ "
        if cut is not None:
            s = s[: -len(cut)]
        elif s[-1:].isspace():
            s = s[:-1]
        else:
            return s


def _unwrap_text(s: str) -> str:
    """Drop a unit's ``\\text{...}`` after a value (TeX spacing between them too: ``5\\,\\text{cm}``);
    reduce every other one to its content."""
    pos = 0
    while (m := _TEXT.search(s, pos)) is not None:
        close = closing_brace(s, m.end() - 1)
        if close is None:
            return s
        content, after = s[m.end() : close], s[close + 1 :]
        before = s[: m.start()].rstrip()
        is_unit = bool(before) and (content.startswith(" ") or before[-1].isdigit())
        if not is_unit:  # TeX spacing before a unit word: 5\,\text{cm}, \frac{3}{4}\,\text{cup}
            spaced = _without_tex_spacing(s[: m.start()])  # (not 3\,\mathrm{i}: i is no unit)
            words = content.replace("/", " ").split()  # km/h, square units, cubic feet
            if spaced != before and spaced and words and all(_is_unit(w) for w in words):
                before, is_unit = spaced, True
        if is_unit and _UNIT_TAIL.fullmatch(after):
            return before
        s, pos = s[: m.start()] + " " + content + after, m.start()  # a space: \\quad apples stays spacing
    return s


def _argument(s: str, at: int) -> tuple[str, int] | None:
    """One TeX argument of a command at ``s[at:]`` (whitespace already removed): a braced group
    (its content, normalised in turn), a command name or one character; and where it ends."""
    if at >= len(s) or s[at] in "}^_":
        return None
    if s[at] == "{":
        close = closing_brace(s, at)
        return None if close is None else (_brace_arguments(s[at + 1 : close]), close + 1)
    command = re.match(r"\\(?:[A-Za-z]+|.)", s[at:])
    token = command.group() if command else s[at]
    return token, at + len(token)


def _brace_arguments(s: str) -> str:
    """``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt2`` → ``\\sqrt{2}`` (also inside braced arguments)."""
    out, pos = [], 0
    while (m := _BRACED_COMMAND.search(s, pos)) is not None:
        out.append(s[pos : m.end()])
        at = m.end()
        if m.group(1) == "sqrt" and s.startswith("[", at):  # \sqrt[3]{x}: the index stays
            end = s.find("]", at)
            at = len(s) if end < 0 else end + 1
            out.append(s[m.end() : at])
        for _ in range(2 if m.group(1) == "frac" else 1):
            arg = _argument(s, at)
            if arg is None:
                break
            out.append("{" + arg[0] + "}")
            at = arg[1]
        pos = at
    out.append(s[pos:])
    return "".join(out)


def _trim_zeros(m: re.Match[str]) -> str:
    return m.group(1) + ("." + m.group(2) if m.group(2) else "")


def normalize_math(answer: str) -> str:
    """``answer``'s normal form (module docstring): equal forms are the same answer."""
    s = re.sub(r"\\\\(?=[A-Za-z])", r"\\", answer.translate(_TO_HYPHEN))  # −5 is -5
    s = s.replace("\\\\", _ROW)  # a matrix row break, never a backslash before spacing (``\\ 2``)
    s = _REMOVED.sub("", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = _unwrap_text(s)
    s = _SPACING.sub("", s)
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if _VARIABLE.fullmatch(lhs):
            s = rhs
    s = _brace_arguments(s)
    s = s.replace("{,}", ",").rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(?<!\d)\.(?=\d)", "0.", s)
    return _TRAILING_ZEROS.sub(_trim_zeros, s).replace(_ROW, "\\\\")


_DECIMAL = r"-?\d+(?:\.\d+)?"
_FRACTION = re.compile(rf"(-?)\\frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}|({_DECIMAL})/({_DECIMAL})")


def _unreduced(normal: str) -> bool:
    """A normal form written as a fraction of integers not in lowest terms (``\\frac{2}{4}``,
    ``4/2``)."""
    m = _FRACTION.fullmatch(normal)
    if m is None:
        return False
    num, den = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
    if "." in num or "." in den:
        return False
    return math.gcd(int(num), int(den)) != 1


def math_number(normal: str) -> Fraction | None:
    """The value of a normal form that is a number: an integer or decimal, ``\\frac{a}{b}`` (with an
    optional sign before it) or ``a/b``; None otherwise (and for a zero denominator)."""
    if len(normal) > MAX_NUMBER_CHARS:
        return None
    if re.fullmatch(_DECIMAL, normal):
        return Fraction(normal)
    m = _FRACTION.fullmatch(normal)
    if m is None:
        return None
    sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.group(2) else ("", m.group(4), m.group(5))
    if Fraction(den) == 0:
        return None
    value = Fraction(num) / Fraction(den)
    return -value if sign else value


def math_equal(got: str, want: str) -> bool:
    """Whether two MATH answers (box contents or plain text) are the same: equal normal forms, or
    the same number — exactly, or within a relative ``REL_TOL`` when either is written with
    decimals (``0.333333`` for ``\\frac{1}{3}``; ``999999`` is not ``1000000``). An empty answer
    equals nothing; one longer than ``MAX_ANSWER_CHARS`` only itself, as written."""
    if max(len(got), len(want)) > MAX_ANSWER_CHARS:
        return bool(got.strip()) and got.strip() == want.strip()
    a, b = normalize_math(got), normalize_math(want)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = math_number(a), math_number(b)
    if x is None or y is None or _unreduced(a):  # MATH wants lowest terms: 2/4 is not 1/2
        return False
    if "." not in a and "." not in b:
        return x == y
    return abs(x - y) <= REL_TOL * max(abs(x), abs(y))
