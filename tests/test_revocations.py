"""The revocation rate a job learns from its own pool (``nereus.control.revocations``): a cluster
YAML states revocable nodes and at best a flat rate; the job's telemetry shows which nodes it
held and which left, and by how long the pool had been unchanged when they did."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.control.controller import Controller
from nereus.control.revocations import AGE_BINS_S, PRIOR_HOURS, RevocationHistory
from nereus.control.telemetry import Telemetry
from nereus.plan.search import search
from nereus.spec.domains import FailureDomains
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

NODE = 4  # GPUs per node
RESERVED = frozenset(range(8))  # nodes 0 and 1
ALL = tuple(range(32))  # nodes 0-7: six revocable


def _tel(step: int, time_s: float, pool: tuple[int, ...]) -> Telemetry:
    return Telemetry(step, time_s, 1024.0, 1200.0, pool)


def _without(*nodes: int) -> tuple[int, ...]:
    return tuple(g for g in ALL if g // NODE not in nodes)


def test_with_nothing_seen_the_yaml_rate_holds() -> None:
    h = RevocationHistory(FailureDomains(RESERVED, NODE, 0.5))
    assert h.rate_per_hour() == pytest.approx(0.5) and h.age_factors() == ()
    h.observe(_tel(0, 0.0, ALL))
    assert h.domains().revocations_per_hour == pytest.approx(0.5)


def test_losses_and_hours_held_move_the_rate_from_its_prior() -> None:
    """Six revocable nodes for 10 hours, one lost: (1 + 0.1 · 24) / (60 + 24) per node-hour. A
    reserved node leaving is not a revocation, nor are hours on reserved nodes exposure."""
    h = RevocationHistory(FailureDomains(RESERVED, NODE, 0.1))
    for k in range(21):  # a step every half hour
        h.observe(_tel(k, 1800.0 * k, ALL))
    h.observe(_tel(21, 1800.0 * 20.0001, _without(7)))
    assert sum(h.lost) == 1
    expected = (1 + 0.1 * PRIOR_HOURS) / (6 * 10.0001 + PRIOR_HOURS)
    assert h.rate_per_hour() == pytest.approx(expected, rel=1e-4)
    h.observe(_tel(22, 1800.0 * 21, _without(7, 0)))  # reserved node 0 goes: not counted
    assert sum(h.lost) == 1


def test_a_node_the_launcher_drains_is_not_revoked() -> None:
    h = RevocationHistory(FailureDomains(RESERVED, NODE, 0.0))
    h.observe(_tel(0, 0.0, ALL))
    h.draining(_without(6, 7))
    h.observe(_tel(1, 600.0, _without(6, 7)))
    assert sum(h.lost) == 0 and h.rate_per_hour() == 0.0  # rate unknown, nothing revoked: still 0
    h.observe(_tel(2, 1200.0, _without(5, 6, 7)))  # then one leaves by itself
    assert sum(h.lost) == 1 and h.rate_per_hour() > 0


def test_a_node_revoked_and_replaced_within_a_step_is_a_revocation() -> None:
    """The pool is whole at both ends of the step, but node 6's workers died in between
    (``Telemetry.lost``): that is a revocation, and the pool changed then. GPUs of a reserved node
    in ``lost`` are not."""
    h = RevocationHistory(FailureDomains(RESERVED, NODE, 0.0))
    h.observe(_tel(0, 0.0, ALL))
    h.observe(dataclasses.replace(_tel(1, 600.0, ALL), lost=(24, 25, 26, 27, 0)))
    assert sum(h.lost) == 1 and h.rate_per_hour() > 0 and h._changed_s == 600.0


def test_losses_right_after_changes_make_early_ages_riskier() -> None:
    """The pool changes, a node is lost within the first minute; later, hours of calm: the
    first bin's factor is above 1, the calm bins below."""
    h = RevocationHistory(FailureDomains(RESERVED, NODE, 0.0))
    t, pool, k = 0.0, ALL, 0
    for cycle in range(6):
        h.observe(_tel(k, t, pool))
        k, t = k + 1, t + 30.0
        lost = 7 - cycle % 2  # node 7 or 6 goes 30 s after the pool changed
        pool = _without(lost)
        h.observe(_tel(k, t, pool))
        for _ in range(12):  # then 2 h calm at 10-min steps
            k, t = k + 1, t + 600.0
            h.observe(_tel(k, t, pool))
        k, t, pool = k + 1, t + 600.0, ALL  # it comes back
    factors = dict(h.age_factors())
    assert list(factors) == list(AGE_BINS_S)
    assert factors[0.0] > 2.0 and factors[AGE_BINS_S[-1]] < 1.0
    # shrunk toward 1: a bin with no hours held says nothing
    assert factors[60.0] == 1.0  # (0 lost + PRIOR_EVENTS) / (0 expected + PRIOR_EVENTS)
    with pytest.raises(ValueError, match="age bins"):
        RevocationHistory(FailureDomains(RESERVED, NODE, 0.0), (10.0, 20.0))


def test_a_controller_on_a_yaml_cluster_prices_what_it_has_seen() -> None:
    """A cluster YAML marks two reserved nodes, rate unknown: before any loss no plan risks
    anything; after a revocable node goes, the options price a rate and age factors while the
    planner's problem keeps the YAML's domains (placement needs only which GPUs are reserved)."""
    problem = make_problem(gpus=32, response=1024)
    cluster = dataclasses.replace(problem.cluster, reserved_nodes=2)
    plan = search(problem).plan
    ctl = Controller(problem.workload, problem.models, cluster, plan)
    assert ctl.history is not None and ctl.domains is not None
    ctl.observe(_tel(0, 0.0, ALL))
    assert ctl.options.domains is not None and not ctl.options.domains.at_risk
    d = ctl.observe(_tel(1, 300.0, _without(7)))
    assert d is not None  # the pool shrank under the plan
    assert d.to_json()["revocation_rate"] == pytest.approx(1 / (6 * 300 / 3600 + PRIOR_HOURS))
    learned = ctl.options.domains
    assert learned is not None and learned.at_risk and learned.age_factors
    assert ctl.pool_age.domains == learned and ctl.domains.revocations_per_hour == 0.0
    assert ctl.problem(_without(7), problem.seq).domains == ctl.domains
    given = Controller(problem.workload, problem.models, cluster, plan, domains=ctl.domains)
    assert given.history is None  # domains handed in (a trace's) are not relearned
