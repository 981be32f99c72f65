"""``nereus run``: the job as local worker processes on this machine (one per virtual GPU).

``launch_local`` is a small supervisor: it starts one process per worker, the first of which (GPU 0)
hosts the job's rendezvous store and the controller, and waits for them. A scripted gain starts a
new process that joins the running job through the store, exactly as a node added to a SLURM
allocation does; a scripted loss or kill ends a process. The job succeeds when the leader does.
Edge module (processes).
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import shutil
from pathlib import Path

import torch

from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.loop import JobLoop
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
    procs[0].join()
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
        m = Membership.host(secret, 0, "127.0.0.1", 0, log=folder / "membership.log")
        m.rendezvous.write(folder / RDZV)
    else:
        m = Membership.connect(Rendezvous.read(folder / RDZV), secret, gpu)
    ctx = mp.get_context("spawn")

    def spawn(g: int) -> None:
        ctx.Process(target=joiner_main, args=(g, spec, out, secret), name=f"nereus-gpu{g}").start()

    try:
        m.form(members, 0)
        loop = JobLoop(m, spec, folder, spawn_local=spawn if gpu == 0 else None)
        loop.install_signals()
        loop.run(loop.start(resume))
    finally:
        m.close()


def joiner_main(gpu: int | None, spec: ExperimentSpec, out: str, secret: bytes) -> None:
    """A newcomer: ask the running job to let it in, then take part from the next boundary."""
    torch.set_num_threads(1)
    folder = Path(out)
    m = Membership.connect(Rendezvous.read(folder / RDZV), secret, -1)
    try:
        _, generation, members = m.request_join(gpu)
        loop = JobLoop(m, spec, folder)
        loop.install_signals()
        boundary = loop.enter(generation, members)
        loop.run(boundary.step, boundary)
    finally:
        m.close()
