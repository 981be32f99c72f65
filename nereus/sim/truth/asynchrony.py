"""A step's true length from its model-stages' true seconds: synchronous and asynchronous RL.

Synchronous: the stages run one after another on a shared pool, so a step is the sum over the
workflow's stages of each stage's slowest model-stage (generation receives the new weights as
part of its own stage, ``stage.weight_sync``).

Asynchronous (one-step off-policy and beyond, as in NeMo-RL's async GRPO): generation runs on
GPUs of its own and produces batch k+1 while inference and training consume batch k. A step is
the interval between two weight syncs (actor.train ⇒ actor.gen), which are the only safe
boundaries for transitions. The truth's rules:

* the trainer side (inference, then training, stage by stage) starts once the previous sync has
  landed and its batch is generated: if generation is slower, it waits (*train wait*);
* generation runs batches back to back, each with the newest weights that have landed; batch b
  may start only while it is at most ``max_staleness`` versions ahead of the trainer's weights
  (b − version ≤ s), otherwise generation waits (*gen wait*: the staleness wait);
* the sync needs the generation engine between batches (it loads the new weights): it starts
  once training is done and the batch in decode has finished; once training is done generation
  starts no new batch before the sync lands. Its seconds are the truth's broadcast of the actor's
  bf16 weights over the group of the trainer's and the generator's GPUs, bucket by bucket.

So in steady state, nothing waiting but the slower side, a step is max(gen, inf + train) + sync;
with ``max_staleness`` 0 it is gen + inf + train + sync, the synchronous sum. At every boundary
all started batches are complete (the sync waited for them): the state carried to the next step
is the versions of the batches generated ahead. A transition or restart either keeps them
(drain) or drops them (drop); a crash drops them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from nereus.sim.truth import collectives
from nereus.sim.truth.collectives import Group
from nereus.sim.truth.params import GRAD_BUCKET_BYTES, TruthParams
from nereus.sim.truth.shard import Shard
from nereus.sim.truth.stage import PARAMS
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec


def sync_step(stage_seconds: Iterable[Iterable[float]]) -> float:
    """A synchronous step: the sum, stage after stage in workflow order, of each stage's
    slowest model-stage (``stage_seconds``: each stage's model-stage seconds)."""
    total = 0.0
    for seconds in stage_seconds:
        total += max(seconds)
    return total


def weight_sync_seconds(
    model: ModelSpec,
    cluster: ClusterSpec,
    trainer_gpus: Sequence[int],
    generator_gpus: Sequence[int],
    p: TruthParams = PARAMS,
) -> dict[str, float]:
    """True seconds per op class of broadcasting the actor's bf16 weights from its trainer to
    its generation engine, bucket by bucket, over the group their GPUs form."""
    if not trainer_gpus or not generator_gpus:
        raise ValueError("a weight sync needs trainer and generator GPUs")
    nbytes = 2.0 * Shard.of(model, 1, 1).stage_params(1)
    group = Group.of(tuple(dict.fromkeys((*trainer_gpus, *generator_gpus))), cluster.gpus_per_node)
    if group.size < 2:
        group = Group(2, 1)  # the same GPU on both sides: a copy at NVLink-class speed at worst
    full, rest = divmod(nbytes, GRAD_BUCKET_BYTES)
    intra, inter = cluster.intra_node_bandwidth_gbs * 1e9, cluster.inter_node_bandwidth_gbs * 1e9
    seconds = full * collectives.seconds("broadcast", group, GRAD_BUCKET_BYTES, intra, inter, p)
    seconds += collectives.seconds("broadcast", group, rest, intra, inter, p)
    return {f"broadcast.{group.link}": seconds}


@dataclass(frozen=True, slots=True)
class AsyncStep:
    """One asynchronous step (seconds from the previous sync's landing to this one's)."""

    step_s: float
    overlap_s: float  # generation and the trainer side both busy
    gen_wait_s: float  # generation idle before the sync: staleness bound, or a sync pending
    train_wait_s: float  # the trainer side idle before the sync: waiting for rollouts
    sync_s: float  # the weight sync that ends the step
    staleness: int  # weight versions between the consumed batch's generator and the trainer
    ahead: int  # batches generated for later steps, carried to the next one

    def __post_init__(self) -> None:
        for name in ("step_s", "overlap_s", "gen_wait_s", "train_wait_s", "sync_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.staleness < 0 or self.ahead < 0:
            raise ValueError("staleness and ahead must be non-negative")

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "overlap_s": self.overlap_s,
            "gen_wait_s": self.gen_wait_s,
            "train_wait_s": self.train_wait_s,
            "sync_s": self.sync_s,
            "staleness": self.staleness,
            "ahead": self.ahead,
        }


def _overlap(spans: Sequence[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


class Pipeline:
    """The asynchronous step model with its state across steps: the trainer's weight version
    and the versions of the batches generated ahead of it."""

    __slots__ = ("_ahead", "max_staleness", "version")

    def __init__(self, max_staleness: int = 1) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be non-negative, got {max_staleness}")
        self.max_staleness = max_staleness
        self.version = 0  # weight syncs so far: the trainer's weights
        self._ahead: deque[int] = deque()  # weight version of each batch generated ahead, in order

    @property
    def ahead(self) -> int:
        return len(self._ahead)

    def step(self, gen_s: float, trainer_s: float, sync_s: float) -> AsyncStep:
        """Run one step from the previous sync's landing (time 0): generation's seconds per
        batch, the trainer side's (inference then training) and the weight sync's."""
        if min(gen_s, trainer_s, sync_s) < 0:
            raise ValueError("seconds must be non-negative")
        gen: list[tuple[float, float]] = []  # this step's generation spans
        free = 0.0  # when the generation engine is free
        if not self._ahead:  # nothing generated ahead: this step's batch first
            gen.append((0.0, gen_s))
            self._ahead.append(self.version)
            free = gen_s
        consumed = self._ahead.popleft()
        start = gen[0][1] if gen else 0.0
        end = start + trainer_s
        # next batches, while the trainer still runs and the staleness bound allows
        while free < end and len(self._ahead) + 1 <= self.max_staleness:
            gen.append((free, free + gen_s))
            self._ahead.append(self.version)
            free += gen_s
        sync_start = max(end, free)
        busy = _overlap(gen, 0.0, sync_start)
        result = AsyncStep(
            step_s=sync_start + sync_s,
            overlap_s=_overlap(gen, start, end),
            gen_wait_s=max(0.0, sync_start - busy),
            train_wait_s=max(0.0, sync_start - trainer_s),
            sync_s=sync_s,
            staleness=self.version - consumed,
            ahead=len(self._ahead),
        )
        self.version += 1
        return result

    def flush(self, keep: bool) -> int:
        """At a transition or restart: keep the batches generated ahead (drain) or drop them.
        Returns how many batches were dropped."""
        if keep:
            return 0
        dropped = len(self._ahead)
        self._ahead.clear()
        return dropped
