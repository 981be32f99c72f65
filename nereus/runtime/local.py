"""``nereus run``: the job as local worker processes on this machine (one per virtual GPU).

Each local worker counts as a node of its own for shrink requests (``<out>/control/shrink-*.json``
with ``{"nodes": K}``, as ``nereus-launch shrink`` writes them).

``launch_local`` is a small supervisor: it prepares the output folder (``nereus.runtime.outdir``)
and starts one process per worker, the first of which (GPU 0) hosts the job's rendezvous store
and the controller, and waits for them. A scripted gain starts a new process that joins the
running job through the store, exactly as a node added to a SLURM allocation does; a scripted
loss or kill ends a process. SIGINT, SIGTERM or SIGUSR2 — to the supervisor, which passes it on
to every worker as srun does, or to the whole process group — stops the job at its next
boundary after a checkpoint, and the run ends with the signal's exit code
(``nereus.runtime.signals``; ``nereus run --resume`` continues). A second SIGINT to the
supervisor kills the workers at once (the last checkpoint stays). The job succeeds when the
leader does.

The supervisor imports no torch: the initial workers start from a fork server (where
``multiprocessing`` offers one) that imports the runtime (``PRELOAD``: torch and the modules
``member_main`` uses) once, before forking them, instead of every worker importing it anew; a
joiner, started later by the leader, imports it itself. Edge module (processes).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from nereus.errors import NereusError
from nereus.runtime import outdir, outlock, signing
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.signals import STOP_SIGNALS, exit_code, start, stop_with, stopped_by

if TYPE_CHECKING:  # the supervisor imports no torch
    from nereus.control.action import Outcome
    from nereus.devices import Devices
    from nereus.runtime.preemption import Preemption

RDZV = "rendezvous.json"
# What every initial worker imports before it takes part, imported once by the fork server.
# Not vLLM: it reads its settings from the environment a worker sets up before building an
# engine. The modules ``nereus.cli`` imports, not itself: a worker re-runs the main module of
# ``python -m nereus.cli`` (runpy warns when that module is already imported).
PRELOAD = (
    "nereus.control.action",
    "nereus.describe",
    "nereus.devices",
    "nereus.plan.exhaustive",
    "nereus.plan.report",
    "nereus.plan.solvers",
    "nereus.runtime.checkpoint",
    "nereus.runtime.command",
    "nereus.runtime.loop",
    "nereus.runtime.membership",
    "nereus.runtime.preemption",
    "nereus.sim.command",
    "nereus.telemetry",
    "nereus.transition.command",
    "rich.table",
)
SAME_STOP_S = 0.2  # a second SIGINT sooner than this is the first one's copy, not a second Ctrl-C
STRAGGLER_S = 60.0  # how long the other workers may take to stop after the leader did
ERRORS = ".start-errors"  # an initial worker's refusal, for the supervisor to print (``_fail``)
PEER_LEFT = 1  # a worker's exit when a peer stopped during start-up (the peer's error is the job's)


@dataclass(frozen=True, slots=True)
class Ending:
    """How a local run ended: ``code`` is what ``nereus run`` exits with (0: done; the leader's
    exit code otherwise), ``signum`` the signal that stopped it, ``checkpoint`` the step of the
    latest checkpoint, ``forced`` whether a second SIGINT killed the workers."""

    code: int
    signum: int | None = None
    checkpoint: int | None = None
    forced: bool = False


class _Supervisor:
    """The supervisor's signal handling: the first stop signal is passed on to every worker; a
    second SIGINT kills them. A SIGINT within ``SAME_STOP_S`` of the first is the same stop
    (``timeout -s INT`` signals the process, then its group; a terminal's Ctrl-C reaches the group):
    a user's second Ctrl-C comes later. A signal that arrives while the workers start reaches
    those that have a pid; ``started`` passes it on to the rest."""

    def __init__(self, procs: list[BaseProcess], clock: Callable[[], float] = time.monotonic) -> None:
        self.procs = procs
        self.signum: int | None = None
        self.forced = False
        self.clock = clock
        self._first_s = 0.0
        self._sent: dict[int, set[int]] = {}  # signal → the pids it was sent to

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT and not self.forced:
            if self.clock() - self._first_s < SAME_STOP_S:
                return
            self.forced = True
            self._send(signal.SIGKILL)
            return
        if self.signum is None:
            self.signum, self._first_s = signum, self.clock()
        self._send(signum)

    def started(self) -> None:
        """Every worker has a pid: a stop signal that came during the start reaches the workers
        that had none then (each holds it until its handler is in)."""
        if self.forced:
            self._send(signal.SIGKILL)
        elif self.signum is not None:
            self._send(self.signum, once=True)

    def _send(self, signum: int, once: bool = False) -> None:
        sent = self._sent.setdefault(signum, set())
        for p in self.procs:
            if p.pid is not None and p.exitcode is None and not (once and p.pid in sent):
                sent.add(p.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)


def launch_local(spec: ExperimentSpec, out: Path, resume: bool = False, force: bool = False) -> Ending:
    """Run ``spec`` on ``spec.workers`` processes; results under ``out``. The caller has run the
    preflight; this prepares ``out`` (``outdir.prepare``) and runs the job."""
    out = Path(out)
    key = outdir.prepare(out, resume, force)
    (out / RDZV).unlink(missing_ok=True)
    secret = secrets.token_bytes(32)
    ctx = _context()
    members = tuple(range(spec.workers))
    me = os.getpid()
    procs: list[BaseProcess] = [
        ctx.Process(
            target=member_main,
            args=(g, members, spec, str(out), secret, key, resume, me),
            name=f"nereus-gpu{g}",
        )
        for g in members
    ]
    supervisor = _Supervisor(procs)
    previous = {s: signal.signal(s, supervisor) for s in STOP_SIGNALS}
    try:
        start(procs)  # the workers start with the stop signals held until their handlers are in
        supervisor.started()
        procs[0].join()
        for p in procs[1:]:
            p.join(timeout=STRAGGLER_S)
            if p.is_alive():  # SIGKILL: a straggler may hold its stop signals
                p.kill()
                p.join()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    (out / RDZV).unlink(missing_ok=True)
    code = procs[0].exitcode
    code = 128 + signal.SIGKILL if code is None or code < 0 else code
    recorded = _start_error(out)
    if recorded is not None and code != 0:  # a worker refused to start: its one line, its code
        code, line = recorded
        print(f"nereus run: error: {line}", file=sys.stderr)
    try:
        found = signing.latest(out / "checkpoints")
    except NereusError:
        found = None
    step = _step_of(found) if found is not None else None
    if supervisor.forced:
        return Ending(exit_code(signal.SIGINT), signal.SIGINT, step, forced=True)
    signum = stopped_by(code)
    return Ending(code, signum, step if signum is not None else None)


def _context() -> Any:
    """The initial workers' start method: a fork server that imports ``PRELOAD`` once, where
    there is one; else spawn. Either way a worker starts from a process that never ran the job
    (no threads, sockets or torch state of the supervisor's)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _step_of(path: Path) -> int | None:
    import json

    try:
        return int(json.loads((path / signing.META).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class _PeerLeftError(NereusError):
    """A peer stopped while the job started (a collective lost it): the peer's refusal is the
    job's error, this worker only leaves."""

    exit_code = PEER_LEFT


def _fail(exc: NereusError, folder: Path | None = None, gpu: int = 0) -> NoReturn:
    """A worker's clear error: the error's exit code; an initial worker also records its line
    (``folder``/``ERRORS``/``gpu``) for the supervisor to print once (``_start_error``), whichever
    worker found it (the one that reads the bad weights need not be the leader), or prints it
    itself when the record cannot be written."""
    if folder is not None:
        try:
            (folder / ERRORS).mkdir(exist_ok=True)
            (folder / ERRORS / f"gpu{gpu}").write_text(f"{exc.exit_code}\n{exc}")
        except OSError:  # a full disk, say (its error may be the line): the line goes out here
            print(f"nereus run: error: {exc}", file=sys.stderr, flush=True)
    _exit(exc.exit_code)


def _start_error(folder: Path) -> tuple[int, str] | None:
    """The error an initial worker recorded (the lowest GPU's), as (exit code, line); None if
    none did. The record is removed."""
    found = None
    errors = folder / ERRORS
    for path in sorted(errors.glob("gpu*"), key=lambda p: int(p.name[3:]) if p.name[3:].isdigit() else 0):
        with contextlib.suppress(OSError, ValueError):
            code, _, line = path.read_text().partition("\n")
            found = found or (int(code), line)
    with contextlib.suppress(OSError):
        for path in errors.glob("*"):
            path.unlink()
        errors.rmdir()
    return found


def member_main(
    gpu: int, members: tuple[int, ...], spec: ExperimentSpec, out: str, secret: bytes, key: bytes,
    resume: bool, supervisor: int,
) -> None:  # fmt: skip
    """An initial worker process: GPU 0 hosts the store; the others connect to it. Exits 0 when
    the job is done, with the stop signal's code when it stopped, with a ``NereusError``'s code
    (2 for a ``ConfigError``; the leader prints its one line) when it refused to go on. A worker
    a recovery went on without (it hung, or checked in too late) asks to rejoin (``_rejoin``)."""
    from nereus.runtime.preemption import Preemption

    preemption = Preemption(STOP_SIGNALS).install()  # first: the signals were held until now
    stop_with(supervisor)  # a supervisor killed outright: SIGTERM, the job stops at a checkpoint
    outlock.hold_as_worker(Path(out))  # no other run starts in the folder while this one may write

    from nereus.control.action import Outcome
    from nereus.devices import activate, choose
    from nereus.runtime import checkpoint as ckpt
    from nereus.runtime.comm import is_peer_failure
    from nereus.runtime.loop import JobLoop
    from nereus.runtime.membership import Membership, Rendezvous

    folder = Path(out)
    try:  # one node, every GPU visible to every worker: worker g is local rank g, on GPU g
        devices = choose(gpu, spec.workers, shared=True)
    except NereusError as exc:
        _fail(exc, folder, gpu)
    activate(devices)
    ckpt.use_key(key)
    if gpu == 0:
        m = Membership.host(
            secret, 0, "127.0.0.1", 0, log=folder / "membership.log", node=f"local{gpu}", devices=devices
        )
        m.rendezvous.write(folder / RDZV)
    else:
        m = Membership.connect(
            Rendezvous.read(folder / RDZV), secret, gpu, node=f"local{gpu}", devices=devices
        )
    ctx = mp.get_context("spawn")

    def spawn(g: int, dies: bool) -> None:
        args = (g, spec, out, secret, key, dies)
        start([ctx.Process(target=joiner_main, args=args, name=f"nereus-gpu{g}")])

    status, error, behind, started = Outcome.DONE, None, False, False
    try:
        m.form(members, 0)
        local = spawn if gpu == 0 else None
        loop = JobLoop.start(m, spec, folder, resume, folder / "control", local, preemption)
        started = True  # from here on the loop recovers from peers that leave
        status = loop.run()
        behind = loop.left_behind
    except NereusError as exc:
        error = exc
    except Exception as exc:  # a peer that stopped at start-up (its error is recorded): no traceback
        if not is_peer_failure(exc) or started:
            raise
        error = _PeerLeftError(f"GPU {gpu}: a peer left during start-up")
    finally:
        m.close()
    if error is not None:
        _fail(error, None if isinstance(error, _PeerLeftError) else folder, gpu)
    if behind:
        try:
            status = _rejoin(gpu, spec, folder, secret, preemption, devices)
        except NereusError as exc:
            _fail(exc)
    if status is Outcome.PREEMPTED:
        _exit(exit_code(preemption.signum or signal.SIGTERM))


def joiner_main(
    gpu: int | None, spec: ExperimentSpec, out: str, secret: bytes, key: bytes, dies: bool = False
) -> None:
    """A newcomer: ask the running job to let it in, then take part from the next boundary
    (``dies``: a scripted fault, it is killed once accepted, before it forms the generation)."""
    from nereus.runtime.preemption import Preemption

    preemption = Preemption(STOP_SIGNALS).install()
    outlock.hold_as_worker(Path(out))

    from nereus.control.action import Outcome
    from nereus.devices import activate, choose
    from nereus.runtime import checkpoint as ckpt

    try:
        devices = choose(gpu or 0, spec.workers, shared=True)
    except NereusError as exc:
        _fail(exc)
    activate(devices)
    ckpt.use_key(key)
    folder = Path(out)
    try:
        status, behind = _enter(gpu, spec, folder, secret, preemption, devices, dies)
    except NereusError as exc:
        _fail(exc)
    if behind:
        try:
            status = _rejoin(gpu, spec, folder, secret, preemption, devices)
        except NereusError as exc:
            _fail(exc)
    if status is Outcome.PREEMPTED:
        _exit(exit_code(preemption.signum or signal.SIGTERM))


def _enter(
    gpu: int | None, spec: ExperimentSpec, folder: Path, secret: bytes, preemption: Preemption,
    devices: Devices, dies: bool = False,
) -> tuple[Outcome, bool]:  # fmt: skip
    """Ask the running job to admit this process (as ``gpu``; None: the next free one) and take
    part from the boundary it is admitted at (``dies``: killed once admitted, a scripted fault).
    Returns (outcome, whether a recovery went on without it)."""
    from nereus.control.action import Outcome
    from nereus.runtime import faults
    from nereus.runtime.comm import first_line, is_peer_failure
    from nereus.runtime.loop import JobLoop
    from nereus.runtime.membership import Membership, Rendezvous

    name = f"local-new{gpu}" if gpu is not None else "local-new"
    m = Membership.connect(Rendezvous.read(folder / RDZV), secret, -1, node=name, devices=devices)
    try:
        _, generation, members = m.request_join(gpu)
        if dies:
            faults.kill()
        try:
            loop = JobLoop.enter(m, spec, folder, generation, members, preemption)
        except Exception as exc:  # a member lost meanwhile (the roll call's verdict, or a peer that
            if not is_peer_failure(exc):  # died as the state came): the others recover without
                raise  # this newcomer, which asks to join again
            print(
                f"nereus: GPU {m.gpu}: {first_line(exc)}; asking to join again", file=sys.stderr, flush=True
            )
            return Outcome.LEFT, True
        return loop.run(), loop.left_behind
    finally:
        m.close()


def _rejoin(
    gpu: int | None, spec: ExperimentSpec, folder: Path, secret: bytes, preemption: Preemption,
    devices: Devices,
) -> Outcome:  # fmt: skip
    """A healthy worker the job went on without (it hung, or checked in to a recovery too late):
    ask to be admitted again as its own GPU while the job's store answers
    (``nereus.runtime.rejoin``)."""
    from nereus.runtime.membership import Rendezvous
    from nereus.runtime.rejoin import rejoin

    def store_answers() -> bool:
        path = folder / RDZV  # removed when the job is over
        try:
            rdzv = Rendezvous.read(path, timeout_s=0.0) if path.is_file() else None
        except (OSError, ValueError, KeyError, TimeoutError):
            rdzv = None
        return rdzv is not None and rdzv.answers()

    return rejoin(gpu, store_answers, lambda: _enter(gpu, spec, folder, secret, preemption, devices))
