"""The leader's keeping of the pool (a mixin of ``Leader``, which holds the state it reads): at a
boundary, who leaves (scripted losses, GPUs the health rule condemns), who joins (newcomers whose
join requests it accepts) and which nodes drain for shrink requests; and what becomes of a drain
whose move failed. Edge module (the store, the control folder).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torch._C._distributed_c10d import TCPStore

from nereus.plan.report import gpu_ranges
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.health import describe, unhealthy_members
from nereus.runtime.membership import JOIN_QUEUE, JoinRequest, Membership
from nereus.runtime.pool import (
    SHRINK_GLOB,
    Change,
    drain_gpus,
    joiner_gpu,
    node_blocks,
    read_shrink_requests,
    refuse_shrinks,
    retake_shrinks,
)
from nereus.spec import ClusterSpec

JOIN_WAIT_S = 120.0  # a scripted local gain: how long the leader waits for the new process


class PoolKeeping:
    """Pool changes at a boundary, on the leader (``Leader``'s state)."""

    m: Membership
    spec: ExperimentSpec
    cluster: ClusterSpec
    control: Path | None  # shrink requests (``shrink-*.json``) from nereus-launch
    shrinks: tuple[Path, ...]  # the requests the last pool change read
    draining: tuple[int, ...]  # GPUs a drain is moving off, until they leave
    spawn_local: Callable[[int, bool], None] | None  # local mode: start a scripted newcomer
    spawned: set[tuple[int, int]]  # (step, GPU): each scripted newcomer starts once
    probe_store: TCPStore  # the helper's own connection to the store

    def calm_pool(self, nxt: int) -> bool:
        """Whether nothing can change the pool at the boundary before step ``nxt``: no scripted
        loss or gain, no join request waiting, no shrink request (health reports aside). A request
        that arrives after this look is taken at the next boundary, as if it had come a moment
        later."""
        if self.spec.lost_at(nxt) or self.spec.gained_at(nxt):
            return False
        if int(self.probe_store.queue_len(JOIN_QUEUE)) > 0:
            return False
        return self.control is None or not self.control.is_dir() or not any(self.control.glob(SHRINK_GLOB))

    def pool_change(self, nxt: int, health: Sequence[str] = ()) -> Change | None:
        """Who is in the generation from step ``nxt``: scripted losses, GPUs the health rule
        condemns (``health``: every rank's report, in rank order), accepted newcomers (each
        answered with its GPU id and the generation), nodes drained for shrink requests."""
        condemned = self.condemned(health)
        lost = set(self.spec.lost_at(nxt)) | set(condemned)
        leaving = tuple(sorted(g for g in lost if g in self.m.members and g != self.m.gpu))
        accepted = self._joins(nxt)
        nodes, self.shrinks = read_shrink_requests(self.control, self.m.log)
        draining, why = drain_gpus(nodes, self.m.members, self.m.hosts() if nodes else {}, self.m.gpu)
        if why:
            self.m.log(why)
            refuse_shrinks(self.shrinks, why)
        draining = tuple(g for g in draining if g not in leaving)
        if not (leaving or accepted or draining):
            return None
        joining = tuple(g for g, _ in accepted)
        members = tuple(sorted((set(self.m.members) - set(leaving)) | set(joining)))
        generation = self.m.generation + (1 if leaving or joining else 0)
        change = Change(nxt, members, generation, leaving, joining, draining)
        self.m.log(describe_change(change, condemned))
        for gpu, req in accepted:
            self.m.answer(req, gpu, change.generation, members)
        return change

    def _joins(self, nxt: int) -> list[tuple[int, JoinRequest]]:
        """Newcomers to admit now (scripted local gains are started and awaited)."""
        expected = [
            g for g in self.spec.gained_at(nxt) if g not in self.m.members and (nxt, g) not in self.spawned
        ]  # a step run again (a rollback) does not start its newcomers again
        if expected and self.spawn_local is not None:
            dying = self.spec.killed_joining(nxt)
            for g in expected:
                self.spawned.add((nxt, g))
                self.spawn_local(g, g in dying)
        accepted: list[tuple[int, JoinRequest]] = []
        deadline = time.monotonic() + JOIN_WAIT_S
        taken = set(self.m.members)
        limit = self.cluster.total_gpus
        blocks: dict[str, int] | None = None  # node → its block of GPU ids, read at the first request
        while True:
            for req in self.m.pending_joins():
                if req.gpu is not None and req.gpu not in taken:
                    gpu = req.gpu
                else:
                    if blocks is None:
                        blocks = node_blocks(self.m.hosts(), self.cluster.gpus_per_node)
                    gpu = joiner_gpu(req.host, taken, blocks, self.cluster.gpus_per_node, limit)
                if gpu >= limit:
                    self.m.refuse(req, f"the cluster has {limit} GPUs and all are in the job")
                    continue
                taken.add(gpu)
                accepted.append((gpu, req))
            missing = [g for g in expected if g not in {a for a, _ in accepted}]
            if not missing or self.spawn_local is None:
                return accepted
            if time.monotonic() > deadline:
                self.m.log(f"scripted newcomers {missing} did not ask to join in {JOIN_WAIT_S:.0f} s")
                return accepted
            time.sleep(0.05)

    def unfinished_drain(self) -> None:
        """A drain's move failed (a peer lost in it) and rolled back: the drained nodes still hold
        their state and stay members. With every drained GPU still here, the requests are read
        again at the next boundary; with some of them lost, they are refused (draining as many
        nodes again would take others); with all lost, the nodes are gone as asked."""
        draining, self.draining = self.draining, ()
        if not draining:
            return
        lost = [g for g in draining if g not in self.m.members]
        if not lost:
            self.m.log(f"the move off GPUs {list(draining)} failed; their shrink is taken again")
            retake_shrinks(self.shrinks)
        elif len(lost) < len(draining):
            refuse_shrinks(
                self.shrinks, f"the move off its nodes failed and GPUs {lost} were lost; ask again"
            )

    def drained(self) -> None:
        """The drained GPUs left: their shrink is carried out."""
        self.draining = ()

    def condemned(self, health: Sequence[str]) -> tuple[int, ...]:
        """The members whose health report (``health``, in rank order; none: nothing to judge)
        condemns their GPU, each logged with why. The leader's own GPU is logged, never dropped:
        it hosts the store and the controller, so the job cannot go on without it."""
        if not health:
            return ()
        problems = unhealthy_members(health, self.m.members, self.m.log)
        for line in describe(problems):
            self.m.log(line)
        if self.m.gpu in problems:
            self.m.log(f"GPU {self.m.gpu} hosts the job's controller and stays; replace its node")
        return tuple(g for g in problems if g != self.m.gpu)


def describe_change(change: Change, condemned: Sequence[int] = ()) -> str:
    """The ``membership.log`` line of a pool change decided at a boundary: who leaves (scripted,
    or condemned by its health report), who joins, who is drained, and the members from then on
    (GPU ids as ranges, so a large pool's line stays within the log's line limit)."""
    parts = []
    scripted = [g for g in change.leaving if g not in condemned]
    unhealthy = [g for g in change.leaving if g in condemned]
    parts += [f"GPUs {gpu_ranges(tuple(scripted))} leave (scripted)"] if scripted else []
    parts += [f"GPUs {gpu_ranges(tuple(unhealthy))} leave (unhealthy)"] if unhealthy else []
    parts += [f"GPUs {gpu_ranges(change.joining)} join"] if change.joining else []
    if change.draining:
        after = gpu_ranges(change.after_drain)
        parts.append(f"GPUs {gpu_ranges(change.draining)} drain (shrink), leaving GPUs {after}")
    return (
        f"before step {change.step}: {'; '.join(parts)}; generation {change.generation} has GPUs "
        f"{gpu_ranges(change.members)}"
    )
