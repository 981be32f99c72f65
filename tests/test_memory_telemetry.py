"""Memory telemetry that means what it says (issue 16).

The runtime used to report the bytes of state a rank holds as each model-stage's "peak memory".
That is the resident part of the footprint only, so the controller's memory correction (measured
over predicted peaks) learnt that the model over-predicts: on Llama-3.1-8B PPO over 64 H200s it hit
its 0.5 floor within 4 steps, and the planner would have believed twice as much fits. Now a peak is
the allocator's (GPU) and a CPU reports none: the correction learns only from real peaks.
"""

from __future__ import annotations

import pytest
import torch

from nereus.control.controller import Controller
from nereus.control.telemetry import Telemetry
from nereus.devices import CPU, Devices, StageMemory, StageOutOfMemoryError
from nereus.plan.evaluate import price, shapes_of
from nereus.plan.layout import Plan
from nereus.plan.search import search
from nereus.runtime.monitor import RankReport, memory_gib, peaks
from nereus.spec.workload import Stage
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


@pytest.fixture(scope="module")
def job() -> tuple[Controller, Plan, dict[str, float]]:
    problem = make_problem(model="llama-3.1-8b", cluster="h200-ib", gpus=64, response=4096)
    plan = search(problem).plan
    cost = price(problem, shapes_of(plan))
    held = {c.model_stage: float(cost.resident[c.model_stage]) for c in plan.candidates}
    return Controller(problem.workload, problem.models, problem.cluster, plan), plan, held


def _steps(ctl: Controller, pool: tuple[int, ...], peak_memory: dict[str, float]) -> None:
    for step in range(4):
        ctl.observe(Telemetry(step, 10.0 * step, 4096, 4096, pool, peak_memory=peak_memory))


def test_held_bytes_fed_as_peaks_drove_the_correction_to_its_floor(job) -> None:  # type: ignore[no-untyped-def]
    ctl, plan, held = job
    ctl = Controller(ctl.workload, ctl.models, ctl.cluster, plan)
    _steps(ctl, plan.pool, held)  # what the runtime used to report
    assert min(ctl.calibration.memory_factor(s) for s in Stage) == pytest.approx(0.5)


def test_cpu_ranks_report_no_peak_and_the_correction_stays(job) -> None:  # type: ignore[no-untyped-def]
    ctl, plan, _ = job
    ctl = Controller(ctl.workload, ctl.models, ctl.cluster, plan)
    memory = StageMemory(Devices(CPU))
    with memory.measure("actor.train", own_bytes=1 << 30):
        torch.ones(1000).sum()
    assert memory.peaks == {}  # no allocator to ask on a CPU: no peak, rather than a wrong one
    reports = [RankReport({"actor.train": 0.1}, dict(memory.peaks), False, ()) for _ in range(4)]
    assert peaks(reports) == {}
    _steps(ctl, plan.pool, peaks(reports))
    assert all(ctl.calibration.memory_factor(s) == 1.0 for s in Stage)


def test_real_peaks_are_what_the_correction_learns(job) -> None:  # type: ignore[no-untyped-def]
    ctl, plan, _ = job
    ctl = Controller(ctl.workload, ctl.models, ctl.cluster, plan)
    problem = ctl.problem(plan.pool, ctl._seq(Telemetry(0, 0.0, 4096, 4096, plan.pool), ahead=0.0))
    active = price(problem, shapes_of(plan)).active
    measured = {n: 1.2 * float(active[n]) for n in ("actor.train", "critic.train")}  # the model is 20% low
    reports = [RankReport({}, {n: int(v) for n, v in measured.items()}, False, ())]
    _steps(ctl, plan.pool, peaks(reports))
    assert ctl.calibration.memory_factor(Stage.TRAIN) == pytest.approx(1.2, rel=0.01)


def test_an_out_of_memory_error_is_named_after_its_model_stage() -> None:
    memory = StageMemory(Devices(CPU))
    with (
        pytest.raises(StageOutOfMemoryError, match=r"actor\.train ran out of memory") as info,
        memory.measure("actor.train", 0),
    ):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert info.value.model_stage == "actor.train"
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_metrics_carry_each_stages_allocated_and_reserved_peak() -> None:
    gib = 1 << 30
    reports = [
        RankReport({}, {"actor.train": 3 * gib, "actor.gen": gib}, False, (), "", {"actor.train": 4 * gib}),
        RankReport({}, {"actor.train": 5 * gib // 2}, False, (), "", {"actor.train": 6 * gib}),
    ]
    assert memory_gib(reports) == {
        "actor.gen": {"allocated": 1.0, "reserved": 0.0},
        "actor.train": {"allocated": 3.0, "reserved": 6.0},  # the largest over the stage's ranks
    }
    assert memory_gib([RankReport({"actor.train": 0.1}, {}, False, ())]) == {}  # CPU ranks: none
