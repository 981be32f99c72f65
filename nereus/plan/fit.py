"""Per-op-class efficiencies fitted from end-to-end times (pure NumPy).

A measured end-to-end time is one number, but the cost model splits its prediction across op
classes: ``predicted_i = Σ_k ideal_ik / η_k`` with ``ideal_ik`` the class-``k`` seconds of point
``i`` at η = 1. Given several points, the slowdowns ``x_k = 1/η_k`` are fitted by least squares on
relative error, ``Σ_i (Σ_k ideal_ik x_k / measured_i − 1)²`` (a linear problem in ``x``), with a
ridge pull of weight ``ridge`` towards the prior slowdown of each class (a class few points see
stays near its prior instead of absorbing noise). Slowdowns are kept in ``[1, 1/ETA_MIN]`` by an
active-set loop: a class that leaves the box is pinned to the bound and the rest are refitted.

``attribute`` then splits each measured total across classes in proportion to the fitted
per-class seconds, which gives the ``Measurement(op, ideal_s, measured_s)`` samples that
``CalibrationStore.update`` learns from, the way the runtime feeds it per-op timings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nereus.plan.calibration import Measurement
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass

ETA_MIN = 0.01  # the calibration store's floor
DEFAULT_RIDGE = 1e-3


@dataclass(frozen=True, slots=True)
class Point:
    """One end-to-end measurement: ideal seconds per op class (η = 1) and the measured seconds."""

    ideal: Mapping[OpClass, float]
    measured_s: float

    def __post_init__(self) -> None:
        if not self.measured_s > 0:
            raise ValueError("measured_s must be positive")
        if any(v < 0 for v in self.ideal.values()) or not any(v > 0 for v in self.ideal.values()):
            raise ValueError("ideal seconds must be non-negative and not all zero")


@dataclass(frozen=True, slots=True)
class Fit:
    """Fitted efficiencies (classes the points exercise) and the residual relative errors."""

    eta: Mapping[OpClass, float]
    residuals: tuple[float, ...]  # predicted / measured − 1 per point, under the linear model


def fit_efficiencies(
    points: Sequence[Point],
    prior: Mapping[OpClass, float] = PRIOR_EFFICIENCY,
    ridge: float = DEFAULT_RIDGE,
) -> Fit:
    """Least-squares η per op class from end-to-end ``points`` (see the module docstring)."""
    if not points:
        raise ValueError("no points to fit")
    classes = sorted({op for p in points for op, v in p.ideal.items() if v > 0})
    a = np.array([[p.ideal.get(op, 0.0) / p.measured_s for op in classes] for p in points])
    x0 = np.array([1.0 / prior[op] for op in classes])
    lo, hi = 1.0, 1.0 / ETA_MIN
    pinned: dict[int, float] = {}
    x = x0.copy()
    for _ in range(2 * len(classes) + 1):
        free = [k for k in range(len(classes)) if k not in pinned]
        fixed = sum((a[:, k] * v for k, v in pinned.items()), np.zeros(len(points)))
        # rows: points (a·x = 1), then ridge rows sqrt(ridge)·(x_k/x0_k − 1) = 0
        lhs = np.vstack([a[:, free], np.sqrt(ridge) * np.diag(1.0 / x0[free])])
        rhs = np.concatenate([1.0 - fixed, np.sqrt(ridge) * np.ones(len(free))])
        sol = np.linalg.lstsq(lhs, rhs, rcond=None)[0] if free else np.zeros(0)
        x = x0.copy()
        for k, v in pinned.items():
            x[k] = v
        x[free] = sol
        out = [k for k in free if not lo <= x[k] <= hi]
        if not out:
            break
        worst = max(out, key=lambda k: max(lo - x[k], x[k] - hi))
        pinned[worst] = float(np.clip(x[worst], lo, hi))
    x = np.clip(x, lo, hi)
    residuals = tuple(float(r) for r in a @ x - 1.0)
    return Fit({op: float(1.0 / x[k]) for k, op in enumerate(classes)}, residuals)


def attribute(points: Sequence[Point], eta: Mapping[OpClass, float]) -> list[Measurement]:
    """Each point's measured total split across its classes in proportion to the seconds
    predicted at ``eta``: per-class ``Measurement(op, ideal_s, measured_s)`` samples."""
    out: list[Measurement] = []
    for p in points:
        predicted = {op: v / eta[op] for op, v in p.ideal.items() if v > 0}
        total = sum(predicted.values())
        for op, seconds in predicted.items():
            out.append(Measurement(op, p.ideal[op], p.measured_s * seconds / total))
    return out
