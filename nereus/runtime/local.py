"""``nereus run``: the job as local worker processes on this machine (one per virtual GPU).

Each local worker counts as a node of its own for shrink requests (``<out>/control/shrink-*.json``
with ``{"nodes": K}``, as ``nereus-launch shrink`` writes them).

``launch_local`` is a small supervisor: it starts one process per worker, the first of which (GPU 0)
hosts the job's rendezvous store and the controller, and waits for them. A scripted gain starts a
new process that joins the running job through the store, exactly as a node added to a SLURM
allocation does; a scripted loss or kill ends a process. SIGUSR2 or SIGTERM to the supervisor
is passed to every worker, as srun does: the job checkpoints at its next boundary and stops
(``nereus run --resume`` continues). The job succeeds when the leader does.
Edge module (processes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import shutil
import signal
from pathlib import Path

import torch

from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.loop import JobLoop, Preemption
from nereus.runtime.membership import Membership, Rendezvous

RDZV = "rendezvous.json"


def launch_local(spec: ExperimentSpec, out: Path, resume: bool = False) -> Path:
    """Run ``spec`` on ``spec.workers`` processes; results under ``out``."""
    out = Path(out)
    if not resume and out.exists():
        for name in ("metrics.jsonl", "report.png", "membership.log"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "tensorboard", ignore_errors=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / RDZV).unlink(missing_ok=True)
    secret = secrets.token_bytes(32)
    ctx = mp.get_context("spawn")
    members = tuple(range(spec.workers))
    procs = [
        ctx.Process(
            target=member_main, args=(g, members, spec, str(out), secret, resume), name=f"nereus-gpu{g}"
        )
        for g in members
    ]
    for p in procs:
        p.start()

    def forward(signum: int, frame: object) -> None:  # preemption: as srun does, to every worker
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        procs[0].join()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    for p in procs[1:]:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
    (out / RDZV).unlink(missing_ok=True)
    if procs[0].exitcode != 0:
        raise RuntimeError(f"the job's leader (GPU 0) failed with exit code {procs[0].exitcode}; see above")
    return out


def member_main(
    gpu: int, members: tuple[int, ...], spec: ExperimentSpec, out: str, secret: bytes, resume: bool
) -> None:
    """An initial worker process: GPU 0 hosts the store; the others connect to it."""
    torch.set_num_threads(1)
    folder = Path(out)
    if gpu == 0:
        m = Membership.host(secret, 0, "127.0.0.1", 0, log=folder / "membership.log", node=f"local{gpu}")
        m.rendezvous.write(folder / RDZV)
    else:
        m = Membership.connect(Rendezvous.read(folder / RDZV), secret, gpu, node=f"local{gpu}")
    ctx = mp.get_context("spawn")

    def spawn(g: int) -> None:
        ctx.Process(target=joiner_main, args=(g, spec, out, secret), name=f"nereus-gpu{g}").start()

    try:
        m.form(members, 0)
        preemption = Preemption().install()
        local = spawn if gpu == 0 else None
        JobLoop.start(m, spec, folder, resume, folder / "control", local, preemption).run()
    finally:
        m.close()


def joiner_main(gpu: int | None, spec: ExperimentSpec, out: str, secret: bytes) -> None:
    """A newcomer: ask the running job to let it in, then take part from the next boundary."""
    torch.set_num_threads(1)
    folder = Path(out)
    m = Membership.connect(Rendezvous.read(folder / RDZV), secret, -1, node=f"local-new{gpu}")
    try:
        preemption = Preemption().install()
        _, generation, members = m.request_join(gpu)
        JobLoop.enter(m, spec, folder, generation, members, preemption).run()
    finally:
        m.close()
