"""Trace-driven simulation of an adaptive RL job at any scale (pure).

Names load lazily, so ``nereus.sim.truth`` (the hardware truth, which must not see the planner)
can be imported without importing the engine and, through it, ``nereus.plan``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nereus.sim.engine import Scenario, SimulationError, StepRecord, Summary, simulate
    from nereus.sim.seqcurve import SeqCurve
    from nereus.sim.trace import GpuSupply, SpotTrace
    from nereus.sim.truth import Episode, Hardware

_HOME = {
    "Scenario": "engine",
    "SimulationError": "engine",
    "StepRecord": "engine",
    "Summary": "engine",
    "simulate": "engine",
    "SeqCurve": "seqcurve",
    "GpuSupply": "trace",
    "SpotTrace": "trace",
    "Episode": "truth",
    "Hardware": "truth",
}

__all__ = [
    "Episode",
    "GpuSupply",
    "Hardware",
    "Scenario",
    "SeqCurve",
    "SimulationError",
    "SpotTrace",
    "StepRecord",
    "Summary",
    "simulate",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"nereus.sim.{_HOME[name]}"), name)
    raise AttributeError(f"module 'nereus.sim' has no attribute {name!r}")
