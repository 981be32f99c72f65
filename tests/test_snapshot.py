"""The boundary snapshots a failed step rolls back to (``nereus.runtime.snapshot``), and the
survivors' agreement on which one (``JobLoop._roll_back``), without processes: two snapshots kept
until they settle, fresh copies on every restore, the oldest of the survivors' newest snapshots
chosen, and the step counter and plan going back with the state (CI once saw survivors roll back
to different steps after a node went down at a step boundary)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nereus.runtime.surviving as surviving_module
from nereus.devices import CPU
from nereus.plan.layout import Layout
from nereus.runtime.loop import JobLoop
from nereus.runtime.snapshot import Mark, Snapshot, agreed
from nereus.spec import load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.emu import LogicalState
from nereus.state.holder import RankState
from tests.device_checks import small_plan
from tests.rollback_helpers import SOURCES, StandInWorker, moved_plan, stand_in_loop, trainer_at, update

pytestmark = pytest.mark.pure


def test_agreed_is_the_oldest_newest_snapshot_and_newcomers_do_not_count() -> None:
    assert agreed([Mark(4, 2), Mark(4, 1), None, Mark(4, 2)]) == Mark(4, 1)
    assert agreed([Mark(5, 0), Mark(4, 7)]) == Mark(4, 7)  # generations order before counts
    assert agreed([None, None]) is None
    assert agreed([]) is None


def test_marks_count_within_a_generation_and_two_are_kept_until_settled() -> None:
    snap, rs, plan = Snapshot(CPU), trainer_at(), small_plan()
    assert snap.newest() is None and snap.marks() == ()
    assert snap.take(2, 10, plan, {"actor.train": rs}, SOURCES) == Mark(2, 0)
    assert snap.take(2, 11, plan, {"actor.train": rs}, SOURCES) == Mark(2, 1)
    assert snap.take(2, 12, plan, {"actor.train": rs}, SOURCES) == Mark(2, 2)
    assert snap.marks() == (Mark(2, 1), Mark(2, 2)) and snap.steps() == (11, 12)  # at most two
    snap.settle()
    assert snap.marks() == (Mark(2, 2),)
    assert snap.take(3, 12, plan, {"actor.train": rs}, SOURCES) == Mark(3, 0)  # the same step, again
    assert snap.marks() == (Mark(2, 2), Mark(3, 0)) and snap.steps() == (12, 12)
    with pytest.raises(ValueError, match="generations only grow"):
        snap.take(1, 13, plan, {"actor.train": rs}, SOURCES)


def test_restore_gives_independent_copies_of_the_snapshot_asked_for() -> None:
    snap, rs = Snapshot(CPU), trainer_at(5)
    plan, moved = small_plan(), moved_plan(small_plan())
    policy = StatePolicy.of(Stage.INF, Precision.BF16_MIXED)
    frozen = RankState.empty("ref.inf", load_model("tiny-qwen3"), Layout(1, 1), 0, 0, policy)
    want = rs.buffers[BufferKind.PARAM].clone()
    first = snap.take(
        0, 5, plan, {"actor.train": rs, "ref.inf": frozen, "actor.gen": rs}, SOURCES | {"ref.inf"}
    )
    update(rs)
    second = snap.take(0, 6, moved, {"actor.train": rs}, SOURCES)
    update(rs)
    assert snap.boundary(first) == (5, plan) and snap.boundary(second) == (6, moved)
    a = snap.restore(first)
    assert set(a) == {"actor.train", "ref.inf"}  # a weight copy is not kept
    assert a["ref.inf"] is frozen  # nothing changes a frozen model: held as it is
    assert a["actor.train"].state.updates == 5
    assert torch.equal(a["actor.train"].buffers[BufferKind.PARAM], want)
    a["actor.train"].buffers[BufferKind.PARAM].add_(100)  # the step that runs again changes it
    b = snap.restore(first)["actor.train"]
    assert torch.equal(b.buffers[BufferKind.PARAM], want)  # intact for a second failure
    assert b.buffers[BufferKind.PARAM].data_ptr() != a["actor.train"].buffers[BufferKind.PARAM].data_ptr()
    assert snap.restore(second)["actor.train"].state.updates == 6


def test_restoring_a_snapshot_this_rank_does_not_hold_says_so() -> None:
    snap = Snapshot(CPU)
    snap.take(1, 3, small_plan(), {"actor.train": trainer_at()}, SOURCES)
    with pytest.raises(
        LookupError, match=r"no snapshot \(1, 5\) on this rank \(it holds: \(1, 0\) before step 3\)"
    ):
        snap.restore(Mark(1, 5))
    with pytest.raises(LookupError, match="it holds: none"):
        Snapshot(CPU).restore(Mark(0, 0))


def test_back_to_forgets_newer_snapshots_and_a_newcomer_gets_nothing() -> None:
    snap, rs, plan = Snapshot(CPU), trainer_at(), small_plan()
    old = snap.take(0, 4, plan, {"actor.train": rs}, SOURCES)
    update(rs)
    snap.take(0, 5, plan, {"actor.train": rs}, SOURCES)
    assert snap.back_to(old)["actor.train"].state.updates == 0
    assert snap.marks() == (old,)  # the newer one's step runs again: it is gone
    assert snap.take(1, 4, plan, {"actor.train": rs}, SOURCES) == Mark(1, 0)

    newcomer = Snapshot(CPU)  # joined at generation 1, took its first snapshot there
    newcomer.take(1, 5, plan, {}, SOURCES)
    assert newcomer.back_to(old) == {} and newcomer.marks() == ()

    behind = Snapshot(CPU)  # holds only an older one than agreed: cannot happen, and says so
    behind.take(0, 3, plan, {"actor.train": rs}, SOURCES)
    with pytest.raises(LookupError, match=r"no snapshot \(1, 0\)"):
        behind.back_to(Mark(1, 0))


def _roll_back_together(loops: list[JobLoop], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loop's ``_roll_back``, its collectives answered as the world of ``loops`` would
    (rank order: the leader first)."""
    newest = [lp.worker.snapshot.newest() for lp in loops]
    leader = next(lp for lp in loops if lp.leader is not None)
    said: list[Any] = []

    def broadcast(obj: object, tp: Any, src: int = 0) -> Any:
        if obj is not None:
            said.append(obj)
        return said[0]

    monkeypatch.setattr(
        surviving_module, "all_gather", lambda obj, tp: [tuple(m) if m else None for m in newest]
    )
    monkeypatch.setattr(surviving_module, "broadcast", broadcast)
    leader._roll_back()
    for lp in loops:
        if lp is not leader:
            lp._roll_back()


def test_survivors_one_snapshot_apart_roll_back_to_the_same_step_and_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU 0 got through boundary 42's last collective, moved to another plan and took the
    snapshot before step 43; GPU 1 failed inside the boundary (its step counter already 43, the
    move half done); GPU 3 joined at the boundary and holds none. All go back to before step 42."""
    plan = small_plan()
    moved = moved_plan(plan)
    ranks = {g: StandInWorker(g, {"actor.train": trainer_at(40)}) for g in (0, 1)}
    before_42 = {}
    for step in (40, 41, 42):
        for g, w in ranks.items():
            w.take_snapshot(7, step, plan)
            before_42[g] = w.holder.units["actor.train"].buffers[BufferKind.PARAM].clone()
        for w in ranks.values():  # the barrier after the snapshot: every rank has it
            w.snapshot.settle()
            update(w.holder.units["actor.train"])
    ranks[0].take_snapshot(7, 43, moved)  # then the peer died: GPU 0's barrier fails
    assert ranks[0].snapshot.steps() == (42, 43) and ranks[1].snapshot.steps() == (42,)
    ranks[1].holder.units["actor.train"].buffers[BufferKind.PARAM].add_(7)  # half a transition
    newcomer = StandInWorker(3, {})
    loops = [
        stand_in_loop(ranks[0], moved, 43, True),
        stand_in_loop(ranks[1], moved, 43, False),
        stand_in_loop(newcomer, plan, 43, False),
    ]

    _roll_back_together(loops, monkeypatch)

    for lp in loops:
        assert lp.step == 42 and lp.plan == plan  # the step runs again, on the plan it ran on
        assert lp.worker.engines == {}  # weight copies dropped: the next weight sync rebuilds them
    for g in (0, 1):
        got = ranks[g].holder.units["actor.train"]
        assert got.state == LogicalState(updates=42, version=42)
        assert torch.equal(got.buffers[BufferKind.PARAM], before_42[g])
        assert ranks[g].snapshot.steps() == (42,)  # the snapshot before step 43 is forgotten
    assert newcomer.holder.units == {} and newcomer.snapshot.marks() == ()


def test_a_failure_during_the_boundarys_move_runs_the_step_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank took the snapshot before step 9, ran it, and failed in the move at its boundary
    (the step counter already 10): step 9's update is not lost, it runs again."""
    plan = small_plan()
    workers = [StandInWorker(g, {"actor.train": trainer_at(9)}) for g in (0, 1)]
    for w in workers:
        w.take_snapshot(2, 9, plan)
    for w in workers:
        w.snapshot.settle()
        update(w.holder.units["actor.train"])
    loops = [stand_in_loop(w, moved_plan(plan), 10, g == 0) for g, w in enumerate(workers)]

    _roll_back_together(loops, monkeypatch)

    assert [lp.step for lp in loops] == [9, 9] and all(lp.plan == plan for lp in loops)
    assert all(w.holder.units["actor.train"].state.updates == 9 for w in workers)


def test_a_rank_without_the_snapshot_its_plan_needs_is_an_error() -> None:
    plan = small_plan()
    w = StandInWorker(0, {"actor.train": trainer_at()})  # GPU 0 trains in ``plan``, yet took no snapshot
    with pytest.raises(
        RuntimeError, match=r"GPU 0: no snapshot \(1, 0\) to roll back to, yet its plan puts actor.train here"
    ):
        w.rollback(Mark(1, 0), plan)
    stranger = StandInWorker(5, {})
    stranger.rollback(Mark(1, 0), plan)  # GPU 5 has no part in ``plan``: nothing to restore
    assert stranger.holder.units == {}
