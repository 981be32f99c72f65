"""Plans and how they are found: layouts, cost and memory models, calibration, search (pure)."""

from nereus.plan.calibration import CalibrationStore, Efficiencies, Measurement
from nereus.plan.candidates import CandidateTable, Estimate, Shape, candidate_table
from nereus.plan.cost import CostModel, LatencyTerms
from nereus.plan.layout import Candidate, Layout, Plan, is_power_of_two, split_layers
from nereus.plan.memory import MemoryTerms
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.plan.overlap import critical_path, step_latency
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import SearchResult, search
from nereus.plan.solvers import Solver, solve

__all__ = [
    "CalibrationStore",
    "Candidate",
    "CandidateTable",
    "Collective",
    "CostModel",
    "Efficiencies",
    "Estimate",
    "LatencyTerms",
    "Layout",
    "Link",
    "Measurement",
    "MemoryTerms",
    "OpClass",
    "Plan",
    "PlanningProblem",
    "SearchResult",
    "SearchSpace",
    "SeqStats",
    "Shape",
    "Solver",
    "candidate_table",
    "critical_path",
    "is_power_of_two",
    "search",
    "solve",
    "split_layers",
    "step_latency",
]
