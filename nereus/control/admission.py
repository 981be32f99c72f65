"""Admission (paper §2.8–2.9, Eq. 2): is a transition feasible, and does it pay back in time?

Options are tried in order — the planner's target S* first, then slightly slower plans with
cheaper transitions — and the first that passes is admitted:

* feasible: the target plan fits (the planner guarantees it) and so does its transition (memory
  while state moves, an intact copy of every model-stage: ``TransitionEstimator``);
* profitable (opportunistic triggers only): ΔL = L(S) − L(S*) > 0 and L_tran / ΔL ≤ γ · H, with
  H the smallest horizon of the signals that fired. Urgent triggers waive profitability: the
  plan must change, and of the options whose transitions are feasible the one that costs least
  over the pool's horizon H_pool (the steps until the GPU pool is expected to change again) is
  admitted, L_tran + H_pool · L — Eq. 2 between two options: a faster one is worth its dearer
  move when the extra transition seconds pay back within H_pool. Where GPUs can be revoked, each L
  includes the restart the plan risks per step (``risk``): a plan that leaves a trainer's last
  copy on revocable GPUs is slower by its expected restart seconds.

``Rule`` also expresses the baselines the simulator compares: ``any-gain`` admits any ΔL > 0
(DynaRL-style) and ``switch`` admits whatever differs (a periodic policy). If nothing passes, an
opportunistic replan keeps the current plan — unless no option can move in place at all and a
checkpoint restart onto the target pays back under the same rule (``restart_instead``: the
restart's seconds are its L_tran); an urgent one asks for checkpoint and restart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from nereus.control.action import Action, Keep, Move, Restart
from nereus.control.transition_cost import TransitionEstimate, staged
from nereus.control.triggers import Trigger
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem


class Verdict(StrEnum):
    ADMIT = "admit"
    KEEP = "keep"
    RESTART = "restart"  # checkpoint and restart: nothing transitions in place


class Profit(StrEnum):
    PAYBACK = "payback"  # Nereus: ΔL > 0 and L_tran/ΔL ≤ γ·H
    ANY_GAIN = "any-gain"  # DynaRL-style: ΔL > 0
    SWITCH = "switch"  # periodic: adopt the target whenever it differs


@dataclass(frozen=True, slots=True)
class Rule:
    profit: Profit = Profit.PAYBACK
    gamma: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")

    def pays_back(self, delta_s: float, l_tran_s: float, horizon: float) -> tuple[bool, str]:
        if self.profit is Profit.SWITCH:
            return True, "switch (this policy moves on every replan it makes)"
        if delta_s <= 0:
            return False, f"no gain (ΔL {delta_s:+.3g} s)"
        if self.profit is Profit.ANY_GAIN:
            return True, f"ΔL {delta_s:.3g} s > 0"
        payback = l_tran_s / delta_s
        bar = self.gamma * horizon
        if payback <= bar:
            return True, f"payback {payback:.3g} ≤ γ·H = {bar:.3g} steps"
        return False, f"payback {payback:.3g} > γ·H = {bar:.3g} steps"


@dataclass(frozen=True, slots=True)
class Option:
    """A candidate target plan with its predicted step latency and where it came from."""

    label: str  # "target", "reserved", "hold-layouts", "relayout:<stage>", "widened", "urgent"
    plan: Plan
    step_latency_s: float
    risk_s: float = 0.0  # expected restart seconds per step (nereus.control.risk)

    @property
    def expected_s(self) -> float:
        """Step latency with the restart it risks."""
        return self.step_latency_s + self.risk_s


@dataclass(frozen=True, slots=True)
class Decision:
    """One replan, as the runtime logs it."""

    step: int
    time_s: float
    triggers: tuple[Trigger, ...]
    urgent: bool
    verdict: Verdict
    reason: str
    current_latency_s: float | None  # None: the current plan is no longer valid
    target: Plan | None = None
    target_label: str = ""
    target_latency_s: float | None = None
    delta_s: float | None = None
    l_tran_s: float | None = None
    payback_steps: float | None = None
    horizon_steps: float | None = None
    transition: TransitionEstimate | None = None
    current_risk_s: float = 0.0  # expected restart seconds per step of the current plan
    target_risk_s: float = 0.0  # … and of the target
    # revocations per revocable instance-hour the risks were priced at (None: nothing revocable)
    revocation_rate: float | None = None
    # the running plan was priced past its headroom (within the memory, or nothing else fits):
    # kept, it carries on, its memory checked ahead against half the headroom from then on
    # (``Controller.tolerated_headroom``), and against the memory itself once kept again past that
    over_headroom: bool = False

    @property
    def action(self) -> Action:
        """What to do about this decision: move to the target along the priced transition,
        restart from a checkpoint, or keep the plan."""
        if self.verdict is Verdict.ADMIT:
            tr = self.transition.transition if self.transition is not None else None
            if self.target is None or tr is None:
                raise ValueError(f"step {self.step}: an admitted decision without a priced transition")
            return Move(self.target, tr, self.reason)
        if self.verdict is Verdict.RESTART:
            return Restart(self.target, self.reason)
        return Keep(self.reason)

    def to_json(self) -> dict[str, Any]:
        def layouts(plan: Plan | None) -> dict[str, str] | None:
            if plan is None:
                return None
            return {c.model_stage: f"{c.layout}·dp{c.dp}" for c in plan.candidates}

        def finite(x: float | None) -> float | None:  # JSON has no infinity: "never" is null
            return x if x is None or math.isfinite(x) else None

        return {
            "step": self.step,
            "time_s": self.time_s,
            "triggers": [t.describe() for t in self.triggers],
            "urgent": self.urgent,
            "verdict": self.verdict.value,
            "reason": self.reason,
            "current_latency_s": finite(self.current_latency_s),
            "target": layouts(self.target),
            "target_label": self.target_label,
            "target_latency_s": finite(self.target_latency_s),
            "delta_s": finite(self.delta_s),
            "l_tran_s": finite(self.l_tran_s),
            "payback_steps": finite(self.payback_steps),
            "horizon_steps": finite(self.horizon_steps),
            "current_risk_s": finite(self.current_risk_s),
            "target_risk_s": finite(self.target_risk_s),
            "revocation_rate": finite(self.revocation_rate),
            # the world re-forms at this boundary: engine rebuilds are not the transition's cost
            "sunk_rebuilds": self.transition is not None and self.transition.sunk,
        }


def admit(
    rule: Rule,
    current_latency_s: float | None,
    options: Sequence[Option],
    estimates: Sequence[TransitionEstimate],
    horizon: float,
    urgent: bool,
) -> tuple[int | None, str]:
    """Index of the first admissible option (or None) and the reasons, one per option tried.
    ``current_latency_s`` and each option's ``expected_s`` include the restart they risk."""
    reasons = []
    for i, (opt, est) in enumerate(zip(options, estimates, strict=True)):
        if not est.feasible:
            reasons.append(f"{opt.label}: transition infeasible ({est.reason})")
            continue
        if urgent or current_latency_s is None:
            return least_cost(options, estimates, horizon)  # one is feasible
        delta = current_latency_s - opt.expected_s
        ok, why = rule.pays_back(delta, est.seconds, horizon)
        if ok:
            return i, f"{opt.label}: {why}"
        reasons.append(f"{opt.label}: {why}")
    return None, "; ".join(reasons) or "no option"


def least_cost(
    options: Sequence[Option], estimates: Sequence[TransitionEstimate], horizon: float
) -> tuple[int | None, str]:
    """The urgent choice: of the options whose transitions are feasible, the one with the least
    L_tran + H · L (ties: the earlier option), with ``horizon`` H the steps the new plan is expected
    to run (the pool's horizon)."""
    feasible = [i for i, e in enumerate(estimates) if e.feasible]
    if not feasible:
        return None, "no option"
    best = min(feasible, key=lambda i: (estimates[i].seconds + horizon * options[i].expected_s, i))
    cost = estimates[best].seconds + horizon * options[best].expected_s
    return best, (
        f"{options[best].label}: urgent, profitability waived; least L_tran + H·L "
        f"({cost:.4g} s over H = {horizon:.3g} steps) of {len(feasible)} feasible"
    )


def payback_steps(delta_s: float, l_tran_s: float) -> float:
    return l_tran_s / delta_s if delta_s > 0 else math.inf


def restart_instead(
    rule: Rule,
    base: Decision,
    best: Option,
    why_not: str,
    expected_s: float,
    restart_s: float,
    horizon: float,
) -> Decision | None:
    """No option can move in place (``why_not``), yet ``best`` is faster than the running plan
    (``expected_s``, its restart risk included): a checkpoint restart onto it is one more way
    there, admitted by the same rule with the restart's ``restart_s`` as L_tran."""
    delta = expected_s - best.expected_s
    ok, why = rule.pays_back(delta, restart_s, horizon)
    if not ok or delta <= 0:
        return None
    return replace(
        base,
        verdict=Verdict.RESTART,
        reason=f"{best.label}: no transition in place ({why_not}); a restart pays: {why}",
        target=best.plan,
        target_label=best.label,
        target_latency_s=best.step_latency_s,
        delta_s=delta,
        l_tran_s=restart_s,
        payback_steps=payback_steps(delta, restart_s),
        target_risk_s=best.risk_s,
    )


def admit_staged(
    rule: Rule, problem: PlanningProblem, expected: float | None, options: Sequence[Option],
    estimates: list[TransitionEstimate], h: float, urgent: bool,
) -> tuple[int | None, str]:  # fmt: skip
    """``admit``, the chosen move's zero-copy staging counted (``transition_cost.staged``): a
    move priced from a class plan whose staging does not fit becomes infeasible in
    ``estimates`` and admission goes on to the next option."""
    while True:
        index, reason = admit(rule, expected, options, estimates, h, urgent)
        if index is None:
            return index, reason
        estimates[index] = staged(problem, estimates[index])
        if estimates[index].feasible:
            return index, reason


def decided(
    base: Decision, options: Sequence[Option], estimates: Sequence[TransitionEstimate],
    index: int | None, reason: str, expected: float | None,
) -> Decision:  # fmt: skip
    """``base`` with admission's answer: the move to ``options[index]`` (its gain, L_tran and
    payback), or, where none was admitted, kept with the least payback of the faster options
    that could move (None where none could)."""
    if index is None:
        gains = [
            payback_steps(expected - o.expected_s, e.seconds)
            for o, e in zip(options, estimates, strict=True)
            if e.feasible and expected is not None and expected > o.expected_s
        ]
        return replace(base, reason=reason, payback_steps=min(gains) if gains else None)
    chosen, est = options[index], estimates[index]
    delta = None if expected is None else expected - chosen.expected_s
    return replace(
        base,
        verdict=Verdict.ADMIT,
        reason=reason,
        target=chosen.plan,
        target_label=chosen.label,
        target_latency_s=chosen.step_latency_s,
        target_risk_s=chosen.risk_s,
        delta_s=delta,
        l_tran_s=est.seconds,
        payback_steps=payback_steps(delta, est.seconds) if delta is not None else None,
        transition=est,
    )
