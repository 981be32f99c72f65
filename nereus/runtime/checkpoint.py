"""Job checkpoints with ``torch.distributed.checkpoint``: any plan in, any plan out.

What is saved: every model-stage that nothing else can rebuild — the trainers (parameters,
master weights, Adam moments) and the frozen ones without a weight-sync source (reference,
reward model) — as DTensors on each model-stage's (dp, pp, tp) mesh (``nereus.state.checkpoint``),
plus ``meta.json`` (the step, the model and workload the job trains, every saved model-stage's
logical state, the plan) and, in an asynchronous job, ``pending.bin``: the batches generated
ahead of training (``pending.py``), so a resume neither repeats nor skips samples. Generation
and inference stages are restored from their trainers by a weight sync after loading.

A checkpoint is written to a hidden temporary folder, signed (``nereus.runtime.signing``: a
manifest of every file's SHA-256 and an HMAC with the job's key) and renamed when every rank has
finished; ``latest`` names the newest complete one, so a failing worker never leaves a
checkpoint that looks complete. ``load`` refuses, on every rank alike and before DCP reads
anything, a checkpoint that does not verify or that another model or workload wrote. The key
is the process's (``use_key``: the launched job's secret, or ``nereus run``'s
``<out>/checkpoint.key``). All functions but ``use_key`` are collective over the world. Edge
module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nereus.errors import ConfigError, NereusError
from nereus.plan.layout import Plan
from nereus.runtime import outdir, pending, signing
from nereus.runtime.comm import all_gather, broadcast, first_line
from nereus.runtime.rollout import Batch
from nereus.runtime.worker import Worker
from nereus.state.checkpoint import kv_mesh, layout_mesh, to_dtensors
from nereus.state.emu import LogicalState, replicas
from nereus.state.holder import RankState

LATEST = signing.LATEST
PENDING = "pending.bin"  # async RL: the batches generated ahead (``pending.py``)
DCP_METADATA = ".metadata"
_KEY: dict[str, bytes] = {}  # "key": this process's checkpoint key


def use_key(key: bytes) -> None:
    """The key this process signs and verifies checkpoints with."""
    if len(key) < signing.KEY_BYTES:
        raise ValueError(f"a checkpoint key has at least {signing.KEY_BYTES} bytes, got {len(key)}")
    _KEY["key"] = bytes(key)


def _the_key() -> bytes:
    if "key" not in _KEY:
        raise RuntimeError("no checkpoint key: the process's entry point calls checkpoint.use_key")
    return _KEY["key"]


def saved_stages(worker: Worker) -> list[str]:
    """Model-stages a checkpoint holds: those without a weight-sync source."""
    return [ms.name for ms in worker.workflow.model_stages if worker.workflow.sync_source(ms.name) is None]


def identity(worker: Worker) -> dict[str, Any]:
    """What the checkpoint's state belongs to (``signing.run_identity``): a resume with another
    model, architecture, algorithm or precision is refused."""
    return signing.run_identity(worker.models, worker.workload, worker.seed)


@contextlib.contextmanager
def _state_dict(worker: Worker, plan: Plan) -> Iterator[dict[str, Any]]:
    """The saved model-stages' buffers as DTensors, for DCP, on meshes without process groups of
    their own (``layout_mesh``): a save or load forms no group, so a peer that dies at the
    checkpoint fails its collectives at once instead of a group's store barrier."""
    out: dict[str, Any] = {}
    try:
        for name in saved_stages(worker):
            rs = worker.holder.units.get(name)
            if rs is None:
                continue
            c = plan.candidate(name)
            ranks = [worker.rank_of[g] for u in replicas(c) for g in u.gpus]
            kind = worker.device.type
            mesh = layout_mesh(c.layout, ranks, kind)
            kv = kv_mesh(worker.model_of(name), c.layout, ranks, kind)
            out.update({f"{name}/{k}": v for k, v in to_dtensors(rs, mesh, kv).items()})
        yield out
    finally:
        out.clear()


def save(worker: Worker, plan: Plan, step: int, folder: Path, keep: int = 2) -> Path:
    """Checkpoint after ``step`` into ``folder/step_<step>``, signed; keeps the newest ``keep``
    checkpoints (a folder that is not a signed checkpoint is never pruned). A write that fails
    (a full disk, a read-only file) is a ``CheckpointWriteError`` naming the file, its partial
    files removed; the pointer still names the previous checkpoint."""
    key = _the_key()
    folder = Path(folder)
    final = folder / f"step_{step:06d}"
    tmp = folder / f".step_{step:06d}.tmp"
    try:
        if dist.get_rank() == 0:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
        dist.barrier()
        with _state_dict(worker, plan) as state:
            dcp_save(state, checkpoint_id=str(tmp))
    except (OSError, CheckpointException) as exc:
        if dist.get_rank() == 0:  # the half-written files would keep a full disk full
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(step, tmp, exc) from None
    states = all_gather(
        {n: dataclasses.asdict(rs.state) for n, rs in worker.holder.units.items()}, dict[str, dict[str, int]]
    )
    if dist.get_rank() == 0:
        logical = {n: s for part in states for n, s in part.items() if n in saved_stages(worker)}
        meta = {"step": step, **identity(worker), "logical_state": logical, "plan": _plan_json(plan)}
        try:
            if worker.pending:  # async: the batches generated ahead, which the next steps train on
                (tmp / PENDING).write_bytes(pending.pack(worker.pending))
                meta["pending"] = sorted(worker.pending)
            (tmp / signing.META).write_text(json.dumps(meta, indent=1) + "\n")
            signing.sign(tmp, key)
            _replace(tmp, final)  # a step that ran again: ``latest`` may name the old one meanwhile
            pointer = folder / f".{LATEST}.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, folder / LATEST)
            outdir.drop_replaced(folder.parent, wait=False)  # after --force: the old run's files go now
        except OSError as exc:
            (folder / f".{LATEST}.tmp").unlink(missing_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(step, final, exc) from None
        for old in signing.checkpoints(folder)[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _replace(new: Path, final: Path) -> None:
    """``new`` becomes ``final``; an old ``final`` (the same step saved before it ran again) is
    moved aside first and removed only once ``new`` is in place, else put back."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(new, final)
    except OSError:
        if old.exists():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


class CheckpointWriteError(NereusError):
    """A checkpoint could not be written; the one before it stays the latest."""

    def __init__(self, step: int, where: Path, exc: BaseException) -> None:
        if isinstance(exc, OSError):
            why = f"{exc.filename2 or exc.filename or where}: {exc.strerror or type(exc).__name__}"
        else:
            why = f"{where}: {first_line(exc)}"
        super().__init__(
            f"the checkpoint after step {step} could not be written ({why}); the previous checkpoint "
            "stays the latest"
        )


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under ``folder`` (``signing.latest``: only a folder directly
    under it); None when there is none. Not collective."""
    return signing.latest(folder)


def agreed_latest(folder: Path, wanted: bool = True) -> Path | None:
    """``latest`` as rank 0 finds it, on every rank (None when not ``wanted``); a bad pointer is
    the same ``ConfigError`` everywhere."""
    found: dict[str, str] | None = None
    if dist.get_rank() == 0 and wanted:
        try:
            path = latest(folder)
            found = {"path": str(path)} if path is not None else None
        except ConfigError as exc:
            found = {"error": str(exc)}
    got: dict[str, str] | None = broadcast(found, dict[str, str] | None)
    if got is not None and "error" in got:
        raise ConfigError(got["error"])
    return Path(got["path"]) if got is not None else None


def verified(path: Path) -> signing.Manifest:
    """Checkpoint ``path``'s manifest after every rank checked its share of the files; one rank's
    refusal is every rank's ``ConfigError``."""
    manifest, error = None, None
    try:
        manifest = signing.verify(path, _the_key(), dist.get_rank(), dist.get_world_size())
    except (ConfigError, OSError) as exc:
        error = str(exc)
    first = next((e for e in all_gather(error, str | None) if e is not None), None)
    if first is not None or manifest is None:
        raise ConfigError(first or f"{path}: not verified")
    return manifest


def _meta(path: Path, meta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    try:
        return int(meta["step"]), dict(meta["logical_state"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}/meta.json: not a Nereus checkpoint ({exc})") from None


def step_of(path: Path) -> int:
    """The step after which checkpoint ``path`` was written (its ``meta.json``, unverified: for
    messages; ``load`` verifies). Not collective."""
    try:
        meta = json.loads((Path(path) / signing.META).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}/meta.json: not a Nereus checkpoint ({exc})") from None
    return _meta(path, meta if isinstance(meta, dict) else {})[0]


class VerifiedReader(FileSystemReader):
    """DCP's file reader, unpickling ``.metadata`` only from bytes with the signed digest."""

    def __init__(self, manifest: signing.Manifest) -> None:
        super().__init__(manifest.path)
        self.manifest = manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        data = self.manifest.read(DCP_METADATA)  # refused unless it is what was signed
        metadata: Metadata = pickle.loads(data)  # verified bytes only
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class Loaded(NamedTuple):
    """What ``load`` restored: the checkpoint's step, and how many of its batches generated ahead
    were dropped as staler than this run's ``max_staleness`` (async RL; a resume may lower it)."""

    step: int
    dropped: int


def load(worker: Worker, plan: Plan, path: Path) -> Loaded:
    """Fill this rank's saved model-stages under ``plan`` from ``path``.
    Nothing is loaded unless the checkpoint verifies and this job's model and workload wrote it."""
    manifest = verified(path)
    meta = manifest.meta()
    signing.check_identity(path, meta, identity(worker))
    step, logical = _meta(path, meta)
    missing = sorted(set(saved_stages(worker)) - set(logical))
    if missing:
        raise ConfigError(f"{path}/meta.json: key 'logical_state': no state for {missing}")
    worker.drop()
    for name in saved_stages(worker):
        place = worker.place(plan.candidate(name))
        if place is not None:
            worker.holder.units[name] = RankState.empty(
                name, worker.model_of(name), plan.candidate(name).layout, place.t, place.p,
                worker.policy_of(name), LogicalState(**logical[name]), worker.device,
            )  # fmt: skip
    with _state_dict(worker, plan) as state:
        dcp_load(state, storage_reader=VerifiedReader(manifest))
    kept = _pending(manifest, step)
    worker.pending = fresh(kept, worker.workload.max_staleness)
    stale = sorted(set(kept) - set(worker.pending))
    if stale and worker.rank == 0:
        which = f"batch generated ahead for step {stale[0]} is" if len(stale) == 1 else (
            f"batches generated ahead for steps {', '.join(map(str, stale))} are"
        )  # fmt: skip
        print(
            f"nereus: {path}: the {which} staler than this run's max_staleness "
            f"{worker.workload.max_staleness}; {'it is' if len(stale) == 1 else 'they are'} generated again",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return Loaded(step, len(stale))


def fresh(batches: dict[int, Batch], max_staleness: int) -> dict[int, Batch]:
    """The batches a run whose bound is ``max_staleness`` may train on (a resume may lower it):
    a staler one is dropped, and generated again when its step comes, as a transition's drop is."""
    return {b: batch for b, batch in batches.items() if batch.step - batch.version <= max_staleness}


def _pending(manifest: signing.Manifest, step: int) -> dict[int, Batch]:
    """The checkpoint's batches generated ahead (async RL; none in a synchronous job's)."""
    if PENDING not in manifest.files:
        return {}
    try:
        batches = pending.unpack(manifest.read(PENDING))
    except ValueError as exc:
        raise ConfigError(f"{manifest.path}/{PENDING}: {exc}") from None
    early = sorted(b for b in batches if b <= step)
    if early:
        raise ConfigError(
            f"{manifest.path}/{PENDING}: a batch of step {early[0]}, which the checkpoint's step {step} "
            "had trained"
        )
    return batches


def _plan_json(plan: Plan) -> dict[str, Any]:
    return {
        c.model_stage: {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.dp, "gpus": list(c.gpus)}
        for c in plan.candidates
    }
