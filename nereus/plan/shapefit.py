"""Efficiency by shape: one op class's η as a function of the size of the work it times.

A scalar η per op class cannot follow how a GEMM's achieved rate grows with its size, or how a
collective's bus bandwidth grows with its message and with how many of its ranks share a node
(a hierarchical collective moves only 1/g of the bytes over each GPU's NIC, where the planner's
ring prices all of them). So a class's measurements carry the size of the work they timed
(``Measurement.size``: forward GEMM FLOPs of one layer on one GPU, attention FLOPs likewise, a
collective's bytes per rank, a memory-bound pass's bytes) and, for all-reduce, all-gather and
memory-bound work, a group (``Measurement.group``: ranks per node; the pipeline stages a decode
step cycles through), and the store fits

    ln η(size) = f(ln size)                  over all samples of the class, and
    ln η(size, group) = f_g(ln size)         over the samples of each group bucket g,

bucket g = round(log2 group). Each f is piecewise linear in ln size on knots half a decade apart
over the sizes measured (a penalised regression spline: hat-function basis, a second-difference
penalty so that knots with few samples follow their neighbours, a weak pull to the class-wide
η), fitted to ln(ideal/measured) with robust rejection (3 scaled MADs of the residual, at least
10%, re-judged against each refit); a bucket measured at one size only is a level. A row takes
its bucket's curve, else the pooled one. (A slope in ln group shared across sizes was tried
first: groups and sizes vary together — deeper pipelines hold fewer bytes per stage — and the
slope extrapolated to η in the hundreds at combinations never measured.) The form is ours, not
the truth's (``nereus.sim.truth`` uses saturating Hill and occupancy curves); outside the
measured sizes a curve holds its end values; a row of unknown size takes the class-wide η.

η here is achieved over the planner's own ideal (its ring at the link's per-GPU peak), so it may
exceed 1 where the hardware beats that ideal (hierarchical all-reduce over nodes); it is kept in
[ETA_MIN, ETA_MAX]. Pure NumPy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from nereus.plan.replica import FloatArray

ETA_MIN, ETA_MAX = 0.01, 64.0
KNOT_SPACING = math.log(10.0) / 2.0  # half a decade of size
MIN_SAMPLES = 4  # fewer sized samples of a class: no curve (the class-wide η)
MIN_SPREAD = math.log(1.5)  # sizes within a factor 1.5: no curve
SMOOTH = 0.05  # weight of the second-difference penalty (per knot, against unit-weight samples)
PULL = 1e-3  # weight of the pull of every knot to the class-wide ln η
REJECT_FLOOR = 0.1  # residuals within 3 × 10% are never rejected
MAD_SCALE = 1.4826
REJECT_ROUNDS = 3  # a straggler drags its neighbours' residuals: re-admit them against the refit


Profile = tuple[tuple[float, ...], tuple[float, ...]]  # knots (ln size), ln η at each knot


def _check(knots: tuple[float, ...], values: tuple[float, ...]) -> None:
    if len(knots) < 2 or len(knots) != len(values):
        raise ValueError("a shape curve needs at least two knots and one value per knot")
    if any(b <= a for a, b in itertools.pairwise(knots)):
        raise ValueError("shape-curve knots must increase")
    if not all(math.isfinite(v) for v in (*knots, *values)):
        raise ValueError("shape-curve parameters must be finite")


def bucket(group: FloatArray | float) -> npt.NDArray[np.int64]:
    """A group's bucket: log2 of its ranks per node (pipeline stages), rounded (a sample whose
    class mixed groups carries their geometric mean)."""
    g = np.maximum(np.asarray(group, dtype=np.float64), 1e-12)
    result: npt.NDArray[np.int64] = np.rint(np.log2(g)).astype(np.int64)
    return result


@dataclass(frozen=True, slots=True)
class ShapeCurve:
    """η of one op class by size: knots in ln size and ln η at each knot, over all samples; and,
    per group bucket measured (``bucket``), a curve of that bucket's own samples, which prices the
    rows of that bucket (a bucket never measured takes the pooled curve)."""

    knots: tuple[float, ...]
    values: tuple[float, ...]
    groups: tuple[int, ...] = ()
    group_curves: tuple[Profile, ...] = ()
    ceiling: float = ETA_MAX  # the highest η it prices (1 for compute: no work runs above peak)

    def __post_init__(self) -> None:
        _check(self.knots, self.values)
        if not ETA_MIN < self.ceiling <= ETA_MAX:
            raise ValueError(
                f"a shape curve's ceiling must be in ({ETA_MIN:g}, {ETA_MAX:g}], got {self.ceiling!r}"
            )
        if len(self.groups) != len(self.group_curves) or len(set(self.groups)) != len(self.groups):
            raise ValueError("a shape curve needs one curve per distinct group bucket")
        for knots, values in self.group_curves:
            _check(knots, values)

    def eta(self, size: FloatArray | float, group: FloatArray | float | None = None) -> FloatArray:
        """η at each row's size (and group); ``size`` ≤ 0 rows are the caller's to replace."""
        u = np.log(np.maximum(np.asarray(size, dtype=np.float64), 1e-300))
        y = np.interp(u, self.knots, self.values)
        if self.groups and group is not None:
            b = bucket(group)
            for g, (knots, values) in zip(self.groups, self.group_curves, strict=True):
                y = np.where(b == g, np.interp(u, knots, values), y)
        result: FloatArray = np.clip(np.exp(y), ETA_MIN, self.ceiling)
        return result


def _design(u: FloatArray, knots: FloatArray) -> FloatArray:
    """Hat functions on ``knots`` at points ``u`` (inside the knot range): rows sum to 1."""
    k = len(knots)
    pos = np.clip(np.searchsorted(knots, u, side="right") - 1, 0, k - 2)
    frac = (u - knots[pos]) / (knots[pos + 1] - knots[pos])
    basis = np.zeros((len(u), k))
    rows = np.arange(len(u))
    basis[rows, pos] = 1.0 - frac
    basis[rows, pos + 1] = frac
    return basis


def _solve(basis: FloatArray, y: FloatArray, n_knots: int, base: float) -> FloatArray:
    """Least squares of ``basis``·x = ``y`` with the smoothness and pull rows on the first
    ``n_knots`` columns (the knot values)."""
    width = basis.shape[1]
    rows, rhs = [basis], [y]
    if n_knots >= 3:
        second = np.zeros((n_knots - 2, width))
        for i in range(n_knots - 2):
            second[i, i : i + 3] = (1.0, -2.0, 1.0)
        rows.append(math.sqrt(SMOOTH) * second)
        rhs.append(np.zeros(n_knots - 2))
    pull = np.zeros((n_knots, width))
    pull[:, :n_knots] = np.eye(n_knots) * math.sqrt(PULL)
    rows.append(pull)
    rhs.append(np.full(n_knots, math.sqrt(PULL) * base))
    sol: FloatArray = np.linalg.lstsq(np.vstack(rows), np.concatenate(rhs), rcond=None)[0]
    return sol


def _profile(u: FloatArray, y: FloatArray, base: float, flat_ok: bool) -> Profile | None:
    """A penalised piecewise-linear fit of ``y`` over ``u`` with robust rejection; samples of one
    size give a level (``flat_ok``) or nothing."""
    if len(y) < MIN_SAMPLES:
        return None
    lo, hi = float(u.min()), float(u.max())
    if hi - lo < MIN_SPREAD:
        if not flat_ok:
            return None
        level = float(np.median(y))
        return ((lo - MIN_SPREAD / 2, hi + MIN_SPREAD / 2), (level, level))
    count = max(2, math.ceil((hi - lo) / KNOT_SPACING) + 1)
    knots = np.linspace(lo, hi, count)
    basis = _design(u, knots)
    keep = np.ones(len(y), dtype=bool)
    sol = _solve(basis, y, count, base)
    for _ in range(REJECT_ROUNDS):  # reject against the fit of the samples kept, then refit
        resid = y - basis @ sol
        med = float(np.median(resid[keep]))
        scale = max(float(np.median(np.abs(resid[keep] - med))) * MAD_SCALE, REJECT_FLOOR)
        again = np.abs(resid - med) <= 3.0 * scale
        if np.array_equal(again, keep) or int(again.sum()) < MIN_SAMPLES:
            break
        keep = again
        sol = _solve(basis[keep], y[keep], count, base)
    return tuple(float(k) for k in knots), tuple(float(x) for x in sol[:count])


def fit_curve(
    samples: Sequence[tuple[float, float, float, float]], class_eta: float, ceiling: float = ETA_MAX
) -> ShapeCurve | None:
    """The curve of one class from (ideal_s, measured_s, size, group) samples of known size, or
    None (too few samples, or one size in one group only): the class-wide η ``class_eta`` then
    prices it. ``ceiling``: the highest η the curve prices."""
    rows = [(i, m, s, g) for i, m, s, g in samples if s > 0]
    if len(rows) < MIN_SAMPLES:
        return None
    arr = np.array(rows, dtype=np.float64)
    y = np.log(arr[:, 0] / arr[:, 1])
    u = np.log(arr[:, 2])
    base = math.log(class_eta)
    grouped = arr[:, 3] > 0
    buckets = bucket(np.where(grouped, arr[:, 3], 1.0))
    distinct = sorted({int(b) for b in buckets[grouped]})
    pooled = _profile(u, y, base, flat_ok=len(distinct) > 1)
    if pooled is None:
        return None
    groups, curves = [], []
    if len(distinct) > 1:
        for g in distinct:
            mine = grouped & (buckets == g)
            profile = _profile(u[mine], y[mine], base, flat_ok=True)
            if profile is not None:
                groups.append(g)
                curves.append(profile)
    return ShapeCurve(pooled[0], pooled[1], tuple(groups), tuple(curves), ceiling)
