"""A step on freshly built engines (the job's first, the first after a transition, a restart, a
rollback or a re-formed world) is warm-up: its op-class timings stay out of calibration and the
efficiency triggers (``nereus.control.warmup``).

The defect this pins: one 30×-slow first step (vLLM's warm-up) dragged the fitted decode η from
0.5 to 0.03, the efficiency trigger fired on the next step's recovery, and the controller moved to
a slower plan, never to move back."""

from __future__ import annotations

import pytest

from nereus.control.controller import Controller
from nereus.control.telemetry import Telemetry
from nereus.control.triggers import TriggerKind
from nereus.control.warmup import WarmUp
from nereus.plan.calibration import Measurement
from nereus.plan.opclass import OpClass
from nereus.plan.search import search
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

ETA = 0.5  # the cluster's true decode and GEMM efficiency in these tests


def _tel(step: int, pool: tuple[int, ...], slow: float = 1.0, reformed: bool = False) -> Telemetry:
    ops = tuple(
        Measurement(op, ideal, ideal / ETA * slow)
        for op, ideal in ((OpClass.DECODE, 2.0), (OpClass.GEMM, 1.0))
        for _ in range(4)  # four ranks' samples
    )
    return Telemetry(step, 100.0 * step, 2048.0, 2048.0, pool, measurements=ops, reformed=reformed)


def test_a_slow_first_step_neither_calibrates_nor_triggers() -> None:
    p = make_problem(gpus=16)
    ctl = Controller(p.workload, p.models, p.cluster, search(p).plan)
    pool = p.pool
    assert ctl.observe(_tel(0, pool, slow=30.0)) is None  # warm-up: left out
    assert ctl.calibration.sample_count(OpClass.DECODE) == 0
    assert ctl.observe(_tel(1, pool)) is None  # no efficiency drift from the recovery
    assert ctl.calibration.efficiency(OpClass.DECODE) == pytest.approx(ETA)
    assert ctl.calibration.efficiency(OpClass.GEMM) == pytest.approx(ETA)
    d = ctl.observe(_tel(2, pool, slow=3.0))  # a lasting slowdown on warm engines still counts
    assert d is not None and any(
        t.kind is TriggerKind.DRIFT and t.signal.startswith("efficiency.") for t in d.triggers
    )


def test_every_rebuild_makes_the_next_step_warm_up() -> None:
    w, pool = WarmUp(), (0, 1)
    assert w.strip(_tel(0, pool)).measurements == ()  # the job's first step
    assert w.strip(_tel(1, pool)).measurements != ()
    w.rebuilt()  # a transition, a restart or a rollback
    assert w.strip(_tel(2, pool)).measurements == ()
    assert w.strip(_tel(3, pool, reformed=True)).measurements != ()  # this one ran before the re-form
    assert w.strip(_tel(4, pool)).measurements == ()  # the first step in the re-formed world
    assert w.strip(_tel(5, pool)).measurements != ()
    w.rebuilt()  # a rollback, then the recovery's decision on telemetry of no step
    assert w.strip(Telemetry(5, 500.0, 2048.0, 2048.0, pool)).measurements == ()
    assert w.strip(_tel(6, pool)).measurements == ()  # still the first step on the rebuilt engines
    assert w.strip(_tel(7, pool)).measurements != ()
    # a recovery's telemetry (no step ran) at a boundary that re-formed the world: the next step warms up
    assert w.strip(Telemetry(7, 700.0, 2048.0, 2048.0, pool, reformed=True)).measurements == ()
    assert w.strip(_tel(8, pool)).measurements == ()


def test_a_dropped_decision_rebuilds_nothing_so_the_next_step_counts() -> None:
    p = make_problem(gpus=16)
    ctl = Controller(p.workload, p.models, p.cluster, search(p).plan)
    ctl.observe(_tel(0, p.pool))
    ctl.adopt(ctl.plan, rebuilt=False)  # a deferred decision dropped before it acted
    ctl.observe(_tel(1, p.pool))
    assert ctl.calibration.sample_count(OpClass.DECODE) == 4  # four ranks' samples
    ctl.adopt(ctl.plan)  # a rollback: the engines are built again
    ctl.observe(_tel(2, p.pool))
    assert ctl.calibration.sample_count(OpClass.DECODE) == 4


def test_off_every_step_counts() -> None:
    """The simulator's truth models no warm-up: its controller keeps every step's timings."""
    w, pool = WarmUp(enabled=False), (0, 1)
    assert w.strip(_tel(0, pool)).measurements != ()
    w.rebuilt()
    assert w.strip(_tel(1, pool, reformed=True)).measurements != ()
    assert w.strip(_tel(2, pool)).measurements != ()
