"""A transition's fixed costs start from the job's own start-up builds (``FixedCosts``).

Before any move was measured, the estimator priced engine rebuilds and regroups at zero, so a
first move was priced about 10× too cheap (4.6 s predicted, 58 s taken). The job measures what
building its engines and groups took at start-up; the estimator starts from those seconds and a
measured transition takes over from there.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from nereus.control.transition_cost import WARM, DagEstimator, FixedCosts, TransitionEstimate, communicators
from nereus.plan.layout import Layout
from nereus.plan.problem import SearchSpace
from nereus.plan.search import search
from nereus.sim.engine import _Run
from nereus.sim.moving import engine_of
from nereus.sim.truth import PARAMS
from nereus.sim.truth.engines import build_seconds, regroup_seconds
from nereus.spec.workload import Stage
from tests.helpers import make_problem
from tests.test_simulate import SHIPPED, _scenario

pytestmark = pytest.mark.pure

G, INF, T = Stage.GEN, Stage.INF, Stage.TRAIN


def test_fixed_costs_average_each_kind_over_the_model_stages_that_built_one() -> None:
    one = (1, 1, 4)  # every model-stage forms one DP communicator of 4 ranks
    f = FixedCosts.of([G, INF, INF, T], [30.0, 6.0, 0.0, 10.0], [1.0, 2.0, 3.0, 2.0], [one] * 4)
    assert f.gen_rebuild_s == 30.0
    assert f.other_rebuild_s == pytest.approx(8.0)  # the inference engine not built here is not a 0
    assert f.communicator_s == pytest.approx(2.0) and f.per_rank_s is None  # one width: no b
    none = FixedCosts.of([INF, T], [5.0, 7.0], [0.0, 0.0], [one, one])
    assert none.gen_rebuild_s is None and none.communicator_s is None and none.other_rebuild_s == 6.0
    single = FixedCosts.of([INF], [5.0], [0.3], [(1, 1, 1)])  # one GPU: no communicator to learn from
    assert single.communicator_s is None


def test_fixed_costs_split_a_communicator_into_its_handshake_and_its_ranks() -> None:
    """Forming a communicator costs a + b · ranks: a start-up whose model-stages form
    communicators of different widths tells a and b apart (one per parallel dimension wider than
    one rank, joined in turn)."""
    a, b = 0.4, 0.02
    degrees = [(8, 1, 4), (1, 1, 64), (2, 2, 1), (4, 1, 1)]
    group_s = [sum(a + b * d for d in g if d > 1) for g in degrees]
    f = FixedCosts.of([G, INF, T, INF], [9.0, 1.0, 1.0, 1.0], group_s, degrees)
    assert f.communicator_s == pytest.approx(a) and f.per_rank_s == pytest.approx(b)
    assert communicators((8, 1, 4)) == (2, 12) and communicators((1, 1, 1)) == (0, 0)
    assert "+ 20.00 ms per rank" in f.describe()


def test_a_wide_regroup_is_priced_above_a_narrow_one() -> None:
    """Seeded with a and b, regrouping a model-stage whose DP spans 256 ranks is priced at what
    its 256-rank communicator costs, not at a count of regrouped model-stages."""
    e = DagEstimator()
    e.seed(FixedCosts(30.0, 1.0, 0.5, 0.05))
    narrow = TransitionEstimate(1.0, 0.0, True, features=(1.0, 0.0, 0.0, 2.0, 12.0, 0.0))  # tp 8, dp 4
    wide = TransitionEstimate(1.0, 0.0, True, features=(1.0, 0.0, 0.0, 1.0, 256.0, 0.0))  # dp 256
    assert float(e.weights @ narrow.features) == pytest.approx(1.0 + 2 * 0.5 + 12 * 0.05)
    assert float(e.weights @ wide.features) == pytest.approx(1.0 + 0.5 + 256 * 0.05)
    with pytest.raises(ValueError, match="features needs 6 values"):
        TransitionEstimate(1.0, 0.0, True, features=(1.0, 0.0, 0.0, 1.0))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_fixed_costs_refuse_what_is_not_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match=r"FixedCosts\.gen_rebuild_s"):
        FixedCosts(bad, 1.0, 1.0)
    with pytest.raises(ValueError, match="3 stages, 2 build times"):
        FixedCosts.of([G, INF, T], [1.0, 2.0], [1.0, 1.0, 1.0], [(1, 1, 2)] * 3)
    with pytest.raises(ValueError, match=r"FixedCosts\.per_rank_s"):
        FixedCosts(1.0, 1.0, 1.0, -0.1)


def test_a_seeded_estimator_prices_rebuilds_until_transitions_measure_them() -> None:
    rebuild = TransitionEstimate(2.0, 0.0, True, features=(2.0, 1.0, 1.0, 2.0, 8.0, 0.0))
    e = DagEstimator()
    assert float(e.weights @ rebuild.features) == pytest.approx(2.0)  # unseeded: rebuilds are free
    e.seed(FixedCosts(30.0, 8.0, None))
    assert float(e.weights @ rebuild.features) == pytest.approx(2.0 + 30.0 + 8.0)  # regroups unmeasured
    for _ in range(4):  # in truth, a generation rebuild costs 12 s here and a communicator 1 s
        e.observe(rebuild, 2.0 + 12.0 + 8.0 + 2.0)
    learned = e.weights.copy()
    assert float(learned @ rebuild.features) == pytest.approx(24.0, rel=0.05)
    e.seed(FixedCosts(60.0, 60.0, 60.0, 1.0))  # a later start-up (a restart) does not undo what was learned
    assert (e.weights[:WARM] == learned[:WARM]).all()  # (no warm rebuild was measured: its seed moves)
    assert (e.weights >= 0).all()


def test_a_generation_engine_rebuilt_in_a_layout_the_job_built_before_is_priced_warm() -> None:
    """vLLM's compile cache outlives an engine: rebuilding the generation engine in a layout the
    job built before is warm, priced apart from a cold rebuild (from a cold one's seconds until a
    warm one is measured), and learning what a warm one takes leaves the cold price as it was."""
    problem = make_problem(model="llama-3.1-8b", cluster="a100-80gb-dgx", gpus=16, response=1024)
    start = search(problem).plan
    gen = next(c for c in start.candidates if start.stage_of(c) is G)
    other = next(lay for lay in (Layout(1, 1), Layout(2, 1), Layout(4, 1)) if lay != gen.layout)
    moved = search(replace(problem, space=SearchSpace(fixed_layouts=((gen.model_stage, other),)))).plan
    e = DagEstimator()
    e.seed(FixedCosts(40.0, 2.0, 0.5))
    e.built(start)
    there, back = e.estimate(problem, start, moved), e.estimate(problem, moved, start)
    assert (there.features[1], there.features[WARM]) == (1.0, 0.0)  # a layout never built: cold
    assert (back.features[1], back.features[WARM]) == (0.0, 1.0)  # the start-up's layout: warm
    assert back.seconds - back.features[0] * e.weights[0] == pytest.approx(
        there.seconds - there.features[0] * e.weights[0], abs=2.0 + 0.5 * 8 + 1e-9
    )  # unmeasured, a warm rebuild is priced as a cold one (the regroups may differ)
    warm = TransitionEstimate(2.0, 0.0, True, features=(2.0, 0.0, 0.0, 0.0, 0.0, 1.0))
    cold = TransitionEstimate(2.0, 0.0, True, features=(2.0, 1.0, 0.0, 0.0, 0.0, 0.0))
    for _ in range(3):  # in truth a warm rebuild takes half a cold one
        e.observe(warm, 2.0 + 20.0)
    assert float(e.weights @ warm.features) == pytest.approx(22.0, rel=0.1)
    assert float(e.weights @ cold.features) == pytest.approx(42.0, rel=0.05)


def test_the_simulated_job_tells_its_controller_what_its_start_up_builds_took() -> None:
    """The truth's rebuild and regroup costs, measured with its noise at start-up, seed the
    controller's estimator; the planner's model itself is not told them."""
    run = _Run(_scenario(SHIPPED[0], steps=4, seed=3), "nereus", 0.5)
    run.step(0, None)
    assert run.controller is not None
    w = run.controller.estimator.weights  # type: ignore[attr-defined]
    assert w[0] == pytest.approx(1.0)
    plan = run.controller.plan
    engines = [engine_of(plan, c.model_stage, run.s.models) for c in plan.candidates]
    gen = [build_seconds(e, False, PARAMS) for e in engines if e.stage == "gen"]  # compile caches cold
    assert w[1] == pytest.approx(sum(gen) / len(gen), rel=0.15)
    assert w[2] == pytest.approx(PARAMS.module_setup_s, rel=0.15)  # inference and training engines
    # a and b of a communicator reproduce what forming the start-up's groups took, in all
    degrees = [(c.layout.tp, c.layout.pp, c.dp) for c in plan.candidates]
    fitted = sum(w[3] * n + w[4] * r for n, r in map(communicators, degrees))
    assert fitted == pytest.approx(sum(regroup_seconds(e, PARAMS) for e in engines), rel=0.15)


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
