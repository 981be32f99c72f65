"""L_tran and transition feasibility before anything moves (paper §2.8–2.9, §2.13).

``TransitionEstimator`` is the interface admission uses. ``DagEstimator`` builds the global
transition DAG from the running plan to the target (``nereus.transition``): feasibility is the
DAG's (every acquisition gets its memory, every model-stage has a source of state), the peak is
the largest per-GPU bound the DAG guarantees plus the runtime reserve, and the moving time is the
list schedule's makespan (bytes over links, shared-link contention, communicator setup).

Transitions also pay costs bytes do not explain: rebuilding an engine for a new layout,
re-forming process groups. The estimate is w · (DAG makespan, generation rebuilds, other rebuilds,
communicators formed, their ranks, warm generation rebuilds). A generation rebuild is warm in a
layout the job built that engine in before (``DagEstimator.built``): vLLM's compile cache, keyed
by the model and its parallel layout, outlives the engine and makes such a build cheaper; how
much cheaper is learned, from a prior of a cold build. Every changed model-stage regroups (a
re-laid-out one as well as one whose DP changed: its groups are new either way, and the start-up
measures groups and engines apart). A rank of a regrouped model-stage joins one communicator per
parallel dimension (TP, PP, DP) wider than one rank, in turn, and initialising one costs a + b · ranks (a
fixed handshake, and a bootstrap that exchanges every rank's address): at 1,024 GPUs a DP group
spans hundreds of ranks and forming it costs several times what a TP group of 8 does, which a
count of regroups cannot price. w is fitted by non-negative least squares to the measured
transitions (``DagEstimator``), starting from the pure DAG model w = (1, 0, 0, 0, 0, 0) — or, once
the job reports what building its engines and groups took at start-up (``FixedCosts``,
``DagEstimator.seed``), from those seconds: a first move is then priced with the rebuilds it will
pay, not as free. At a boundary where the job's world re-forms anyway (a worker joined or left),
every engine and group is rebuilt whether the plan changes or not: those costs are sunk, the
features count the DAG alone (``sunk``), and the fit learns from the DAG's measured seconds only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from nereus.plan.layout import Layout, Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import Stage
from nereus.transition import NoSourceError, Transition
from nereus.transition.between import ROOMY, Priced, fit_staging, price_transition

# DAG makespan, (cold) generation rebuilds, other rebuilds, communicators, their ranks, warm
# generation rebuilds (a layout the job built that engine in before)
FEATURES = 6
WARM = 5  # the warm generation rebuilds' index


@dataclass(frozen=True, slots=True)
class TransitionEstimate:
    seconds: float
    peak_bytes: float  # largest per-GPU memory during the transition (with the runtime reserve)
    feasible: bool
    reason: str = ""
    changed: tuple[str, ...] = ()  # model-stages whose units change
    resharded: tuple[str, ...] = ()  # model-stages whose (tp, pp) changes
    moved_bytes: float = 0.0
    per_gpu_seconds: Mapping[int, float] = field(default_factory=dict)  # when each GPU is done
    # what the fitted cost model multiplies: (DAG makespan s, cold generation rebuilds, other
    # rebuilds, communicators formed, the ranks of those communicators, warm generation rebuilds)
    features: tuple[float, ...] = (0.0,) * FEATURES
    priced: Priced | None = None  # what was priced: a class plan, or the DAG and schedule a move runs
    sunk: bool = False  # rebuilds and regroups happen anyway (the world re-forms): not charged
    dag_weight: float = 1.0  # the fitted weight on the DAG makespan ``seconds`` was priced with

    def __post_init__(self) -> None:
        if len(self.features) != FEATURES:
            raise ValueError(f"TransitionEstimate.features needs {FEATURES} values, got {self.features}")

    @property
    def transition(self) -> Transition | None:
        """The per-unit DAG and schedule a move runs (a class plan's is built on first use)."""
        return self.priced.transition if self.priced is not None else None


def communicators(degrees: Iterable[int]) -> tuple[int, int]:
    """The communicators a rank of a model-stage with parallel ``degrees`` (TP, PP, DP) joins,
    one per dimension wider than one rank, and their ranks summed."""
    wide = [d for d in degrees if d > 1]
    return len(wide), sum(wide)


def regroup_features(plan: Plan, names: Iterable[str]) -> tuple[float, float]:
    """(communicators, their ranks) that regrouping the model-stages ``names`` of ``plan`` forms."""
    count = ranks = 0
    for name in names:
        c = plan.candidate(name)
        n, r = communicators((c.layout.tp, c.layout.pp, c.dp))
        count, ranks = count + n, ranks + r
    return float(count), float(ranks)


@dataclass(frozen=True, slots=True)
class FixedCosts:
    """What a transition pays beyond moving bytes, as the job measured it at start-up: seconds to
    build one generation engine, one engine of another stage, and, per communicator a rank
    joins, the fixed seconds of its initialisation and the seconds per rank it spans.
    ``None``: not measured (no engine of that kind was built, no group formed; per rank: the
    start-up's groups could not tell the two apart)."""

    gen_rebuild_s: float | None
    other_rebuild_s: float | None
    communicator_s: float | None
    per_rank_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("gen_rebuild_s", "other_rebuild_s", "communicator_s", "per_rank_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"FixedCosts.{name} must be a finite number of seconds ≥ 0, got {v!r}")

    @classmethod
    def of(
        cls,
        stages: Sequence[Stage],
        build_s: Sequence[float],
        group_s: Sequence[float],
        degrees: Sequence[tuple[int, int, int]],
    ) -> FixedCosts:
        """From one start-up, per model-stage: its stage, the seconds its slowest rank took to
        build its engine (0: none built, e.g. a rank held none of its units) and to form its
        groups, and its (TP, PP, DP). Each engine kind's cost is the mean over the model-stages
        that built one; the communicators' a and b are the non-negative least-squares fit of the
        group times to (communicators, ranks) — b stays unknown unless the start-up formed
        communicators of different widths."""
        if not len(stages) == len(build_s) == len(group_s) == len(degrees):
            raise ValueError(
                f"FixedCosts.of: {len(stages)} stages, {len(build_s)} build times, "
                f"{len(group_s)} group times and {len(degrees)} layouts"
            )

        def mean(xs: list[float]) -> float | None:
            xs = [x for x in xs if x > 0]
            return sum(xs) / len(xs) if xs else None

        gen = [b for s, b in zip(stages, build_s, strict=True) if s is Stage.GEN]
        other = [b for s, b in zip(stages, build_s, strict=True) if s is not Stage.GEN]
        rows = [(*communicators(d), g) for d, g in zip(degrees, group_s, strict=True) if g > 0]
        rows = [r for r in rows if r[0] > 0]  # a model-stage of one GPU forms no communicator
        if not rows:
            return cls(mean(gen), mean(other), None)
        widths = {r / n for n, r, _ in rows}
        if len(widths) < 2:  # one width: a and b cannot be told apart, a takes it all
            return cls(mean(gen), mean(other), sum(g for *_, g in rows) / sum(n for n, *_ in rows))
        x = np.array([r[:2] for r in rows], dtype=np.float64)
        a, b = nonnegative_lstsq(x, np.array([r[2] for r in rows], dtype=np.float64))
        return cls(mean(gen), mean(other), float(a), float(b))

    def describe(self) -> str:
        def s(v: float | None) -> str:
            return "none built" if v is None else f"{v:.2f} s"

        per_rank = "" if self.per_rank_s is None else f" + {self.per_rank_s * 1e3:.2f} ms per rank"
        return (
            f"a generation engine {s(self.gen_rebuild_s)}, another engine {s(self.other_rebuild_s)}, "
            f"a communicator {s(self.communicator_s)}{per_rank if self.communicator_s is not None else ''}"
        )

    def as_weights(self) -> tuple[float | None, ...]:
        """The estimator's fixed-cost weights, in feature order: a warm generation rebuild's is a
        cold one's (a start-up builds every engine cold: it tells nothing of what a cache saves)."""
        return (self.gen_rebuild_s, self.other_rebuild_s, self.communicator_s, self.per_rank_s,
                self.gen_rebuild_s)  # fmt: skip


def staged(problem: PlanningProblem, est: TransitionEstimate) -> TransitionEstimate:
    """``est`` with its zero-copy staging counted where it was priced from a class plan, which
    counts none: the per-unit DAG the move runs is built now (as running it would build it) and
    checked with its staging (``between.fit_staging``: smaller batches, else a more serial DAG
    that leaves room for them); the checked DAG is what the move runs, and where it was planned
    again its makespan replaces the class plan's in the price. A GPU over capacity either way
    makes the move infeasible, naming the GPU. Only the move admission chooses pays for the build."""
    tr = est.priced
    if tr is None or tr.classes is None or not est.feasible or tr.checked:
        return est
    checked = fit_staging(problem, tr.transition)
    peak = max(est.peak_bytes, checked.peak_max + problem.reserved_bytes)
    if not checked.feasible:
        reason = checked.dag.reason
        priced = Priced(checked, tr.classes)
        return replace(est, seconds=0.0, peak_bytes=peak, feasible=False, reason=reason, priced=priced)
    if checked.path != ROOMY:
        return replace(est, peak_bytes=peak, priced=Priced(checked, tr.classes))
    longer = checked.l_tran_s - est.features[0]  # the DAG planned again, more serial
    return replace(
        est,
        seconds=est.seconds + est.dag_weight * longer,
        peak_bytes=peak,
        per_gpu_seconds=checked.gpu_done(),
        features=(checked.l_tran_s, *est.features[1:]),
        priced=Priced(checked),
    )


class TransitionEstimator(Protocol):
    def estimate(
        self, problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset(),
        skip: frozenset[str] = frozenset(), sunk: bool = False,
    ) -> TransitionEstimate: ...  # fmt: skip

    def observe(self, estimate: TransitionEstimate, measured_s: float) -> None: ...

    def seed(self, fixed: FixedCosts) -> None: ...

    def built(self, plan: Plan) -> None: ...


# how far a start-up measurement is trusted as a transition's fixed cost: its standard deviation,
# as a share of it (a rebuild for a new layout is not exactly the first build: caches are warm,
# imports done); a few measured transitions outweigh it
SEED_SPREAD = 0.5
SEED_FLOOR_SD = (0.0, 0.1, 0.1, 0.1, 0.01, 0.1)  # ... and at least this (seconds; per rank: 10 ms)


class DagEstimator:
    """L_tran from the transition DAG's schedule, with fixed costs learned from measurements.

    The weights are the non-negative least-squares fit of the measured transitions (the newest
    ``window``, each older one down-weighted by ``forgetting``) with a Gaussian prior: the DAG's
    timing is trusted (w₀ = 1, sd 0.3), the fixed costs start at 0 with no trust (sd 100 s) or at
    the start-up builds (``seed``, sd half of them; a second per rank, sd 1 s, where the
    start-up could not tell). Solved exactly with the constraint (a clipped recursive update
    stalls where a prior is above the truth)."""

    def __init__(self, forgetting: float = 0.95, window: int = 64) -> None:
        self.forgetting, self.window = forgetting, window
        self._prior = np.zeros(FEATURES)
        self._prior[0] = 1.0
        # trust the DAG, not fixed costs (a rank's share of a communicator: ≤ a second or so)
        self._prior_sd = np.array([0.1**0.5, 100.0, 100.0, 100.0, 1.0, 100.0])
        self._seen: list[tuple[np.ndarray, float]] = []  # (features, measured s), oldest first
        self.weights = self._prior.copy()
        self._built: set[tuple[str, Layout]] = set()  # generation engines built: (model-stage, layout)

    def seed(self, fixed: FixedCosts) -> None:
        """Start the fixed-cost weights from the job's own start-up builds (``FixedCosts``), where
        no transition has measured them yet; the DAG's weight is kept. A warm generation rebuild
        starts at a cold one's seconds, trusted no closer than those seconds."""
        learned = [any(f[i] for f, _ in self._seen) for i in range(FEATURES)]
        for i, v in enumerate(fixed.as_weights(), start=1):
            if v is None or learned[i]:  # not measured, or a transition measured it already
                continue
            spread = 1.0 if i == WARM else SEED_SPREAD
            self._prior[i], self._prior_sd[i] = v, max(spread * v, SEED_FLOOR_SD[i])
        self.weights = self._fit()

    def built(self, plan: Plan) -> None:
        """The job built ``plan``'s engines (at start-up, a move, a restart): a later rebuild of
        one of its generation engines in the same layout is warm."""
        for c in plan.candidates:
            if plan.stage_of(c) is Stage.GEN:
                self._built.add((c.model_stage, c.layout))

    def observe(self, estimate: TransitionEstimate, measured_s: float) -> None:
        """Fold one measured transition into the weights."""
        f = np.asarray(estimate.features, dtype=np.float64)
        if measured_s <= 0 or not f.any():
            return
        self._seen = [*self._seen[-(self.window - 1) :], (f, float(measured_s))]
        self.weights = self._fit()

    def _fit(self) -> np.ndarray:
        n = len(self._seen)
        age = np.sqrt(self.forgetting ** np.arange(n - 1, -1, -1, dtype=np.float64))
        prior = np.sqrt(self.forgetting**n) / self._prior_sd  # the prior fades like an old sample
        a = np.vstack([np.diag(prior), *(f[None, :] * r for (f, _), r in zip(self._seen, age, strict=True))])
        b = np.concatenate([prior * self._prior, [y * r for (_, y), r in zip(self._seen, age, strict=True)]])
        w = nonnegative_lstsq(a, b)
        if not any(f[WARM] for f, _ in self._seen):  # no warm rebuild measured: none dearer than cold
            w[WARM] = min(w[WARM], w[1])
        return w

    def estimate(
        self, problem: PlanningProblem, current: Plan, target: Plan, lost: frozenset[int] = frozenset(),
        skip: frozenset[str] = frozenset(), sunk: bool = False,
    ) -> TransitionEstimate:  # fmt: skip
        """``skip``: model-stages left out of the transition (weight copies that a weight sync
        rebuilds after it, when a failed step's rollback dropped them). ``sunk``: the world
        re-forms at this boundary, so rebuilds and regroups are not the transition's to pay."""
        try:
            tr = price_transition(problem, current, target, lost, skip)
        except NoSourceError as exc:
            return TransitionEstimate(0.0, 0.0, False, str(exc))
        if tr.classes is None:  # a per-unit DAG: its zero-copy staging counts in its memory
            tr = Priced(fit_staging(problem, tr.transition))
        changed, resharded = tr.changed, tr.resharded
        peak = tr.peak_max + problem.reserved_bytes
        if not tr.feasible:
            return TransitionEstimate(
                0.0, peak, False, tr.transition.dag.reason, changed, resharded, tr.moved_bytes, priced=tr
            )
        done = tr.gpu_done()
        gens = [n for n in resharded if target.workflow.get(n).stage is Stage.GEN]
        warm = sum(1 for n in gens if (n, target.candidate(n).layout) in self._built)
        comms, ranks = regroup_features(target, changed)  # a re-laid-out model-stage regroups too
        features = (
            (tr.l_tran_s, 0.0, 0.0, 0.0, 0.0, 0.0)
            if sunk
            else (tr.l_tran_s, float(len(gens) - warm), float(len(resharded) - len(gens)), comms, ranks,
                  float(warm))
        )  # fmt: skip
        seconds = float(np.dot(self.weights, features))
        return TransitionEstimate(
            seconds, peak, True, "", changed, resharded, float(tr.moved_bytes), done, features, tr, sunk,
            float(self.weights[0]),
        )  # fmt: skip


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖a·x − b‖ over x ≥ 0, exactly, for a handful of columns: the optimum is the
    unconstrained fit on some set of free columns (the rest at 0), so the best feasible one of
    those fits is it. Requires ``a`` of full column rank on every subset (a prior row per column
    ensures it)."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(b @ b)
    for mask in range(1, 1 << k):
        free = [i for i in range(k) if mask >> i & 1]
        x_free = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (x_free < 0).any():
            continue
        x = np.zeros(k)
        x[free] = x_free
        r = a @ x - b
        if (err := float(r @ r)) < best_err:
            best, best_err = x, err
    return best
