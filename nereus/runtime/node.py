"""What runs on a compute node: one worker process of a job whose folder the launcher wrote.

``main(job_dir)`` is called on every task of a SLURM job (through submitit, ``srun --mpi=pmi2``) or
of a local submitit job: rank 0 starts the job's rendezvous store on its node's address (a free
port; ``rendezvous.json`` in the 0700 job folder, and over MPI when there is MPI), every rank forms
the first generation, and the job runs — resuming from the folder's latest checkpoint when there
is one (a requeued job). ``main(job_dir, join=True)`` is a newcomer (``nereus-launch grow``): it
presents the job's secret, waits to be admitted at a step boundary, and takes part from then on.
A preempted job checkpoints at its next boundary and hands over to the launcher's requeue.
Checkpoints are signed and verified with the job's secret (``nereus.runtime.signing``): a
requeued job resumes only from what the job itself wrote. Edge module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nereus.control.action import Outcome
from nereus.errors import ConfigError
from nereus.runtime import checkpoint as ckpt
from nereus.runtime.bootstrap import bootstrap
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.loop import JobLoop
from nereus.runtime.membership import Membership, Rendezvous, node_address
from nereus.runtime.preemption import Preemption
from nereus.runtime.signing import KEY_BYTES

RDZV = "rendezvous.json"


@dataclass(frozen=True, slots=True)
class JobFolder:
    """The launcher's job folder: ``experiment.yaml``, ``secret``; the run writes ``run/``."""

    path: Path

    def __post_init__(self) -> None:
        for name in ("experiment.yaml", "secret"):
            if not (self.path / name).is_file():
                raise ConfigError(f"{self.path}: not a job folder (no {name})")

    @property
    def run(self) -> Path:
        return self.path / "run"

    def spec(self) -> ExperimentSpec:
        return ExperimentSpec.load(self.path / "experiment.yaml")

    def secret(self) -> bytes:
        try:
            secret = bytes.fromhex((self.path / "secret").read_text(encoding="ascii").strip())
        except (OSError, ValueError):  # unreadable, not ASCII, not hex
            raise ConfigError(f"{self.path / 'secret'}: expected hex") from None
        if len(secret) < KEY_BYTES:
            raise ConfigError(f"{self.path / 'secret'}: expected at least {2 * KEY_BYTES} hex digits")
        return secret


def main(job_dir: str, join: bool = False) -> Outcome:
    """Run this process's part of the job; returns ``done``, ``preempted`` or ``left``."""
    torch.set_num_threads(int(os.environ.get("NEREUS_THREADS", "1")))
    job = JobFolder(Path(job_dir))
    spec, secret = job.spec(), job.secret()
    ckpt.use_key(secret)  # checkpoints are signed with the job's secret
    job.run.mkdir(mode=0o700, parents=True, exist_ok=True)
    if join:  # a newcomer needs no MPI: the rendezvous is in the job folder
        m = Membership.connect(Rendezvous.read(job.path / RDZV), secret, -1)
        try:
            preemption = Preemption().install()
            _, generation, members = m.request_join(None)
            status = JobLoop.enter(m, spec, job.run, generation, members, preemption).run()
            if status is Outcome.PREEMPTED:
                preemption.hand_over(m.leader)
            return status
        finally:
            m.close()
    boot, comm = bootstrap()
    if boot.rank == 0:
        m = Membership.host(secret, 0, node_address(), 0, log=job.run / "membership.log")
        rdzv = Rendezvous(m.rendezvous.host, m.rendezvous.port, boot.launch_id)
        rdzv.write(job.path / RDZV)
    else:
        rdzv = None
    if comm is not None:
        sent = comm.bcast((rdzv.host, rdzv.port, rdzv.launch_id) if rdzv else None, root=0)
        rdzv = Rendezvous(*sent)
    if boot.rank != 0:
        rdzv = rdzv or Rendezvous.read(job.path / RDZV, launch_id=boot.launch_id)
        m = Membership.connect(rdzv, secret, boot.rank)
    try:
        m.form(tuple(range(boot.world)), 0)
        preemption = Preemption().install()
        resume = ckpt.latest(job.run / "checkpoints") is not None
        status = JobLoop.start(m, spec, job.run, resume, job.path / "control", preemption=preemption).run()
        if status is Outcome.PREEMPTED:
            preemption.hand_over(m.leader)
        return status
    finally:
        m.close()
