"""Failure domains: reserved and revocable GPUs, reserved-first placement of trainers, and the
restart risk admission prices (issue 19)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest

from nereus.cli import main
from nereus.control.admission import Decision, Option, Profit, Rule, Verdict, admit, restart_instead
from nereus.control.controller import Controller
from nereus.control.reserved import fitting_layouts, reserved_option
from nereus.control.risk import last_copy_loss, lost_work
from nereus.control.transition_cost import TransitionEstimate
from nereus.errors import ConfigError
from nereus.plan.candidates import Shape
from nereus.plan.evaluate import shapes_of
from nereus.plan.layout import Layout, Plan
from nereus.plan.placement import place
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import search
from nereus.sim import GpuSupply, SpotTrace
from nereus.spec import Stage, load_cluster
from nereus.spec.domains import MAX_COUNT_CELLS, FailureDomains, _all_drawn
from nereus.spec.registry import config_root
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def _trainer_replicas(plan: Plan) -> dict[str, list[tuple[int, ...]]]:
    return {
        c.model_stage: [c.replica_gpus(r) for r in range(c.dp)]
        for c in plan.candidates
        if plan.stage_of(c) is Stage.TRAIN
    }


def _with(problem: PlanningProblem, domains: FailureDomains | None, **kw: object) -> PlanningProblem:
    return dataclasses.replace(problem, domains=domains, **kw)  # type: ignore[arg-type]


def test_domains_validate_and_price_losses() -> None:
    d = FailureDomains(frozenset(range(4)), 2, 3.0)
    assert d.on_reserved((0, 3)) and not d.on_reserved((3, 4))
    assert d.revocable_instances((0, 4, 5, 7)) == {2, 3}
    assert d.all_lost_probability([(0, 1)], 3600.0) == 0.0  # reserved GPUs are never revoked
    assert d.all_lost_probability([(4, 5)], 3600.0) == pytest.approx(1 - math.exp(-3.0))
    assert d.all_lost_probability([(4, 6)], 3600.0) == pytest.approx(1 - math.exp(-6.0))  # two instances
    # both replicas must fail; one on reserved GPUs never does
    assert d.all_lost_probability([(4, 5), (6, 7)], 600.0) == pytest.approx((1 - math.exp(-0.5)) ** 2)
    assert d.all_lost_probability([(4, 5), (0, 1)], 600.0) == 0.0
    assert FailureDomains(frozenset(), 2, 0.0).all_lost_probability([(4,)], 1e6) == 0.0  # rate unknown
    for bad in ({"gpus_per_instance": 0}, {"revocations_per_hour": -1.0}, {"revocations_per_hour": math.nan}):
        with pytest.raises(ValueError):
            FailureDomains(**{"reserved": frozenset(), "gpus_per_instance": 2, **bad})  # type: ignore[arg-type]


def test_cluster_yaml_marks_reserved_nodes(tmp_path: Path) -> None:
    a100 = load_cluster("a100-64gb-hdr100")
    assert a100.failure_domains() is None  # nothing revocable unless the YAML says so
    marked = dataclasses.replace(a100, reserved_nodes=2, revocations_per_node_hour=0.5)
    d = marked.failure_domains()
    assert d is not None and d.reserved == frozenset(range(8)) and d.gpus_per_instance == 4
    with pytest.raises(ValueError, match="reserved_nodes must be in"):
        dataclasses.replace(a100, reserved_nodes=a100.nodes + 1)
    with pytest.raises(ValueError, match="revocations_per_node_hour"):
        dataclasses.replace(a100, revocations_per_node_hour=-1.0)
    src = Path("configs/clusters/a100-64gb-hdr100.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(src + "\nreserved_nodes: many\n")
    with pytest.raises(ConfigError, match="reserved_nodes"):
        type(a100).from_yaml(bad)


def test_placement_puts_a_replica_of_every_trainer_on_reserved_gpus() -> None:
    problem = make_problem("llama-125m", gpus=32, response=1024)  # trainers: 4 replicas of 4 GPUs
    reserved = frozenset(range(24, 32))  # the last two nodes: not where best fit starts
    domains = FailureDomains(reserved, 4, 2.0)
    bare = _trainer_replicas(search(problem).plan)
    assert not all(any(set(r) <= reserved for r in reps) for reps in bare.values())  # not by luck
    plan = search(_with(problem, domains)).plan
    trainers = _trainer_replicas(plan)
    assert trainers and all(any(set(r) <= reserved for r in reps) for reps in trainers.values()), trainers
    # the same shapes as without domains: placement changes where, never what
    assert {c.model_stage: (c.layout, c.dp) for c in plan.candidates} == {
        c.model_stage: (c.layout, c.dp) for c in search(problem).plan.candidates
    }
    assert last_copy_loss(plan, domains, 100.0) == 0.0


def test_placement_keeps_the_running_reserved_replica_and_falls_back_when_none_fits() -> None:
    problem = make_problem("llama-125m", gpus=32, response=1024)
    domains = FailureDomains(frozenset(range(24, 32)), 4, 2.0)
    running = search(_with(problem, domains)).plan
    again = search(_with(problem, domains, anchor=running)).plan
    for name, reps in _trainer_replicas(running).items():
        on_reserved = [r for r in reps if set(r) <= domains.reserved]
        assert set(on_reserved) <= set(_trainer_replicas(again)[name])  # nothing moved for it
    tiny = FailureDomains(frozenset({31}), 4, 2.0)  # no trainer replica fits on one GPU
    plan = search(_with(problem, tiny)).plan
    sizes = [len(r) for reps in _trainer_replicas(plan).values() for r in reps]
    assert min(sizes) > 1 and last_copy_loss(plan, tiny, 100.0) > 0.0


def test_restart_risk_grows_with_exposure() -> None:
    problem = make_problem(gpus=32, response=1024)
    plan = search(problem).plan  # placed without domains
    everything_revocable = FailureDomains(frozenset(), 4, 2.0)
    short, long = (last_copy_loss(plan, everything_revocable, s) for s in (10.0, 1000.0))
    assert 0.0 < short < long < 1.0
    assert last_copy_loss(plan, FailureDomains(frozenset(range(32)), 4, 2.0), 1e9) == 0.0
    job = (problem.workload, problem.models, problem.cluster, plan)
    bare = Controller(*job)  # the cluster YAML marks nothing revocable
    assert bare.domains is None and bare.options.risk(plan, 1000.0, problem) == 0.0
    exposed = Controller(*job, domains=everything_revocable)
    restart = exposed.options.restart_seconds(plan, problem)
    lost = lost_work(plan, everything_revocable, 1000.0)  # the step's own work, lost with any GPU
    assert lost > 0
    assert exposed.options.risk(plan, 1000.0, problem) == pytest.approx(lost + long * restart)


def test_admission_weighs_the_restart_a_faster_plan_risks() -> None:
    plan = search(make_problem(gpus=16, response=1024)).plan
    est = TransitionEstimate(1.0, 0.0, True)
    rule = Rule(Profit.ANY_GAIN)
    exposed = Option("target", plan, 90.0, risk_s=15.0)  # 10 s faster, 15 s of expected restarts
    index, reason = admit(rule, 100.0, [exposed], [est], 10.0, urgent=False)
    assert index is None and "no gain" in reason
    safe = Option("target", plan, 90.0, risk_s=0.0)
    assert admit(rule, 100.0, [safe], [est], 10.0, urgent=False)[0] == 0


def test_supply_knows_its_reserved_floor_and_revocation_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [4, 4, 2, 2, 4, 4]}))
    supply = GpuSupply(SpotTrace.load(path), gpus_per_instance=2, max_gpus=8, min_gpus=2)
    d = supply.domains()
    assert d.reserved == frozenset({0, 1}) and d.gpus_per_instance == 2
    # revocable instances held per tick: 3 3 1 1 3 3 → 2 revoked over 11 instance-ticks of 300 s
    assert d.revocations_per_hour == pytest.approx(2 / (11 * 300 / 3600))
    faster = dataclasses.replace(supply, speedup=4.0)  # trace time runs 4× faster: 4× the rate
    assert faster.domains().revocations_per_hour == pytest.approx(4 * d.revocations_per_hour)
    assert all(g in supply.pool_at(t) for t in (0.0, 700.0, 1e6) for g in d.reserved)


def test_age_counts_split_a_traces_ticks_by_the_pools_age(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [4, 4, 2, 2, 4, 4, 4, 3]}))
    supply = GpuSupply(SpotTrace.load(path), gpus_per_instance=1, max_gpus=8, min_gpus=1)
    # revocable held per tick: 3 3 1 1 3 3 3 2; ages 0 1 0 1 0 1 2 → bins 0, 1, 2–3
    exposed, drops = supply.age_counts()
    assert exposed[:3] == [3, 3, 1] and drops[:3] == [0, 1, 1] and sum(exposed) == 7
    for cut in range(8):  # a window's counts keep the ages the whole trace gives its ticks
        a, b = supply.age_counts(0, cut), supply.age_counts(cut)
        assert [x + y for x, y in zip(a[0], b[0], strict=True)] == exposed
        assert [x + y for x, y in zip(a[1], b[1], strict=True)] == drops


def test_when_reserved_gpus_hold_one_trainer_the_most_exposed_gets_them() -> None:
    """8 reserved GPUs, two trainers of 8-GPU replicas: the critic with one replica (lost with any
    of its instances) gets them, not the actor with two (both must be lost) — even when the
    actor's replica already sits there."""
    problem = make_problem("llama-125m", gpus=32, response=1024)
    shapes = shapes_of(search(problem).plan)
    shapes["actor.train"] = Shape(Layout(4, 2), 2, shapes["actor.train"].micro_batch)
    shapes["critic.train"] = Shape(Layout(4, 2), 1, shapes["critic.train"].micro_batch)
    domains = FailureDomains(frozenset(range(8)), 2, 1.0)
    wf, mode = problem.workflow, problem.workload.mode
    plan = place(wf, mode, shapes, problem.pool, 4, domains=domains)
    assert set(plan.candidate("critic.train").gpus) == set(range(8))
    held = place(wf, mode, {**shapes, "critic.train": Shape(Layout(4, 2), 1, 1)}, problem.pool, 4)
    running = place(wf, mode, shapes, problem.pool, 4, anchor=held)  # actor's replica 0 on GPUs 0-7
    assert running.candidate("actor.train").replica_gpus(0) == tuple(range(8))
    again = place(wf, mode, shapes, problem.pool, 4, anchor=running, domains=domains)
    assert set(again.candidate("critic.train").gpus) == set(range(8))
    assert last_copy_loss(again, domains, 60.0) < last_copy_loss(running, domains, 60.0)


def test_a_restart_is_admitted_when_nothing_moves_in_place_and_it_pays_back() -> None:
    plan = search(make_problem(gpus=16, response=1024)).plan
    base = Decision(3, 0.0, (), False, Verdict.KEEP, "", 150.0)
    target = Option("target", plan, 100.0)
    payback = Rule(Profit.PAYBACK, 0.5)
    got = restart_instead(payback, base, target, "no source", 150.0, 100.0, horizon=4.0)
    assert got is not None and got.verdict is Verdict.RESTART and got.target is plan
    assert got.payback_steps == pytest.approx(2.0) and got.l_tran_s == 100.0 and "no source" in got.reason
    assert restart_instead(payback, base, target, "no source", 150.0, 100.0, horizon=3.0) is None
    # a switch policy restarts only towards a faster plan
    assert restart_instead(Rule(Profit.SWITCH), base, target, "x", 90.0, 10.0, horizon=1.0) is None


def test_correlated_revocations_take_replicas_together(tmp_path: Path) -> None:
    """Spot capacity goes in bursts: an event taking every revocable instance loses all replicas
    at once, however many there are; one taking a single instance never loses two replicas."""
    replicas = [(4, 5), (6, 7)]  # two replicas on two revocable instances of 2 GPUs
    burst = FailureDomains(frozenset(range(4)), 2, 0.0, 2.0, (1.0,))
    assert burst.correlated and burst.at_risk
    assert burst.all_lost_probability(replicas, 1800.0, held=2) == pytest.approx(1 - math.exp(-1.0))
    single = FailureDomains(frozenset(range(4)), 2, 0.0, 2.0, (0.5,))  # one of the two per event
    assert single.all_lost_probability(replicas, 1800.0, held=2) == 0.0
    assert single.all_lost_probability([(4, 5)], 1800.0, held=2) == pytest.approx(1 - math.exp(-0.5))
    assert burst.all_lost_probability([(0, 1), (4, 5)], 1800.0, held=2) == 0.0  # one on reserved
    with pytest.raises(ValueError, match="event_fractions"):
        FailureDomains(frozenset(), 2, 0.0, 1.0, (0.0,))
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [4, 4, 2, 2, 4, 4]}))
    supply = GpuSupply(SpotTrace.load(path), gpus_per_instance=2, max_gpus=8, min_gpus=2)
    events, fractions = supply.revocation_events()  # revocable held 3 3 1 1 3 3: one drop, 2 of 3
    assert fractions == pytest.approx((2 / 3,)) and events == pytest.approx(1 / (5 * 300 / 3600))
    assert supply.domains().event_fractions == fractions
    # a window of ticks [first, end): the drop after tick 1 is inside [0, 2), not [2, end)
    events, fractions = supply.revocation_events(0, 2)
    assert fractions == pytest.approx((2 / 3,)) and events == pytest.approx(1 / (2 * 300 / 3600))
    assert supply.revocation_events(2) == (0.0, ())


@pytest.mark.parametrize(
    ("total", "sizes", "drawn"),
    [(7, [1, 2], 3), (8, [2, 2, 1], 4), (9, [3, 3], 5), (6, [1, 1, 1], 3), (10, [2, 3, 1], 6), (5, [2], 0)],
)
def test_an_event_takes_every_replica_as_often_as_counting_says(
    total: int, sizes: list[int], drawn: int
) -> None:
    """The chance that ``drawn`` random instances hit every replica's (disjoint) instances, against
    counting every subset."""
    sets, start = [], 0
    for m in sizes:
        sets.append(set(range(start, start + m)))
        start += m
    picks = list(itertools.combinations(range(total), drawn))
    hit = sum(all(s & set(p) for s in sets) for p in picks) / len(picks)
    assert _all_drawn(total, sizes, drawn) == pytest.approx(hit, rel=1e-9, abs=1e-300)


@pytest.mark.timeout(20)
def test_an_event_in_a_pool_of_a_hundred_thousand_instances_is_priced_at_once() -> None:
    """At 10⁵ instances (exact integers of 10⁵ bits took seconds a call), 60 replicas of 8: near
    the binomial draw of the drawn fraction; and at 5,000, the exact inclusion–exclusion in integers
    (r equal sets: Σ_j (−1)^j C(r, j) C(total − j·m, drawn) / C(total, drawn))."""
    for p in (0.8, 0.3):
        got = _all_drawn(100_000, [8] * 60, int(p * 100_000))
        assert got == pytest.approx((1 - (1 - p) ** 8) ** 60, rel=5e-3)
    assert _all_drawn(100_000, [8] * 60, 59) == 0.0  # fewer picks than replicas
    # large sets and few draws (the terms that matter are far from the count's peak): exact integers
    for total, r, m, drawn in [(5_000, 30, 4, 1_500), (12_500, 2, 1_000, 10), (5_000, 4, 300, 30),
                               (100_000, 2, 1_024, 200), (100_000, 4, 512, 400)]:  # fmt: skip
        exact = sum((-1) ** j * math.comb(r, j) * math.comb(total - j * m, drawn) for j in range(r + 1))
        want = exact / math.comb(total, drawn)
        assert _all_drawn(total, [m] * r, drawn) == pytest.approx(want, rel=1e-8), (total, r, m, drawn)


def test_past_the_exact_counts_budget_the_risk_is_bounded_above() -> None:
    """Too large a count for ``MAX_COUNT_CELLS``: the replicas as if hit independently, which
    under sampling without replacement is an upper bound, so a risk is never under-priced."""
    total, sizes, drawn = 100_000, [1_024] * 64, 3_000
    assert sum(sizes) * (drawn + 1) > MAX_COUNT_CELLS
    bound = _all_drawn(total, sizes, drawn)
    assert bound == pytest.approx(
        math.prod(1 - math.comb(total - 1024, drawn) / math.comb(total, drawn) for _ in sizes)
    )
    small = 20_000, [64] * 8, 500  # within the budget: the exact count is below the bound
    independent = math.prod(
        1 - math.comb(small[0] - 64, small[2]) / math.comb(small[0], small[2]) for _ in range(8)
    )
    assert _all_drawn(*small) < independent


def test_a_long_history_prices_each_distinct_fraction_once() -> None:
    """A trace of many ticks holds thousands of events but few distinct fractions: the risk is the
    per-event mean over all of them, computed once per fraction (a 2·10⁵-tick trace without a
    floor took a minute per policy when every event was priced on every plan)."""
    fractions = tuple([0.25] * 30_000 + [0.5] * 20_000 + [1.0] * 10_000)
    many = FailureDomains(frozenset(range(4)), 2, 0.0, 2.0, fractions)
    assert many.fraction_counts == ((0.25, 30_000), (0.5, 20_000), (1.0, 10_000))
    few = FailureDomains(frozenset(range(4)), 2, 0.0, 2.0, (0.25, 0.25, 0.25, 0.5, 0.5, 1.0))
    replicas, gpus = [(4, 5), (6, 7)], (4, 5, 8, 9)
    for held in (2, 4, 7):
        assert many.all_lost_probability(replicas, 1800.0, held) == pytest.approx(
            few.all_lost_probability(replicas, 1800.0, held), rel=1e-12
        )
        assert many.any_lost_probability(gpus, 1800.0, held) == pytest.approx(
            few.any_lost_probability(gpus, 1800.0, held), rel=1e-12
        )
    assert many.any_lost_probability(gpus, 1800.0, 4) > 0.0


def test_fitting_layouts_shrink_the_largest_trainer_pipeline_first() -> None:
    """One replica of every trainer must fit the reserved GPUs together: the largest replica
    shrinks first, its pipeline halved before its tensor parallelism; None where they already fit
    or where fewer GPUs are reserved than there are trainers."""
    problem = make_problem(gpus=32, response=1024)
    plan = search(problem).plan
    sizes = {n: reps[0] for n, reps in _trainer_replicas(plan).items()}
    assert {len(r) for r in sizes.values()} == {16}  # tp4·pp4 each: 32 GPUs, more than reserved
    got = fitting_layouts(plan, problem.pool, FailureDomains(frozenset(range(24, 32)), 4, 2.0))
    assert got == {"actor.train": Layout(4, 1), "critic.train": Layout(4, 1)}
    got = fitting_layouts(plan, problem.pool, FailureDomains(frozenset(range(20, 32)), 4, 2.0))
    assert got == {"actor.train": Layout(4, 1), "critic.train": Layout(4, 2)}  # 12 GPUs: 4 + 8
    assert fitting_layouts(plan, problem.pool, FailureDomains(frozenset(range(32)), 4, 2.0)) is None
    assert fitting_layouts(plan, problem.pool, FailureDomains(frozenset({31}), 4, 2.0)) is None
    assert fitting_layouts(plan, (), FailureDomains(frozenset(range(24, 32)), 4, 2.0)) is None


@pytest.mark.parametrize(("rate", "first"), [(5.0, "reserved"), (0.05, "target"), (50.0, "floor")])
def test_a_plan_keeping_every_trainer_copy_on_reserved_gpus_is_offered(rate: float, first: str) -> None:
    """The fastest plan's trainers (16 GPUs each) cannot keep a copy on 8 reserved GPUs, so a
    revocation may take their last copy. The controller also offers the best plan whose trainer
    layouts fit there ("reserved", no restart risk), before the target when its expected step
    (latency plus what it risks) is the shorter — at a high revocation rate — and after it
    otherwise; and the best plan on the reserved GPUs alone ("floor", no risk at all), first
    when revocations are so frequent that steps on revocable GPUs rarely complete."""
    problem = make_problem(gpus=32, response=1024)
    domains = FailureDomains(frozenset(range(24, 32)), 4, rate)
    plan = search(_with(problem, domains)).plan
    controller = Controller(problem.workload, problem.models, problem.cluster, plan, domains=domains)
    options = controller._options(controller.problem(problem.pool, problem.seq))
    by = {o.label: o for o in options}
    target, safe, floor = by["target"], by["reserved"], by["floor"]
    assert target.risk_s > safe.risk_s > 0.0  # the reserved option still loses a step's work
    assert last_copy_loss(safe.plan, domains, safe.step_latency_s) == 0.0
    assert last_copy_loss(target.plan, domains, target.step_latency_s) > 0.0
    trainers = _trainer_replicas(safe.plan)
    assert all(any(set(r) <= domains.reserved for r in reps) for reps in trainers.values())
    assert safe.step_latency_s > target.step_latency_s  # slower, but safe
    assert floor.risk_s == 0.0 and {g for c in floor.plan.candidates for g in c.gpus} <= domains.reserved
    assert floor.step_latency_s > safe.step_latency_s
    assert options[0].label == min((target, safe, floor), key=lambda o: o.expected_s).label == first


def test_no_reserved_option_without_risk_or_under_a_policys_own_holds() -> None:
    problem = make_problem(gpus=32, response=1024)
    plan = search(problem).plan
    bare = Controller(problem.workload, problem.models, problem.cluster, plan)  # nothing revocable
    assert "reserved" not in {o.label for o in bare._options(bare.problem(problem.pool, problem.seq))}
    domains = FailureDomains(frozenset(range(24, 32)), 4, 20.0)
    held = {c.model_stage: c.layout for c in plan.candidates}
    exposed = Controller(problem.workload, problem.models, problem.cluster, plan, domains=domains)
    static = exposed.problem(problem.pool, problem.seq)
    static = dataclasses.replace(static, space=static.space.holding(held))  # a static policy's holds
    best = exposed._options(static)[0]
    assert best.risk_s > 0 and reserved_option(static, best, domains, exposed.options.plan) is None


def test_nereus_plan_places_with_the_cluster_yamls_reserved_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``nereus plan`` places as the job's controller does: with ``reserved_nodes: 1`` each
    trainer keeps one replica on node 0 (without it both of the actor's sit there)."""

    def trainers(cluster: str) -> dict[str, list[list[int]]]:
        argv = ["plan", "--model", "llama-3.1-8b", "--algo", "ppo", "--cluster", cluster, "--gpus", "16"]
        assert main([*argv, "--seq-len", "1024", "--json"]) == 0
        stages = json.loads(capsys.readouterr().out)["stages"]
        out = {}
        for s in stages:
            if s["name"].endswith(".train"):
                n = s["tp"] * s["pp"]
                out[s["name"]] = [s["gpus"][i * n : (i + 1) * n] for i in range(s["dp"])]
        return out

    text = (config_root() / "clusters" / "h100-ib.yaml").read_text()
    (tmp_path / "spot.yaml").write_text(text + "reserved_nodes: 1\n")
    spot = trainers(str(tmp_path / "spot.yaml"))
    assert all(any(max(r) < 8 for r in replicas) for replicas in spot.values()), spot
    plain = trainers("h100-ib")
    assert not all(any(max(r) < 8 for r in replicas) for replicas in plain.values()), plain
    (tmp_path / "rate.yaml").write_text(text + "revocations_per_node_hour: 5\n")
    with pytest.raises(ConfigError, match="revocations_per_node_hour needs reserved_nodes"):
        load_cluster(str(tmp_path / "rate.yaml"))
