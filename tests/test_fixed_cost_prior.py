"""A transition's fixed costs start from the job's own start-up builds (``FixedCosts``).

Before any move was measured, the estimator priced engine rebuilds and regroups at zero, so a
first move was priced about 10× too cheap (4.6 s predicted, 58 s taken). The job measures what
building its engines and groups took at start-up; the estimator starts from those seconds and a
measured transition takes over from there.
"""

from __future__ import annotations

import math

import pytest

from nereus.control.transition_cost import DagEstimator, FixedCosts, TransitionEstimate
from nereus.sim.engine import _Run
from nereus.sim.moving import engine_of
from nereus.sim.truth import PARAMS
from nereus.sim.truth.engines import build_seconds, regroup_seconds
from nereus.spec.workload import Stage
from tests.test_simulate import SHIPPED, _scenario

pytestmark = pytest.mark.pure

G, INF, T = Stage.GEN, Stage.INF, Stage.TRAIN


def test_fixed_costs_average_each_kind_over_the_model_stages_that_built_one() -> None:
    f = FixedCosts.of([G, INF, INF, T], [30.0, 6.0, 0.0, 10.0], [1.0, 2.0, 3.0, 2.0])
    assert f.gen_rebuild_s == 30.0
    assert f.other_rebuild_s == pytest.approx(8.0)  # the inference engine not built here is not a 0
    assert f.regroup_s == pytest.approx(2.0)
    none = FixedCosts.of([INF, T], [5.0, 7.0], [0.0, 0.0])
    assert none.gen_rebuild_s is None and none.regroup_s is None and none.other_rebuild_s == 6.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_fixed_costs_refuse_what_is_not_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match=r"FixedCosts\.gen_rebuild_s"):
        FixedCosts(bad, 1.0, 1.0)
    with pytest.raises(ValueError, match="3 stages, 2 build"):
        FixedCosts.of([G, INF, T], [1.0, 2.0], [1.0, 1.0, 1.0])


def test_a_seeded_estimator_prices_rebuilds_until_transitions_measure_them() -> None:
    rebuild = TransitionEstimate(2.0, 0.0, True, features=(2.0, 1.0, 1.0, 2.0))
    e = DagEstimator()
    assert float(e.weights @ rebuild.features) == pytest.approx(2.0)  # unseeded: rebuilds are free
    e.seed(FixedCosts(30.0, 8.0, None))
    assert float(e.weights @ rebuild.features) == pytest.approx(2.0 + 30.0 + 8.0)  # regroups unmeasured
    for _ in range(4):  # in truth, a generation rebuild costs 12 s here and a regroup 1 s
        e.observe(rebuild, 2.0 + 12.0 + 8.0 + 2.0)
    learned = e.weights.copy()
    assert float(learned @ rebuild.features) == pytest.approx(24.0, rel=0.05)
    e.seed(FixedCosts(60.0, 60.0, 60.0))  # a later start-up (a restart) does not undo what was learned
    assert (e.weights == learned).all()
    assert (e.weights >= 0).all()


def test_the_simulated_job_tells_its_controller_what_its_start_up_builds_took() -> None:
    """The truth's rebuild and regroup costs, measured with its noise at start-up, seed the
    controller's estimator; the planner's model itself is not told them."""
    run = _Run(_scenario(SHIPPED[0], steps=4, seed=3), "nereus", 0.5)
    run.step(0, None)
    assert run.controller is not None
    w = run.controller.estimator.weights  # type: ignore[attr-defined]
    assert w[0] == 1.0
    plan = run.controller.plan
    engines = [engine_of(plan, c.model_stage, run.s.models) for c in plan.candidates]
    gen = [build_seconds(e, False, PARAMS) for e in engines if e.stage == "gen"]  # compile caches cold
    groups = [g for g in (regroup_seconds(e, PARAMS) for e in engines) if g > 0]
    assert w[1] == pytest.approx(sum(gen) / len(gen), rel=0.15)
    assert w[2] == pytest.approx(PARAMS.module_setup_s, rel=0.15)  # inference and training engines
    assert w[3] == pytest.approx(sum(groups) / len(groups), rel=0.15)


def test_moves_are_priced_near_what_they_take_from_the_first_one_on() -> None:
    """The moves nereus makes on the shipped traces are priced near their true seconds from the
    first one on: the first within 1.5×, four in five within 1.5×, every one within 2×. Unseeded,
    the first (an urgent move rebuilding engines) was priced 0.2 s and took 16 s, and what that
    one taught overpriced a later one 2.8×. (Not every one within 1.5×: in truth a communicator's
    init grows with its ranks (``sim/truth/engines.py``), while the estimator counts regroups, so a
    move onto a pool larger than the start-up's regroups slower than the start-up taught — 0.64×
    priced on a 32 s move — until measured moves refit the weight; and a fixed cost few moves
    pay is fitted from those few.)"""
    priced = []
    for path in SHIPPED:
        run = _Run(_scenario(path, steps=24, seed=11), "nereus", 0.5)
        prev = None
        for k in range(24):
            record, prev = run.step(k, prev)
            d = record.decision
            for move in (t for t in record.transitions if t.kind.value == "move" and t.seconds > 0):
                assert d is not None and not d.get("sunk_rebuilds")
                priced.append((path.stem, k, d["l_tran_s"], move.seconds))
    assert len(priced) >= 6, priced
    near = [2 / 3 <= p / s <= 1.5 for *_, p, s in priced]
    firsts = [next(i for i, x in enumerate(priced) if x[0] == path.stem) for path in SHIPPED]
    assert all(near[i] for i in firsts), priced
    assert sum(near) >= 0.8 * len(near), priced
    assert all(1 / 2 <= p / s <= 2.0 for *_, p, s in priced), priced
