"""Trace-driven simulation of an adaptive RL job at any scale (pure)."""

from nereus.sim.engine import Scenario, SimulationError, StepRecord, Summary, simulate
from nereus.sim.seqcurve import SeqCurve
from nereus.sim.trace import GpuSupply, SpotTrace
from nereus.sim.truth import Episode, Hardware

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
