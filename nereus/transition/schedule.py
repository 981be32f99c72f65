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

from nereus.transition.dag import TransitionDag


@dataclass(frozen=True, slots=True)
class Schedule:
    start: tuple[float, ...]
    finish: tuple[float, ...]
    makespan: float
    critical_path: tuple[int, ...]


def list_schedule(dag: TransitionDag, durations: Sequence[float] | None = None) -> Schedule:
    """Schedule every node of ``dag`` (durations default to each node's ``est_s``)."""
    nodes = dag.nodes
    n = len(nodes)
    if not n:
        return Schedule((), (), 0.0, ())
    dur = [float(x) for x in durations] if durations is not None else [nd.est_s for nd in nodes]
    preds = dag.preds()
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in set(ps):
            succs[p].append(i)
    waiting = [len(set(ps)) for ps in preds]
    rank = {node: r for r, node in enumerate(dag.order)} if len(dag.order) == n else {i: i for i in range(n)}
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
    return Schedule(tuple(start), tuple(finish), finish[end], tuple(reversed(path)))
