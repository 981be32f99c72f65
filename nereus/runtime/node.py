"""What runs on a compute node: one worker process of a job whose folder the launcher wrote.

``main(job_dir)`` is called on every task of a SLURM job (through submitit, ``srun --mpi=pmi2``) or
of a local submitit job: rank 0 starts the job's rendezvous store on its node's address (a free
port; ``rendezvous.json`` in the 0700 job folder, and over MPI when there is MPI), every rank forms
the first generation, and the job runs — resuming from the folder's latest checkpoint when there
is one (a requeued job). ``main(job_dir, join=True)`` is a newcomer (``nereus-launch grow``): it
presents the job's secret, waits to be admitted at a step boundary, and takes part from then on.
A preempted job checkpoints at its next boundary and hands over to the launcher's requeue.
Checkpoints are signed and verified with the job's secret (``nereus.runtime.signing``): a
requeued job resumes only from what the job itself wrote.

Under ``nereus-launch --launcher torchrun`` each node's torchrun agent starts the node's workers
(``bootstrap`` source ``torchrun-slurm``) and restarts them when one fails. A restarted worker
(``TORCHELASTIC_RESTART_COUNT`` > 0) has lost its state: it rejoins the running job through the
signed join path, asking for its own GPU id, exactly as a ``grow`` newcomer does. The leader (GPU
0) hosts the job's store, which dies with it: a restarted leader requeues the job instead (while
SLURM's requeue count is below torchrun's ``--max-restarts``), which resumes from its latest
checkpoint. Under torchrun only SIGUSR2 stops a worker at a boundary (the agent sends SIGTERM to
the node's other workers when it restarts them: they end at once and rejoin), the agent forwards
it (``--signals-to-handle``), and the leader requeues the job through ``scontrol requeue`` after the
checkpoint (submitit's requeue is not in these processes). Edge module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nereus.control.action import Outcome
from nereus.devices import Devices, activate, launched
from nereus.errors import ConfigError, NereusError, TooFewGpusError
from nereus.runtime import checkpoint as ckpt
from nereus.runtime import joberror
from nereus.runtime.bootstrap import Bootstrap, bootstrap, torchrun_on_slurm
from nereus.runtime.comm import first_line, is_peer_failure
from nereus.runtime.engines import describe_engines, job_engines
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.loop import JobLoop
from nereus.runtime.membership import JoinRefusedError, Membership, Rendezvous, node_address
from nereus.runtime.preemption import Preemption
from nereus.runtime.rejoin import rejoin
from nereus.runtime.signals import PREEMPT_SIGNALS
from nereus.runtime.signing import KEY_BYTES

RDZV = "rendezvous.json"
STORE_PROBE_S = 10.0  # a restarted worker: how long the job's store may take to answer
GROW_WAIT_S = 120.0  # a newcomer of a grow: how long the job's store may not answer (a requeue)
MAX_SHORT_REQUEUES = 3  # requeues of a job whose GPUs left after a loss could not run it


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
    job = JobFolder(Path(job_dir))
    spec, secret = job.spec(), job.secret()
    ckpt.use_key(secret)  # checkpoints are signed with the job's secret
    job.run.mkdir(mode=0o700, parents=True, exist_ok=True)
    if join:  # a newcomer needs no MPI: the rendezvous is in the job folder
        signals = stop_signals("torchrun-slurm" if torchrun_on_slurm(os.environ) else "")
        devices = launched()
        activate(devices)
        return _join(job, spec, secret, _live_rendezvous(job), None, signals, devices)
    boot, comm = bootstrap()
    devices = launched(local_rank=boot.local_rank)
    activate(devices)
    if boot.restart:  # torchrun's agent restarted this worker: its state is gone
        if refused := joberror.this_jobs(job.path):  # bad input, not a crash: no rejoin, no requeue
            raise ConfigError(refused)
        return _rejoin(job, spec, secret, boot, devices)
    rdzv, refused = None, ""
    if boot.rank == 0:
        try:
            address = node_address()
        except ConfigError as exc:  # told to every rank, which would otherwise wait in the bcast
            refused = str(exc)
        else:
            m = Membership.host(secret, 0, address, 0, log=job.run / "membership.log", devices=devices)
            rdzv = Rendezvous(m.rendezvous.host, m.rendezvous.port, boot.launch_id)
            rdzv.write(job.path / RDZV)
    if comm is not None:
        sent = comm.bcast(refused or ((rdzv.host, rdzv.port, rdzv.launch_id) if rdzv else None), root=0)
        if isinstance(sent, str):
            raise ConfigError(sent)
        rdzv = Rendezvous(*sent)
    elif refused:
        raise ConfigError(refused)
    if boot.rank != 0:
        rdzv = rdzv or Rendezvous.read(job.path / RDZV, launch_id=boot.launch_id)
        m = Membership.connect(rdzv, secret, boot.rank, devices=devices)
    try:
        m.form(tuple(range(boot.world)), 0)
        if m.leader:  # the job's log names what runs each model-stage (``nereus run`` prints it too)
            print(f"{spec.name}: {describe_engines(job_engines(spec))}", flush=True)
        if boot.source == "torchrun-slurm" and m.leader:  # what hand_over runs after the checkpoint
            signal.signal(signal.SIGUSR2, _requeue_after_checkpoint)
        preemption = Preemption(stop_signals(boot.source)).install()
        resume = ckpt.latest(job.run / "checkpoints") is not None
        loop = JobLoop.start(m, spec, job.run, resume, job.path / "control", preemption=preemption)
        try:
            status = loop.run()
        except TooFewGpusError as exc:
            return _requeue_short_of_gpus(exc)
        if status is Outcome.PREEMPTED:
            preemption.hand_over(m.leader)
    finally:
        m.close()
    if loop.left_behind:
        assert rdzv is not None  # every member learnt it before the first generation
        return _rejoin_left_behind(job, spec, secret, rdzv, m.gpu, stop_signals(boot.source), devices)
    return status


def stop_signals(source: str) -> tuple[int, ...]:
    """The signals that stop a worker at its next boundary. Under torchrun only SIGUSR2 (SLURM's
    warning before the time limit, ``scancel --signal=USR2``): the agent stops the node's other
    workers with SIGTERM when one of them failed, and those must end at once, not stop the job."""
    return (signal.SIGUSR2,) if source == "torchrun-slurm" else PREEMPT_SIGNALS


def _join(
    job: JobFolder, spec: ExperimentSpec, secret: bytes, rdzv: Rendezvous, gpu: int | None,
    signals: tuple[int, ...], devices: Devices,
) -> Outcome:  # fmt: skip
    """A newcomer: ask the leader (signed, with the job's secret) to be admitted, as GPU ``gpu``
    (None: the next free one), and take part from the boundary it is admitted at."""
    status, behind = _enter(job, spec, secret, rdzv, gpu, signals, devices)
    if behind is not None:
        return _rejoin_left_behind(job, spec, secret, rdzv, behind, signals, devices)
    return status


def _enter(
    job: JobFolder, spec: ExperimentSpec, secret: bytes, rdzv: Rendezvous, gpu: int | None,
    signals: tuple[int, ...], devices: Devices,
) -> tuple[Outcome, int | None]:  # fmt: skip
    """``_join``'s admission and run: (outcome, the GPU id it had when a recovery went on without
    it, else None)."""
    m = Membership.connect(rdzv, secret, -1, devices=devices)
    try:
        preemption = Preemption(signals).install()
        _, generation, members = m.request_join(gpu)
        try:
            loop = JobLoop.enter(m, spec, job.run, generation, members, preemption)
        except Exception as exc:  # a member lost meanwhile (the roll call's verdict, or a peer that
            if not is_peer_failure(exc):  # died as the state came): the others recover without
                raise  # this newcomer, which asks to join again
            print(
                f"nereus: GPU {m.gpu}: {first_line(exc)}; asking to join again", file=sys.stderr, flush=True
            )
            return Outcome.LEFT, m.gpu
        status = loop.run()
        if status is Outcome.PREEMPTED:
            preemption.hand_over(m.leader)
    finally:
        m.close()
    return status, (m.gpu if loop.left_behind else None)


def _rejoin(
    job: JobFolder, spec: ExperimentSpec, secret: bytes, boot: Bootstrap, devices: Devices
) -> Outcome:
    """A worker its torchrun agent restarted: rejoin the running job as its own GPU id. The
    leader's store died with the leader: a restarted leader requeues the job instead."""
    if boot.rank == 0:
        return _requeue_lost_leader(boot)
    rdzv = Rendezvous.read(job.path / RDZV, launch_id=boot.launch_id)
    if not store_answers(rdzv):
        raise JoinRefusedError(
            f"GPU {boot.rank} cannot rejoin: the job's store at {rdzv.host}:{rdzv.port} does not answer "
            "(the leader, GPU 0, is gone; its restart requeues the job)"
        )
    print(
        f"GPU {boot.rank}: restarted by torchrun (restart {boot.restart}); rejoining the job", file=sys.stderr
    )
    return _join(job, spec, secret, rdzv, boot.rank, stop_signals(boot.source), devices)


def _live_rendezvous(job: JobFolder, wait_s: float = GROW_WAIT_S) -> Rendezvous:
    """The running job's rendezvous, for a newcomer of a grow: its store answering, read again
    while a requeued job writes a new one, for up to ``wait_s``. A grow that starts after its job
    ended (SLURM ran it late) is refused in one line, not left waiting 30 minutes on a store
    that is gone while it holds its nodes."""
    deadline = time.monotonic() + wait_s
    while True:
        rdzv = Rendezvous.read(job.path / RDZV)
        if store_answers(rdzv):
            return rdzv
        if time.monotonic() > deadline:
            raise JoinRefusedError(
                f"cannot join: the job's store at {rdzv.host}:{rdzv.port} did not answer for {wait_s:.0f} s "
                "(the job has ended, or is being requeued); grow it again while it runs"
            )


def store_answers(rdzv: Rendezvous, timeout_s: float | None = None) -> bool:
    """Whether the job's store answers within ``timeout_s`` (default ``STORE_PROBE_S``)."""
    return rdzv.answers(STORE_PROBE_S if timeout_s is None else timeout_s)


def _requeue_lost_leader(boot: Bootstrap) -> Outcome:
    """The leader, restarted by torchrun: the job's store and controller died with it, so the job
    cannot go on in place. Requeue it (it resumes from its latest checkpoint), at most as often as
    torchrun may restart a node's workers; ``preempted`` then (SLURM ends this launch)."""
    done = _env_int("SLURM_RESTART_COUNT")
    limit = _env_int("TORCHELASTIC_MAX_RESTARTS")
    if done >= limit:
        raise NereusError(
            f"the job's leader (GPU 0) died and was restarted (restart {boot.restart}); its store died "
            f"with it, and the job was requeued {done} time(s) already (--max-restarts {limit}): not again"
        )
    print(
        f"GPU 0: restarted by torchrun (restart {boot.restart}); the job's store died with the leader: "
        f"requeueing the job (requeue {done + 1} of at most {limit}) to resume from its checkpoint",
        file=sys.stderr,
    )
    requeue()
    return Outcome.PREEMPTED


def _rejoin_left_behind(
    job: JobFolder, spec: ExperimentSpec, secret: bytes, rdzv: Rendezvous, gpu: int,
    signals: tuple[int, ...], devices: Devices,
) -> Outcome:  # fmt: skip
    """A healthy worker the job went on without (it checked in to a recovery too late, held in a
    connect to a dead peer): ask to be admitted again as its own GPU while the job's store
    answers (``nereus.runtime.rejoin``)."""

    def enter() -> tuple[Outcome, bool]:
        status, behind = _enter(job, spec, secret, rdzv, gpu, signals, devices)
        return status, behind is not None

    return rejoin(gpu, lambda: store_answers(rdzv), enter)


def _requeue_short_of_gpus(exc: TooFewGpusError) -> Outcome:
    """The leader, when the GPUs a loss left cannot run the job: under SLURM, requeue it (it
    resumes from its latest checkpoint on the allocation SLURM gives it again), at most
    ``MAX_SHORT_REQUEUES`` times; ``preempted`` then (SLURM ends this launch). Elsewhere, or past
    that, the error stands."""
    if not os.environ.get("SLURM_JOB_ID", "").isdigit():
        raise exc
    done = _env_int("SLURM_RESTART_COUNT")
    if done >= MAX_SHORT_REQUEUES:
        raise TooFewGpusError(f"{exc}; the job was requeued {done} time(s) already: not again") from None
    print(f"GPU 0: {exc}: requeueing the job to resume from it", file=sys.stderr, flush=True)
    requeue()
    return Outcome.PREEMPTED


def _requeue_after_checkpoint(signum: int, frame: Any) -> None:
    """The leader under torchrun, after a stop signal's checkpoint (``Preemption.hand_over``)."""
    try:
        requeue()
    except NereusError as exc:
        print(f"GPU 0: {exc}; nereus-launch resume JOB submits it again from its checkpoint", file=sys.stderr)


def requeue() -> None:
    """``scontrol requeue`` this SLURM job: SLURM ends this launch and runs the job again."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise NereusError(f"cannot requeue: SLURM_JOB_ID is {job_id!r}, not a SLURM job id")
    try:
        subprocess.run(
            ["scontrol", "requeue", job_id], check=True, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as exc:
        why = getattr(exc, "stderr", None) or str(exc)
        raise NereusError(f"scontrol requeue {job_id} failed: {why.strip()[:200]}") from None


def _env_int(key: str) -> int:
    text = os.environ.get(key, "0").strip()
    return int(text) if text.isdigit() else 0
