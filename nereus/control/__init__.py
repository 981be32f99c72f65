"""When to adapt: telemetry, triggers, payback admission and the controller (pure)."""

from nereus.control.admission import Decision, Option, Profit, Rule, Verdict, admit
from nereus.control.controller import Controller, ControllerConfig, State, policy_config
from nereus.control.telemetry import Telemetry
from nereus.control.transition_cost import (
    DagEstimator,
    FixedCosts,
    TransitionEstimate,
    TransitionEstimator,
)
from nereus.control.triggers import Trigger, TriggerKind, TriggerMonitor

__all__ = [
    "Controller",
    "ControllerConfig",
    "DagEstimator",
    "Decision",
    "FixedCosts",
    "Option",
    "Profit",
    "Rule",
    "State",
    "Telemetry",
    "TransitionEstimate",
    "TransitionEstimator",
    "Trigger",
    "TriggerKind",
    "TriggerMonitor",
    "Verdict",
    "admit",
    "policy_config",
]
