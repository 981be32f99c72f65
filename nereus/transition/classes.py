"""Replica classes: a transition's grouped nodes straight from the two plans (issue 21).

``group.py`` groups the per-unit nodes after building them; at 1,024 GCDs building them is most of
the time. Here the groups (*classes*: one per model-stage × primitive × geometry, with a
multiplicity, a round count and the GPU ports they hold) come straight from each model-stage's
two candidates, as numpy arrays of replica GPUs, with no ``Node``, ``Emu`` or ``StageMove``. The
class is the group ``group.Groups`` would form from the per-unit DAG ``local.py`` builds: the
same Splits, Extends, Destroys and Merges, the same seconds (one ``LinkModel.node_seconds`` call
per distinct link pattern), the same bytes and the same local edges, followed rule by rule:

* a DP-only move (layout kept) extends the new replicas and destroys the surplus;
* a reshape to a multiple of the current layout (T_sub = current: no Split) keeps the slots a
  current replica already is, extends the others and merges each target replica;
* a reshape to a divisor of the current layout (T_sub = target: no Merge) splits the replicas
  with kept slots and the nearest others, extends the other slots and destroys what is left.

Where a move leaves these rules (a restore, an in-place reshard, a reshape through an
intermediate layout, lost GPUs) or the Extend sources are not a plain round robin (a source on
the node of a slot it may feed: ``local.SourceChooser`` would weigh it), ``derive`` returns None
and the caller plans per unit. The classes are checked against ``group.Groups`` of the per-unit
DAG when a transition is expanded for execution (``group.expand_onto``) and in the tests.

This module holds the class values and the builder's primitives (Extends, Destroys, the classes
they form, the per-GPU memory); ``class_moves.py`` holds ``derive`` and the rules move by move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from nereus.plan.layout import Candidate, Layout
from nereus.plan.opclass import Link
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.transition.dag import Flow, Primitive
from nereus.transition.links import LinkModel
from nereus.transition.primitives import Geometry, geometry

Ints = NDArray[np.int64]
_E, _D, _M, _S = Primitive.EXTEND, Primitive.DESTROY, Primitive.MERGE, Primitive.SPLIT


@dataclass(frozen=True, slots=True)
class Mem:
    """Bytes a class's members acquire (or release) per GPU, kept as the builder made them and
    reduced only where the ledger asks (``vector``): ``gpus`` one row per member of the move
    (its GPUs), ``bytes`` per column (one row for all) or per cell, ``mine`` the class's rows."""

    gpus: Ints
    bytes: Ints
    mine: Ints | slice

    def vector(self, size: int) -> Ints:
        """The class's bytes on every GPU id below ``size``."""
        g = self.gpus[self.mine]
        b = np.broadcast_to(self.bytes, self.gpus.shape)[self.mine]
        out = np.zeros(size, np.int64)
        np.add.at(out, g.ravel(), b.ravel())
        return out


@dataclass(frozen=True, slots=True)
class Cls:
    """One class: ``count`` nodes alike, ``rounds`` port-disjoint waves of them, ``ports`` (GPU
    ports as ints, 2·GPU send, 2·GPU + 1 receive) every member occupies, ``preds`` earlier classes."""

    stage: str
    primitive: Primitive
    est_s: float
    bytes: int  # per member
    acquires: int  # (GPU, bytes) pairs a member acquires
    count: int
    rounds: int
    preds: frozenset[int]
    ports: Ints
    acquire: Mem | None = None  # what its members acquire (None: nothing)
    release: Mem | None = None  # what its members release (None: nothing)

    def __post_init__(self) -> None:
        if self.count <= 0 or self.rounds <= 0 or self.est_s < 0:
            raise ValueError(
                f"class {self.stage} {self.primitive}: count, rounds and seconds must be positive"
            )


@dataclass(frozen=True, slots=True)
class Derived:
    classes: tuple[Cls, ...]  # in a topological order
    init: Ints  # per GPU id: state bytes before the transition
    acquired: Ints  # per GPU id: every acquisition of the transition
    changed: tuple[str, ...]
    resharded: tuple[str, ...]
    direct: bool = False  # reshapes re-laid out straight from one replica (``local._direct``)

    @property
    def nodes(self) -> int:
        return sum(c.count for c in self.classes)


class FallbackError(Exception):
    """The move leaves the rules ``derive`` follows: plan it per unit."""


_GEOMETRY: dict[tuple[ModelSpec, Head, StatePolicy], Geometry] = {}


_STAGED: dict[tuple[int, Head, Stage, Precision], tuple[ModelSpec, Geometry]] = {}


def stage_geometry(model: ModelSpec, head: Head, stage: Stage, precision: Precision) -> Geometry:
    """``headed_geometry`` of a model-stage's state (``StatePolicy.of``), memoised on the model
    object: a ModelSpec's hash walks every field, and each transition asks it of every stage."""
    key = (id(model), head, stage, precision)
    hit = _STAGED.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    geo = headed_geometry(model, head, StatePolicy.of(stage, precision))
    if len(_STAGED) >= 64:
        _STAGED.clear()
    _STAGED[key] = (model, geo)  # the model held: its id stays unique while the entry lives
    return geo


def headed_geometry(model: ModelSpec, head: Head, policy: StatePolicy) -> Geometry:
    """``geometry(model.with_head(head), policy)`` without re-making the headed model each time."""
    key = (model, head, policy)
    out = _GEOMETRY.get(key)
    if out is None:
        out = _GEOMETRY[key] = geometry(model.with_head(head), policy)
        if len(_GEOMETRY) > 64:
            _GEOMETRY.pop(next(iter(_GEOMETRY)))
    return out


_ROWS: dict[int, tuple[Candidate, Ints]] = {}


def rows_of(c: Candidate) -> Ints:
    """A candidate's GPUs, one row per replica (read-only; memoised on the candidate: a plan's are
    priced against many targets, and 1,024 GPU ids take ~10 µs to convert)."""
    hit = _ROWS.get(id(c))
    if hit is not None and hit[0] is c:
        return hit[1]
    rows = np.asarray(c.gpus, dtype=np.int64).reshape(c.dp, c.layout.size)
    rows.flags.writeable = False
    if len(_ROWS) >= 256:
        _ROWS.clear()
    _ROWS[id(c)] = (c, rows)  # the candidate held: its id stays unique while the entry lives
    return rows


def unique_rows(a: Ints) -> tuple[Ints, Ints]:
    """Distinct rows of ``a`` (first-appearance order) and each row's index among them: peeled
    off one pattern at a time (replicas that move alike share a handful), ``np.unique`` beyond."""
    if not len(a) or (a == a[0]).all():
        return a[:1], np.zeros(len(a), np.int64)
    of = np.full(len(a), -1, np.int64)
    pats: list[Ints] = []
    left = np.arange(len(a))
    while len(left) and len(pats) < 8:
        row = a[left[0]]
        same = (a[left] == row).all(1)
        of[left[same]] = len(pats)
        pats.append(row)
        left = left[~same]
    if not len(left):
        return (np.vstack(pats) if pats else a[:0]), of
    uniq, first, inverse = np.unique(a, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return uniq[order], rank[inverse.reshape(-1)]


SECONDS: dict[tuple[object, ...], tuple[float, int, int]] = {}


def remember(key: tuple[object, ...], est: float, moved: int, acquires: int) -> tuple[float, int, int]:
    """A member's (seconds, bytes, acquisitions) for one link pattern, memoised on the pattern
    (with the link model and geometry it came from)."""
    if len(SECONDS) > 4096:
        SECONDS.clear()
    out = SECONDS[key] = (est, moved, acquires)
    return out


_TABLES: dict[tuple[Geometry, Layout], tuple[list[int], Ints]] = {}


def table(geo: Geometry, lay: Layout) -> tuple[list[int], Ints]:
    """(payload bytes, held bytes) of every rank of ``lay``, rank order (memoised with the geometry)."""
    out = _TABLES.get((geo, lay))
    if out is None:
        pos = lay.positions()
        out = _TABLES[geo, lay] = (
            [geo.payload(lay, t, p) for t, p in pos],
            np.asarray([geo.held(lay, t, p) for t, p in pos], np.int64),
        )
    return out


class Builder:
    """Classes of every model-stage, the per-GPU memory, in the order ``local.py`` makes nodes."""

    def __init__(self, links: LinkModel, size: int) -> None:
        self.links, self.gpn = links, links.gpus_per_node
        self.out: list[Cls] = []
        self.init = np.zeros(size, np.int64)
        self.acq = np.zeros(size, np.int64)

    def hold(self, cur: Ints, geo: Geometry, lay: Layout) -> None:
        self.init[cur] += table(geo, lay)[1]  # one model-stage's replicas are disjoint

    # ------------------------------------------------------------ classes
    def classes(
        self, stage: str, prim: Primitive, keys: list[tuple[float, int, int, frozenset[int]]], of: Ints,
        src: Ints | None, ports: list[Ints], acquire: tuple[Ints, Ints] | None = None,
        release: tuple[Ints, Ints] | None = None,
    ) -> Ints:  # fmt: skip
        """Group members by (seconds, bytes, acquisitions, preds): ``keys`` per distinct pattern,
        ``of`` each member's pattern; ``src`` each member's Extend source (rounds: copies of one
        source serialise on its ports); ``acquire``/``release``: (GPUs per member, bytes) as
        ``Mem`` keeps them. Returns each member's class id."""
        index: dict[tuple[float, int, int, frozenset[int]], int] = {}
        cls_of_pattern = np.asarray([index.setdefault(k, len(index)) for k in keys], np.int64)
        member = cls_of_pattern[of] if len(of) else of
        base = len(self.out)
        for k, c in index.items():
            if len(index) > 1:
                sel = member == c
                mine: Ints | slice = sel
                count = int(np.count_nonzero(sel))
            else:
                mine, count = slice(None), len(member)
            rounds = 1
            if src is not None and k[0] > 0 and count > 1:
                rounds = int(np.bincount(src[mine]).max())
            held = np.concatenate([p[mine].ravel() for p in ports]) if ports else np.zeros(0, np.int64)
            if ports and held.min(initial=0) < 0:
                held = held[held >= 0]
            acq = Mem(acquire[0], acquire[1], mine) if acquire is not None else None
            rel = Mem(release[0], release[1], mine) if release is not None else None
            self.out.append(Cls(stage, prim, k[0], k[1], k[2], count, rounds, k[3], held, acq, rel))
        return member + base

    def preds_of(
        self, cls: Ints, n: int, rows: Ints, more: Ints | None = None
    ) -> tuple[Ints, list[frozenset[int]]]:
        """For ``n`` targets, the set of classes of the members that point at each (``rows[i]``:
        the target of member i, −1 none; ``more``: a class per target, −1 none), as each target's
        pattern and the patterns' sets."""
        base = len(self.out)
        if len(cls):
            base = min(base, int(cls.min()))
        if more is not None and (more >= 0).any():
            base = min(base, int(more[more >= 0].min()))
        if len(self.out) - base > 62:
            raise FallbackError  # the sets as bits of one int64
        mask = np.zeros(n, np.int64)
        hit = rows >= 0
        np.bitwise_or.at(mask, rows[hit], np.left_shift(1, cls[hit] - base))
        if more is not None:
            mask |= np.where(more >= 0, np.left_shift(1, np.maximum(more - base, 0)), 0)
        if n and (mask == mask[0]).all():  # every target alike (replicas that move alike): one set
            codes, of = [int(mask[0])], np.zeros(n, np.int64)
        else:
            unique, inverse = np.unique(mask, return_inverse=True)
            codes, of = unique.tolist(), inverse.reshape(-1)
        sets = [frozenset(base + b for b in range(63) if code >> b & 1) for code in codes]
        return of, sets

    def extends(
        self, stage: str, geo: Geometry, lay: Layout, dst: Ints, pool: Ints, extra: Ints
    ) -> tuple[Ints, Ints]:
        """Extends into ``dst`` rows from ``pool`` round robin (``extra``: a pred class per member,
        −1 none; a second column: an idle-Destroy class). Returns (member classes, sources)."""
        n, s = dst.shape
        if not n:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        src = np.arange(n, dtype=np.int64) % len(pool)
        sg = pool[src]
        gpn = self.gpn
        # per rank: 0 the same GPU (a local copy), 1 the same node, 2 another node
        code = (sg != dst).view(np.int8) + (sg // gpn != dst // gpn).view(np.int8)
        pats, of = unique_rows(np.hstack([code, extra]))
        payload, held = table(geo, lay)
        self.acq[dst] += held  # slots are disjoint
        keys = []
        for row in pats.tolist():
            memo = (self.links, geo, lay, _E, *row[:s])
            out = SECONDS.get(memo)
            if out is None:
                flows = tuple(
                    Flow(r, 0 if c == 0 else payload[r], Link.INTRA if c < 2 else Link.INTER)
                    for r, c in enumerate(row[:s])
                )
                out = remember(
                    memo, self.links.node_seconds(_E, flows, distinct=True), sum(f.bytes for f in flows), s
                )
            keys.append((*out, frozenset(x for x in row[s:] if x >= 0)))
        return self.classes(stage, _E, keys, of, src, [2 * sg, 2 * dst + 1], (dst, held)), src

    def destroys(self, stage: str, of: Ints, sets: list[frozenset[int]], rows: Ints, held: Ints) -> Ints:
        """Destroys whose preds are ``sets[of[i]]``, member i freeing replica ``rows[i]``
        (``held``: the bytes per rank of its layout)."""
        keys = [(0.0, 0, 0, p) for p in sets]
        return self.classes(stage, _D, keys, of, None, [], release=(rows, held))

    def idle(self, stage: str, idle_rows: Ints, dst: Ints, held: Ints) -> Ints:
        """Destroy the current replicas ``idle_rows`` (no copy reads them, ``held`` bytes per rank)
        before every Extend onto their GPUs; per Extend row of ``dst``, the idle-Destroy class it
        waits for (−1 none)."""
        if not len(idle_rows):
            return np.full(len(dst), -1, np.int64)
        none = np.zeros(len(idle_rows), np.int64)
        cls = int(self.destroys(stage, none, [frozenset()], idle_rows, held)[0])
        mark = np.zeros(len(self.init), bool)
        mark[idle_rows.ravel()] = True
        return np.where(mark[dst].any(axis=1), cls, -1)
