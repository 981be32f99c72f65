"""Asynchronous RL on every worker: generation of the batches ahead overlaps training on this one.

A step k is the interval between two weight syncs. At its start the generation engines and
actor.inf hold policy version k (the trainer's weights after k steps) and every worker holds the
batches generated ahead (``worker.pending``, step → ``Batch``). Then:

1. if batch k is not there (the first step, ``max_staleness: 0``, or after a transition dropped
   the batches ahead) it is generated now, with version k: the training side waits for it, as a
   synchronous step does;
2. the **generation side** (the ranks of actor.gen) generates every missing batch k+1 … k+s
   (s = ``max_staleness``; never past the job's last step) with version k — the staleness bound
   holds generation back rather than exceed it — while the **training side** (the ranks of
   every other model-stage) rewards, infers and trains on batch k, exchanging results in a group
   of its own (``Worker.train_side``), so neither side waits for the other's collectives; a rank
   on both sides does one, then the other;
3. at the boundary every worker gathers the new batches, actor.inf — still version k, the
   weights that generated them — scores their log-probs (the behaviour policy: PPO's ratio and
   the KL penalty use them, so a stale batch is corrected for the policy that produced it), and
   the weight sync moves version k+1 into actor.gen, actor.inf and critic.inf.

With ``max_staleness: 0`` this is the synchronous step, computation for computation. Each rank
times its two sides from the step's start (after the boundary barrier: the ranks' clocks start
together); the leader turns every rank's spans into the step's ``Overlap``: seconds the two sides
actually ran at the same time and seconds each waited. Edge module (torch.distributed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from nereus.plan.layout import Plan
from nereus.runtime.comm import gather
from nereus.runtime.job import (
    JobSetup,
    Parts,
    batch_prompts,
    behaviour,
    collect_batch,
    generate_batch,
    generate_parts,
    learn,
)
from nereus.runtime.rollout import Batch
from nereus.runtime.worker import Worker

Span = tuple[float, float]  # seconds from the step's start on this rank: (began, ended)


@dataclass(frozen=True, slots=True)
class SideReport:
    """What one rank tells the leader about an async step: its sides' spans, when it reached the
    boundary, and — on the training side — the step's metrics."""

    gen: tuple[Span, ...] = ()
    train: tuple[Span, ...] = ()
    arrived: float = 0.0
    metrics: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class Overlap:
    """An async step's concurrency, from every rank's spans: the interval until the last rank
    reached the boundary; the seconds each side was busy (the union of its ranks' spans), ran
    together, and waited (the interval less its busy seconds)."""

    interval_s: float = 0.0
    gen_s: float = 0.0
    train_s: float = 0.0
    overlap_s: float = 0.0

    @property
    def gen_wait_s(self) -> float:
        return max(0.0, self.interval_s - self.gen_s)

    @property
    def train_wait_s(self) -> float:
        return max(0.0, self.interval_s - self.train_s)

    @classmethod
    def of(cls, reports: Iterable[SideReport]) -> Overlap:
        rs = list(reports)
        gen = _union(s for r in rs for s in r.gen)
        train = _union(s for r in rs for s in r.train)
        interval = max((r.arrived for r in rs), default=0.0)
        return cls(interval, _length(gen), _length(train), _length(_intersect(gen, train)))

    def as_dict(self) -> dict[str, float]:
        return {
            "overlap_s": round(self.overlap_s, 6), "gen_busy_s": round(self.gen_s, 6),
            "train_busy_s": round(self.train_s, 6), "gen_wait_s": round(self.gen_wait_s, 6),
            "train_wait_s": round(self.train_wait_s, 6),
        }  # fmt: skip


def _union(spans: Iterable[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(x: Sequence[Span], y: Sequence[Span]) -> list[Span]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans: Iterable[Span]) -> float:
    return sum(b - a for a, b in spans)


@dataclass(slots=True)
class AsyncResult:
    """One async step as the loop sees it on this rank."""

    batch: Batch  # the batch trained on
    generated: tuple[int, ...]  # steps whose batches this step generated
    reports: list[SideReport] | None = None  # every rank's, on the leader
    metrics: dict[str, float] = field(default_factory=dict)  # the training side's (leader)
    overlap: Overlap = field(default_factory=Overlap)


def ahead(step: int, staleness: int, last: int, pending: Iterable[int]) -> tuple[int, ...]:
    """The batches the generation side makes during ``step``: the missing ones of step+1 …
    step+staleness, never past ``last`` (the job's last step)."""
    have = set(pending)
    return tuple(b for b in range(step + 1, min(step + staleness, last) + 1) if b not in have)


def async_step(
    worker: Worker, plan: Plan, setup: JobSetup, step: int, max_new: Callable[[int], int],
    after_generate: Callable[[], None] | None = None,
) -> AsyncResult:  # fmt: skip
    """Step ``step`` of an async job on this rank (see the module docstring); the weight sync
    follows (the loop's). ``max_new(b)``: the response budget of batch b's step."""
    w = setup.workload
    began = time.perf_counter()
    gen_spans: list[Span] = []
    if step not in worker.pending:  # nothing generated ahead: the trainers wait for it
        t = time.perf_counter() - began
        r, base = generate_batch(worker, plan, setup, step, max_new(step))
        gen_spans.append((t, time.perf_counter() - began))
        worker.pending[step] = behaviour(worker, plan, step, step, r, base)
    batch = worker.pending.pop(step)
    todo = ahead(step, w.max_staleness, setup.spec.steps - 1, worker.pending)
    on_gen = worker.place(plan.candidate("actor.gen")) is not None
    prompts = {b: batch_prompts(setup, b) for b in todo}  # every rank gathers them at the boundary
    parts: dict[int, Parts] = {}
    if on_gen and todo:
        t = time.perf_counter() - began
        for b in todo:
            parts[b] = generate_parts(worker, plan, setup, prompts[b], max_new(b))
        gen_spans.append((t, time.perf_counter() - began))
    if after_generate is not None:
        after_generate()
    metrics, train_spans = None, []
    if worker.train_side_member:
        t = time.perf_counter() - began
        worker.exchange = worker.train_side
        try:
            _, metrics = learn(worker, plan, setup, batch)
        finally:
            worker.exchange = None
        train_spans.append((t, time.perf_counter() - began))
    arrived = time.perf_counter() - began
    for b in todo:  # the boundary: every worker gathers the new batches and their behaviour log-probs
        r, base = collect_batch(worker, setup, prompts[b], parts.get(b))
        worker.pending[b] = behaviour(worker, plan, b, step, r, base)
    mine = SideReport(tuple(gen_spans), tuple(train_spans), arrived, metrics)
    reports = gather(mine, SideReport)
    result = AsyncResult(batch, todo, reports)
    if reports is not None:
        result.metrics = next((r.metrics for r in reports if r.metrics is not None), {})
        result.overlap = Overlap.of(reports)
    return result
