"""Validation on held-out prompts (verl's ``val_files`` and ``test_freq``).

An experiment whose ``data.val`` names prompt files is validated after every ``val_every``-th
step and after its last (``ExperimentSpec.validates_at``): once the step's weight sync has put the
new weights into ``actor.gen``, every held-out prompt is answered greedily (verl validates with
``do_sample: false``) by the generation replicas, each answering its share, a step's worth of
rollouts at a time (``chunk_rows``: the memory and the collective timeout the plan has for
generation suffice for any size of set), and the verifier scores the responses on every worker,
as a step's are (``by_source``: by each row's source). The
step's record then holds ``validation``: the mean ``reward``, the ``accuracy`` (share scoring
1), the ``prompts``, the ``seconds`` it took, and ``reward/<source>`` per data source.

Validation is not the step: it runs after the step's time is taken, and the seconds, op-class
timings, generation statistics and memory peaks it adds are taken out again, so the controller's
telemetry (and so its replans and calibration) sees the step alone. A reward model does not
score validation: on an asynchronous job's generation-only ranks it has no part to play, and
verl's validation scores with its reward function too. A failure in it is the step's failure
(a lost peer, an out-of-memory error: the step is recovered and run again).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from nereus.plan.layout import Plan
from nereus.rl.data import Sample, collate
from nereus.runtime.job import JobSetup, sampling, verified
from nereus.runtime.rollout import Rollouts
from nereus.runtime.worker import Worker


def validate(worker: Worker, plan: Plan, setup: JobSetup, max_new: int) -> dict[str, float]:
    """Greedy responses to every held-out prompt, scored (collective over the world)."""
    data = setup.validation
    if data is None:
        raise ValueError("validate: the experiment names no data.val")
    started = time.perf_counter()
    samples = data.samples(0, len(data))  # every record once (the order does not matter)
    chunk = chunk_rows(setup)
    parts = []
    with _untimed(worker):
        for start in range(0, len(samples), chunk):
            part = samples[start : start + chunk]
            parts.append(
                verified(setup, _answers(worker, plan, setup, part, max_new), [s.record for s in part])
            )
    if worker.memory.devices.accelerated:  # the allocator's cache back: later reserved peaks are theirs
        torch.cuda.empty_cache()
    scores, sources = torch.cat(parts), [s.record.source for s in samples]
    out = {
        "reward": float(scores.mean()),
        "accuracy": float((scores >= 1.0).float().mean()),
        "prompts": float(len(samples)),
    }
    for source in sorted({s for s in sources if s}):
        picked = [float(v) for v, s in zip(scores.tolist(), sources, strict=True) if s == source]
        out[f"reward/{source}"] = sum(picked) / len(picked)
    out["seconds"] = time.perf_counter() - started
    return out


def chunk_rows(setup: JobSetup) -> int:
    """Prompts answered at once: a step's rollouts (what the plan sized generation's memory and the
    collective timeout for), so a held-out set of any size needs no more of either."""
    w = setup.workload
    return w.prompts_per_step * w.samples_per_prompt


def _answers(worker: Worker, plan: Plan, setup: JobSetup, samples: list[Sample], max_new: int) -> Rollouts:
    """The greedy rollouts of ``samples``, on every worker (collective)."""
    ids, valid, sample_ids = collate(samples, setup.tokenizer, 1)
    params = sampling(setup, max_new, greedy=True)
    part = worker.generate_part(plan, ids, valid, list(sample_ids), params)
    return worker.collect(part, ids, valid, list(sample_ids), setup.tokenizer.pad_id)


@contextlib.contextmanager
def _untimed(worker: Worker) -> Iterator[None]:
    """Work whose seconds, op-class timings, generation statistics and memory peaks stay out of
    the step's telemetry."""
    seconds, optimes = dict(worker.times.seconds), list(worker.optimes)
    generation = dict(worker.generation)
    peaks, reserved = dict(worker.memory.peaks), dict(worker.memory.reserved)
    try:
        yield
    finally:
        worker.times.seconds.clear()
        worker.times.seconds.update(seconds)
        worker.optimes[:] = optimes
        worker.generation.clear()
        worker.generation.update(generation)
        worker.memory.peaks.clear()
        worker.memory.peaks.update(peaks)
        worker.memory.reserved.clear()
        worker.memory.reserved.update(reserved)
