"""The start-up collective sweep on the job's world: ``nereus.plan.sweep``'s probes, timed.

Collective over the world (``new_group`` is): every rank forms the probes' groups in the same
order, members or not, then each group's members run its probes in turn — one untimed call, then
``REPEATS`` timed ones, each finished on the device before the clock is read — and keep the
median. A rank outside a probe's group goes on to the next probe; the untimed call lines the
members up, so a rank still busy with an earlier probe delays no timed call. One all-reduce (max)
brings every probe's slowest member's time to every rank.

Tensors live on the worker's device, so the world's backend for that device carries them (NCCL or
RCCL on GPUs, gloo on the CPU): the sweep times the fabric the job's collectives will use. On gloo
the sizes stop at ``GLOO_MAX_BYTES`` (a CPU ring's large messages take seconds and teach the planner
nothing a smaller one does not). Edge module (torch.distributed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nereus.devices import Devices
from nereus.plan.opclass import Collective
from nereus.plan.sweep import REPEATS, SIZES, WARMUP, Probe, probes

GLOO_MAX_BYTES = 4 * 2**20


def _sync(devices: Devices) -> None:
    if devices.accelerated:
        torch.cuda.synchronize(devices.device)


def _call(
    p: Probe, pg: Any, ranks: Sequence[int], me: int, buf: torch.Tensor, out: list[torch.Tensor]
) -> None:
    """One collective of probe ``p`` on this rank (``ranks``: the group's world ranks; ``out``:
    an all-gather's outputs)."""
    if p.kind is Collective.ALLREDUCE:
        dist.all_reduce(buf, group=pg)
    elif p.kind is Collective.ALLGATHER:  # nccl-tests' size: the gathered buffer
        dist.all_gather(out, buf[: out[0].numel()], group=pg)
    elif p.kind is Collective.BROADCAST:
        dist.broadcast(buf, src=ranks[0], group=pg)
    elif me == ranks[0]:
        dist.send(buf, dst=ranks[1], group=pg)
    else:
        dist.recv(buf, src=ranks[0], group=pg)


def _time(p: Probe, pg: Any, ranks: Sequence[int], me: int, devices: Devices) -> float:
    """This rank's median seconds per call of probe ``p`` (buffers allocated before the clock)."""
    elements = max(len(ranks), p.nbytes // 4)
    buf = torch.ones(elements, dtype=torch.float32, device=devices.device)
    part = elements // len(ranks)
    out = (
        [torch.empty(part, dtype=torch.float32, device=devices.device) for _ in ranks]
        if p.kind is Collective.ALLGATHER
        else []
    )
    for _ in range(WARMUP):
        _call(p, pg, ranks, me, buf, out)
    _sync(devices)
    times = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        _call(p, pg, ranks, me, buf, out)
        _sync(devices)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def sweep_world(
    members: Sequence[int],
    gpu: int,
    gpus_per_node: int,
    devices: Devices,
    timeout: timedelta | None = None,
    sizes: Sequence[int] = SIZES,
) -> list[tuple[Probe, float]]:
    """Every probe of the world ``members`` (GPU ids in rank order; this rank's is ``gpu``) and the
    slowest member's median seconds per call, on every rank. Collective over the world."""
    if not devices.accelerated:
        sizes = [s for s in sizes if s <= GLOO_MAX_BYTES]
    rank_of = {g: r for r, g in enumerate(members)}
    me = rank_of[gpu]
    found = probes(members, gpus_per_node, sizes)
    groups: dict[tuple[int, ...], tuple[Any, list[int]]] = {}
    for gpus in dict.fromkeys(p.gpus for p in found):  # in the same order on every rank
        ranks = [rank_of[g] for g in gpus]
        groups[gpus] = (dist.new_group(ranks, timeout=timeout), ranks)
    seconds = torch.zeros(len(found), dtype=torch.float64)
    for i, p in enumerate(found):
        pg, ranks = groups[p.gpus]
        if me in ranks:
            seconds[i] = _time(p, pg, ranks, me, devices)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    for pg, ranks in groups.values():
        if me in ranks:
            dist.destroy_process_group(pg)
    return list(zip(found, seconds.tolist(), strict=True))
