"""The named policies (``nereus``, ``static``, ``always``, ``periodic:K``, ``oracle``) as
controller configurations: all share the urgent path and the planner; they differ in admission
and in which triggers start a replan. Pure logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from nereus.control.admission import Profit, Rule
from nereus.control.triggers import TriggerKind
from nereus.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    rule: Rule = field(default_factory=Rule)
    delta_len: float = 0.30  # δ_len
    delta_eff: float = 0.25  # δ for achieved efficiency per op class
    ema_weight: float = 0.5  # weight of the newest interval in H_x
    fallback_tolerance: float = 0.10  # fallbacks at most this much slower than S*
    period: int = 0  # > 0: replan every `period` steps (periodic policy)
    # which triggers start a replan (urgent ones always do)
    replan_on: frozenset[TriggerKind] = frozenset(TriggerKind)
    hold_layouts: bool = False  # static policy: TP/PP fixed to the first plan's, DP follows the pool
    restart_s: float = 120.0  # a restart's relaunch seconds (reading the checkpoint comes on top)

    def __post_init__(self) -> None:
        if self.period < 0 or self.fallback_tolerance < 0 or not self.restart_s >= 0:
            raise ValueError("period, fallback_tolerance and restart_s must be non-negative")


POLICIES = ("nereus", "static", "always", "periodic:K", "oracle")
MAX_PERIOD = 10_000_000  # a run's most steps (``experiment.MAX_STEPS``)


def policy_config(name: str, gamma: float = 0.5) -> ControllerConfig:
    """The controller configuration of a named policy (``nereus``, ``static``, ``always``,
    ``periodic:K``, ``oracle``); all share the urgent path and the planner, they differ in
    admission. ``oracle`` replans every step and adopts the planner's best plan each time: with the
    simulator's free transitions it is the reference for what admission could gain (a bound only
    as far as the planner's model matches the hardware)."""
    if name == "nereus":
        return ControllerConfig(rule=Rule(Profit.PAYBACK, gamma))
    if name == "always":
        return ControllerConfig(rule=Rule(Profit.ANY_GAIN, gamma))
    if name == "static":
        return ControllerConfig(
            rule=Rule(Profit.SWITCH, gamma), replan_on=frozenset({TriggerKind.POOL}), hold_layouts=True
        )
    if name == "oracle":
        return ControllerConfig(rule=Rule(Profit.SWITCH, gamma), period=1)
    if name.startswith("periodic:"):
        digits = name.split(":", 1)[1]  # ASCII digits only: int() also takes "1_0", " 2", "٣"
        k = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 8 else 0
        if not 0 < k <= MAX_PERIOD:
            raise ConfigError(
                f"policy {name!r}: periodic:K needs a whole number K in [1, {MAX_PERIOD:,}] (ASCII digits)"
            )
        return ControllerConfig(
            rule=Rule(Profit.SWITCH, gamma), period=k, replan_on=frozenset({TriggerKind.PERIODIC})
        )
    raise ConfigError(f"unknown policy {name!r} (choices: {', '.join(POLICIES)})")
