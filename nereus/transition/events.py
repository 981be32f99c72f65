"""A discrete-event executor of transition nodes: memory held per GPU, ports, launch times.

Two policies (paper §2.13, Table 5):

* ``RESPECT_EDGES``: Nereus. Every edge of the global DAG is honoured (local and resource) and
  memory is never checked before a start: the builder guarantees that any execution respecting
  the edges stays within capacity, so an acquisition that does not fit raises
  ``MemoryBoundError`` — a bug of the DAG, not a wait.
* ``INDEPENDENT``: the uncoordinated baseline (DynaRL-style). Only LOCAL edges count; a node
  starts once its local predecessors are done, its model-stage is launched, its ports are free
  and what it acquires fits *now* on every GPU, first come first served. When nothing runs and
  every remaining node waits for memory, the model-stages are deadlocked.

In both, a node acquires its bytes at its start and releases at its finish, as in the builder's
ledger, and the ports it occupies (shared links) serialise its transfers as in ``list_schedule``.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from nereus.transition.dag import Edge, EdgeKind, Node


class Policy(StrEnum):
    RESPECT_EDGES = "respect_edges"
    INDEPENDENT = "independent"


class MemoryBoundError(RuntimeError):
    """An execution of the global DAG went over a GPU's capacity (the builder's bound failed)."""


@dataclass(frozen=True, slots=True)
class Execution:
    """What happened: per-node times (NaN: never started), per-model-stage completion, memory."""

    start: tuple[float, ...]
    finish: tuple[float, ...]
    completion: dict[str, float]  # last finish of each model-stage's nodes; inf when unfinished
    deadlock: bool
    peak: dict[int, int]  # the most bytes each GPU held at any instant
    held: dict[int, int]  # bytes each GPU holds at the end
    live: frozenset[str]  # units alive at the end, of those the nodes touch

    @property
    def makespan(self) -> float:
        return max(self.completion.values(), default=0.0)

    @property
    def stalled(self) -> tuple[int, ...]:
        """Nodes that never started."""
        return tuple(i for i, s in enumerate(self.start) if math.isnan(s))


def execute(
    nodes: Sequence[Node],
    edges: Sequence[Edge],
    initial: Mapping[int, int],
    capacity: int | Mapping[int, int],
    policy: Policy,
    launch: Mapping[str, float] | None = None,
    durations: Sequence[float] | None = None,
    order: Sequence[int] | None = None,
) -> Execution:
    """Run ``nodes`` (ids 0..n−1) from ``initial`` bytes per GPU under ``capacity`` per GPU.

    ``launch`` gives each model-stage's start time (default 0), ``durations`` each node's seconds
    (default ``est_s``); among nodes ready at once the earliest-ready goes first, ties by ``order``
    (a priority, e.g. the builder's commit order; default the node id).
    """
    n = len(nodes)
    if any(nd.id != i for i, nd in enumerate(nodes)):
        raise ValueError("node ids must be 0..n-1 in order")
    launch = launch or {}
    dur = [float(x) for x in durations] if durations is not None else [nd.est_s for nd in nodes]
    rank = {x: r for r, x in enumerate(order)} if order is not None else {i: i for i in range(n)}
    respect = policy is Policy.RESPECT_EDGES
    preds: list[set[int]] = [set() for _ in range(n)]
    for e in edges:
        if respect or e.kind is EdgeKind.LOCAL:
            preds[e.dst].add(e.src)
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succs[p].append(i)

    def cap(g: int) -> int:
        return capacity if isinstance(capacity, int) else capacity.get(g, 0)

    need: list[dict[int, int]] = []
    for nd in nodes:
        acq: dict[int, int] = defaultdict(int)
        for g, b in nd.acquire:
            acq[g] += b
        need.append(dict(acq))

    held: dict[int, int] = defaultdict(int, initial)
    peak = dict(held)
    busy: set[tuple[int, int]] = set()
    waiting = [len(p) for p in preds]
    ready = [(launch.get(nodes[i].model_stage, 0.0), rank[i], i) for i in range(n) if not waiting[i]]
    running: list[tuple[float, int]] = []
    start, finish = [math.nan] * n, [math.nan] * n
    finished: list[int] = []  # in completion order (consistent with the edges)
    now = 0.0

    def fits(i: int) -> bool:
        return all(held[g] + b <= cap(g) for g, b in need[i].items())

    while True:
        ready.sort()
        still = []
        for item in ready:
            t, _, i = item
            if t > now or any(p in busy for p in nodes[i].ports):
                still.append(item)
                continue
            if not fits(i):
                if respect:
                    g = next(g for g, b in need[i].items() if held[g] + b > cap(g))
                    raise MemoryBoundError(
                        f"node {i} ({nodes[i].describe()}) at t={now:.3f}s: GPU {g} would hold "
                        f"{held[g] + need[i][g]} B > capacity {cap(g)} B"
                    )
                still.append(item)
                continue
            for g, b in need[i].items():
                held[g] += b
                peak[g] = max(peak.get(g, 0), held[g])
            busy.update(nodes[i].ports)
            start[i], finish[i] = now, now + dur[i]
            heapq.heappush(running, (finish[i], i))
        ready = still
        times = [t for t, _, _ in ready if t > now] + ([running[0][0]] if running else [])
        if not times:
            break
        now = min(times)
        while running and running[0][0] <= now:
            _, i = heapq.heappop(running)
            finished.append(i)
            busy.difference_update(nodes[i].ports)
            for g, b in nodes[i].release:
                held[g] -= b
            for s in succs[i]:
                waiting[s] -= 1
                if not waiting[s]:
                    ready.append((max(now, launch.get(nodes[s].model_stage, 0.0)), rank[s], s))

    completion: dict[str, float] = {}
    for i, nd in enumerate(nodes):
        f = finish[i] if not math.isnan(finish[i]) else math.inf
        completion[nd.model_stage] = max(completion.get(nd.model_stage, 0.0), f)
    made = {u for nd in nodes for u in nd.outputs}
    live = {u for nd in nodes for u in nd.inputs if u not in made}
    for i in finished:
        live.update(nodes[i].outputs)
        live.difference_update(nodes[i].frees)
    deadlock = len(finished) < n
    return Execution(tuple(start), tuple(finish), completion, deadlock, peak, dict(held), frozenset(live))
