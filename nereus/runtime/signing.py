"""Signed checkpoints: a job loads only what it wrote itself (torch-free).

A checkpoint folder (``checkpoints/step_<n>``) is trusted input: DCP unpickles its ``.metadata``
on load. So after every save, rank 0 writes ``manifest.json`` (every file of the folder with its
SHA-256, and ``meta.json``'s digest again) and ``manifest.sig``, an HMAC-SHA256 over the
manifest's bytes with the job's key: a launched job's secret (``nereus.runtime.node``), or for
``nereus run`` the key kept in its output folder (``<out>/checkpoint.key``, 32 random bytes as
hex, 0600, created by the first run). ``verify`` checks the signature first (nothing else of an
unsigned folder is parsed), then that the folder holds exactly the manifest's files, no
symbolic links, each with its digest. ``latest`` follows the ``latest`` pointer only to a
folder directly under the checkpoint folder.

``nereus run --resume`` verifies in its preflight (exit 2, nothing started); the workers verify
again before DCP reads anything (``nereus.runtime.checkpoint.load``), and DCP's ``.metadata``
is unpickled only from bytes whose digest was checked.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nereus.errors import ConfigError
from nereus.spec.workload import Role

if TYPE_CHECKING:
    from nereus.spec.model import ModelSpec
    from nereus.spec.workload import WorkloadSpec

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
META = "meta.json"
LATEST = "latest"
KEY_FILE = "checkpoint.key"
KEY_BYTES = 32
FORMAT = 1
CHECKPOINT_NAME = re.compile(r"step_[0-9]{6,}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


# ------------------------------------------------------------------ the key
def read_key(path: Path) -> bytes:
    """The key in ``path`` (hex, as ``create_key`` writes it)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the checkpoint key ({exc.strerror})") from None
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except ValueError:  # not hex, or not text at all (UnicodeDecodeError is a ValueError)
        key = b""
    if len(key) < KEY_BYTES:
        raise ConfigError(f"{path}: expected {2 * KEY_BYTES} hex digits (the key nereus run wrote)")
    return key


def create_key(path: Path) -> bytes:
    """A new random key in a new file ``path`` (0600); an existing file is never overwritten."""
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
        f.flush()
        os.fsync(f.fileno())
    return key


# ------------------------------------------------------------------ signing
def digest(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """The folder's files by relative path (manifest and signature aside); a symbolic link or
    anything but a regular file or folder is refused."""
    out: dict[str, Path] = {}
    for root, dirs, names in os.walk(folder, followlinks=False):
        for entry in (*dirs, *names):
            path = Path(root) / entry
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                raise ConfigError(f"{folder}: {rel} is a symbolic link; a checkpoint holds only files")
            if entry in names:
                if not path.is_file():
                    raise ConfigError(f"{folder}: {rel} is not a regular file")
                if rel not in (MANIFEST, SIGNATURE):
                    out[rel] = path
    return dict(sorted(out.items()))


def _mac(key: bytes, data: bytes) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def _write(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sign(folder: Path, key: bytes) -> None:
    """Write ``manifest.json`` and its signature into the finished checkpoint ``folder``."""
    folder = Path(folder)
    files = {rel: digest(p) for rel, p in _files(folder).items()}
    if META not in files:
        raise ValueError(f"{folder}: no {META} to sign")
    manifest = {"format": FORMAT, "files": files, "meta": files[META]}
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    _write(folder / MANIFEST, data)
    _write(folder / SIGNATURE, (_mac(key, data) + "\n").encode())


@dataclass(frozen=True, slots=True)
class Manifest:
    """A verified checkpoint: its folder and every file's digest."""

    path: Path
    files: dict[str, str]

    def read(self, rel: str) -> bytes:
        """The bytes of file ``rel``, refused unless their digest is the signed one."""
        expected = self.files.get(rel)
        if expected is None:
            raise ConfigError(f"{self.path}: {rel} is not in the signed manifest")
        data = (self.path / rel).read_bytes()
        if hashlib.sha256(data).hexdigest() != expected:
            raise ConfigError(f"{self.path}/{rel}: changed since the checkpoint was signed")
        return data

    def meta(self) -> dict[str, Any]:
        """``meta.json``, from verified bytes."""
        try:
            meta = json.loads(self.read(META))
        except ValueError as exc:
            raise ConfigError(f"{self.path}/{META}: not JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise ConfigError(f"{self.path}/{META}: expected a JSON object")
        return meta


def verify(folder: Path, key: bytes, rank: int = 0, world: int = 1) -> Manifest:
    """The signed manifest of checkpoint ``folder``, after checking the signature with ``key``,
    that the folder holds exactly the manifest's files, and their digests (``rank`` of ``world``
    checks every ``world``-th file, so a world shares the reading; ``meta.json`` always)."""
    folder = Path(folder)
    try:
        data = (folder / MANIFEST).read_bytes()
        signature = (folder / SIGNATURE).read_text(errors="replace").strip()
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{folder}: not a signed checkpoint (no {Path(str(exc.filename)).name}); "
            "a checkpoint is loaded only with the manifest and signature its run wrote"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot read the manifest ({exc.strerror})") from None
    if not hmac.compare_digest(signature.encode(), _mac(key, data).encode()):
        raise ConfigError(
            f"{folder}: the signature does not verify with this run's key "
            "(the manifest was changed, or another run wrote the checkpoint)"
        )
    try:
        doc = json.loads(data)
        files = doc["files"]
        ok = doc["format"] == FORMAT and doc["meta"] == files[META]
        ok = ok and all(isinstance(d, str) and _HEX64.fullmatch(d) for d in files.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ConfigError(f"{folder}/{MANIFEST}: not a manifest of format {FORMAT}")
    present = _files(folder)
    extra, missing = sorted(set(present) - set(files)), sorted(set(files) - set(present))
    if extra:
        raise ConfigError(f"{folder}: {extra[0]} is not in the signed manifest")
    if missing:
        raise ConfigError(f"{folder}: {missing[0]} is missing (the signed manifest lists it)")
    for i, (rel, expected) in enumerate(sorted(files.items())):
        if (i % world == rank or rel == META) and digest(present[rel]) != expected:
            raise ConfigError(f"{folder}/{rel}: changed since the checkpoint was signed")
    return Manifest(folder, dict(files))


# the model fields that shape a checkpoint's tensors (every role's model is the actor's, with a
# head): a folder of the same name holding another architecture must not be resumed into
STATE_FIELDS = (
    "family", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "head_dim", "tie_word_embeddings", "qk_norm", "attention_bias",
)  # fmt: skip


def run_identity(
    models: Mapping[Role, ModelSpec], workload: WorkloadSpec, seed: int | None = None
) -> dict[str, Any]:
    """What a checkpoint's state belongs to (``meta.json``): the actor's model and the workload's
    names, the actor's state-shaping fields, each model the workload names for another role
    (``models:``: its name and fields), the workload's algorithm (which trainers hold state),
    precision (whether fp32 master weights exist) and mode (an async one's batches generated
    ahead), its prompts per step (step k trains on the data set's prompts from k · prompts_per_step)
    and the run's seed (the data order and the sampling read it)."""
    model = models[Role.ACTOR]
    out: dict[str, Any] = {
        "model": model.name,
        "workload": workload.name,
        "architecture": _architecture(model),
        "role_models": {
            role: {"model": models[Role(role)].name, "architecture": _architecture(models[Role(role)])}
            for role in sorted(workload.models)
            if role != Role.ACTOR.value
        },
        "algorithm": workload.algorithm.value,
        "precision": workload.precision.value,
        "mode": workload.mode.value,
        "prompts_per_step": workload.prompts_per_step,
    }
    if seed is not None:
        out["seed"] = seed
    return out


def _names(roles: dict[str, Any]) -> str:
    """``{critic: llama-125m}``: the model each role names."""
    if not roles:
        return "{} (every role the actor's model)"
    return (
        "{"
        + ", ".join(f"{r}: {m.get('model') if isinstance(m, dict) else m}" for r, m in sorted(roles.items()))
        + "}"
    )


def _architecture(model: ModelSpec) -> dict[str, Any]:
    arch = {f: getattr(model, f) for f in STATE_FIELDS}
    return {k: v.value if isinstance(v, Enum) else v for k, v in arch.items()}


def _same_roles(found: dict[str, Any], want: dict[str, Any]) -> bool:
    """The same roles with models of their own, each of the same architecture (a name alone where
    the checkpoint recorded no architecture)."""
    if set(found) != set(want):
        return False
    for role, was in found.items():
        if isinstance(was, dict) and isinstance(was.get("architecture"), dict):
            if was["architecture"] != want[role].get("architecture"):
                return False
        elif (was.get("model") if isinstance(was, dict) else was) != want[role].get("model"):
            return False
    return True


def _seed_of(meta: dict[str, Any]) -> int | None:
    """The seed the checkpoint's run had: recorded, else its model-stages' logical state's (one
    seed for all of them), else None."""
    recorded = meta.get("seed")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    states = meta.get("logical_state")
    if not isinstance(states, dict):
        return None
    seeds = [v.get("seed") for v in states.values() if isinstance(v, dict)]
    first = seeds[0] if seeds else None
    if isinstance(first, int) and not isinstance(first, bool) and all(x == first for x in seeds):
        return first
    return None


def check_identity(path: Path, meta: dict[str, Any], expected: dict[str, Any], prefix: str = "") -> None:
    """A checkpoint resumes only a run its state fits, judged by what shapes the state rather than
    by names (a workload file copied or renamed, a model folder moved, resume as before): the
    actor's architecture, the roles' own models' architectures, the algorithm and precision, the
    prompts per step and the seed; batches an async run generated ahead resume only into an async
    run, which trains on them. The first difference is named in one line. A checkpoint written
    before the architecture was recorded is judged by the model's and workload's names, as it was
    then."""
    written = f"{prefix}{path} was written for model {meta.get('model')} and workload {meta.get('workload')}"
    this = f"this run has model {expected['model']} and workload {expected['workload']}"
    arch = meta.get("architecture")
    if not isinstance(arch, dict):
        if {k: meta.get(k) for k in ("model", "workload")} != {k: expected[k] for k in ("model", "workload")}:
            raise ConfigError(f"{written}; {this}")
    else:
        for field, want in expected["architecture"].items():
            if field in arch and arch[field] != want:
                raise ConfigError(
                    f"{written}, with {field} {arch[field]!r} in its model; this run's model "
                    f"{expected['model']} has {want!r} (another architecture: its state would not fit)"
                )
    found_roles = meta.get("role_models", {})  # {} in checkpoints from before they were recorded
    want_roles = expected.get("role_models", {})
    if isinstance(found_roles, dict) and not _same_roles(found_roles, want_roles):
        raise ConfigError(
            f"{prefix}{path} was written with the roles' models {_names(found_roles)}; this run's "
            f"workload names {_names(want_roles)} (models:; their state would not fit)"
        )
    for key in ("algorithm", "precision"):
        if key in meta and meta[key] != expected[key]:
            raise ConfigError(
                f"{written}, with {key} {meta[key]!r}; this run's workload {expected['workload']} has "
                f"{expected[key]!r} (its state does not fit)"
            )
    seed = _seed_of(meta)
    if "seed" in expected and seed is not None and seed != expected["seed"]:
        raise ConfigError(
            f"{prefix}{path} was written by a run with seed {seed}; this run's is {expected['seed']} "
            "(the data order and the sampling follow it: a resume would repeat and skip prompts; "
            f"resume with seed: {seed}, or start over with --force)"
        )
    pps, want = meta.get("prompts_per_step"), expected.get("prompts_per_step")
    if pps is not None and want is not None and pps != want:  # (not recorded before: not checked)
        raise ConfigError(
            f"{prefix}{path} was written by a run with prompts_per_step {pps}; this run's workload "
            f"{expected['workload']} has {want} (step k trains on the data's prompts from k · "
            f"prompts_per_step: a resume would repeat or skip prompts; resume with prompts_per_step: "
            f"{pps}, or start over with --force)"
        )
    if meta.get("pending") and expected.get("mode") != "async":
        raise ConfigError(
            f"{prefix}{path} holds batches an async run generated ahead (for steps "
            f"{', '.join(map(str, meta['pending']))}); this run's workload {expected['workload']} is "
            "mode: sync, which would drop them (resume with mode: async)"
        )


# ------------------------------------------------------------------ the latest pointer
def checkpoints(folder: Path) -> list[Path]:
    """The signed checkpoint folders directly under ``folder``, oldest first by step (a
    ``step_*`` folder without a signature, a user's, is not one; neither is a link)."""
    if not Path(folder).is_dir():
        return []
    found = [
        p
        for p in Path(folder).iterdir()
        if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
        and (p / SIGNATURE).is_file()
    ]  # fmt: skip
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def latest(folder: Path) -> Path | None:
    """The checkpoint ``folder/latest`` names: a folder directly under ``folder`` (no ``..``, no
    absolute path, no symbolic link). None when there is no pointer."""
    folder = Path(folder)
    pointer = folder / LATEST
    if not pointer.is_symlink() and not pointer.exists():
        return None
    if pointer.is_symlink() or not pointer.is_file():
        raise ConfigError(f"{pointer}: not a regular file")
    name = pointer.read_text(errors="replace").strip()
    allowed = f"allowed: a checkpoint folder directly under {folder}, named step_<6 digits>"
    if not CHECKPOINT_NAME.fullmatch(name):
        raise ConfigError(f"{pointer}: names {name!r} ({allowed})")
    path = folder / name
    if path.is_symlink():
        raise ConfigError(f"{pointer}: names {name}, a symbolic link ({allowed})")
    if not path.is_dir():
        raise ConfigError(f"{pointer}: names {name}, which does not exist ({allowed})")
    if path.resolve().parent != folder.resolve():
        raise ConfigError(f"{pointer}: names {name}, which is not directly under {folder} ({allowed})")
    return path
