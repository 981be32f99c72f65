"""Sequence-length curves: mean and p95 response length per step.

Either a CSV with the header ``step,mean_len,p95_len`` (strictly increasing steps, linear in
between, the last row holds beyond the end), or the built-in growth of paper-notes §4.1: the mean
response grows from 500 to 8,000 tokens over 1,000 steps (geometrically), p95 a fixed ratio above.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nereus.errors import ConfigError
from nereus.spec.files import MAX_DATA_BYTES, brief, read_text

COLUMNS = ("step", "mean_len", "p95_len")
MAX_LEN = float(1 << 24)  # tokens: beyond any context window
MAX_STEP = 1_000_000_000
MAX_GROWTH_STEPS = 1_000_000


@dataclass(frozen=True, slots=True)
class SeqCurve:
    steps: tuple[int, ...]
    mean: tuple[float, ...]
    p95: tuple[float, ...]
    name: str = "curve"

    def __post_init__(self) -> None:
        if not self.steps or not len(self.steps) == len(self.mean) == len(self.p95):
            raise ValueError("a curve needs equally many steps, means and p95s")
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("steps must increase strictly")
        if any(not 0 <= s <= MAX_STEP for s in self.steps):
            raise ValueError(f"steps must be in [0, {MAX_STEP}]")
        if any(not (0 < m <= p <= MAX_LEN) for m, p in zip(self.mean, self.p95, strict=True)):
            raise ValueError(f"lengths must be in (0, {MAX_LEN:.0f}] tokens with p95 ≥ mean")

    @classmethod
    def growth(
        cls, start: float = 500.0, end: float = 8000.0, over_steps: int = 1000, p95_ratio: float = 1.15
    ) -> SeqCurve:
        """Geometric growth from ``start`` to ``end`` mean tokens over ``over_steps`` steps."""
        if not 1 <= over_steps <= MAX_GROWTH_STEPS:
            raise ValueError(f"over_steps must be in [1, {MAX_GROWTH_STEPS}], got {over_steps}")
        for name, value in (("start", start), ("end", end)):
            if not 1 <= value <= MAX_LEN / p95_ratio:
                raise ValueError(f"{name} must be in [1, {MAX_LEN / p95_ratio:.0f}] tokens, got {value}")
        steps = np.arange(0, over_steps + 1, max(1, over_steps // 100))
        mean = start * (end / start) ** (steps / over_steps)
        return cls(tuple(int(s) for s in steps), tuple(mean), tuple(mean * p95_ratio), "growth")

    @classmethod
    def load_csv(cls, path: Path) -> SeqCurve:
        """Read ``step,mean_len,p95_len``; errors name the file, the line and the field."""
        text = read_text(path, "sequence-length curve", MAX_DATA_BYTES)
        try:
            return cls._parse(path, text)
        except csv.Error as exc:
            raise ConfigError(f"{path}: not a CSV file ({brief(str(exc))})") from None

    @classmethod
    def _parse(cls, path: Path, text: str) -> SeqCurve:
        reader = csv.DictReader(text.splitlines(), skipinitialspace=True)  # "step, mean_len, p95_len"
        names = list(reader.fieldnames or [])
        missing = [c for c in COLUMNS if c not in names]
        if missing:
            raise ConfigError(f"{path}: line 1: missing column '{missing[0]}' (need {', '.join(COLUMNS)})")
        twice = [c for c in COLUMNS if names.count(c) > 1]  # csv keeps the last of two silently
        if twice:
            raise ConfigError(f"{path}: line 1: column '{twice[0]}' is named twice")
        steps: list[int] = []
        mean: list[float] = []
        p95: list[float] = []
        for row in reader:
            line = reader.line_num
            short = None in row.values()  # fewer fields than the header names
            if None in row or short:  # or more
                count = (
                    len(row) - 1 + len(row[None]) if None in row else sum(v is not None for v in row.values())
                )
                raise ConfigError(
                    f"{path}: line {line}: {count} fields, the header names "
                    f"{len(reader.fieldnames or [])} ({', '.join(reader.fieldnames or [])})"
                )
            try:
                step = int(row["step"])
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{path}: line {line}: field 'step': expected an integer, got {brief(row['step'])}"
                ) from None
            if not 0 <= step <= MAX_STEP:
                raise ConfigError(
                    f"{path}: line {line}: field 'step': expected an integer in [0, {MAX_STEP}], "
                    f"got {brief(step)}"
                )
            values = []
            for col in ("mean_len", "p95_len"):
                try:
                    v = float(row[col])
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"{path}: line {line}: field '{col}': expected a number, got {brief(row[col])}"
                    ) from None
                if not (math.isfinite(v) and 1 <= v <= MAX_LEN):
                    raise ConfigError(
                        f"{path}: line {line}: field '{col}': expected a number of tokens in "
                        f"[1, {MAX_LEN:.0f}], got {brief(row[col])}"
                    )
                values.append(v)
            if steps and step <= steps[-1]:
                raise ConfigError(
                    f"{path}: line {line}: field 'step': steps must increase, {step} after {steps[-1]}"
                )
            if values[1] < values[0]:
                raise ConfigError(f"{path}: line {line}: field 'p95_len': below mean_len")
            steps.append(step)
            mean.append(values[0])
            p95.append(values[1])
        if not steps:
            raise ConfigError(f"{path}: no rows")
        return cls(tuple(steps), tuple(mean), tuple(p95), path.stem)

    def at(self, step: int) -> tuple[float, float]:
        """(mean, p95) response length at ``step``."""
        m = float(np.interp(step, self.steps, self.mean))
        p = float(np.interp(step, self.steps, self.p95))
        return m, max(m, p)
