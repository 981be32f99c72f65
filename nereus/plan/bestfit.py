"""Best fit on a pool of free GPUs, and what it does to the groups of one model-stage.

``FreeGpus`` is placement's view of the pool (``nereus.plan.placement``): free GPU ids per node,
nodes bucketed by how many they have free; a replica that fits in a node takes the fullest node
that still fits it, a larger one whole free nodes first, and a replica no node can hold (a
fragmented pool: spot instances smaller than a node) is filled from the nodes with most free GPUs,
so its TP groups, its pipeline neighbours and its replicas' DP groups may cross nodes (on nodes of
6 or 12 GPUs each node gives it whole TP groups while one holds a TP group).

The cost model prices links from this (``group_spans``): the pool's *occupancy* (free GPUs per
node, largest first: a small hashable summary the planner's caches key on, ``()`` when every node
is whole) replayed through the same best fit, one model-stage alone on the pool, gives per DP degree
how many nodes the worst TP group, the worst replica and the worst DP group span. Approximations,
measured against ``place`` in ``tests/test_plan_pool_links.py``: the model-stages of one stage
share the pool there (each is priced as if it had it alone), nodes with equal free GPUs are
interchangeable here (placement breaks ties by node id), and the anchor and reserved-first rules
are not replayed. On whole nodes of a power of two GPUs the spans are the layout's (groups inside a
node when they fit); whole nodes of another size (6, 12) are replayed like a fragmented pool, and
there a TP group or replica smaller than a node that does not divide it (8 of 12, 4 of 6) is
priced between nodes unless its model-stage is placed alone on the pool: the room best fit found
for it alone may go to a stage-mate. Groups that divide the node never straddle one on whole
nodes (replicas go largest first, so every node's free GPUs stay a multiple of the group), so
what is priced inside a node is placed inside one.
A model-stage of the running plan that stays where it is at its shape is priced where it runs
(``anchored``): so the controller's price of the running plan, and the ideal seconds the
simulator pairs its telemetry with, read the links the plan uses, stage-mates and all.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from nereus.errors import InfeasibleError
from nereus.plan.layout import Candidate, Plan
from nereus.plan.problem import PlanningProblem
from nereus.plan.replica import FloatArray
from nereus.spec.workload import ExecutionMode, ModelStage, Stage, Workflow

Occupancy = tuple[int, ...]
# a running model-stage priced where it runs: (name, tp, pp, dp, (TP, replica, DP) spans)
Anchored = tuple[str, int, int, int, tuple[float, float, float]]


def occupancy(pool: Sequence[int], gpus_per_node: int) -> Occupancy:
    """Free GPUs per node of ``pool``, largest first; ``()`` when every node is whole and the
    node holds a power of two of GPUs. Groups (powers of two) tile such a node, so each lies in
    one node or spans whole ones; on nodes of 6 or 12 GPUs best fit leaves remainders that a
    later TP group or replica straddles, so those pools keep their profile even when whole."""
    counts = np.bincount(np.asarray(pool, dtype=np.int64) // gpus_per_node)
    counts = counts[counts > 0]
    tiled = gpus_per_node & (gpus_per_node - 1) == 0
    if tiled and bool((counts == gpus_per_node).all()):
        return ()
    return tuple(sorted((int(c) for c in counts), reverse=True))


def pool_span(pool: Sequence[int], gpus_per_node: int) -> float:
    """The span of a group holding GPUs on every node of ``pool``: its size on one node, the
    GPUs of its nodes otherwise (beyond one node's: priced between nodes)."""
    nodes = len({g // gpus_per_node for g in pool})
    return float(len(pool) if nodes <= 1 else nodes * gpus_per_node)


class FreeGpus:
    """Free GPU ids per node, with nodes bucketed by how many GPUs they have free."""

    def __init__(self, gpus: Sequence[int], gpus_per_node: int) -> None:
        self.gpn = gpus_per_node
        self.nodes: dict[int, list[int]] = {}
        for g in sorted(gpus):
            self.nodes.setdefault(g // gpus_per_node, []).append(g)
        self.free = len(gpus)
        self.buckets: list[list[int]] = [[] for _ in range(gpus_per_node + 1)]
        for node, free in self.nodes.items():  # node ids ascending: each bucket sorted
            self.buckets[len(free)].append(node)

    def _first(self, free: int, prefer: frozenset[int]) -> int:
        """The node to take from bucket ``free``: the first (lowest id) of those in ``prefer``
        (nodes), else the first. Nodes of one bucket have as many GPUs free, so preferring
        among them changes no best-fit choice the cost model's replay (``occupancy``) priced."""
        bucket = self.buckets[free]
        if prefer:
            for node in bucket:
                if node in prefer:
                    return node
        return bucket[0]

    def take(self, count: int, tp: int = 1, prefer: frozenset[int] = frozenset()) -> tuple[int, ...]:
        """``count`` free GPUs for one replica whose TP groups are runs of ``tp`` of them: the
        fullest node that still fits it, else whole free nodes, then the nodes with most free
        GPUs. On nodes of 6 or 12 GPUs each node gives whole TP groups while some node holds
        one (8 + 8 for a tp8·pp2 replica on nodes of 12, not 12 + 4; 4 + 4 for tp4·pp2 on
        what async generation left, not 6 + 2), and what no node holds straddles, the
        replica's own nodes first. On nodes of a power of two GPUs a TP group that fits
        divides the node, and whole nodes (replicas largest first) keep every node's free
        GPUs a multiple of it; their fragmented pools are filled as they always were.
        ``prefer``: nodes to take from first among equally free ones (a weight-sync receiver's
        trainer's nodes: the sync then stays inside them)."""
        if count > self.free:
            raise InfeasibleError(f"placement needs {count} more GPUs, {self.free} free")
        if count <= self.gpn:
            for free in range(count, self.gpn + 1):  # best fit: the fullest node that still fits
                if self.buckets[free]:
                    return self._pop(self._first(free, prefer), count)
        tiled = self.gpn & (self.gpn - 1) == 0  # every TP group that fits divides the node
        unit = 1 if tiled or tp >= self.gpn else tp  # what each node gives: whole TP groups
        whole = self.gpn // unit * unit  # what a whole node gives: all of it when tp divides it
        taken: list[int] = []
        while count - len(taken) >= whole and self.buckets[self.gpn]:
            taken.extend(self._pop(self._first(self.gpn, prefer), whole))  # whole free nodes
        while len(taken) < count:  # ragged pool: fill from the nodes with most free GPUs
            free = max(f for f in range(1, self.gpn + 1) if self.buckets[f])
            if free < unit:  # no node holds a TP group: the rest straddles nodes
                break
            node = self._first(free, prefer)
            taken.extend(self._pop(node, min(count - len(taken), free // unit * unit)))
        rest: list[int] = []
        # what the replica's own nodes have left first (no node more), then the most free
        own = sorted(
            {g // self.gpn for g in taken} & self.nodes.keys(), key=lambda n: (-len(self.nodes[n]), n)
        )
        while len(taken) + len(rest) < count:
            if own:
                node = own.pop(0)
            else:
                node = self.buckets[max(f for f in range(1, self.gpn + 1) if self.buckets[f])][0]
            rest.extend(self._pop(node, min(count - len(taken) - len(rest), len(self.nodes[node]))))
        # ids ascending: each node's GPUs a run (of whole TP groups), the straddling rest last
        return tuple(sorted(taken)) + tuple(sorted(rest))

    def take_block(self, count: int) -> tuple[int, ...] | None:
        """``count`` GPUs of one node — the fullest node that holds them all (best fit on the
        block) — or nothing (None) when no node has ``count`` free."""
        for free in range(count, self.gpn + 1) if count <= self.gpn else ():
            if self.buckets[free]:
                return self._pop(self.buckets[free][0], count)
        return None

    def take_within(self, count: int, allowed: frozenset[int]) -> tuple[int, ...] | None:
        """Take ``count`` free GPUs all in ``allowed`` — one node's when ``count`` fits in a node
        (best fit), else the fewest nodes — or nothing (None) when ``allowed`` lacks them."""
        usable = {n: [g for g in free if g in allowed] for n, free in self.nodes.items()}
        usable = {n: gs for n, gs in usable.items() if gs}
        chosen: list[int] = []
        if count <= self.gpn:
            fits = [n for n, gs in usable.items() if len(gs) >= count]
            if not fits:
                return None
            node = min(fits, key=lambda n: (len(usable[n]), n))
            chosen = usable[node][:count]
        else:
            for node in sorted(usable, key=lambda n: (-len(usable[n]), n)):
                chosen.extend(usable[node][: count - len(chosen)])
                if len(chosen) == count:
                    break
            if len(chosen) < count:
                return None
        taken = self.take_exactly(chosen)
        assert taken
        return tuple(sorted(chosen))

    def holds(self, gpus: Sequence[int]) -> bool:
        """Whether every one of these GPUs is free."""
        gpn, nodes = self.gpn, self.nodes
        return all(g // gpn in nodes and g in nodes[g // gpn] for g in gpus)

    def take_exactly(self, gpus: Sequence[int]) -> bool:
        """Take these GPUs if every one is free; otherwise take nothing."""
        gpn, nodes = self.gpn, self.nodes
        wanted: dict[int, set[int]] = {}
        for g in gpus:
            wanted.setdefault(g // gpn, set()).add(g)
        if not all(n in nodes and gs.issubset(nodes[n]) for n, gs in wanted.items()):
            return False
        for node, gs in wanted.items():  # a node's bucket: by its free count, ids ascending
            free = nodes[node]
            self.buckets[len(free)].remove(node)
            rest = [g for g in free if g not in gs]
            self.free -= len(free) - len(rest)
            if rest:
                nodes[node] = rest
                bisect.insort(self.buckets[len(rest)], node)
            else:
                del nodes[node]
        return True

    def _pop(self, node: int, count: int) -> tuple[int, ...]:
        free = self.nodes[node]
        self.buckets[len(free)].remove(node)
        taken, rest = free[:count], free[count:]
        self.free -= len(taken)
        if rest:
            self.nodes[node] = rest
            bisect.insort(self.buckets[len(rest)], node)
        else:
            del self.nodes[node]
        return tuple(taken)


def _nodes(gpus: Sequence[int], gpn: int) -> int:
    return len({g // gpn for g in gpus})


@functools.lru_cache(maxsize=512)
def _spread(profile: Occupancy, gpn: int, size: int, tp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicas of ``size`` GPUs (TP ``tp``) placed on a pool of this occupancy as placement
    places them: d replicas that fit one node together go into one node when one has room for
    them all (``FreeGpus.take_block``), else one by one by best fit. For each DP degree d (index
    d), the nodes spanned by the worst TP group, the worst replica and the worst DP group (one rank
    position across replicas) of the first d."""
    pool = [n * gpn + i for n, free in enumerate(profile) for i in range(free)]
    free = FreeGpus(pool, gpn)
    count = len(pool) // size
    tp_n, rep_n, dp_n = (np.ones(count + 1, dtype=np.int64) for _ in range(3))
    positions: list[set[int]] = [set() for _ in range(size)]
    worst = (1, 1, 1)
    roomiest = max(profile)
    for d in range(1, count + 1):
        gpus = free.take(size, tp)
        for i, g in enumerate(gpus):
            positions[i].add(g // gpn)
        worst = (
            max(worst[0], *(_nodes(gpus[i : i + tp], gpn) for i in range(0, size, tp))),
            max(worst[1], _nodes(gpus, gpn)),
            max(len(p) for p in positions),
        )
        tp_n[d], rep_n[d], dp_n[d] = (1, 1, 1) if d * size <= roomiest else worst
    return tp_n, rep_n, dp_n


def alone_on_pool(workflow: Workflow, mode: ExecutionMode, model_stage: ModelStage) -> bool:
    """Whether placement places ``model_stage`` by itself on the whole pool: the only
    model-stage of its stage, in sync mode or as async generation (async inference and
    training share what generation leaves)."""
    return len(workflow.by_stage(model_stage.stage)) == 1 and (
        mode is ExecutionMode.SYNC or model_stage.stage is Stage.GEN
    )


def group_spans(
    profile: Occupancy,
    gpus_per_node: int,
    tp: FloatArray,
    size: FloatArray,
    dp: FloatArray,
    alone: bool = False,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Per row, the spans (GPUs, in the cost model's sense: ≤ GPUs per node is inside a node,
    else ⌈span / GPUs per node⌉ nodes) its TP groups, replicas and DP groups take when placed by
    best fit on a pool of ``profile``; on whole nodes (``()``) the layout's own: tp, size and
    size·dp. A TP group or replica smaller than a node that does not divide it (8 GPUs on nodes
    of 12, 4 on nodes of 6) is priced between nodes (at least two) unless the model-stage is
    placed ``alone`` on the pool (``alone_on_pool``): best fit keeps it inside a node when one has
    room, but its stage-mates, placed from the same pool and priced apart, may leave none, and
    a price must never be below what placement gives (on a pool of one node nothing straddles).
    Groups that divide the node never straddle on whole nodes (``FreeGpus.take``), so their price
    is exact."""
    whole = (tp, size, size * dp)
    if not profile:
        return whole
    gpn = float(gpus_per_node)
    spans = [np.array(s, dtype=np.float64, copy=True) for s in np.broadcast_arrays(*whole)]
    t, s = np.broadcast_to(tp, spans[0].shape), np.broadcast_to(size, spans[0].shape)
    d = np.broadcast_to(dp, spans[0].shape).astype(np.int64)
    for ti, si in {(int(a), int(b)) for a, b in zip(t.ravel(), s.ravel(), strict=True)}:
        rows = (t == ti) & (s == si)
        nodes = _spread(profile, gpus_per_node, si, ti)
        at = np.minimum(d[rows], len(nodes[0]) - 1)
        for span, n, inside in zip(spans, nodes, (ti, si, si * d[rows]), strict=True):
            k = n[at]
            span[rows] = np.where(k > 1, k * gpn, np.minimum(inside, gpn))
        for span, members in ((spans[0], ti), (spans[1], si)) if not alone and len(profile) > 1 else ():
            if members < gpus_per_node and gpus_per_node % members:  # does not tile the node
                span[rows] = np.maximum(span[rows], 2.0 * gpn)  # so between nodes
    return spans[0], spans[1], spans[2]


def _span(nodes: int, inside: float, gpn: int) -> float:
    return float(nodes * gpn) if nodes > 1 else float(min(inside, gpn))


def placed_spans(c: Candidate, gpus_per_node: int) -> tuple[float, float, float]:
    """The spans of a placed candidate's worst TP group, replica and DP group, from its GPU ids
    (the cost model's sense, as ``group_spans``)."""
    gpn, size = gpus_per_node, c.layout.size
    nodes = np.asarray(c.gpus, dtype=np.int64) // gpn
    tp_n = _most_nodes(nodes.reshape(-1, c.layout.tp))  # TP groups: consecutive runs of tp
    rep_n = _most_nodes(nodes.reshape(c.dp, size))  # replicas: consecutive runs of size
    dp_n = _most_nodes(nodes.reshape(c.dp, size).T) if c.dp > 1 else -(-size // gpn)  # a rank position
    return _span(tp_n, c.layout.tp, gpn), _span(rep_n, size, gpn), _span(dp_n, size * c.dp, gpn)


def _most_nodes(groups: np.ndarray) -> int:
    """The most distinct nodes any row of ``groups`` (node ids, one group per row) spans."""
    if groups.shape[1] < 2:
        return 1
    ordered = np.sort(groups, axis=1)
    return int((ordered[:, 1:] != ordered[:, :-1]).sum(axis=1).max()) + 1


def _normal(span: float, gpn: int) -> float:
    """A span as whole nodes once it leaves one (what the links read of it)."""
    return span if span <= gpn else float(-(-span // gpn) * gpn)


def anchored(problem: PlanningProblem) -> tuple[Anchored, ...]:
    """Model-stages of the running plan (``problem.anchor``) that placement keeps where they are
    at their shape (every GPU still in the pool: same layout and DP degree stay put) and whose
    groups span other nodes there than best fit on the pool's occupancy predicts — say a
    model-stage placed after a stage-mate took the whole nodes. The cost model prices those
    shapes where they run, so the running plan's price (and the ideal seconds its telemetry is
    paired with) reads the links it uses."""
    plan = problem.anchor
    if plan is None:
        return ()
    gpn = problem.cluster.gpus_per_node
    pool = tuple(problem.pool)
    key = (id(plan), gpn, pool)
    with _ANCHORED_LOCK:
        found = _ANCHORED.get(key)
        if found is not None and found[0] is plan:
            _ANCHORED.move_to_end(key)
            return found[1]
    result = _anchored(plan, gpn, pool)
    with _ANCHORED_LOCK:
        _ANCHORED[key] = (plan, result)  # the plan held: its id stays unique while the entry lives
        while len(_ANCHORED) > ANCHORED_KEEP:
            _ANCHORED.popitem(last=False)
    return result


# ``anchored`` of the newest (plan, GPUs per node, pool): a replan asks it of every model-stage's
# price key and cost model, and the controller replans one running plan on one pool many times
ANCHORED_KEEP = 16
_ANCHORED_LOCK = threading.Lock()
_ANCHORED: OrderedDict[tuple[int, int, tuple[int, ...]], tuple[Plan, tuple[Anchored, ...]]] = OrderedDict()


def _anchored(plan: Plan, gpn: int, pool_ids: tuple[int, ...]) -> tuple[Anchored, ...]:
    pool = set(pool_ids)
    profile = occupancy(pool_ids, gpn)
    out: list[Anchored] = []
    for c in plan.candidates:
        if c.dp < 1 or not pool.issuperset(c.gpus):
            continue
        lay = c.layout
        one = np.array([float(lay.tp)]), np.array([float(lay.size)]), np.array([float(c.dp)])
        alone = alone_on_pool(plan.workflow, plan.mode, plan.workflow.get(c.model_stage))
        fit = tuple(_normal(float(x[0]), gpn) for x in group_spans(profile, gpn, *one, alone=alone))
        where = placed_spans(c, gpn)
        if c.dp == 1:  # no DP collective: its span reads nothing
            where = (where[0], where[1], fit[2])
        if where != fit:
            out.append((c.model_stage, lay.tp, lay.pp, c.dp, where))
    return tuple(out)
