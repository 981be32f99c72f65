"""Grouped planning at scale: identical units planned as one node with a multiplicity (issue 21).

DP replicas of one model-stage with the same geometry move alike: their Splits, Extends, Merges
and Destroys differ only by GPU ids. At scale the per-unit greedy (``build.py`` commit ledger,
``schedule.py`` list schedule over every node) spends its time on hundreds of such copies. The
grouped path plans one node per *group* instead and expands the result to the per-unit nodes the
executor runs:

* **groups**: nodes of one model-stage with the same primitive, duration, bytes, per-rank acquire
  and release bytes and restore source, whose local predecessors lie in the same groups (taken in
  a topological order, so every group edge goes from an earlier group to a later one and the
  grouped DAG is acyclic; a node is never grouped with one of its ancestors).
* **multiplicity**: a group's members that share a GPU port serialise; greedy port colouring puts
  them into rounds of port-disjoint members, and the group runs ``rounds × est_s`` holding the
  union of its members' ports.
* **ledger**, vectorised: the grouped path applies only when every GPU has room for its initial
  state plus *every* acquisition of the transition (``init + Σ acquire ≤ capacity``, one numpy
  pass). Then no acquisition ever waits for a release, the per-unit builder would add no resource
  edge either, and the DAG's local edges alone keep memory within ``peak = init + Σ acquire`` for
  every execution order — the executor's guarantee holds unchanged. Under memory pressure the
  exact per-unit builder runs instead.
* **schedule**: the grouped DAG is list-scheduled (commit-order and longest-remaining-path
  priorities, both commit orders) and expanded: member k of a group starts at the group's start
  plus its round × ``est_s``. Every per-unit edge lies inside a group edge, members of one round
  share no port and the group holds its ports throughout, so the expanded schedule respects
  precedence, ports and memory (``rcpsp.verify``); its makespan is not the per-unit greedy's but
  stays close (``tests/test_transition_group.py``).

Opt-in (``plan_transition(..., grouped=None)`` where it applies, ``True`` wherever memory
allows): building the per-unit local DAGs and ``StageMove`` units, which the executor needs and
this path still does, is most of the planning time at 1,024 GCDs, so grouping the ledger and the
schedule alone saves little end to end, and one benchmark pair (pool 50%→100% at 1,024) comes out
4.4% longer than the per-unit greedy.

The returned ``TransitionDag`` has the per-unit nodes, edges and units the per-unit builder makes
(no resource edges), a topological ``order`` (by group start) and the conservative ``peak``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import numpy as np

from nereus.state.emu import Emu
from nereus.transition.dag import Edge, EdgeKind, Node, Primitive, TransitionDag
from nereus.transition.schedule import Prepared, Schedule, best_schedule, lower_bound

GROUP_MIN_NODES = 256  # fewer per-unit nodes: the exact per-unit planner (cheap enough, golden-pinned)
GROUP_MIN_RATIO = 2.0  # and only when grouping at least halves the nodes to schedule


def room_for_everything(
    nodes: Sequence[Node], init: Mapping[int, int], cap: Mapping[int, int]
) -> dict[int, int] | None:
    """Per GPU ``init + Σ acquire`` when it fits under ``cap`` everywhere, else None (numpy)."""
    gpus = np.fromiter(cap, dtype=np.int64, count=len(cap))
    size = int(gpus.max()) + 1 if len(gpus) else 0
    held = np.zeros(size, dtype=np.int64)
    if init:
        held[np.fromiter(init, np.int64, len(init))] = np.fromiter(init.values(), np.int64, len(init))
    pairs = [p for nd in nodes for p in nd.acquire]
    if pairs:
        arr = np.asarray(pairs, dtype=np.int64)
        np.add.at(held, arr[:, 0], arr[:, 1])  # exact int64 sums per GPU
    limit = np.zeros(size, dtype=np.int64)
    limit[gpus] = np.fromiter(cap.values(), np.int64, len(cap))
    if (held[gpus] > limit[gpus]).any():
        return None
    return dict(zip(gpus.tolist(), held[gpus].tolist(), strict=True))


def _topological(n: int, edges: Sequence[Edge]) -> tuple[list[int], list[list[int]]]:
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for e in edges:
        preds[e.dst].append(e.src)
        succs[e.src].append(e.dst)
    waiting = [len(p) for p in preds]
    out = [i for i in range(n) if not waiting[i]]
    for i in out:  # appended to while iterated: Kahn's algorithm in id order of discovery
        for s in succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                out.append(s)
    return out, preds


class Groups:
    """The per-unit nodes partitioned into groups, each member's round, each group's grouped node."""

    def __init__(self, nodes: Sequence[Node], edges: Sequence[Edge]) -> None:
        topo, preds = _topological(len(nodes), edges)
        if len(topo) != len(nodes):
            raise ValueError("transition DAG has a cycle")
        self.of = [-1] * len(nodes)
        self.members: list[list[int]] = []
        index: dict[tuple[object, ...], int] = {}
        for i in topo:
            nd = nodes[i]
            key = (
                nd.model_stage, nd.primitive, nd.est_s, nd.bytes, nd.source, len(nd.acquire),
                frozenset([self.of[p] for p in preds[i]]),
            )  # fmt: skip
            gid = index.get(key)
            if gid is None:
                gid = index[key] = len(self.members)
                self.members.append([])
            self.of[i] = gid
            self.members[gid].append(i)
        # GPU ports as ints (2·GPU send, 2·GPU + 1 receive), once
        self.ports = [[2 * g for g in nd.sends] + [2 * g + 1 for g in nd.recvs] for nd in nodes]
        self.round = [0] * len(nodes)
        self.rounds = [1] * len(self.members)
        for gid, mine in enumerate(self.members):
            if len(mine) > 1 and nodes[mine[0]].est_s > 0:
                self.rounds[gid] = self._colour(mine)
        self.edges = sorted({(self.of[e.src], self.of[e.dst]) for e in edges})

    def _colour(self, mine: list[int]) -> int:
        """Rounds of port-disjoint members (greedy colouring, members in id order)."""
        ports = self.ports
        every = [p for i in mine for p in ports[i]]
        if len(set(every)) == len(every):
            return 1  # no two members share a port: one round
        used: dict[int, set[int]] = {}
        top = 0
        for i in mine:
            mine_ports = ports[i]
            r = 0
            while any(r in used.get(p, ()) for p in mine_ports):
                r += 1
            for p in mine_ports:
                used.setdefault(p, set()).add(r)
            self.round[i] = r
            top = max(top, r)
        return top + 1

    def grouped_nodes(self, nodes: Sequence[Node]) -> tuple[Node, ...]:
        """One node per group, running ``rounds × est_s``. Its ports are port *classes*: the GPU
        ports its members use, merged where the same groups use them (a port of one group only
        never makes anyone wait), so a group holds a handful of ports instead of thousands."""
        users: dict[int, list[int]] = {}
        ports = self.ports
        for gid, mine in enumerate(self.members):
            for port in {p for i in mine for p in ports[i]}:
                users.setdefault(port, []).append(gid)
        classes: dict[tuple[int, ...], int] = {}
        for users_of in users.values():
            if len(users_of) > 1:
                classes.setdefault(tuple(users_of), len(classes))
        held: list[list[int]] = [[] for _ in self.members]
        for shared, c in classes.items():
            for gid in shared:
                held[gid].append(c)
        out = []
        for gid, mine in enumerate(self.members):
            first = nodes[mine[0]]
            out.append(
                Node(
                    id=gid, primitive=first.primitive, model_stage=first.model_stage, gpus=(),
                    bytes=first.bytes * len(mine), est_s=first.est_s * self.rounds[gid],
                    sends=tuple(held[gid]), source=first.source,
                )
            )  # fmt: skip
        return tuple(out)


def _priority_order(
    gnodes: Sequence[Node], preds: list[list[int]], succs: list[list[int]], key: Sequence[tuple[int, ...]]
) -> tuple[int, ...]:
    """The groups in a topological order, smallest ``key`` first among the ready ones."""
    waiting = [len(set(p)) for p in preds]
    heap = [(key[i], i) for i in range(len(gnodes)) if not waiting[i]]
    heapq.heapify(heap)
    out = []
    while heap:
        _, i = heapq.heappop(heap)
        out.append(i)
        for s in succs[i]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(heap, (key[s], s))
    return tuple(out)


def plan_grouped(
    nodes: list[Node],
    edges: list[Edge],
    units: dict[str, Emu],
    init: Mapping[int, int],
    cap: Mapping[int, int],
    stage_rank: Mapping[str, int],
    order_of: Mapping[str, int],
    classes: Sequence[Mapping[Primitive, int]],
    force: bool = False,
) -> tuple[TransitionDag, Schedule] | None:
    """The per-unit DAG and the expanded grouped schedule, or None where grouping does not apply
    (fewer than ``GROUP_MIN_NODES`` nodes or too little to group, unless ``force``; memory too
    tight for the no-wait ledger, always)."""
    if not force and len(nodes) < GROUP_MIN_NODES:
        return None
    peak = room_for_everything(nodes, init, cap)
    if peak is None:
        return None
    groups = Groups(nodes, edges)
    if not force and len(groups.members) * GROUP_MIN_RATIO > len(nodes):
        return None
    gnodes = groups.grouped_nodes(nodes)
    gsched = schedule_groups(gnodes, groups.edges, cap, stage_rank, order_of, classes)
    return expand_schedule(nodes, edges, units, groups, gsched, peak, cap)


def schedule_groups(
    gnodes: Sequence[Node],
    gedges: Sequence[tuple[int, int]],
    cap: Mapping[int, int],
    stage_rank: Mapping[str, int],
    order_of: Mapping[str, int],
    classes: Sequence[Mapping[Primitive, int]],
) -> Schedule:
    """The best list schedule of the grouped DAG over both commit orders' priorities."""
    edges = tuple(Edge(a, b, EdgeKind.LOCAL) for a, b in gedges)
    gpreds: list[list[int]] = [[] for _ in gnodes]
    gsuccs: list[list[int]] = [[] for _ in gnodes]
    for a, b in gedges:
        gpreds[b].append(a)
        gsuccs[a].append(b)
    best: Schedule | None = None
    bound: float | None = None
    for cls in classes:
        key = [
            (cls[g.primitive], stage_rank.get(g.model_stage, 0), order_of.get(g.model_stage, 0), g.id)
            for g in gnodes
        ]
        gdag = TransitionDag(
            tuple(gnodes), edges, {}, _priority_order(gnodes, gpreds, gsuccs, key), {}, dict(cap), True
        )
        prep = Prepared(gdag)
        if bound is None:  # the same for every order: local edges and ports only
            bound = lower_bound(gdag, prep)
        sched = best_schedule(gdag, bound=bound, prep=prep)
        if best is None or sched.makespan < best.makespan - 1e-12:
            best = sched
        if best.makespan <= bound * (1 + 1e-9):
            break  # no order does better than the bound
    assert best is not None
    return best


def signatures(nodes: Sequence[Node], groups: Groups) -> list[tuple[object, ...]]:
    """Each group as (model-stage, primitive, seconds, bytes, acquisitions, members, rounds, the
    signatures of its predecessors): what a replica class must equal (``classes.py``)."""
    preds: list[set[int]] = [set() for _ in groups.members]
    for a, b in groups.edges:
        preds[b].add(a)
    out: list[tuple[object, ...]] = []
    for gid, mine in enumerate(groups.members):  # group edges go from earlier groups to later ones
        nd = nodes[mine[0]]
        out.append((
            nd.model_stage, nd.primitive, nd.est_s, nd.bytes, len(nd.acquire), len(mine),
            groups.rounds[gid], frozenset(out[p] for p in preds[gid]),
        ))  # fmt: skip
    return out


def match(
    nodes: Sequence[Node], edges: Sequence[Edge], sigs: Sequence[tuple[object, ...]]
) -> tuple[Groups, list[int]] | None:
    """The per-unit nodes' groups and each group's class (``sigs``: each class's signature), when
    the groups are the classes one for one; else None."""
    groups = Groups(nodes, edges)
    mine = signatures(nodes, groups)
    where = {s: i for i, s in enumerate(sigs)}
    if len(where) != len(sigs) or len(set(mine)) != len(mine) or set(mine) != set(where):
        return None
    return groups, [where[s] for s in mine]


def expand_onto(
    nodes: list[Node],
    edges: list[Edge],
    units: dict[str, Emu],
    init: Mapping[int, int],
    cap: Mapping[int, int],
    sigs: Sequence[tuple[object, ...]],
    sched: Schedule,
) -> tuple[TransitionDag, Schedule] | None:
    """The per-unit DAG with the class schedule ``sched`` expanded onto it, when its groups are
    the classes one for one (``sigs``: each class's signature, in ``sched``'s node order); None
    when they are not or memory lacks room for every acquisition."""
    peak = room_for_everything(nodes, init, cap)
    found = match(nodes, edges, sigs) if peak is not None else None
    if peak is None or found is None:
        return None
    groups, to = found
    return lay_onto(nodes, edges, units, groups, to, sched, peak, cap)


def lay_onto(
    nodes: list[Node],
    edges: list[Edge],
    units: dict[str, Emu],
    groups: Groups,
    to: Sequence[int],
    sched: Schedule,
    peak: dict[int, int],
    cap: Mapping[int, int],
    rank: Sequence[int] | None = None,
) -> tuple[TransitionDag, Schedule]:
    """The class schedule ``sched`` laid onto the per-unit DAG (``to``: each group's class;
    ``expand_schedule`` with ``rank`` per group)."""
    start = tuple(sched.start[c] for c in to)
    finish = tuple(sched.finish[c] for c in to)
    back = {c: g for g, c in enumerate(to)}
    path = tuple(back[c] for c in sched.critical_path)
    gsched = Schedule(start, finish, sched.makespan, path, sched.priority)
    dag, out = expand_schedule(nodes, edges, units, groups, gsched, peak, cap, rank)
    return dag, Schedule(out.start, out.finish, out.makespan, out.critical_path, f"class {sched.priority}")


def expand_schedule(
    nodes: list[Node],
    edges: list[Edge],
    units: dict[str, Emu],
    groups: Groups,
    gsched: Schedule,
    peak: dict[int, int],
    cap: Mapping[int, int],
    rank: Sequence[int] | None = None,
) -> tuple[TransitionDag, Schedule]:
    """Member k of a group starts at the group's start plus its round × ``est_s``; the order is
    by group start, then the group's ``rank`` (default its id: a topological order of the local
    edges), then the round."""
    n = len(nodes)
    of, rnd = groups.of, groups.round
    gstart = gsched.start
    start = [gstart[of[i]] + rnd[i] * nodes[i].est_s for i in range(n)]
    gfinish = gsched.finish  # a member's end never passes its group's (float sums may)
    finish = [min(s + nd.est_s, gfinish[of[i]]) for i, (s, nd) in enumerate(zip(start, nodes, strict=True))]
    place = rank if rank is not None else range(len(groups.members))
    order = tuple(sorted(range(n), key=lambda i: (gstart[of[i]], place[of[i]], rnd[i], i)))
    # the grouped critical path, each group by its member that finishes last
    path = tuple(max(groups.members[g], key=lambda i: (finish[i], -i)) for g in gsched.critical_path)
    makespan = max(finish, default=0.0)
    dag = TransitionDag(tuple(nodes), tuple(edges), units, order, peak, dict(cap), True)
    return dag, Schedule(tuple(start), tuple(finish), makespan, path, f"grouped {gsched.priority}")
