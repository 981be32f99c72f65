"""The list scheduler: when each node of a transition DAG runs, and the makespan L_tran.

A node starts when its predecessors have finished and its GPU ports (send, receive) are free;
among startable nodes the greedy commit order decides. Ports model shared-link contention: two
transfers into one GPU take turns, as they would share its bandwidth. Memory needs no check
here: the DAG's edges already guarantee the ledger bound for every execution order.

The critical path is traced back from the last node through whatever made each node wait: a
predecessor or the previous user of one of its ports.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from nereus.transition.dag import EdgeKind, TransitionDag


@dataclass(frozen=True, slots=True)
class Schedule:
    start: tuple[float, ...]
    finish: tuple[float, ...]
    makespan: float
    critical_path: tuple[int, ...]
    priority: str = "commit"  # which order broke ties among startable nodes

    def order(self) -> tuple[int, ...]:
        """Nodes by start time (ties by id): the order an executor launches them in."""
        return tuple(sorted(range(len(self.start)), key=lambda i: (self.start[i], i)))


def tail_priority(dag: TransitionDag, durations: Sequence[float] | None = None) -> tuple[int, ...]:
    """Nodes by longest remaining path to the end (ties: commit order)."""
    dur = [float(x) for x in durations] if durations is not None else [nd.est_s for nd in dag.nodes]
    succs: list[list[int]] = [[] for _ in dag.nodes]
    for e in dag.edges:
        succs[e.src].append(e.dst)
    tail = [0.0] * len(dag.nodes)
    for i in reversed(dag.order):
        tail[i] = dur[i] + max((tail[s] for s in succs[i]), default=0.0)
    rank = {node: r for r, node in enumerate(dag.order)}
    return tuple(sorted(rank, key=lambda i: (-tail[i], rank[i])))


def lower_bound(dag: TransitionDag) -> float:
    """No schedule of ``dag``'s nodes is shorter: the longest path through its local edges, or
    the busiest port's total work (resource edges are choices, so they do not count)."""
    preds: list[list[int]] = [[] for _ in dag.nodes]
    for e in dag.edges:
        if e.kind is EdgeKind.LOCAL:
            preds[e.dst].append(e.src)
    finish = [0.0] * len(dag.nodes)
    for i in dag.order if len(dag.order) == len(dag.nodes) else range(len(dag.nodes)):
        finish[i] = max((finish[p] for p in preds[i]), default=0.0) + dag.nodes[i].est_s
    work: dict[tuple[int, int], float] = {}
    for nd in dag.nodes:
        for port in nd.ports:
            work[port] = work.get(port, 0.0) + nd.est_s
    return max(max(finish, default=0.0), max(work.values(), default=0.0))


def best_schedule(
    dag: TransitionDag, durations: Sequence[float] | None = None, bound: float | None = None
) -> Schedule:
    """The shorter of the commit-order and the longest-remaining-path list schedules.

    Commit order is release-before-acquire and stage order; it can start a long Split before
    short copies that gate the critical path. The second pass is skipped when the first already
    meets ``bound`` (a lower bound on the makespan, see ``lower_bound``).
    """
    commit = list_schedule(dag, durations)
    if len(dag.order) != len(dag.nodes) or (bound is not None and commit.makespan <= bound * (1 + 1e-9)):
        return commit
    tail = list_schedule(dag, durations, tail_priority(dag, durations), "critical-path")
    return tail if tail.makespan < commit.makespan - 1e-12 else commit


def list_schedule(
    dag: TransitionDag,
    durations: Sequence[float] | None = None,
    priority: Sequence[int] | None = None,
    label: str = "commit",
) -> Schedule:
    """Schedule every node of ``dag`` (durations default to each node's ``est_s``).

    ``priority`` lists the nodes most urgent first (default: the DAG's commit order).
    """
    nodes = dag.nodes
    n = len(nodes)
    if not n:
        return Schedule((), (), 0.0, (), label)
    dur = [float(x) for x in durations] if durations is not None else [nd.est_s for nd in nodes]
    preds = dag.preds()
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in set(ps):
            succs[p].append(i)
    waiting = [len(set(ps)) for ps in preds]
    order = priority if priority is not None else dag.order
    rank = {node: r for r, node in enumerate(order)} if len(order) == n else {i: i for i in range(n)}
    ports = [nd.ports for nd in nodes]
    busy: set[tuple[int, int]] = set()
    last_user: dict[tuple[int, int], int] = {}
    parked: dict[tuple[int, int], list[int]] = {}  # ready nodes waiting for a busy port
    start = [0.0] * n
    finish = [0.0] * n
    why = [-1] * n
    candidates = [(rank[i], i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(candidates)
    running: list[tuple[float, int]] = []
    now, done = 0.0, 0
    while done < n:
        while candidates:
            _, i = heapq.heappop(candidates)
            blocked = next((port for port in ports[i] if port in busy), None)
            if blocked is not None:
                parked.setdefault(blocked, []).append(i)
                continue
            start[i] = now
            finish[i] = now + dur[i]
            causes = list(preds[i]) + [last_user[port] for port in ports[i] if port in last_user]
            if causes:
                why[i] = max(causes, key=finish.__getitem__)
            for port in ports[i]:
                busy.add(port)
                last_user[port] = i
            heapq.heappush(running, (finish[i], i))
        if not running:
            raise RuntimeError("transition DAG has a cycle or an unreachable node")
        now = running[0][0]
        while running and running[0][0] <= now:
            _, i = heapq.heappop(running)
            done += 1
            for port in ports[i]:
                busy.discard(port)
                for j in parked.pop(port, ()):
                    heapq.heappush(candidates, (rank[j], j))
            for s in succs[i]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    heapq.heappush(candidates, (rank[s], s))
    end = max(range(n), key=finish.__getitem__)
    path = [end]
    while why[path[-1]] >= 0:
        path.append(why[path[-1]])
    return Schedule(tuple(start), tuple(finish), finish[end], tuple(reversed(path)), label)
