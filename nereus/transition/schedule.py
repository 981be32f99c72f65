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
import random
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


class Prepared:
    """What every list schedule of one DAG reads, built once: predecessors (edge order),
    distinct successors, waiting counts and GPU ports as ints (2·GPU, 2·GPU + 1 = send, receive).
    ``best_schedule`` shares one between its passes."""

    __slots__ = ("dag", "ports", "preds", "succs", "waiting")

    def __init__(self, dag: TransitionDag) -> None:
        self.dag = dag
        nodes = dag.nodes
        self.preds = dag.preds()
        self.succs: list[list[int]] = [[] for _ in nodes]
        self.waiting: list[int] = []
        for i, ps in enumerate(self.preds):
            distinct = set(ps)
            self.waiting.append(len(distinct))
            for p in distinct:
                self.succs[p].append(i)
        self.ports = [tuple([2 * g for g in nd.sends] + [2 * g + 1 for g in nd.recvs]) for nd in nodes]


def _prepared(dag: TransitionDag, prep: Prepared | None) -> Prepared:
    return prep if prep is not None and prep.dag is dag else Prepared(dag)


def _durations(dag: TransitionDag, durations: Sequence[float] | None) -> list[float]:
    """Each node's duration: ``durations`` where given, else its ``est_s``."""
    return [float(x) for x in durations] if durations is not None else [nd.est_s for nd in dag.nodes]


def _tails(dag: TransitionDag, dur: Sequence[float], prep: Prepared | None) -> list[float]:
    """Each node's longest remaining path to the end, itself included."""
    succs = _prepared(dag, prep).succs
    tail = [0.0] * len(dag.nodes)
    for i in reversed(dag.order):
        tail[i] = dur[i] + max((tail[s] for s in succs[i]), default=0.0)
    return tail


def tail_priority(
    dag: TransitionDag, durations: Sequence[float] | None = None, prep: Prepared | None = None
) -> tuple[int, ...]:
    """Nodes by longest remaining path to the end (ties: commit order)."""
    tail = _tails(dag, _durations(dag, durations), prep)
    rank = {node: r for r, node in enumerate(dag.order)}
    return tuple(sorted(rank, key=lambda i: (-tail[i], rank[i])))


def lower_bound(
    dag: TransitionDag, prep: Prepared | None = None, durations: Sequence[float] | None = None
) -> float:
    """No schedule of ``dag``'s nodes is shorter: the longest path through its local edges, or
    the busiest port's total work (resource edges are choices, so they do not count). Durations
    default to each node's ``est_s``."""
    dur = _durations(dag, durations)
    preds: list[list[int]] = [[] for _ in dag.nodes]
    for e in dag.edges:
        if e.kind is EdgeKind.LOCAL:
            preds[e.dst].append(e.src)
    finish = [0.0] * len(dag.nodes)
    for i in dag.order if len(dag.order) == len(dag.nodes) else range(len(dag.nodes)):
        finish[i] = max((finish[p] for p in preds[i]), default=0.0) + dur[i]
    work: dict[int, float] = {}
    for d, ports in zip(dur, _prepared(dag, prep).ports, strict=True):
        for port in ports:
            work[port] = work.get(port, 0.0) + d
    return max(max(finish, default=0.0), max(work.values(), default=0.0))


def best_schedule(
    dag: TransitionDag,
    durations: Sequence[float] | None = None,
    bound: float | None = None,
    prep: Prepared | None = None,
    samples: int | None = None,
) -> Schedule:
    """The shorter of the commit-order and the longest-remaining-path list schedules, and of
    ``samples`` (default ``SAMPLES``, fewer on large DAGs) sampled ones where both stay more than
    ``SAMPLE_SLACK`` above ``bound`` (see ``sampled``).

    Commit order is release-before-acquire and stage order; it can start a long Split before
    short copies that gate the critical path. The second pass is skipped when the first already
    meets ``bound`` (a lower bound on the makespan, see ``lower_bound``).
    """
    prep = _prepared(dag, prep)
    commit = list_schedule(dag, durations, prep=prep)
    if len(dag.order) != len(dag.nodes) or (bound is not None and commit.makespan <= bound * (1 + 1e-9)):
        return commit
    tail = list_schedule(dag, durations, tail_priority(dag, durations, prep), "critical-path", prep)
    best = tail if tail.makespan < commit.makespan - 1e-12 else commit
    if bound is not None and best.makespan <= bound * (1 + SAMPLE_SLACK):
        return best
    if samples is None:
        samples = min(SAMPLES, SAMPLE_NODES // max(len(dag.nodes), 1))
    return sampled(dag, durations, best, prep, samples)


SAMPLES = 16  # extra list schedules where the two above stay this far above the lower bound
SAMPLE_SLACK = 0.05
SAMPLE_NODES = 4096  # fewer samples on larger DAGs: samples × nodes at most this


def sampled(
    dag: TransitionDag, durations: Sequence[float] | None, best: Schedule, prep: Prepared, samples: int
) -> Schedule:
    """``best`` or a shorter of ``samples`` list schedules by longest remaining path, each node's
    tail shortened by a random share (0 to 2×, fixed seed) of its own duration: between the longest
    remaining path and what follows the node once it is done. Non-delay list schedules can miss
    every short schedule when a long node takes the ports a short one needs to open a chain (a
    one-tick Split of actor.gen behind a 21-tick Extend of critic.train); these reach them."""
    n = len(dag.nodes)
    dur = _durations(dag, durations)
    tail = _tails(dag, dur, prep)
    rank = {node: r for r, node in enumerate(dag.order)}
    rng = random.Random(0)
    for _ in range(samples):
        key = [tail[i] - 2.0 * rng.random() * dur[i] for i in range(n)]
        s = list_schedule(dag, durations, sorted(range(n), key=lambda i: (-key[i], rank[i])), "sampled", prep)
        if s.makespan < best.makespan - 1e-12:
            best = s
    return best


def list_schedule(
    dag: TransitionDag,
    durations: Sequence[float] | None = None,
    priority: Sequence[int] | None = None,
    label: str = "commit",
    prep: Prepared | None = None,
) -> Schedule:
    """Schedule every node of ``dag`` (durations default to each node's ``est_s``).

    ``priority`` lists the nodes most urgent first (default: the DAG's commit order).
    """
    nodes = dag.nodes
    n = len(nodes)
    if not n:
        return Schedule((), (), 0.0, (), label)
    dur = _durations(dag, durations)
    prep = _prepared(dag, prep)
    preds, succs, ports = prep.preds, prep.succs, prep.ports
    waiting = list(prep.waiting)
    order = priority if priority is not None else dag.order
    rank = {node: r for r, node in enumerate(order)} if len(order) == n else {i: i for i in range(n)}
    busy: set[int] = set()
    last_user: dict[int, int] = {}
    parked: dict[int, list[int]] = {}  # ready nodes waiting for a busy port
    start = [0.0] * n
    finish = [0.0] * n
    why = [-1] * n
    candidates = [(rank[i], i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(candidates)
    running: list[tuple[float, int]] = []
    now, done = 0.0, 0
    pop, push = heapq.heappop, heapq.heappush
    while done < n:
        while candidates:
            _, i = pop(candidates)
            mine = ports[i]
            blocked = -1
            for port in mine:
                if port in busy:
                    blocked = port
                    break
            if blocked >= 0:
                parked.setdefault(blocked, []).append(i)
                continue
            start[i] = now
            end = finish[i] = now + dur[i]
            # what made i wait: the first of its predecessors, then its ports' last users, to
            # finish last
            cause, latest = -1, 0.0
            for p in preds[i]:
                if cause < 0 or finish[p] > latest:
                    cause, latest = p, finish[p]
            for port in mine:
                u = last_user.get(port, -1)
                if u >= 0 and (cause < 0 or finish[u] > latest):
                    cause, latest = u, finish[u]
            why[i] = cause
            for port in mine:
                busy.add(port)
                last_user[port] = i
            push(running, (end, i))
        if not running:
            raise RuntimeError("transition DAG has a cycle or an unreachable node")
        now = running[0][0]
        while running and running[0][0] <= now:
            _, i = pop(running)
            done += 1
            for port in ports[i]:
                busy.discard(port)
                for j in parked.pop(port, ()):
                    push(candidates, (rank[j], j))
            for s in succs[i]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    push(candidates, (rank[s], s))
    end = max(range(n), key=finish.__getitem__)
    path = [end]
    while why[path[-1]] >= 0:
        path.append(why[path[-1]])
    return Schedule(tuple(start), tuple(finish), finish[end], tuple(reversed(path)), label)
