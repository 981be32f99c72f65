"""The simulator's hardware truth, written apart from the planner (it imports nothing from
``nereus.plan``, ``nereus.control`` or ``nereus.transition``): GEMM throughput by shape,
collective bandwidth by message size and node span, vLLM-style decode with KV preemption,
recompute, memory with allocator fragmentation, and transitions (their DAG walked at the truth's
link speeds, engine builds and communicator init), fitted to published measurements
(``benchmarks/fit_truth.py``). The planner learns it only through the per-op-class telemetry the
simulator hands its calibration.
"""

from nereus.sim.truth.engines import Engine
from nereus.sim.truth.hardware import COMPUTE_CLASSES, SCOPES, Episode, Hardware
from nereus.sim.truth.params import TruthParams
from nereus.sim.truth.shard import Placement
from nereus.sim.truth.stage import PARAMS, run_stage
from nereus.sim.truth.work import Lengths, StageResult

__all__ = [
    "COMPUTE_CLASSES",
    "PARAMS",
    "SCOPES",
    "Engine",
    "Episode",
    "Hardware",
    "Lengths",
    "Placement",
    "StageResult",
    "TruthParams",
    "run_stage",
]
