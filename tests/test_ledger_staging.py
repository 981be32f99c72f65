"""The ledger counts zero-copy staging (issue 21): ``wire.staging_bytes`` is exactly what the
executor's ``Staging`` pool grows to on each rank, and ``between.with_staging`` adds it to every
GPU's state peak, so a capacity one byte short of state plus staging makes the transition
infeasible, while the capacity that holds both is enough — at the largest staging batches that
fit: where the default's do not, smaller ones are chosen and every rank's executor runs them;
admission (``DagEstimator``) prices a per-unit transition with it, and counts it in a move priced
from a class plan once it chooses it (``transition_cost.staged``), which then runs the checked DAG."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.control.transition_cost import DagEstimator, staged
from nereus.plan.calibration import Efficiencies
from nereus.plan.problem import PlanningProblem
from nereus.spec import load_cluster
from nereus.state.staging import Staging
from nereus.transition import LinkModel, StageMove, Transition, build_dag
from nereus.transition.between import ROOMY, STAGING_BUDGETS, ledger_capacity, with_staging
from nereus.transition.execute import Executor
from nereus.transition.wire import STAGING_BUDGET, staging_bytes
from tests.helpers_spawn import world
from tests.test_execute_zero_copy import STAGE, WORLD, reshards, start
from tests.test_transition_classes import INTACT, _pair

LINKS = LinkModel(load_cluster("local-cpu"), Efficiencies())


def _staged(seed: int = 3, n: int = 12) -> list[Transition]:
    """Random reshards on 4 GPUs whose zero-copy messages stage something."""
    out = []
    for _, _, move in reshards(n, seed):
        dag = build_dag([move], {STAGE: 2}, LINKS, 2**40)
        if staging_bytes(dag, [move]):
            out.append(Transition(dag, None, (move,)))
    return out


def _replaced(move: StageMove) -> StageMove:
    """The same layout on the GPUs in reverse order: whole ranks move, nothing is cut."""
    lay, units = move.current_layout, [u.gpus for u in move.current]
    return StageMove.between(STAGE, move.model, move.policy, lay, units, lay, [g[::-1] for g in units[::-1]])


@pytest.mark.pure
def test_some_reshards_stage_and_a_copy_of_whole_ranks_does_not() -> None:
    assert len(_staged()) >= 3
    for _, _, move in reshards(12, 3):
        whole = _replaced(move)
        dag = build_dag([whole], {STAGE: 2}, LINKS, 2**40)
        assert dag.nodes and not staging_bytes(dag, [whole])


@pytest.mark.pure
def test_a_capacity_one_byte_short_of_state_and_staging_is_refused() -> None:
    for tr in _staged():
        move = tr.moves[0]
        staging = staging_bytes(tr.dag, tr.moves)
        need = max(tr.dag.peak.get(g, 0) + staging.get(g, 0) for g in set(tr.dag.peak) | set(staging))
        tight = build_dag([move], {STAGE: 2}, LINKS, need)  # the state alone fits with room to spare
        assert tight.feasible and max(tight.peak.values()) < need
        counted = with_staging(Transition(tight, None, (move,)), need)
        assert counted.feasible
        assert counted.peak_max == need  # state + staging on the GPU that binds
        assert all(counted.dag.peak[g] == tight.peak.get(g, 0) + b for g, b in staging.items())
        short = build_dag([move], {STAGE: 2}, LINKS, need - 1)
        assert short.feasible  # the DAG's own ledger (state only) would let it run
        refused = with_staging(Transition(short, None, (move,)), need - 1)
        assert not refused.feasible
        assert "staging" in refused.dag.reason and "1 more than" in refused.dag.reason


SMALL = (64 << 10, 8 << 10, 1 << 10)  # batch sizes small enough to matter on the tiny reshards


def _need(tr: Transition, budget: int) -> int:
    """The largest per-GPU state + staging of ``tr`` run in batches of ``budget``."""
    staging = staging_bytes(tr.dag, tr.moves, budget)
    return max(tr.dag.peak.get(g, 0) + staging.get(g, 0) for g in set(tr.dag.peak) | set(staging))


@pytest.mark.pure
def test_where_the_largest_batches_do_not_fit_smaller_ones_are_chosen() -> None:
    checked = refusals = 0
    for tr in _staged():
        move = tr.moves[0]
        needs = [_need(tr, b) for b in SMALL]
        if not needs[0] > needs[1]:
            continue  # smaller batches stage no less here
        cap = needs[1]
        tight = Transition(build_dag([move], {STAGE: 2}, LINKS, cap), None, (move,))
        assert [_need(tight, b) for b in SMALL[:2]] == needs[:2]  # the same state peaks at that capacity
        counted = with_staging(tight, cap, SMALL)
        assert counted.feasible and counted.staging_budget == SMALL[1] and counted.peak_max == cap
        roomy = Transition(build_dag([move], {STAGE: 2}, LINKS, needs[0]), None, (move,))
        assert with_staging(roomy, needs[0], SMALL).staging_budget == SMALL[0]
        short = min(needs) - 1
        dag = build_dag([move], {STAGE: 2}, LINKS, short)
        if dag.feasible:  # the state alone fits: refused at the smallest batches, which it names
            refused = with_staging(Transition(dag, None, (move,)), short, SMALL)
            assert not refused.feasible and refused.staging_budget == SMALL[-1]
            assert "in batches of at most 0 MiB" in refused.dag.reason
            refusals += 1
        checked += 1
    assert checked >= 2 and refusals >= 1
    with pytest.raises(ValueError, match="staging budgets"):
        with_staging(_staged()[0], 2**40, (0,))


@pytest.mark.pure
def test_the_default_batches_come_first_and_a_transition_refuses_a_bad_budget() -> None:
    assert STAGING_BUDGETS[0] == STAGING_BUDGET
    assert list(STAGING_BUDGETS) == sorted(STAGING_BUDGETS, reverse=True)
    tr = _staged()[0]
    assert tr.staging_budget == STAGING_BUDGET and with_staging(tr, 2**40).staging_budget == STAGING_BUDGET
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="staging_budget"):
            dataclasses.replace(tr, staging_budget=bad)


@pytest.mark.pure
def test_an_infeasible_or_unstaged_transition_is_left_as_it_is() -> None:
    whole = _replaced(reshards(1, 3)[0][2])
    tr = Transition(build_dag([whole], {STAGE: 2}, LINKS, 2**40), None, (whole,))
    assert with_staging(tr, 2**40) is tr
    staged = _staged()[0]
    move = staged.moves[0]
    infeasible = Transition(build_dag([move], {STAGE: 2}, LINKS, 1), None, (move,))
    assert not infeasible.feasible and with_staging(infeasible, 1) is infeasible


def _pool_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        lines = []
        for tr in _staged(n=6):
            move = tr.moves[0]
            staging = Staging()
            Executor(tr.dag, tr.moves, start(move, rank), {r: r for r in range(WORLD)}, staging=staging).run()
            lines.append(f"{staging.nbytes} {staging_bytes(tr.dag, tr.moves).get(rank, 0)}")
        Path(out, f"pool{rank}").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_the_counted_staging_is_what_the_executor_holds(tmp_path: Path) -> None:
    world(_pool_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD)
    for r in range(WORLD):
        rows = [line.split() for line in (tmp_path / f"pool{r}").read_text().splitlines()]
        assert rows and all(held == counted for held, counted in rows), (r, rows)


def _tight(problem: PlanningProblem, cap: int) -> PlanningProblem:
    """``problem`` with the headroom that leaves ``cap`` bytes a GPU for state and staging."""
    headroom = 1.0 - (cap + problem.reserved_bytes) / problem.cluster.gpu_memory_bytes
    out = dataclasses.replace(problem, headroom=headroom)
    assert abs(ledger_capacity(out) - cap) <= 1
    return out


@pytest.mark.pure
def test_a_move_priced_from_a_class_plan_counts_its_staging_once_admission_chooses_it() -> None:
    """A class plan counts no staging; ``staged`` (what admission runs on the move it chooses,
    ``Controller._admit``) builds its per-unit DAG and counts it: on a GPU memory that holds the
    state plus the staging of smaller batches only, the move runs those (its transition says so);
    on one that holds the class plan's state but not state plus staging in any batches, the DAG
    is planned again under capacity less the staging (``between.fit_staging``): more serial, it
    fits, and its makespan replaces the class plan's in the price."""
    # the stored pairs priced from a class plan whose per-unit DAG stages (2.25 GiB on a GCD)
    cases = [c for c in INTACT if c["name"].startswith(("mi250x 1024 shrink", "drift 20 "))]
    assert len(cases) == 2
    checked = 0
    for case in cases:
        problem, current, target = _pair(case)
        est = DagEstimator().estimate(problem, current, target)
        assert est.feasible and est.priced is not None and est.priced.path == "class"
        counted = staged(problem, est)
        assert counted.feasible and counted.peak_bytes >= est.peak_bytes
        tr = est.transition
        assert tr is not None
        assert counted.transition is not None and counted.transition.staging_budget == STAGING_BUDGET
        state = est.priced.peak_max  # what the class plan priced: state only
        need, least = _need(tr, STAGING_BUDGET), _need(tr, STAGING_BUDGETS[-1])
        assert least > state + 2**20  # staging that matters, even in the smallest batches
        assert need > least + 2**20  # ... and smaller batches stage less

        # holds state plus the smallest batches' staging, not the default's: smaller batches run
        between = _tight(problem, (least + need) // 2)
        est = DagEstimator().estimate(between, current, target)
        assert est.feasible and est.priced is not None and est.priced.path == "class"
        smaller = staged(between, est)
        bare = est.transition  # the per-unit DAG without its staging
        assert smaller.feasible and smaller.transition is not None and bare is not None
        budget = smaller.transition.staging_budget
        assert budget < STAGING_BUDGET and smaller.transition.peak_max <= ledger_capacity(between)
        assert smaller.transition.peak_max == _need(bare, budget)
        assert _need(bare, 2 * budget) > ledger_capacity(between)  # the largest batches that fit
        assert staged(between, smaller) is smaller  # counted once

        # holds the class plan's state (every acquisition at once), not state plus staging in any
        # batches: the DAG is planned again, more serial, with room for the staging
        short = _tight(problem, state)
        est = DagEstimator().estimate(short, current, target)
        assert est.feasible and est.priced is not None and est.priced.path == "class"
        bare = est.transition
        assert bare is not None and not with_staging(bare, ledger_capacity(short)).feasible
        roomy = staged(short, est)
        assert roomy.feasible and roomy.transition is not None and roomy.priced is not None
        assert roomy.transition.path == ROOMY and roomy.priced.path == "per-unit"
        assert roomy.transition.peak_max <= ledger_capacity(short)
        assert roomy.features[0] == roomy.transition.l_tran_s and roomy.features[1:] == est.features[1:]
        longer = roomy.transition.l_tran_s - est.features[0]
        assert roomy.seconds == pytest.approx(est.seconds + est.dag_weight * longer)
        assert staged(short, roomy) is roomy
        checked += 1
    assert checked == 2


def _batched_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        lines = []
        for k, tr in enumerate(_staged(n=6)):
            move = tr.moves[0]
            ranks = {r: r for r in range(WORLD)}
            runs = {}
            for budget in (2**62, 4096, 1):  # one batch a round; some; one staged chunk each
                staging = Staging()
                holder = start(move, rank)
                Executor(tr.dag, tr.moves, holder, ranks, staging=staging, staging_budget=budget).run()
                runs[budget] = holder.by_stage().get(STAGE)  # None: this rank holds none of it
                counted = staging_bytes(tr.dag, tr.moves, budget=budget).get(rank, 0)
                lines.append(f"{staging.nbytes} {counted}")
            for budget in (4096, 1):
                a, b = runs[2**62], runs[budget]
                if a is None or b is None:
                    assert a is b, (k, budget)
                    continue
                assert (a.layout, a.t, a.p, a.state) == (b.layout, b.t, b.p, b.state), k
                for kind, buf in a.buffers.items():
                    assert torch.equal(buf.view(torch.uint8), b.buffers[kind].view(torch.uint8)), (k, budget)
        Path(out, f"pool{rank}").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_bounded_staging_runs_in_batches_to_the_same_state_holding_what_the_ledger_counts(
    tmp_path: Path,
) -> None:
    """Random reshards on 4 gloo ranks with staging budgets that cut rounds into batches (down to
    one staged chunk a batch): every buffer comes out bit for bit as with one batch a round, and
    each rank's pool holds exactly the bounded staging the ledger counts."""
    world(_batched_worker, (str(tmp_path / "store"), str(tmp_path)), WORLD)
    for r in range(WORLD):
        rows = [line.split() for line in (tmp_path / f"pool{r}").read_text().splitlines()]
        assert rows and all(held == counted for held, counted in rows), (r, rows)
    smaller = [int(rows.split()[0]) for rows in (tmp_path / "pool0").read_text().splitlines()]
    assert any(smaller[i + 2] < smaller[i] for i in range(0, len(smaller), 3))  # budget 1 < unbounded
