"""What a step's memory tells calibration: measured peaks, and an out-of-memory error's correction.

Both compare the running plan's predicted memory with what the step showed: a measured peak
refines its stage's memory correction (paper §2.5), and an out-of-memory error raises it at least
to where the model would have predicted the error. The controller passes the job's problem on the
running plan's pool at the step's own lengths.

Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from nereus.plan.calibration import OOM_STEP, CalibrationStore
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem
from nereus.spec.workload import Stage

OOM_MIN_STEP = 1.02  # an out-of-memory error raises the stage's memory correction at least this much


def fold_peaks(
    calibration: CalibrationStore, problem: PlanningProblem, plan: Plan, peaks: Mapping[str, float]
) -> None:
    """Each model-stage's measured peak (bytes per GPU) against what the model predicts for it
    without the current correction, folded into its stage's memory correction."""
    predicted = price(problem, shapes_of(plan))
    eff = problem.efficiencies
    for name, measured in peaks.items():
        stage = plan.workflow.get(name).stage
        raw = predicted.active[name] / eff.memory(stage)  # without the current correction
        if raw > 0 and measured > 0:
            calibration.update_memory(stage, raw, measured)


def oom_steps(problem: PlanningProblem, plan: Plan) -> dict[Stage, float]:
    """Per stage, the smallest correction under which the model would have predicted the running
    plan's out-of-memory error: its predicted peak raised to the GPU's physical memory less the
    runtime reserve (the headroom then keeps the next plan clear), at least ``OOM_MIN_STEP`` and
    at most ``OOM_STEP`` — not a fixed escalation that can leave nothing fitting."""
    bound = price(problem, shapes_of(plan)).bound
    physical = problem.cluster.gpu_memory_bytes - problem.reserved_bytes
    peaks: dict[Stage, float] = {}
    for name, b in bound.items():
        stage = plan.workflow.get(name).stage
        peaks[stage] = max(peaks.get(stage, 0.0), b)
    return {s: min(OOM_STEP, max(OOM_MIN_STEP, physical / b)) for s, b in peaks.items() if b > 0}
