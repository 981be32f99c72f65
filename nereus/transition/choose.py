"""Which DAG a transition runs: commit orders, stage orders, re-layouts straight from one replica.

The builder (``build.py``) commits nodes greedily in one priority order, and its memory ledger
adds the resource edges that keep every execution order within memory. Which releases an
acquisition is made to wait for depends on that order: what was committed before it counts as
possibly already acquired. Committed in the paper's stage order gen → inf → train, a trainer's
Extend commits last, after every inference copy onto its GPUs, so it waits for the releases
of those copies' model-stages too. Where that puts a long Extend behind a chain that shares its
ports, no schedule of the DAG is short (32 GCDs, pool doubling: at least 78 of SCIP's 64 ticks).

``plan_dag`` therefore builds the DAG in several orders: the two commit orders under the
paper's stage order first (sampled as before: the floor), then, where that stays more than
``SLACK`` above the lower bound, the same under the other orders of the stage kinds (train
first reaches the bound on that pool doubling), stopping at the first within ``SLACK``; the
shortest of those, sampled too, replaces the floor where it is shorter. Every order gives a DAG
that holds memory in every execution order (the stage rank only orders the commit heap), so
any of them is safe to run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from nereus.transition.build import _CLASS, _RELEASE_FIRST, CommitOrder, _Locals
from nereus.transition.dag import TransitionDag
from nereus.transition.links import LinkModel
from nereus.transition.local import applies_direct
from nereus.transition.move import StageMove
from nereus.transition.schedule import (
    SAMPLE_NODES,
    SAMPLE_SLACK,
    SAMPLES,
    Prepared,
    Schedule,
    best_schedule,
    lower_bound,
    sampled,
)

SLACK = 0.05  # try the next order when the best schedule is this far above its lower bound
ORDER_NODES = 4096  # other stage orders only while nodes × commits tried stay within this


def stage_orders(stage_rank: Mapping[str, int], nodes: int) -> Iterator[dict[str, int]]:
    """``stage_rank`` itself, then the other orders of its distinct ranks (each model-stage takes
    its kind's place in the order), as many as ``ORDER_NODES`` allows for a DAG of ``nodes``."""
    yield dict(stage_rank)
    kinds = sorted(set(stage_rank.values()))
    budget = ORDER_NODES // max(2 * nodes, 1) - 1  # two commit orders per stage order
    for perm in itertools.islice(itertools.permutations(kinds), 1, None):
        if budget <= 0:
            return
        budget -= 1
        place = {kind: i for i, kind in enumerate(perm)}
        yield {name: place[r] for name, r in stage_rank.items()}


def plan_dag(
    moves: Sequence[StageMove],
    stage_rank: Mapping[str, int],
    links: LinkModel,
    capacity: int | Mapping[int, int],
    grouped: bool | None = False,
    direct: bool = True,
) -> tuple[TransitionDag, Schedule | None]:
    """The DAG and schedule a transition runs: the paper's stage order's, or a shorter one's.

    ``grouped``: None plans identical units as groups where that applies (``group.py``: many
    nodes, memory for every acquisition), True wherever memory allows, False never (the exact
    per-unit greedy below).

    The paper's stage order is built in both commit orders and its shorter schedule sampled
    (``schedule.sampled``) where it stays over ``SAMPLE_SLACK`` above the lower bound (critical
    path of the local edges, busiest port): what every transition got before the other orders
    were tried, and the floor. Where that stays more than ``SLACK`` above, the other stage orders
    are built (each while none so far is within ``SLACK``), the shortest of them sampled too, and
    it replaces the floor only where shorter. Where a move changes its layout and GPUs, the
    re-layout straight from one replica (``_direct``) is planned too, and kept where it is shorter
    (``direct``; False: only where Split → Extend → Merge runs out of memory, the per-unit
    reference the class and grouped plans are held to, which plan Split → Extend → Merge).
    """
    locals_ = _Locals(moves, links, capacity)
    if grouped is not False:
        from nereus.transition.group import plan_grouped

        out = plan_grouped(
            locals_.nodes, locals_.edges, locals_.units, locals_.init, locals_.cap, stage_rank,
            locals_.order_of, (_CLASS, _RELEASE_FIRST), force=grouped is True,
        )  # fmt: skip
        if out is not None:
            return out
    orders = stage_orders(stage_rank, len(locals_.nodes))
    best = _sampled(_commit_orders(locals_, next(orders)))  # the paper's stage order: the floor
    if not _within(best, SLACK):
        alternative: _Built | None = None
        for rank in orders:  # the shortest unsampled one, up to the first within SLACK
            built = _commit_orders(locals_, rank, best.bound)
            if built.schedule is not None and (alternative is None or _shorter(built, alternative)):
                alternative = built
            if _within(built, SLACK):
                break
        if alternative is not None:
            alternative = _sampled(alternative)
            if best.schedule is None or _shorter(alternative, best):
                best = alternative
    if (direct or best.schedule is None) and any(applies_direct(m) for m in moves):
        straight = _direct(_Locals(moves, links, capacity, direct=True), stage_rank)
        if straight is not None and (
            best.schedule is None or straight[1].makespan < best.schedule.makespan - 1e-12
        ):
            return straight
    return best.dag, best.schedule


@dataclass(frozen=True, slots=True)
class _Built:
    """One stage order's DAG (the shorter of its commit orders), its schedule (None: the DAG is
    infeasible), what the schedules of the DAG share and its lower bound."""

    dag: TransitionDag
    schedule: Schedule | None
    prep: Prepared | None
    bound: float


def _commit_orders(locals_: _Locals, rank: Mapping[str, int], bound: float = 0.0) -> _Built:
    """The DAG under ``rank`` in each commit order (the second only while the first stays over
    ``SLACK`` above its bound or is infeasible), the shorter list schedule kept, not sampled.
    ``bound``: the lower bound where already known (0: not yet). It reads only the nodes, their
    local edges and ports, which every order of one transition shares; resource edges are the
    orders' own."""
    best: _Built | None = None
    for order in CommitOrder:
        dag = locals_.commit(rank, order)
        prep = Prepared(dag) if dag.feasible else None
        if dag.feasible and not bound:
            bound = lower_bound(dag, prep)
        sched = best_schedule(dag, bound=bound, prep=prep, samples=0) if dag.feasible else None
        built = _Built(dag, sched, prep, bound if dag.feasible else 0.0)
        if best is None or (sched is not None and (best.schedule is None or _shorter(built, best))):
            best = built
        if _within(best, SLACK):
            break
    assert best is not None
    return best


def _sampled(built: _Built) -> _Built:
    """``built`` with its schedule sampled (``schedule.sampled``) where it stays over
    ``SAMPLE_SLACK`` above its bound."""
    if built.schedule is None or built.prep is None or _within(built, SAMPLE_SLACK):
        return built
    samples = min(SAMPLES, SAMPLE_NODES // max(len(built.dag.nodes), 1))
    return replace(built, schedule=sampled(built.dag, None, built.schedule, built.prep, samples))


def _within(built: _Built, slack: float) -> bool:
    return built.schedule is not None and built.schedule.makespan <= (1.0 + slack) * built.bound


def _shorter(a: _Built, b: _Built) -> bool:
    assert a.schedule is not None and b.schedule is not None
    return a.schedule.makespan < b.schedule.makespan - 1e-12


def _direct(direct: _Locals, stage_rank: Mapping[str, int]) -> tuple[TransitionDag, Schedule] | None:
    """The re-layouts straight from one replica each (``local._direct``), whose GPUs acquire only
    their target shards (Split → Extend → Merge copies whole T_sub shards first: more bytes, more
    memory, and out of memory where a deeper pipeline's Extends land whole shards), in the commit
    order with the shorter schedule that fits; None where none fits. ``plan_dag`` keeps it where
    it is shorter than Split → Extend → Merge, or where that runs out of memory (the infeasible
    DAG's reason then names what blocks)."""
    best: tuple[TransitionDag, Schedule] | None = None
    for order in CommitOrder:
        dag = direct.commit(stage_rank, order)
        if dag.feasible:
            prep = Prepared(dag)
            sched = best_schedule(dag, bound=lower_bound(dag, prep), prep=prep)
            if sched is not None and (best is None or sched.makespan < best[1].makespan - 1e-12):
                best = (dag, sched)
    return best
