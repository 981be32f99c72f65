"""Concrete GPU ids for chosen shapes: node-aware best fit (paper-notes §5.7 leaves it open).

Each stage's replicas are placed from the pool independently (stages are serialised and may share
GPUs; async generation takes its GPUs first and the rest share what remains). Replicas go largest
first, each on the node with the fewest free GPUs that still fits it (whole nodes for replicas
larger than a node; on nodes of 6 or 12 GPUs each node gives whole TP groups), so every TP
group and every replica that fits in a node stays in one node — the assumption the cost
model's link choice makes. On nodes of 6 or 12 GPUs a TP group or replica that does not divide
the node may find no node with room left (the cost model prices it between nodes); one that
divides it always finds one. A trainer's replicas that fit one node together go into the fullest
node that holds them all, so its DP group (the gradient all-reduce) stays inside one node too (one
by one, best fit would fill a part-used node first and split the group).
The trainers are placed first; a model-stage that loads a trainer's weights at the step boundary
(the actor's inference and generation, the critic's inference) then takes that trainer's nodes
first among equally free nodes, so its weight sync stays inside them (best fit still comes
first: on a pool async generation fragmented, a fuller node wins). Otherwise model-stages of a
size are visited in workflow order.

With failure domains (``FailureDomains``: reserved GPUs and revocable instances), placement is
reserved-first for trainers: one replica of every training model-stage — the only state that
cannot be restored from storage or a weight sync — goes on reserved GPUs when one fits there
(the running plan's replica if it already is, else the best-fitting reserved node), so a
revocation never takes a trainer's last copy. The other replicas are placed as above.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

from nereus.plan.bestfit import FreeGpus as _FreeGpus
from nereus.plan.bestfit import placed_spans
from nereus.plan.candidates import Shape
from nereus.plan.layout import Candidate, Plan
from nereus.spec.domains import FailureDomains
from nereus.spec.workload import ExecutionMode, ModelStage, Stage, Workflow

MAX_ORDERS = 720  # orders of trainers tried for the reserved GPUs (6 trainers; RL jobs have 1–2)
STEP_LOSS = 0.01  # ranking horizon for exposure: each revocable instance lost with this probability


def _place_group(
    model_stages: Sequence[ModelStage],
    shapes: Mapping[str, Shape],
    free: _FreeGpus,
    anchor: Plan | None,
    domains: FailureDomains | None = None,
    prefer: Mapping[str, frozenset[int]] | None = None,
) -> list[Candidate]:
    prefer = prefer or {}
    owned: dict[str, list[tuple[int, ...]]] = {ms.name: [] for ms in model_stages}
    if domains is not None:
        owned.update(_reserved_first(model_stages, shapes, free, anchor, domains))
    todo: list[tuple[str, int]] = []
    trainers = {ms.name for ms in model_stages if ms.stage is Stage.TRAIN}
    for ms in model_stages:
        kept = _anchored(ms.name, shapes[ms.name], free, anchor, shapes[ms.name].dp - len(owned[ms.name]))
        owned[ms.name].extend(kept)
        todo.append((ms.name, shapes[ms.name].dp - len(owned[ms.name])))
    # largest first; of a size, those with nodes to prefer first (before others take them);
    # stable: workflow order kept
    todo.sort(key=lambda item: (-shapes[item[0]].layout.size, item[0] not in prefer))
    for name, count in todo:
        size = shapes[name].layout.size
        # a trainer's replicas that fit one node together share one: its DP group (gradient
        # all-reduce) stays inside it. Replicas with no DP collective fill part-used nodes first.
        block = free.take_block(count * size) if count > 1 and name in trainers else None
        if block is not None:
            owned[name].extend(block[i * size : (i + 1) * size] for i in range(count))
            continue
        for _ in range(count):
            owned[name].append(free.take(size, shapes[name].layout.tp, prefer.get(name, frozenset())))
    return [
        Candidate(
            ms.name,
            shapes[ms.name].layout,
            shapes[ms.name].dp,
            tuple(g for rep in owned[ms.name] for g in rep),
            shapes[ms.name].micro_batch,
            shapes[ms.name].recompute,
        )
        for ms in model_stages
    ]


def _reserved_first(
    model_stages: Sequence[ModelStage],
    shapes: Mapping[str, Shape],
    free: _FreeGpus,
    anchor: Plan | None,
    domains: FailureDomains,
) -> dict[str, list[tuple[int, ...]]]:
    """One replica of each trainer on reserved GPUs where it fits. When the reserved GPUs cannot
    hold one of every trainer, the trainers that get one are those that leave the job least
    exposed: a trainer left out risks losing all its replicas, each spread over at least
    ⌈size / instance⌉ revocable instances, so few large replicas are the first to protect. Ties
    keep the most running replicas where they are. Each trainer takes its running replica if that
    already sits on reserved GPUs, else the best-fitting reserved GPUs still free."""
    trainers = [ms.name for ms in model_stages if ms.stage is Stage.TRAIN and shapes[ms.name].dp > 0]
    if not trainers:
        return {}
    reserved_free = [g for gpus in free.nodes.values() for g in gpus if g in domains.reserved]
    best: tuple[tuple[float, int], dict[str, tuple[int, ...]]] | None = None
    for order in itertools.islice(itertools.permutations(trainers), MAX_ORDERS):
        trial, got, kept = _FreeGpus(reserved_free, free.gpn), {}, 0
        for name in order:
            running = _anchor_replicas(name, shapes[name], anchor)
            on_reserved = next((r for r in running if domains.on_reserved(r) and trial.take_exactly(r)), None)
            if on_reserved is not None:
                got[name], kept = on_reserved, kept + 1
            elif (gpus := trial.take_within(shapes[name].layout.size, domains.reserved)) is not None:
                got[name] = gpus
        exposed = [_exposure(shapes[n], domains.gpus_per_instance) for n in trainers if n not in got]
        score = (1.0 - math.prod(1.0 - p for p in exposed), -kept)
        if best is None or score < best[0]:
            best = (score, got)
    assert best is not None
    for gpus in best[1].values():
        taken = free.take_exactly(gpus)
        assert taken
    return {name: [gpus] for name, gpus in best[1].items()}


def _exposure(shape: Shape, gpus_per_instance: int) -> float:
    """How likely a trainer of ``shape`` with no reserved replica is to lose them all, each
    replica on the fewest revocable instances it can span, over a horizon in which one instance
    is lost with probability ``STEP_LOSS`` (the regime of one step): a ranking, not a price."""
    instances = -(-shape.layout.size // gpus_per_instance)
    return (-math.expm1(-STEP_LOSS * instances)) ** shape.dp


def _anchor_replicas(name: str, shape: Shape, anchor: Plan | None) -> list[tuple[int, ...]]:
    """The running plan's replicas of ``name`` if they have ``shape``'s layout, else none."""
    if anchor is None:
        return []
    try:
        before = anchor.candidate(name)
    except KeyError:
        return []
    if before.layout != shape.layout:
        return []
    return [before.replica_gpus(r) for r in range(before.dp)]


def _anchored(
    name: str, shape: Shape, free: _FreeGpus, anchor: Plan | None, want: int
) -> list[tuple[int, ...]]:
    """Up to ``want`` replicas of ``name`` that can stay exactly where the running plan has them
    (same layout, GPUs still free): they keep their shards and nothing moves for them."""
    if want <= 0:
        return []
    replicas = _anchor_replicas(name, shape, anchor)
    if not replicas:
        return []
    # a replica's GPUs are disjoint from the others', so taking each that is wholly free in turn
    # takes the first ``want`` wholly free ones: found first, then taken at once
    kept: list[tuple[int, ...]] = []
    for gpus in replicas:
        if len(kept) >= want:
            break
        if free.holds(gpus):
            kept.append(gpus)
    if kept:
        taken = free.take_exactly([g for gpus in kept for g in gpus])
        assert taken
    return kept


def _place_stage(
    model_stages: Sequence[ModelStage],
    shapes: Mapping[str, Shape],
    pool: Sequence[int],
    gpus_per_node: int,
    anchor: Plan | None,
    domains: FailureDomains | None,
    prefer: Mapping[str, frozenset[int]] | None = None,
) -> tuple[list[Candidate], list[int]]:
    """One stage's model-stages placed on ``pool`` (and the GPUs left free). Replicas kept where
    the running plan has them can leave the new ones only the scattered GPUs of a fragmented pool
    (spot instances smaller than a node), so that a TP group or a replica crosses nodes where
    best fit alone keeps it inside one — not the links the cost model priced (``group_spans``),
    and a TP group over the network runs its per-layer all-reduces several times slower. The
    anchored placement is kept only where no model-stage's worst (TP group, replica) node span
    is larger than in a placement from scratch. ``prefer``: per model-stage, nodes its replicas
    take first among equally free ones (``FreeGpus.take``)."""
    free = _FreeGpus(pool, gpus_per_node)
    placed = _place_group(model_stages, shapes, free, anchor, domains, prefer)
    if anchor is not None and any(_spans(c, gpus_per_node) > _least(c, gpus_per_node) for c in placed):
        fresh_free = _FreeGpus(pool, gpus_per_node)
        fresh = _place_group(model_stages, shapes, fresh_free, None, domains, prefer)
        if any(
            _spans(a, gpus_per_node) > _spans(b, gpus_per_node) for a, b in zip(placed, fresh, strict=True)
        ):
            placed, free = fresh, fresh_free
    return placed, [g for n in free.nodes.values() for g in n]


def _least(c: Candidate, gpus_per_node: int) -> tuple[float, float]:
    """The spans of ``_spans`` when every TP group and replica takes the fewest nodes it can:
    nothing placed from scratch does better, so a placement there needs no second try."""
    if c.dp < 1:
        return (0.0, 0.0)
    gpn = gpus_per_node
    tp, size = c.layout.tp, c.layout.size
    return (
        float(-(-tp // gpn) * gpn if tp > gpn else tp),
        float(-(-size // gpn) * gpn if size > gpn else size),
    )


def _spans(c: Candidate, gpus_per_node: int) -> tuple[float, float]:
    """Node spans of a placed candidate's worst TP group and worst replica (``placed_spans``)."""
    if c.dp < 1:
        return (0.0, 0.0)
    tp, replica, _ = placed_spans(c, gpus_per_node)
    return (tp, replica)


def place(
    workflow: Workflow,
    mode: ExecutionMode,
    shapes: Mapping[str, Shape],
    pool: Sequence[int],
    gpus_per_node: int,
    anchor: Plan | None = None,
    domains: FailureDomains | None = None,
) -> Plan:
    """A Plan giving every model-stage of ``workflow`` its shape on GPUs from ``pool``.

    With an ``anchor`` (the running plan), replicas whose layout is unchanged stay on their GPUs
    when those are still available, so a transition moves only what must move. With
    ``domains``, one replica of every trainer goes on reserved GPUs where it fits. The trainers
    are placed first, and a model-stage that loads a trainer's weights at the step boundary
    (``Workflow.sync_source``: the actor's inference and generation, the critic's inference)
    takes that trainer's nodes first among equally free ones, so its weight sync stays inside
    them, as the cost model prices it (``CommTerms._weight_sync``).
    """
    candidates: dict[str, Candidate] = {}

    def prefer(group: Sequence[ModelStage]) -> dict[str, frozenset[int]]:
        out = {}
        for ms in group:
            src = workflow.sync_source(ms.name)
            if src is not None and src in candidates:
                out[ms.name] = frozenset(g // gpus_per_node for g in candidates[src].gpus)
        return out

    def add(group: Sequence[ModelStage], on: Sequence[int]) -> list[int]:
        placed, left = _place_stage(group, shapes, on, gpus_per_node, anchor, domains, prefer(group))
        candidates.update({c.model_stage: c for c in placed})
        return left

    if mode is ExecutionMode.ASYNC:  # generation on GPUs of its own, the rest on what it leaves
        rest = add(workflow.by_stage(Stage.GEN), pool)
        for stage in (Stage.TRAIN, Stage.INF):
            add(workflow.by_stage(stage), rest)
    else:  # every stage on the whole pool (stages run one after another), the trainers first
        for stage in sorted(workflow.stages, key=lambda s: s is not Stage.TRAIN):
            add(workflow.by_stage(stage), pool)
    ordered = tuple(candidates[m.name] for m in workflow.model_stages)
    return Plan(workflow, ordered, tuple(pool), mode)
