"""The transition schedule as an exact time-indexed RCPSP, solved by SCIP (optional ``nereus[scip]``).

The baseline the greedy (``build.py`` resource edges + ``schedule.list_schedule``) is compared with:
the *same* instance — the DAG's nodes, its LOCAL edges only (SCIP decides every ordering the
greedy's resource edges fixed), GPU ports of capacity 1 and the per-GPU memory ledger — on
integer ticks, with SCIP free to pick every start time.

Durations are ``d_i = ⌈est_s / tick⌉`` (0 only for a node that acquires no memory, e.g. a Destroy;
a node that acquires runs at least one tick so its transient peak is counted). The horizon ``H``
is the greedy list schedule's makespan on those same tick durations, so the greedy schedule is a
feasible incumbent (passed to SCIP as a starting solution). In step form, with ``y[i,t] = 1`` when
node i has started by slot t (``y[i,t] = 0`` below its earliest start ``ES_i`` from LOCAL
precedence, ``1`` from its latest start ``LS_i = H − tail_i``, the longest LOCAL path from i's
start to the end):

    y[i,t−1] ≤ y[i,t]                                                          (start once)
    y[b,t] ≤ y[a,t−d_a]                              for every LOCAL edge a → b   (precedence)
    Σ_{i on port} (y[i,t] − y[i,t−d_i]) ≤ 1          every port, every slot        (ports)
    init_g + Σ_i acq_ig·y[i,τ] − Σ_i rel_ig·y[i,τ−d_i] ≤ cap_g   every GPU that can get tight, τ
    C ≥ LS_i + d_i − Σ_{t<LS_i} y[i,t]               for every node without LOCAL successor
    minimise C

Memory is taken at a start and given back at a finish; a node that finishes at τ releases before
one that starts at τ acquires (the standard RCPSP convention, the list scheduler's too). Ports
(and memory constraints) used by the same nodes with the same coefficients are written once.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nereus.errors import ConfigError
from nereus.transition.dag import EdgeKind, TransitionDag
from nereus.transition.schedule import Schedule, best_schedule, list_schedule, lower_bound

DEFAULT_MAX_SLOTS = 80


def available() -> bool:
    try:
        import pyscipopt  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------ the tick instance (pure)
def ticks(dag: TransitionDag, tick_s: float) -> tuple[int, ...]:
    """Integer durations: ⌈est_s / tick⌉, at least 1 for a node that acquires memory."""
    if tick_s <= 0:
        raise ValueError(f"tick must be positive, got {tick_s}")
    out = []
    for n in dag.nodes:
        d = math.ceil(n.est_s / tick_s - 1e-9) if n.est_s > 0 else 0
        out.append(max(d, 1) if n.acquires else max(d, 0))
    return tuple(out)


def greedy_ticks(dag: TransitionDag, durations: Sequence[int]) -> Schedule:
    """The greedy list schedule on integer durations, as ``plan_transition`` schedules (every
    edge, ports; the better of commit order and longest remaining path, and sampled schedules
    where those stay over 5% above the lower bound)."""
    ticks = [float(d) for d in durations]
    return best_schedule(dag, ticks, bound=lower_bound(dag, durations=ticks))


def horizon(dag: TransitionDag, durations: Sequence[int]) -> int:
    """The greedy makespan on ``durations``; a serial schedule's length when the DAG is infeasible.

    Running every node alone in the start order of any feasible schedule keeps memory feasible
    (each node then sees at least the releases it saw before), so Σ d_i bounds every optimum.
    """
    if dag.feasible:
        return round(greedy_ticks(dag, durations).makespan)
    return int(sum(durations))


def choose_tick(dag: TransitionDag, max_slots: int = DEFAULT_MAX_SLOTS) -> float:
    """The smallest tick (within a few percent) whose horizon has at most ``max_slots`` slots."""
    if max_slots < 1:
        raise ValueError("max_slots must be at least 1")
    span = list_schedule(dag).makespan if dag.feasible else sum(n.est_s for n in dag.nodes)
    if span <= 0:
        return 1.0
    tick = span / max_slots
    for _ in range(64):
        h = horizon(dag, ticks(dag, tick))
        if h <= max_slots:
            return tick
        tick *= max(1.02, h / max_slots)
    return tick


def _local(dag: TransitionDag) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """LOCAL predecessors, successors and a topological order of them."""
    n = len(dag.nodes)
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    seen: set[tuple[int, int]] = set()
    for e in dag.edges:
        if e.kind is EdgeKind.LOCAL and (e.src, e.dst) not in seen:
            seen.add((e.src, e.dst))
            preds[e.dst].append(e.src)
            succs[e.src].append(e.dst)
    waiting = [len(p) for p in preds]
    order = [i for i in range(n) if waiting[i] == 0]
    for i in order:  # grows while it is walked (Kahn)
        for s in succs[i]:
            waiting[s] -= 1
            if waiting[s] == 0:
                order.append(s)
    if len(order) != n:
        raise ValueError("the LOCAL edges of the DAG have a cycle")
    return preds, succs, order


def windows(dag: TransitionDag, durations: Sequence[int], horizon_ticks: int) -> list[tuple[int, int]]:
    """(earliest, latest) start of every node under LOCAL precedence within ``horizon_ticks``."""
    preds, succs, order = _local(dag)
    es = [0] * len(order)
    for i in order:
        es[i] = max((es[p] + durations[p] for p in preds[i]), default=0)
    tail = [0] * len(order)
    for i in reversed(order):
        tail[i] = durations[i] + max((tail[s] for s in succs[i]), default=0)
    return [(es[i], horizon_ticks - tail[i]) for i in range(len(order))]


def verify(
    dag: TransitionDag,
    initial: Mapping[int, int],
    durations: Sequence[int],
    starts: Sequence[int],
    edges: EdgeKind | None = EdgeKind.LOCAL,
) -> list[str]:
    """Every way ``starts`` breaks precedence (``edges``: LOCAL, or None for all), ports or memory."""
    bad: list[str] = []
    fin = [s + d for s, d in zip(starts, durations, strict=True)]
    for e in dag.edges:
        if (edges is None or e.kind is edges) and starts[e.dst] < fin[e.src]:
            bad.append(f"edge {e.src}→{e.dst}: starts at {starts[e.dst]} before {fin[e.src]}")
    users: dict[tuple[int, int], list[int]] = defaultdict(list)
    for n in dag.nodes:
        for p in set(n.ports):
            users[p].append(n.id)
    for p, ids in users.items():
        runs = sorted((starts[i], fin[i], i) for i in ids if durations[i] > 0)
        for (_, f0, a), (s1, _, b) in itertools.pairwise(runs):
            if s1 < f0:
                bad.append(f"port {p}: nodes {a} and {b} overlap")
    events: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # GPU → (time, 0 release/1 take, bytes)
    for n in dag.nodes:
        for g, b in n.acquire:
            events[g].append((starts[n.id], 1, b))
        for g, b in n.release:
            events[g].append((fin[n.id], 0, -b))
    for g, evs in events.items():
        level, cap = initial.get(g, 0), dag.capacity.get(g, 0)
        for t, _, b in sorted(evs):
            level += b
            if level > cap:
                bad.append(f"GPU {g}: {level} bytes > capacity {cap} at {t}")
                break
    return bad


# ------------------------------------------------------------------ the program (SCIP)
@dataclass(frozen=True, slots=True)
class RcpspResult:
    """SCIP's best schedule of the tick instance next to the greedy's on the same ticks.

    ``status`` is SCIP's ("optimal", "timelimit", "infeasible", …); ``starts`` and
    ``makespan_ticks`` are None when SCIP holds no solution. ``bound_ticks`` is a lower bound on
    every schedule's makespan in ticks: SCIP's dual bound, or at least the LOCAL critical path and
    the busiest port's work (what is known when SCIP stops before its root LP); 1e20 when SCIP
    proved the instance infeasible.
    """

    tick_s: float
    durations: tuple[int, ...]
    horizon_ticks: int
    greedy_ticks: int | None  # None when the greedy DAG is infeasible
    makespan_ticks: int | None
    bound_ticks: float
    status: str
    seconds: float  # building and solving
    solve_seconds: float  # SCIP's own solving time
    starts: tuple[int, ...] | None
    variables: int
    constraints: int

    @property
    def optimal(self) -> bool:
        return self.status == "optimal"

    @property
    def makespan_s(self) -> float | None:
        return None if self.makespan_ticks is None else self.makespan_ticks * self.tick_s

    @property
    def gap(self) -> float | None:
        """Greedy over SCIP makespan, minus one (≥ 0 up to SCIP's incumbent)."""
        if self.greedy_ticks is None or not self.makespan_ticks:
            return None
        return self.greedy_ticks / self.makespan_ticks - 1.0

    @property
    def gap_to_bound(self) -> float | None:
        """Greedy over SCIP's lower bound, minus one: the most the greedy can be off."""
        if self.greedy_ticks is None or not 0 < self.bound_ticks < 1e19:
            return None
        return self.greedy_ticks / self.bound_ticks - 1.0


class _Steps:
    """``started(i, t)`` as a constant or a variable; linear forms as {var index: coefficient}."""

    def __init__(self, win: list[tuple[int, int]]) -> None:
        self.win = win
        self.index: dict[tuple[int, int], int] = {}
        for i, (es, ls) in enumerate(win):
            for t in range(es, ls):
                self.index[i, t] = len(self.index)

    def started(self, i: int, t: int) -> int | tuple[int]:
        """0 or 1 when fixed, else (variable index,)."""
        es, ls = self.win[i]
        if t < es:
            return 0
        if t >= ls:
            return 1
        return (self.index[i, t],)


def _add(form: dict[int, int], const: list[int], term: int | tuple[int], coef: int) -> None:
    if isinstance(term, tuple):
        form[term[0]] = form.get(term[0], 0) + coef
    else:
        const[0] += coef * term


def solve_rcpsp(
    dag: TransitionDag,
    initial: Mapping[int, int],
    tick_s: float | None = None,
    max_slots: int = DEFAULT_MAX_SLOTS,
    time_limit_s: float | None = None,
    warm_start: bool = True,
) -> RcpspResult:
    """Minimise the makespan of ``dag`` on ticks with SCIP (raises ``ConfigError`` without pyscipopt).

    ``initial`` is each GPU's bytes before the transition (``build.initial_bytes(moves)``);
    ``tick_s`` defaults to ``choose_tick(dag, max_slots)``.
    """
    try:
        from pyscipopt import Model, quicksum
    except ImportError:
        raise ConfigError("the RCPSP baseline needs pyscipopt: pip install 'nereus[scip]'") from None
    started = time.perf_counter()
    tick = tick_s if tick_s is not None else choose_tick(dag, max_slots)
    dur = ticks(dag, tick)
    greedy = greedy_ticks(dag, dur) if dag.feasible else None
    H = round(greedy.makespan) if greedy is not None else int(sum(dur))
    win = windows(dag, dur, H)
    nodes = dag.nodes
    n = len(nodes)
    if any(ls < es for es, ls in win):  # only when the LOCAL edges alone exceed the horizon
        raise ValueError("horizon shorter than the LOCAL critical path")
    steps = _Steps(win)
    preds, succs, _ = _local(dag)

    m = Model("nereus-transition-rcpsp")
    m.hideOutput()
    if time_limit_s is not None:
        m.setParam("limits/time", time_limit_s)
    y = [m.addVar(vtype="B", name=f"y[{i},{t}]") for (i, t) in steps.index]
    cp = max((es + dur[i] for i, (es, _) in enumerate(win)), default=0)
    port_users: dict[tuple[int, int], list[int]] = defaultdict(list)
    for nd in nodes:
        if dur[nd.id] > 0:
            for p in set(nd.ports):
                port_users[p].append(nd.id)
    port_load = max((sum(dur[i] for i in ids) for ids in port_users.values()), default=0)
    lower = max(cp, port_load)  # LOCAL critical path; the busiest port's total work
    C = m.addVar(vtype="I", lb=lower, ub=H, name="makespan")
    count = 0
    broken = False  # a constraint no start times can meet (fixed nodes alone break it)

    def cons(form: dict[int, int], const: int, rhs: int) -> None:
        """Σ form·y + const ≤ rhs (skipped when it always holds)."""
        nonlocal count, broken
        top = const + sum(c for c in form.values() if c > 0)
        if top <= rhs:
            return
        if not any(form.values()):
            broken = True
            return
        m.addCons(quicksum(c * y[v] for v, c in form.items() if c) <= rhs - const)
        count += 1

    # start once: y monotone in t
    for (i, t), v in steps.index.items():
        if t > win[i][0]:
            m.addCons(y[steps.index[i, t - 1]] <= y[v])
            count += 1
    # LOCAL precedence: b started by t ⇒ a started by t − d_a
    for b in range(n):
        for a in set(preds[b]):
            for t in range(win[b][0], win[b][1]):
                form: dict[int, int] = {}
                const = [0]
                _add(form, const, steps.started(b, t), 1)
                _add(form, const, steps.started(a, t - dur[a]), -1)
                cons(form, const[0], 0)
    # ports: one running node per port and slot (ports of the same nodes written once)
    groups = {tuple(sorted(ids)) for ids in port_users.values() if len(ids) > 1}
    for ids in sorted(groups):
        lo = min(win[i][0] for i in ids)
        hi = max(win[i][1] + dur[i] for i in ids)
        for t in range(lo, hi):
            form, const = {}, [0]
            for i in ids:
                _add(form, const, steps.started(i, t), 1)
                _add(form, const, steps.started(i, t - dur[i]), -1)
            cons(form, const[0], 1)
    # memory: every GPU whose bytes can exceed its capacity, every slot
    acq: dict[int, list[tuple[int, int]]] = defaultdict(list)
    rel: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for nd in nodes:
        for g, b in nd.acquire:
            if b:
                acq[g].append((nd.id, b))
        for g, b in nd.release:
            if b:
                rel[g].append((nd.id, b))
    written: set[tuple[Any, ...]] = set()
    for g in sorted(acq):
        init, cap = initial.get(g, 0), dag.capacity.get(g, 0)
        if init + sum(b for _, b in acq[g]) <= cap:
            continue
        unit = math.gcd(*(b for _, b in acq[g] + rel[g]))
        rhs = (cap - init) // unit  # exact: the left side is a multiple of unit
        for tau in range(H):
            form, const = {}, [0]
            for i, b in acq[g]:
                _add(form, const, steps.started(i, tau), b // unit)
            for i, b in rel[g]:
                _add(form, const, steps.started(i, tau - dur[i]), -(b // unit))
            key = (rhs - const[0], *sorted(form.items()))
            if key not in written:
                written.add(key)
                cons(form, const[0], rhs)
    # makespan
    for i in range(n):
        if not succs[i]:
            es, ls = win[i]
            m.addCons(ls + dur[i] - quicksum(y[steps.index[i, t]] for t in range(es, ls)) <= C)
            count += 1
    m.setObjective(C, "minimize")
    if broken:
        return RcpspResult(
            tick, dur, H, H if greedy is not None else None, None, 1e20, "infeasible",
            time.perf_counter() - started, 0.0, None, len(y) + 1, count,
        )  # fmt: skip

    if warm_start and greedy is not None:
        sol = m.createSol()
        for (i, t), v in steps.index.items():
            m.setSolVal(sol, y[v], 1.0 if t >= round(greedy.start[i]) else 0.0)
        m.setSolVal(sol, C, float(H))
        m.addSol(sol)
    m.optimize()
    status = str(m.getStatus())
    starts_out: tuple[int, ...] | None = None
    best: int | None = None
    if m.getNSols() > 0:
        found = m.getBestSol()
        assert found is not None
        starts_list = []
        for i, (es, ls) in enumerate(win):
            s = next((t for t in range(es, ls) if found[y[steps.index[i, t]]] > 0.5), ls)
            starts_list.append(s)
        starts_out = tuple(starts_list)
        best = max((s + d for s, d in zip(starts_out, dur, strict=True)), default=0)
    return RcpspResult(
        tick, dur, H, H if greedy is not None else None, best, max(float(m.getDualbound()), lower), status,
        time.perf_counter() - started, float(m.getSolvingTime()), starts_out, len(y) + 1, count,
    )  # fmt: skip
