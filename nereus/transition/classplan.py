"""The class plan: a transition scheduled on replica classes, the per-unit DAG built only to run it.

``plan_classes`` derives the classes (``classes.py``), checks the no-wait ledger on them (every
GPU has room for its state plus every acquisition of the transition, one numpy pass: then the
per-unit builder would add no resource edge either; where it fails, ``class_ledger.py`` orders
classes after releases) and list-schedules the class DAG as
``group.py`` schedules groups: a class runs ``rounds × est_s`` and holds the port classes it
shares with other classes. Where a model-stage changes its layout it does so twice, for
Split → Extend → Merge and for the re-layouts straight from one replica (``local._direct``: a
GPU acquires only its target shard), and keeps the shorter, as ``choose.plan_dag`` does per unit.
Its makespan, peak and moved bytes are what admission prices; no ``Node`` per unit, ``Emu`` or
``StageMove`` is made.

``ClassPlan.expand`` builds the per-unit DAG when the transition is executed and lays the class
schedule onto it (member k of a class starts at the class's start plus its round × ``est_s``);
when the per-unit groups are not the classes one for one (``group.expand_onto`` returns None) the
exact per-unit planner runs instead, and ``Transition.path`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem
from nereus.transition.class_ledger import Ledgered, class_ledger
from nereus.transition.class_moves import derive_both
from nereus.transition.classes import Derived
from nereus.transition.dag import Node
from nereus.transition.group import GROUP_MIN_NODES, GROUP_MIN_RATIO, schedule_groups
from nereus.transition.links import LinkModel
from nereus.transition.schedule import Schedule


@dataclass(frozen=True, slots=True)
class ClassPlan:
    derived: Derived
    nodes: tuple[Node, ...]  # one per class: ``rounds × est_s``, port classes as ``sends``
    edges: tuple[tuple[int, int], ...]  # local, then resource
    schedule: Schedule
    peak_max: int  # the largest per-GPU state + staging (init + every acquisition, or the ledger's)
    floor: float  # no per-unit plan of the transition is shorter (either variant; 0: unknown)
    ledger: Ledgered | None = None  # resource edges where memory lacks room for every acquisition

    @property
    def direct(self) -> bool:
        """Whether reshapes are re-laid out straight from one replica (``local._direct``)."""
        return self.derived.direct

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.derived.classes) or len(self.schedule.start) != len(self.nodes):
            raise ValueError("class plan: one node and one start per class")

    @property
    def makespan(self) -> float:
        return self.schedule.makespan

    @property
    def moved_bytes(self) -> int:
        return sum(c.bytes * c.count for c in self.derived.classes)

    def peak(self) -> dict[int, int]:
        held = self.ledger.peak if self.ledger is not None else self.derived.init + self.derived.acquired
        gpus = np.flatnonzero(held)
        return dict(zip(gpus.tolist(), held[gpus].tolist(), strict=True))

    def lower_bound(self) -> float:
        """No schedule of this plan's per-unit DAG is shorter (``class_bound``); ``floor`` is the
        least of that and the other variant's (Split → Extend → Merge or straight)."""
        return class_bound(self.derived)

    def gpu_done(self) -> dict[int, float]:
        """Per GPU, when the last class holding one of its ports finishes (members of earlier
        rounds finish sooner: an upper bound)."""
        done = np.full(len(self.derived.init), -1.0)
        for c, end in zip(self.derived.classes, self.schedule.finish, strict=True):
            np.maximum.at(done, c.ports // 2, end)
        gpus = np.flatnonzero(done >= 0)
        return dict(zip(gpus.tolist(), done[gpus].tolist(), strict=True))

    def signatures(self) -> list[tuple[object, ...]]:
        """Each class as ``group.signatures`` writes a group."""
        out: list[tuple[object, ...]] = []
        for c in self.derived.classes:
            out.append((
                c.stage, c.primitive, c.est_s, c.bytes, c.acquires, c.count, c.rounds,
                frozenset(out[p] for p in c.preds),
            ))  # fmt: skip
        return out


def class_bound(d: Derived) -> float:
    """``schedule.lower_bound`` of the per-unit DAG, from its classes: the longest chain of members
    through the local edges (every member of a class has a predecessor in each of its predecessor
    classes), or the busiest GPU port's total work."""
    finish = [0.0] * len(d.classes)
    for i, c in enumerate(d.classes):  # a topological order
        finish[i] = max((finish[p] for p in c.preds), default=0.0) + c.est_s
    work = np.zeros(2 * len(d.init), np.float64)
    for c in d.classes:
        if len(c.ports) and c.est_s > 0:
            work += np.bincount(c.ports, minlength=len(work)) * c.est_s
    return max(max(finish, default=0.0), float(work.max(initial=0.0)))


def _port_classes(d: Derived, gpus: int) -> list[tuple[int, ...]]:
    """Per class, the port classes it holds: GPU ports merged where the same classes use them (a
    port of one class only never makes anyone wait), as ``Groups.grouped_nodes`` merges them."""
    n = len(d.classes)
    if n > 62:  # the users of a port as bits of one int64
        users = np.zeros((gpus * 2, n), bool)
        for i, c in enumerate(d.classes):
            users[c.ports, i] = True
        shared = users[users.sum(1) >= 2]
        uniq = np.unique(shared, axis=0) if len(shared) else np.zeros((0, n), bool)
        return [tuple(np.flatnonzero(uniq[:, i]).tolist()) for i in range(n)]
    mask = np.zeros(gpus * 2, np.int64)
    for i, c in enumerate(d.classes):
        mask[c.ports] |= 1 << i
    codes = np.unique(mask[(mask & (mask - 1)) != 0]).tolist()  # two users or more
    return [tuple(j for j, code in enumerate(codes) if code >> i & 1) for i in range(n)]


def _most_nodes(current: Plan, target: Plan, skip: frozenset[str]) -> int:
    """At most how many per-unit nodes the transition has: per moving model-stage, a Split per
    current replica, an Extend per slot, a Destroy per sub-unit, a Merge per target replica."""
    out = 0
    for old in current.candidates:
        if old.model_stage in skip:
            continue
        new = target.candidate(old.model_stage)
        if old.layout == new.layout and old.gpus == new.gpus:
            continue
        sub_tp, sub_pp = min(old.layout.tp, new.layout.tp), min(old.layout.pp, new.layout.pp)
        k = old.layout.size // (sub_tp * sub_pp)
        m = new.layout.size // (sub_tp * sub_pp)
        out += old.dp * (1 + k) + new.dp * (1 + m)
    return out


def plan_classes(
    problem: PlanningProblem,
    current: Plan,
    target: Plan,
    links: LinkModel,
    capacity: int,
    stage_rank: Mapping[str, int],
    skip: frozenset[str] = frozenset(),
) -> ClassPlan | None:
    """The class plan, or None where it does not apply: a move outside ``classes.py``'s rules,
    fewer than ``GROUP_MIN_NODES`` per-unit nodes or too little to group, or memory too tight
    even for the class ledger. Where every GPU has room for every acquisition at once, no class
    waits for another's release; else the class ledger (``class_ledger.py``) adds resource edges
    (``ClassPlan.ledger``). Where a model-stage changes its layout, the re-layouts straight from
    one replica (``derive(direct=True)``) are planned too, through the ledger where they need it,
    and kept where their schedule is shorter (``ClassPlan.direct``)."""
    if _most_nodes(current, target, skip) < GROUP_MIN_NODES:
        return None  # too few units to group, whatever the rules say: not worth deriving
    d, straight = derive_both(problem, current, target, links, skip)
    if d is None or d.nodes < GROUP_MIN_NODES or len(d.classes) * GROUP_MIN_RATIO > d.nodes:
        return None
    own_bound = bound = class_bound(d)
    straight_bound = class_bound(straight) if straight is not None else 0.0
    if d.resharded:  # the per-unit planner also plans every reshape straight from one replica
        bound = min(bound, straight_bound) if straight is not None else 0.0  # (0: unknown)
    # the re-layouts straight from one replica (a GPU acquires only its target shard), kept where
    # shorter, as ``choose.plan_dag`` keeps them, or where only they find room
    eligible = (
        straight is not None and d.resharded and len(straight.classes) * GROUP_MIN_RATIO <= straight.nodes
    )
    other: ClassPlan | None = None
    first = eligible and straight_bound < own_bound - 1e-12
    if first and straight is not None:
        # planned first where its bound is the lower: shorter than ``d``'s bound, it is shorter
        # than any plan of ``d`` (whose makespan is at least its bound), which is then not planned
        other = _planned(straight, target, capacity, stage_rank, skip, bound)
        if other is not None and other.makespan < own_bound - 1e-12:
            return other
    plan = _planned(d, target, capacity, stage_rank, skip, bound)
    if eligible and straight is not None:
        longest = plan.makespan if plan is not None else math.inf
        if straight_bound < longest - 1e-12:
            if not first:
                other = _planned(straight, target, capacity, stage_rank, skip, bound)
            if other is not None and other.makespan < longest - 1e-12:
                return other
    return plan


def _class_dag(d: Derived) -> tuple[tuple[Node, ...], tuple[tuple[int, int], ...]]:
    """One node per class (``rounds × est_s``, its port classes as ``sends``) and the local edges."""
    held_by = _port_classes(d, len(d.init))
    nodes = tuple(
        Node(
            id=i, primitive=c.primitive, model_stage=c.stage, gpus=(), bytes=c.bytes * c.count,
            est_s=c.est_s * c.rounds, sends=held_by[i],
        )
        for i, c in enumerate(d.classes)
    )  # fmt: skip
    return nodes, tuple((p, i) for i, c in enumerate(d.classes) for p in sorted(c.preds))


def _planned(
    d: Derived, target: Plan, capacity: int, stage_rank: Mapping[str, int], skip: frozenset[str], bound: float
) -> ClassPlan | None:
    """The class DAG of ``d`` list-scheduled: as it is where every GPU has room for its state plus
    every acquisition at once (no acquisition waits for a release), else with the class ledger's
    resource edges (``class_ledger.py``) in both commit orders, the shorter schedule kept; None
    where neither finds room."""
    from nereus.transition.build import _CLASS, _RELEASE_FIRST

    nodes, local = _class_dag(d)
    order_of = {ms.name: i for i, ms in enumerate(target.workflow.model_stages) if ms.name not in skip}
    priorities = (_CLASS, _RELEASE_FIRST)
    held = int((d.init + d.acquired).max(initial=0))
    if held <= capacity:
        sched = schedule_groups(nodes, local, {}, stage_rank, order_of, priorities)
        return ClassPlan(d, nodes, local, sched, held, bound)
    known = set(local)
    seconds = [n.est_s for n in nodes]
    best: ClassPlan | None = None
    for priority in priorities:
        key = [
            (priority[c.primitive], stage_rank.get(c.stage, 0), order_of.get(c.stage, 0), i)
            for i, c in enumerate(d.classes)
        ]
        led = class_ledger(d, capacity, key, seconds)
        if led is None:
            continue
        edges = local + tuple(e for e in led.edges if e not in known)
        sched = schedule_groups(nodes, edges, {}, stage_rank, order_of, priorities)
        if best is None or sched.makespan < best.makespan - 1e-12:
            best = ClassPlan(d, nodes, edges, sched, int(led.peak.max(initial=0)), bound, led)
    return best
