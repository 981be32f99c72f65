"""Survivors of a peer that dies at a step boundary roll back to the same step (4 spawned
processes, a real gloo world and the job's membership store).

GPUs 0, 1 and 3 step with the snapshot protocol of ``JobLoop._rl_step`` (snapshot, world
barrier, settle); GPU 3 is a newcomer that holds no snapshot. GPU 2 dies after boundary 2.
GPU 0 got through that boundary and took the snapshot before step 3 (on the plan it moved to),
then fails in its barrier; GPUs 1 and 3 fail in the boundary's last collective. The survivors
re-form the world (``JobLoop._survive``) and agree (``JobLoop._roll_back``): all go back to
before step 2, on step 2's plan, with the trainer's state of then. Before the fix GPU 0 went
back to step 3 and GPU 1 to step 2 (CI: "providers disagree on the logical state").
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nereus.runtime.comm import barrier
from nereus.state.buffers import BufferKind
from tests.device_checks import small_plan
from tests.helpers import free_port
from tests.rollback_helpers import StandInWorker, moved_plan, stand_in_loop, trainer_at, update
from tests.test_membership import joined

pytestmark = pytest.mark.dist

GPUS = (0, 1, 2, 3)
TRAINERS = (0, 1)  # the plan's actor.train replicas; GPU 3 joined later and holds none


def _rank(gpu: int, port: int, out: str) -> None:
    m = joined(gpu, port, out, GPUS)
    plan, moved = small_plan(), moved_plan(small_plan())
    worker = StandInWorker(gpu, {"actor.train": trainer_at()} if gpu in TRAINERS else {})
    loop = stand_in_loop(worker, plan, 0, gpu == 0, m)
    before: dict[int, list[float]] = {}
    for step in range(3):  # steps 0-2 and their boundaries
        if gpu != 3:
            worker.take_snapshot(m.generation, step, plan)
        barrier()
        worker.snapshot.settle()
        if gpu in TRAINERS:
            before[step] = worker.holder.units["actor.train"].buffers[BufferKind.PARAM][:4].float().tolist()
            update(worker.holder.units["actor.train"])
        dist.all_reduce(torch.ones(1))  # the boundary's collectives
    if gpu == 2:
        time.sleep(0.3)
        os._exit(0)  # dies without a word
    loop.step = 3  # the boundary set the next step before its action
    failed = False
    try:
        if gpu == 0:  # through the boundary: the move, then step 3's snapshot and barrier
            loop.plan = moved
            worker.take_snapshot(m.generation, 3, moved)
        barrier()  # GPU 0: step 3's barrier; the others: the boundary's last collective
    except RuntimeError:
        failed = True
    assert failed
    steps_before = list(worker.snapshot.steps())
    loop._survive()
    loop._roll_back()
    units = worker.holder.units
    Path(out, f"{gpu}.json").write_text(
        json.dumps({
            "steps_before": steps_before,
            "step": loop.step,
            "plan_is_step_2s": loop.plan == plan,
            "members": list(m.members),
            "updates": units["actor.train"].state.updates if "actor.train" in units else None,
            "param": units["actor.train"].buffers[BufferKind.PARAM][:4].float().tolist() if units else None,
            "before_2": before.get(2),
            "held": list(worker.snapshot.steps()),
        })
    )  # fmt: skip
    m.close()


@pytest.mark.timeout(150)
def test_survivors_one_snapshot_apart_agree_on_the_step_to_run_again(tmp_path: Path) -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(g, port, str(tmp_path))) for g in GPUS]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    got = {g: json.loads((tmp_path / f"{g}.json").read_text()) for g in (0, 1, 3)}
    assert got[0]["steps_before"] == [2, 3] and got[1]["steps_before"] == [2]  # one snapshot apart
    assert got[3]["steps_before"] == []  # the newcomer
    for g, r in got.items():
        assert r["members"] == [0, 1, 3], g
        assert r["step"] == 2 and r["plan_is_step_2s"], (g, r)
        assert r["held"] == ([2] if g in TRAINERS else []), (g, r)
    for g in TRAINERS:
        assert got[g]["updates"] == 2 and got[g]["param"] == got[g]["before_2"], (g, got[g])
    assert got[3]["updates"] is None and got[3]["param"] is None
    assert "lost GPUs [2]" in (tmp_path / "m.log").read_text()
