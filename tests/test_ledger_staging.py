"""The ledger counts zero-copy staging (issue 21): ``wire.staging_bytes`` is exactly what the
executor's ``Staging`` pool grows to on each rank, and ``between.with_staging`` adds it to every
GPU's state peak, so a capacity one byte short of state plus staging makes the transition
infeasible, while the capacity that holds both is enough; admission (``DagEstimator``) prices a
per-unit transition with it, and counts it in a move priced from a class plan once it chooses it
(``transition_cost.staged``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.control.transition_cost import DagEstimator, staged
from nereus.plan.calibration import Efficiencies
from nereus.spec import load_cluster
from nereus.state.staging import Staging
from nereus.transition import LinkModel, StageMove, Transition, build_dag
from nereus.transition.between import ledger_capacity, with_staging
from nereus.transition.execute import Executor
from nereus.transition.wire import staging_bytes
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


@pytest.mark.pure
def test_a_move_priced_from_a_class_plan_counts_its_staging_once_admission_chooses_it() -> None:
    """A class plan counts no staging; ``staged`` (what admission runs on the move it chooses,
    ``Controller._admit``) builds its per-unit DAG and counts it: on a GPU memory that holds the
    class plan's state but not state plus staging the move becomes infeasible, naming the GPU."""
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
        staging = staging_bytes(tr.dag, tr.moves)
        state = est.priced.peak_max  # what the class plan priced: state only
        need = max(tr.dag.peak.get(g, 0) + staging.get(g, 0) for g in set(tr.dag.peak) | set(staging))
        assert need > state + 2**20  # staging that matters
        cap = (state + need) // 2  # holds the class plan's state, not state plus staging
        headroom = 1.0 - (cap + problem.reserved_bytes) / problem.cluster.gpu_memory_bytes
        tight = dataclasses.replace(problem, headroom=headroom)
        assert abs(ledger_capacity(tight) - cap) <= 1
        est = DagEstimator().estimate(tight, current, target)
        assert est.feasible and est.priced is not None and est.priced.path == "class"
        refused = staged(tight, est)
        assert not refused.feasible and refused.seconds == 0.0
        assert "staging" in refused.reason and "GPU" in refused.reason
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
