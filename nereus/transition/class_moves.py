"""Replica classes, move by move: ``derive`` follows ``local.py``'s rules on replica arrays.

See ``classes.py`` for what a class is. ``derive`` walks the model-stages in workflow order and,
for every move that changes, makes the classes of the per-unit nodes ``local.local_dag`` would
make: DP-only moves (Extends from the current replicas round robin, Destroys of the surplus),
reshapes to a multiple of the current layout (kept slots, Extends, Merges) and reshapes to a
divisor of it (Splits of the replicas with kept slots and the nearest others, Extends, Destroys);
with ``direct``, every reshape as ``local._direct`` re-lays it out (each target replica assembled
straight from one current replica, ``class_direct.py``). Anything else raises ``FallbackError`` and
``derive`` returns None.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from nereus.plan.layout import Layout, Plan
from nereus.plan.opclass import Link
from nereus.plan.problem import PlanningProblem
from nereus.transition.class_direct import direct
from nereus.transition.classes import (
    SECONDS,
    Builder,
    Cls,
    Derived,
    FallbackError,
    Ints,
    remember,
    rows_of,
    stage_geometry,
    table,
    unique_rows,
)
from nereus.transition.dag import Flow, Primitive
from nereus.transition.links import LinkModel
from nereus.transition.primitives import Geometry

_E, _D, _M, _S = Primitive.EXTEND, Primitive.DESTROY, Primitive.MERGE, Primitive.SPLIT


def derive(
    problem: PlanningProblem,
    current: Plan,
    target: Plan,
    links: LinkModel,
    skip: frozenset[str],
    direct: bool = False,
) -> Derived | None:
    """The classes of the transition ``current`` → ``target``, or None where a move leaves the rules.
    ``direct``: reshapes re-laid out straight from one replica each (``local._direct``)."""
    return _derive(problem, current, target, links, skip, (direct,))[0]


def derive_both(
    problem: PlanningProblem, current: Plan, target: Plan, links: LinkModel, skip: frozenset[str]
) -> tuple[Derived | None, Derived | None]:
    """``derive`` for Split → Extend → Merge and for ``direct`` at once (moves that keep their
    layout derived once); both None where the first leaves the rules."""
    first, second = _derive(problem, current, target, links, skip, (False, True))
    return first, second


def _derive(
    problem: PlanningProblem,
    current: Plan,
    target: Plan,
    links: LinkModel,
    skip: frozenset[str],
    modes: tuple[bool, ...],
) -> list[Derived | None]:
    """One ``Derived`` per mode (``direct`` or not), None where a move leaves its rules (every one
    where the first mode's does). A move that keeps its layout is the same in every mode: it is
    derived on the first builder and copied onto the others."""
    size = max(max(current.pool, default=0), max(target.pool, default=0)) + 1
    builders: list[_Moves | None] = [_Moves(links, size, direct) for direct in modes]
    first = builders[0]
    assert first is not None
    changed, resharded = [], []
    try:
        for ms in target.workflow.model_stages:
            if ms.name in skip:
                continue
            old, new = current.candidate(ms.name), target.candidate(ms.name)
            geo = stage_geometry(problem.models[ms.role], ms.head, ms.stage, problem.workload.precision)
            cur = rows_of(old)
            first.hold(cur, geo, old.layout)
            tgt = rows_of(new)
            if old.layout == new.layout and (
                old.gpus == new.gpus
                or (old.dp == new.dp and set(map(tuple, cur.tolist())) == set(map(tuple, tgt.tolist())))
            ):
                continue
            changed.append(ms.name)
            if old.layout == new.layout:
                base, acq = len(first.out), first.acq.copy()
                first.same_layout(ms.name, geo, old.layout, cur, tgt)
                for b in builders[1:]:
                    if b is not None:
                        b.copy(first.out[base:], len(b.out) - base, first.acq - acq)
                continue
            resharded.append(ms.name)
            for i, b in enumerate(builders):
                if b is None:
                    continue
                try:
                    b.move(ms.name, geo, old.layout, cur, new.layout, tgt)
                except FallbackError:
                    if not i:
                        raise
                    builders[i] = None
    except FallbackError:
        return [None] * len(modes)
    return [
        None
        if b is None
        else Derived(tuple(b.out), first.init, b.acq, tuple(changed), tuple(resharded), b.direct_moves)
        for b in builders
    ]


_Q_INDEX: dict[tuple[Layout, Layout], Ints] = {}


def _q_index(cl: Layout, sub: Layout) -> Ints:
    """Per rank of ``cl``, the T_sub rank its Split group makes (memoised per layout pair)."""
    out = _Q_INDEX.get((cl, sub))
    if out is None:
        kt, kp = cl.tp // sub.tp, cl.pp // sub.pp
        out = _Q_INDEX[cl, sub] = np.asarray(
            [sub.index(t // kt, p // kp) for t, p in cl.positions()], np.int64
        )
    return out


_GROUPS: dict[tuple[Layout, Layout], Ints] = {}
_TAKES: dict[tuple[Geometry, Layout, Layout], Ints] = {}


def _sub_units(big: Layout, sub: Layout) -> Ints:
    """[j, r]: the rank of ``big`` that is rank r of its j-th ``sub`` unit. A Split of ``big``
    all-gathers column r (the group of T_sub rank r); a Merge into ``big`` lays its j-th slot's
    ranks there (memoised per layout pair)."""
    out = _GROUPS.get((big, sub))
    if out is None:
        kt, kp, pos = big.tp // sub.tp, big.pp // sub.pp, sub.positions()
        out = _GROUPS[big, sub] = np.asarray(
            [
                [(pq * kp + bp) * big.tp + tq * kt + bt for tq, pq in pos]
                for bp in range(kp)
                for bt in range(kt)
            ],
            np.int64,
        )
    return out


def _takes(geo: Geometry, cl: Layout, sub: Layout) -> Ints:
    """Per old rank, the bytes its T_sub shard takes when it keeps one (``Geometry.split_rows``)."""
    out = _TAKES.get((geo, cl, sub))
    if out is None:
        out = _TAKES[geo, cl, sub] = np.asarray([r[4] for r in geo.split_rows(cl, sub)], np.int64)
    return out


class _Moves(Builder):
    """The rules of ``local.py``, move by move, on replica arrays."""

    def __init__(self, links: LinkModel, size: int, direct: bool = False) -> None:
        super().__init__(links, size)
        self.direct_moves = direct

    def copy(self, classes: list[Cls], shift: int, acquired: Ints) -> None:
        """Another builder's classes of one model-stage (``shift``: how much later they start
        here) and what they acquire."""
        self.out += [
            c if not c.preds else replace(c, preds=frozenset(p + shift for p in c.preds)) for c in classes
        ]
        self.acq += acquired

    def move(self, stage: str, geo: Geometry, cl: Layout, cur: Ints, tl: Layout, tgt: Ints) -> None:
        if cl == tl:
            self.same_layout(stage, geo, cl, cur, tgt)
            return
        if self.direct_moves:
            direct(self, stage, geo, cl, cur, tl, tgt)
            return
        # a layout that grows (sub = current) or shrinks (sub = target) changes the replica size, so
        # no replica can be re-laid-out on its own GPUs (``local._in_place``); an in-place reshard
        # keeps the size, and so does a reshape through an intermediate layout: both fall back
        sub = Layout(min(cl.tp, tl.tp), min(cl.pp, tl.pp))
        if sub == cl:
            self.merge_reshape(stage, geo, cl, cur, tl, tgt)
        elif sub == tl:
            self.split_reshape(stage, geo, cl, cur, tl, tgt)
        else:
            raise FallbackError

    def _round_robin(self, slots: Ints, pool: Ints) -> None:
        """``SourceChooser`` picks round robin unless a slot on one node has a source there."""
        if not len(slots):
            return
        if not len(pool):
            raise FallbackError
        gpn = self.gpn
        s_node, p_node = slots.min(1) // gpn, pool.min(1) // gpn
        s_one, p_one = s_node == slots.max(1) // gpn, p_node == pool.max(1) // gpn
        has_source = np.zeros(len(self.init) // gpn + 1, bool)
        has_source[p_node[p_one]] = True
        if has_source[s_node[s_one]].any():
            raise FallbackError

    def same_layout(self, stage: str, geo: Geometry, lay: Layout, cur: Ints, tgt: Ints) -> None:
        # a target replica stays when a current one is the same GPUs in the same order (replicas of
        # one plan are disjoint, so its first GPU names the only candidate)
        owner = np.full(len(self.init), -1, np.int64)
        owner[cur[:, 0]] = np.arange(len(cur))
        match = owner[tgt[:, 0]]
        stays = (match >= 0) & (cur[np.maximum(match, 0)] == tgt).all(1)
        kept = np.zeros(len(cur), bool)
        kept[match[stays]] = True
        dst = tgt[~stays]
        self._round_robin(dst, cur)
        fed = min(len(dst), len(cur))  # sources 0 … fed−1 feed copies
        gone = np.flatnonzero(~kept)
        idle_rows = cur[gone[gone >= fed]]
        held = table(geo, lay)[1]
        waits = self.idle(stage, idle_rows, dst, held)
        ext, src = self.extends(stage, geo, lay, dst, cur, waits[:, None])
        used = gone[gone < fed]
        if len(used):
            at = np.full(len(cur), -1, np.int64)
            at[used] = np.arange(len(used))
            self.destroys(stage, *self.preds_of(ext, len(used), at[src]), cur[used], held)

    def _slots(self, cur: Ints, cl: Layout, sub: Layout, slots: Ints) -> tuple[Ints, Ints]:
        """Which slots (rows of GPUs in T_sub rank order) are kept: each GPU in the matching group
        of one current replica (T_sub rank q of its rank); and each GPU's current replica (−1)."""
        size = sub.size
        code = np.full(len(self.init), -1, np.int64)  # GPU → its replica · |T_sub| + its T_sub rank
        code[cur] = np.arange(len(cur))[:, None] * size + _q_index(cl, sub)[None, :]
        first = code[slots[:, 0]]
        owner = np.where(first >= 0, first // size, -1)
        kept: Ints = (first >= 0) & (code[slots] == (owner * size)[:, None] + np.arange(size)[None, :]).all(1)
        return kept, code // size if size > 1 else code

    def merge_reshape(self, stage: str, geo: Geometry, cl: Layout, cur: Ints, tl: Layout, tgt: Ints) -> None:
        sub = cl
        m = (tl.tp // sub.tp) * (tl.pp // sub.pp)
        slots = tgt[:, _sub_units(tl, sub)].reshape(len(tgt) * m, sub.size)
        kept, owner = self._slots(cur, cl, sub, slots)
        kept_si = np.flatnonzero(kept)
        kept_unit = owner[slots[kept_si, 0]]
        order = np.argsort(kept_unit, kind="stable")
        kept_si, kept_unit = kept_si[order], kept_unit[order]
        has_kept = np.zeros(len(cur), bool)
        has_kept[kept_unit] = True
        free = np.flatnonzero(~has_kept)
        pool = np.vstack([cur[free], slots[kept_si]])
        unmatched = np.flatnonzero(~kept)
        dst = slots[unmatched]
        self._round_robin(dst, pool)
        n_free = len(free)
        fed = min(len(dst), len(pool))
        idle_rows = cur[free[fed:]] if fed < n_free else np.zeros((0, cur.shape[1]), np.int64)
        held = table(geo, cl)[1]
        waits = self.idle(stage, idle_rows, dst, held)
        ext, src = self.extends(stage, geo, sub, dst, pool, waits[:, None])
        if fed > 0 and n_free:
            used = min(fed, n_free)
            of, sets = self.preds_of(ext, used, np.where(src < used, src, -1))
            self.destroys(stage, of, sets, cur[free[:used]], held)
        # each target replica merges its slots, after the Extends into them and the copies of its kept ones
        reads = np.full(len(pool), -1, np.int64)  # pool index → the target whose kept slot it is
        reads[n_free:] = kept_si // m
        target = np.concatenate([unmatched // m, reads[src]])
        dep_of, dep_sets = self.preds_of(np.concatenate([ext, ext]), len(tgt), target)
        rows = geo.merge_rows(sub, tl)
        gpn = self.gpn
        intra = tgt.min(1) // gpn == tgt.max(1) // gpn
        acquire = np.asarray(rows.acquire, np.int64)
        self.acq[tgt] += acquire
        moved = sum(rows.recv)
        pats, of = unique_rows(np.stack([intra.astype(np.int64), dep_of], 1))
        keys = []
        for link_bit, dep in pats.tolist():
            memo = (self.links, geo, sub, tl, _M, link_bit)
            out = SECONDS.get(memo)
            if out is None:
                link = Link.INTRA if link_bit else Link.INTER
                flows = tuple(Flow(r, b, link) for r, b in enumerate(rows.recv))
                est = self.links.node_seconds(_M, flows, m - 1, rows.local, distinct=True)
                out = remember(memo, est, moved, tl.size)
            keys.append((*out, dep_sets[dep]))
        ports = [2 * tgt, 2 * tgt + 1] if moved else []
        release = (tgt, np.asarray(rows.release, np.int64))
        self.classes(stage, _M, keys, of, None, ports, (tgt, acquire), release)

    def split_reshape(self, stage: str, geo: Geometry, cl: Layout, cur: Ints, sub: Layout, tgt: Ints) -> None:
        kt, kp = cl.tp // sub.tp, cl.pp // sub.pp
        k, gpn = kt * kp, self.gpn
        grp = _sub_units(cl, sub)
        kept, owner = self._slots(cur, cl, sub, tgt)
        kept_si = np.flatnonzero(kept)
        kept_unit = owner[tgt[kept_si, 0]]
        order = np.argsort(kept_unit, kind="stable")
        kept_si, kept_unit = kept_si[order], kept_unit[order]
        unmatched = np.flatnonzero(~kept)
        dst = tgt[unmatched]
        # split the replicas with kept slots, then the nearest others until every slot has a source
        split = np.zeros(len(cur), bool)
        split[kept_unit] = True
        waiting = np.zeros(len(self.init) // gpn + 1, bool)
        waiting[dst // gpn] = True
        near = waiting[cur // gpn].sum(1)
        nearest = np.argsort(-near, kind="stable")
        cands = nearest[~split[nearest]]
        n_split = int(split.sum())
        need = max(-(-(len(unmatched) + len(kept_si)) // k) - n_split, 0 if n_split else 1)
        split[cands[: max(need, 0)]] = True
        taking = np.flatnonzero(split)
        # carve: per split replica, its groups' members not in a kept slot, j-th of each group → free j
        kept_gpu = np.zeros(len(self.init), bool)
        kept_gpu[tgt[kept_si].ravel()] = True
        members = cur[taking][:, grp]  # (replica, j, T_sub rank)
        taken = kept_gpu[members]
        order = taken.argsort(axis=1, kind="stable")  # per (replica, rank): its free members first
        rest = members[np.arange(len(taking))[:, None, None], order, np.arange(sub.size)[None, None, :]]
        n_kept = np.bincount(kept_unit, minlength=len(cur))[taking]
        n_left = k - n_kept
        jmask = np.arange(k)[None, :] < n_left[:, None]
        free = rest[jmask].reshape(-1, sub.size)
        n_free = len(free)
        pool = np.vstack([free, tgt[kept_si]])
        pool_owner = np.concatenate([np.repeat(taking, n_left), kept_unit])  # row-major, as ``rest[jmask]``
        self._round_robin(dst, pool)
        fed = min(len(dst), len(pool))
        # the Splits: each split replica's kept sub-units and the free ones that feed a copy
        keep = np.zeros(len(self.init), bool)
        keep[tgt[kept_si].ravel()] = True
        keep[free[: min(fed, n_free)].ravel()] = True
        live = np.zeros(len(cur), bool)
        live[pool_owner[n_free:]] = True
        live[pool_owner[: min(fed, n_free)]] = True
        splits = taking[live[taking]]
        flat = grp.T.ravel()  # old ranks group by group (the Split's flow order)
        U = cur[splits][:, flat]
        kmask = keep[U]
        groups = U.reshape(len(splits), sub.size, k)
        intra = groups.min(2) // gpn == groups.max(2) // gpn
        pats, of = unique_rows(np.hstack([kmask.astype(np.int64), intra.astype(np.int64)]))
        rows = geo.split_rows(cl, sub)
        keys = []
        for row in pats.tolist():
            memo = (self.links, geo, cl, sub, _S, *row)
            out = SECONDS.get(memo)
            if out is None:
                flows: list[Flow] = []
                for x, idx in enumerate(flat.tolist()):
                    if row[x]:
                        link = Link.INTRA if row[len(flat) + x // k] else Link.INTER
                        flows.append(Flow(len(flows), rows[idx][3], link))
                est = self.links.node_seconds(_S, tuple(flows), k - 1, distinct=True)
                out = remember(memo, est, sum(f.bytes for f in flows), len(flows))
            keys.append((*out, frozenset[int]()))
        take_of = _takes(geo, cl, sub)[flat]
        self.acq[U[kmask]] += (kmask * take_of)[kmask]  # each kept rank's take (slots are disjoint)
        recv_ports = np.where(kmask, 2 * U + 1, -1)
        split_cls = np.full(len(cur), -1, np.int64)
        held = table(geo, cl)[1]
        if len(splits):
            # a kept rank ends with its sub-shard (its take less what the sub-shard adds), the
            # others free their old shard
            old = held[flat]
            grows = table(geo, sub)[1][np.arange(len(flat)) // k] - old
            acquire = (U, kmask * take_of)
            release = (U, np.where(kmask, take_of - grows, old))
            ports = [2 * cur[splits], recv_ports]
            split_cls[splits] = self.classes(stage, _S, keys, of, None, ports, acquire, release)
        idle_units = np.flatnonzero(~split | ~live)
        waits = self.idle(stage, cur[idle_units], dst, held)
        made = split_cls[pool_owner]
        src_made = made[np.arange(len(dst)) % len(pool)] if len(dst) else np.zeros(0, np.int64)
        ext, src = self.extends(stage, geo, sub, dst, pool, np.stack([src_made, waits], 1))
        used = min(fed, n_free)
        if used:
            of, sets = self.preds_of(ext, used, np.where(src < used, src, -1), made[:used])
            self.destroys(stage, of, sets, free[:used], table(geo, sub)[1])
