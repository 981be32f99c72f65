"""Signed checkpoints, the output folder's rules, one metrics row per step — without torch.

- ``signing``: a signed folder verifies; any changed, added or removed file, a changed manifest
  or signature, another key, a symbolic link, and a ``latest`` pointer that leaves the checkpoint
  folder are refused with a ``ConfigError`` naming the cause.
- ``outdir``: a run writes only into a new, empty or its own folder (``--force`` replaces a
  previous run's files and nothing else); folders it creates are 0700.
- ``metrics.drop_rows_after``: rows after a step go, one row per step stays, atomically.
- ``nereus run``'s command and its preflight (with ``--resume``) import no torch.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.errors import ConfigError
from nereus.runtime import outdir, outlock, signing
from nereus.runtime.metrics import drop_rows_after, read_rows
from nereus.spec import Role

pytestmark = pytest.mark.pure

KEY = bytes(range(32))


def _checkpoint(folder: Path, step: int = 4, key: bytes = KEY, **meta: object) -> Path:
    path = folder / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"\x80\x04pickled")
    (path / "__0_0.distcp").write_bytes(bytes(100))
    doc = {"step": step, "model": "tiny-llama", "workload": "ppo-tiny", "logical_state": {}, **meta}
    (path / "meta.json").write_text(json.dumps(doc))
    signing.sign(path, key)
    (folder / "checkpoints" / "latest").write_text(path.name + "\n")
    return path


def test_a_signed_checkpoint_verifies_and_its_meta_reads_back(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    manifest = signing.verify(path, KEY)
    assert set(manifest.files) == {".metadata", "__0_0.distcp", "meta.json"}
    assert manifest.meta()["step"] == 4
    assert manifest.read(".metadata") == b"\x80\x04pickled"
    for rank in range(3):  # a world shares the hashing
        signing.verify(path, KEY, rank, 3)
    assert signing.latest(tmp_path / "checkpoints") == path


def _flip(path: Path, at: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda p: _flip(p / ".metadata", 3), ".metadata: changed since the checkpoint was signed"),
        (lambda p: _flip(p / "__0_0.distcp", 50), "__0_0.distcp: changed since"),
        (lambda p: (p / "meta.json").write_text('{"step": 9}'), "meta.json: changed since"),
        (lambda p: (p / "manifest.json").write_text((p / "manifest.json").read_text() + " "), "signature"),
        (lambda p: (p / "manifest.sig").write_text("00" * 32), "signature does not verify"),
        (lambda p: (p / "manifest.sig").unlink(), "not a signed checkpoint (no manifest.sig)"),
        (lambda p: (p / "manifest.json").unlink(), "not a signed checkpoint (no manifest.json)"),
        (lambda p: (p / "extra.bin").write_bytes(b"x"), "extra.bin is not in the signed manifest"),
        (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
        (lambda p: (p / "link").symlink_to("/etc/passwd"), "link is a symbolic link"),
    ],
)
def test_a_changed_checkpoint_is_refused(tmp_path: Path, tamper: object, message: str) -> None:
    path = _checkpoint(tmp_path)
    tamper(path)  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        signing.verify(path, KEY)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_a_checkpoint_of_another_key_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, key=bytes(32))
    with pytest.raises(ConfigError, match="does not verify with this run's key"):
        signing.verify(path, KEY)


@pytest.mark.parametrize(
    ("pointer", "message"),
    [
        ("../outside", "names '../outside'"),
        ("/tmp", "names '/tmp'"),
        ("step_000004/..", "names 'step_000004/..'"),
        ("step_000042", "step_000042, which does not exist"),
        ("link", "names 'link'"),
        ("step_000099", "step_000099, a symbolic link"),
    ],
)
def test_latest_names_only_a_folder_directly_under_the_checkpoints(
    tmp_path: Path, pointer: str, message: str
) -> None:
    _checkpoint(tmp_path)
    other = _checkpoint(tmp_path / "elsewhere", step=99)
    (tmp_path / "checkpoints" / "step_000099").symlink_to(other)
    (tmp_path / "checkpoints" / "latest").write_text(pointer + "\n")
    with pytest.raises(ConfigError) as info:
        signing.latest(tmp_path / "checkpoints")
    assert message in str(info.value) and "allowed:" in str(info.value)


def test_no_pointer_is_no_checkpoint(tmp_path: Path) -> None:
    assert signing.latest(tmp_path / "checkpoints") is None


def test_the_key_file_is_private_and_never_overwritten(tmp_path: Path) -> None:
    key = signing.create_key(tmp_path / "checkpoint.key")
    assert stat.S_IMODE((tmp_path / "checkpoint.key").stat().st_mode) == 0o600
    assert signing.read_key(tmp_path / "checkpoint.key") == key and len(key) == 32
    with pytest.raises(FileExistsError):
        signing.create_key(tmp_path / "checkpoint.key")
    (tmp_path / "bad.key").write_text("abc\n")
    with pytest.raises(ConfigError, match="expected 64 hex digits"):
        signing.read_key(tmp_path / "bad.key")
    (tmp_path / "binary.key").write_bytes(b"\xff\xfe\xfa")  # not text: the same one line
    with pytest.raises(ConfigError, match=r"binary\.key: expected 64 hex digits"):
        signing.read_key(tmp_path / "binary.key")


def test_identity_names_both_models_and_workloads(tmp_path: Path) -> None:
    meta = {"model": "tiny-llama", "workload": "ppo-tiny"}
    signing.check_identity(tmp_path, meta, {"model": "tiny-llama", "workload": "ppo-tiny"})
    with pytest.raises(ConfigError) as info:
        signing.check_identity(tmp_path, meta, {"model": "tiny-qwen", "workload": "grpo-tiny"})
    text = str(info.value)
    assert "model tiny-llama and workload ppo-tiny" in text
    assert "model tiny-qwen and workload grpo-tiny" in text


def test_identity_is_the_state_not_the_names(tmp_path: Path) -> None:
    """A copied workload file or a renamed model folder resumes (the same architecture, algorithm,
    precision and seed); another seed is refused (the data order follows it); a checkpoint from
    before the architecture was recorded is judged by its names."""
    from nereus.spec import load_model, load_workload

    model, workload = load_model("tiny-llama"), load_workload("ppo-tiny")
    ident = signing.run_identity(dict.fromkeys(Role, model), workload, seed=3)
    meta = {
        **ident,
        "model": "model",
        "workload": "ppo-tiny-v2",
        "logical_state": {"actor.train": {"seed": 3}},
    }
    signing.check_identity(tmp_path, meta, ident)
    del meta["seed"]  # a checkpoint from before the seed was recorded: its model-stages' state has it
    signing.check_identity(tmp_path, meta, ident)
    with pytest.raises(ConfigError) as info:
        signing.check_identity(tmp_path, meta, {**ident, "seed": 7})
    assert "was written by a run with seed 3; this run's is 7" in str(info.value)
    assert "resume with seed: 3" in str(info.value)
    old = {k: v for k, v in meta.items() if k != "architecture"}
    with pytest.raises(ConfigError, match="was written for model model and workload ppo-tiny-v2; this run"):
        signing.check_identity(tmp_path, old, ident)


def test_batches_generated_ahead_resume_only_into_an_async_run(tmp_path: Path) -> None:
    meta = {"model": "m", "workload": "w", "mode": "async", "pending": [4, 5]}
    signing.check_identity(tmp_path, meta, {"model": "m", "workload": "w", "mode": "async"})
    with pytest.raises(ConfigError, match=r"generated ahead \(for steps 4, 5\).*mode: sync"):
        signing.check_identity(tmp_path, meta, {"model": "m", "workload": "w", "mode": "sync"})
    drained = {"model": "m", "workload": "w", "mode": "async"}  # nothing ahead: either mode resumes it
    signing.check_identity(tmp_path, drained, {"model": "m", "workload": "w", "mode": "sync"})


# ------------------------------------------------------------------ the output folder
def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_new_folder_is_created_private_and_marked(tmp_path: Path) -> None:
    out = tmp_path / "a" / "run"
    outdir.check(out, resume=False, force=False)
    assert not (tmp_path / "a").exists()
    key = outdir.prepare(out, resume=False, force=False)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert outdir.is_ours(out) and signing.read_key(out / "checkpoint.key") == key


def test_an_empty_folder_or_one_with_shrink_requests_is_fine(tmp_path: Path) -> None:
    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "shrink-1.json").write_text('{"nodes": 1}')
    outdir.check(tmp_path, resume=False, force=False)


def test_a_used_folder_needs_force_and_force_replaces_only_the_runs_files(tmp_path: Path) -> None:
    out = tmp_path / "run"
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "checkpoints").mkdir()
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(ConfigError, match="holds a previous run; pass --resume to continue it or --force"):
        outdir.check(out, resume=False, force=False)
    with pytest.raises(ConfigError, match="--force and --resume"):
        outdir.prepare(out, resume=True, force=True)
    assert _snapshot(out) == before
    outdir.prepare(out, resume=False, force=True)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert (out / "notes.txt").read_text() == "mine"
    # set aside, not removed: a new run that ends before its first row or checkpoint gives them back
    assert (out / outdir.REPLACED / "metrics.jsonl").read_text() == '{"step": 0}\n'
    (out / "checkpoints").mkdir()  # the new run began, wrote nothing yet
    assert outdir.settle(out) and not (out / outdir.REPLACED).exists()
    assert _snapshot(out) == before
    outdir.prepare(out, resume=False, force=True)
    outdir.prepare(out, resume=False, force=True)  # a killed replacing run: the next one settles it first
    assert (out / outdir.REPLACED / "metrics.jsonl").read_text() == '{"step": 0}\n'
    (out / "metrics.jsonl").write_text('{"step": 0, "new": 1}\n')  # the new run trained: the old go
    assert not outdir.settle(out) and not (out / outdir.REPLACED).exists()
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "new": 1}\n'
    outdir.prepare(out, resume=False, force=True)
    (out / "checkpoints" / "step_000000").mkdir(parents=True)
    outdir.drop_replaced(out)  # the first checkpoint's save drops them at once
    assert not (out / outdir.REPLACED).exists()


def test_force_replacement_edges(tmp_path: Path) -> None:
    """A half-written save is no checkpoint; a killed replacing run is settled before a resume
    reads the folder; a set-aside that cannot happen is one line, nothing moved; the old files
    are deleted beside the run, and what a killed process left is removed by the next run."""
    out = tmp_path / "run"
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    before = _snapshot(out)
    outdir.prepare(out, resume=False, force=True)
    (out / "checkpoints" / ".step_000000.tmp").mkdir(parents=True)  # a save that crashed half-way
    assert outdir.settle(out) and _snapshot(out) == before
    outdir.prepare(out, resume=False, force=True)
    outdir.recover(out)  # what a --resume's preflight does first
    assert _snapshot(out) == before and not (out / outdir.REPLACED).exists()
    (out / outdir.REPLACED).write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^--out: .*\.nereus-replaced cannot be set aside for --force"):
        outdir.prepare(out, resume=False, force=True)
    (out / outdir.REPLACED).unlink()
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    outdir.prepare(out, resume=False, force=True)
    (out / "metrics.jsonl").write_text('{"step": 0, "new": 1}\n')
    outdir.drop_replaced(out, wait=False)
    assert not (out / outdir.REPLACED).exists()
    leftover = out / f"{outdir.REPLACED}.1.deleting"
    (leftover / "checkpoints").mkdir(parents=True)
    outdir.prepare(out, resume=True, force=False)
    assert not leftover.exists()


def test_discard_undoes_a_refused_fresh_run_but_never_a_step_a_checkpoint_or_a_users_file(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").mkdir()
    assert outdir.discard(out, created=True) and not out.exists()
    outdir.prepare(out, resume=False, force=False)
    (out / "notes.txt").write_text("mine")  # a folder that held the user's file stays, with it
    assert outdir.discard(out, created=True) and [p.name for p in out.iterdir()] == ["notes.txt"]
    out = tmp_path / "trained"
    outdir.prepare(out, resume=False, force=False)
    (out / "checkpoints" / "step-0").mkdir(parents=True)
    before = _snapshot(out)
    assert not outdir.discard(out, created=True) and _snapshot(out) == before
    out = tmp_path / "stepped"  # a metrics row: a step ran, its results stay
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert not outdir.discard(out, created=True) and (out / "metrics.jsonl").is_file()
    mine = tmp_path / "mine"  # no marker: not a run's folder
    (mine / "checkpoints").mkdir(parents=True)
    assert not outdir.discard(mine, created=True) and (mine / "checkpoints").is_dir()


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        ("metrics-bytes", r"metrics.jsonl cannot be read \(not UTF-8 text\)"),
        ("metrics-folder", r"metrics.jsonl cannot be read \(Is a directory\)"),
        ("tensorboard-file", r"tensorboard is not a folder"),
        ("hf-file", r"hf is not a folder"),
    ],
)
def test_resume_refuses_a_run_whose_own_files_are_damaged(tmp_path: Path, damage: str, error: str) -> None:
    """Each used to fail in the workers (the hf file only at the export, after training)."""
    out = tmp_path / "run"
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "checkpoints").mkdir()
    outdir.check(out, resume=True, force=False)
    name, kind = damage.split("-")
    target = out / ("metrics.jsonl" if name == "metrics" else name)
    if target.is_file():
        target.unlink()
    if kind == "bytes":
        target.write_bytes(b'{"step": 0}\n\xff\xfe junk\n')
    elif kind == "folder":
        target.mkdir()
    else:
        target.write_text("")
    refused = rf"^--out: .*{error}; --resume needs the run's own \(move it away\)$"
    with pytest.raises(ConfigError, match=refused):
        outdir.check(out, resume=True, force=False)


def test_a_foreign_folder_needs_force(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("x")
    with pytest.raises(ConfigError, match=r"is not empty \(thesis.tex\) and nereus run did not create it"):
        outdir.check(tmp_path, resume=False, force=False)
    outdir.prepare(tmp_path, resume=False, force=True)  # the run's files go beside the user's
    assert (tmp_path / "thesis.tex").read_text() == "x" and outdir.is_ours(tmp_path)


def test_force_never_removes_a_users_own_files_of_a_runs_names(tmp_path: Path) -> None:
    """A folder nereus run did not create: its ``checkpoints/`` or ``hf/`` are the user's."""
    (tmp_path / "checkpoints" / "epoch10").mkdir(parents=True)
    (tmp_path / "checkpoints" / "epoch10" / "model.pt").write_text("weights")
    (tmp_path / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoints is there and nereus run did not write it; --force"):
        outdir.prepare(tmp_path, resume=False, force=True)
    assert _snapshot(tmp_path) == before


def test_out_must_be_a_writable_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--out: .*file is a file; expected a folder"):
        outdir.check(tmp_path / "file", resume=False, force=False)
    with pytest.raises(ConfigError, match=r"is inside .*file, a file"):
        outdir.check(tmp_path / "file" / "run", resume=False, force=False)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="is not writable"):
            outdir.check(locked / "run", resume=False, force=False)


# ------------------------------------------------------------------ metrics rows
def test_rows_after_a_step_are_dropped_and_each_step_keeps_one_row(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "n": i} for i, s in enumerate([0, 1, 2, 3, 4, 2, 3])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "half')
    drop_rows_after(path, 3)
    assert [(s, json.loads(line)["n"]) for s, line in read_rows(path)] == [(0, 0), (1, 1), (2, 5), (3, 6)]
    assert path.read_text().endswith("\n")
    before = path.stat().st_mtime_ns
    drop_rows_after(path, 3)  # already so: untouched
    assert path.stat().st_mtime_ns == before
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_line_that_is_not_a_row_is_dropped_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A half-written last line goes quietly (a stop leaves one); other text does not go unsaid."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "half')
    drop_rows_after(path, 5)
    assert [s for s, _ in read_rows(path)] == [0, 1] and capsys.readouterr().err == ""
    path.write_text('{"step": 0}\nnote to self\n[1, 2]\n{"step": 1}\n')
    drop_rows_after(path, 5)
    assert [s for s, _ in read_rows(path)] == [0, 1]
    assert "2 line(s) that are not metrics rows dropped (first: line 2)" in capsys.readouterr().err


# ------------------------------------------------------------------ no torch in the command
def test_the_run_command_and_its_preflight_load_no_torch(tmp_path: Path) -> None:
    """The preflight of a fresh run and of a ``--resume`` (a signed checkpoint, its key), in a
    process of its own: torch stays out (its own checks ran in a child)."""
    out = tmp_path / "out"
    out.mkdir()
    _checkpoint(out, step=1)
    (out / "checkpoint.key").write_text(KEY.hex() + "\n")
    exp = tmp_path / "x.yaml"
    exp.write_text("name: x\nworkload: ppo-tiny\nmodel: tiny-llama\nworkers: 4\nsteps: 3\n")
    from nereus.rl.tasks import generate_tasks, write_jsonl
    from nereus.runtime.experiment import ExperimentSpec

    t = ExperimentSpec.load(exp).task  # the run's record of the prompts it trained on
    write_jsonl(generate_tasks(t.kind, t.n, t.seed, t.difficulty, t.length), out / "tasks.jsonl")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import nereus.cli, nereus.runtime.command as c, nereus.runtime.local\n"
        "from nereus.runtime.experiment import ExperimentSpec\n"
        f"spec = ExperimentSpec.load(Path({str(exp)!r}))\n"
        f"c.preflight(spec, Path({str(tmp_path / 'fresh')!r}), resume=False)\n"
        f"c.preflight(spec, Path({str(out)!r}), resume=True)\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.strip() == "False", proc.stderr[-2000:]


@settings(deadline=None, database=None, max_examples=120)
@given(
    target=st.sampled_from(
        [".metadata", "__0_0.distcp", "meta.json", "manifest.json", "manifest.sig", "latest"]
    ),
    how=st.sampled_from(["flip", "truncate", "append", "replace", "empty"]),
    at=st.integers(0, 10_000),
    junk=st.binary(min_size=1, max_size=64),
)
def test_fuzzed_checkpoint_files_verify_unchanged_or_are_refused(
    tmp_path_factory: pytest.TempPathFactory, target: str, how: str, at: int, junk: bytes
) -> None:
    """Whatever happens to one of a checkpoint's files (or to the pointer), finding and verifying
    it either gives back exactly what was signed or is one ``ConfigError``, nothing else."""
    root = tmp_path_factory.mktemp("fuzz")
    path = _checkpoint(root)
    file = root / "checkpoints" / "latest" if target == "latest" else path / target
    data = file.read_bytes()
    mutated = {
        "flip": lambda: bytes(b ^ (1 if i == at % max(len(data), 1) else 0) for i, b in enumerate(data)),
        "truncate": lambda: data[: at % max(len(data), 1)],
        "append": lambda: data + junk,
        "replace": lambda: junk,
        "empty": lambda: b"",
    }[how]()
    file.write_bytes(mutated)
    try:
        found = signing.latest(root / "checkpoints")
        assert found is not None
        manifest = signing.verify(found, KEY)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert found == path and manifest.read(".metadata") == b"\x80\x04pickled"
    assert manifest.meta()["step"] == 4


def test_one_run_at_a_time_per_folder(tmp_path: Path) -> None:
    """A second ``nereus run`` on a folder a run is using (``--force`` or ``--resume``) is refused
    before it replaces or writes anything; the lock goes with the run."""
    out = tmp_path / "run"
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    before = _snapshot(out)
    code = (
        "import sys; from nereus.runtime import outdir; from nereus.errors import ConfigError\n"
        "for resume, force in ((False, True), (True, False)):\n"
        "    for step in (outdir.check, outdir.prepare):\n"
        "        try:\n"
        "            step(sys.argv[1], resume, force)\n"
        "            print('allowed')\n"
        "        except ConfigError as exc:\n"
        "            print(exc)\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert got == [f"--out: {out} is in use by another nereus run (pid {os.getpid()}); wait for it to "
                   "end, or choose another --out"] * 4, got  # fmt: skip
    assert _snapshot(out) == before
    outdir.prepare(out, resume=True, force=False)  # this process's own run: its lock


def test_a_killed_runs_workers_keep_the_folder_in_use_until_they_end(tmp_path: Path) -> None:
    """``nereus run`` killed outright lets go of its lock, but its workers run on to their next
    boundary and write a checkpoint and a row there: a ``--resume`` started meanwhile ran beside
    them (step 4's row twice). Each worker holds ``.nereus-workers`` while it lives; a run is
    refused, writing nothing, until the last has ended."""
    out = tmp_path / "run"
    outdir.prepare(out, resume=False, force=False)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    outlock.release(out)  # the supervisor's lock gone, as when it is killed
    worker = subprocess.Popen(  # a worker of the killed run, still going
        [sys.executable, "-c", "import sys; from nereus.runtime import outlock; "
         "outlock.hold_as_worker(sys.argv[1]); print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "held"
        before = _snapshot(out)
        message = f"--out: {out} is in use by the worker processes of a nereus run that was killed"
        for step in (outdir.check, outdir.prepare):
            with pytest.raises(ConfigError, match=re.escape(message)):
                step(out, True, False)
        assert _snapshot(out) == before
    finally:
        worker.communicate("", timeout=30)  # the worker ends
    assert outdir.prepare(out, resume=True, force=False)  # free again
    outlock.release(out)
    (out / ".nereus-workers").unlink()
    (out / ".nereus-workers").symlink_to(tmp_path / "elsewhere")  # no worker could hold that
    with pytest.raises(ConfigError, match=r"nereus-workers is a symbolic link; expected the run lock file"):
        outdir.check(out, True, False)


def test_only_signed_checkpoints_count_and_they_sort_by_step(tmp_path: Path) -> None:
    """Pruning keeps the newest two of these and nothing else is touched: a user's ``step_*``
    folder is not a checkpoint, and step 1,000,000 is newer than step 999,999."""
    folder = tmp_path / "checkpoints"
    for step in (999_998, 1_000_000, 999_999):
        _checkpoint(tmp_path, step)
    (folder / "step_000001").mkdir()
    (folder / "step_000001" / "keep.txt").write_text("mine")
    (folder / "step_000099").mkdir()
    assert [p.name for p in signing.checkpoints(folder)] == ["step_999998", "step_999999", "step_1000000"]
    assert signing.checkpoints(tmp_path / "absent") == []


def test_a_resume_keeps_the_generated_task_and_says_which_rows_are_gone(tmp_path: Path) -> None:
    from nereus.rl.tasks import generate_tasks, write_jsonl
    from nereus.runtime.experiment import ExperimentSpec, TaskSpec
    from nereus.runtime.resume import check_task, missing_rows

    spec = ExperimentSpec(name="t", workload="ppo-tiny", model="tiny-llama", task=TaskSpec(n=16))
    write_jsonl(generate_tasks("add", 16, 0, 4, 2), tmp_path / "tasks.jsonl")
    check_task(spec, tmp_path)
    for changed in (
        TaskSpec(n=15),
        TaskSpec(n=16, difficulty=3),
        TaskSpec(n=16, seed=1),
        TaskSpec(kind="copy", n=16),
    ):
        with pytest.raises(ConfigError, match=r"--resume: task: .* is not the task .*tasks.jsonl records"):
            check_task(
                ExperimentSpec(name="t", workload="ppo-tiny", model="tiny-llama", task=changed), tmp_path
            )
    (tmp_path / "tasks.jsonl").unlink()  # the record gone: the prompts trained on are not known
    with pytest.raises(
        ConfigError, match=r"--resume: .*tasks.jsonl is missing: the prompts the run trained on"
    ):
        check_task(
            ExperimentSpec(name="t", workload="ppo-tiny", model="tiny-llama", task=TaskSpec(n=9)), tmp_path
        )
    rows = tmp_path / "metrics.jsonl"
    rows.write_text('{"step": 0}\n{"step": 1}\nnot json\n{"step": 4}\n')
    assert missing_rows(rows, 6) == [2, 3, 5]
    assert missing_rows(tmp_path / "absent.jsonl", 2) == [0, 1]


def test_a_resume_keeps_the_prompts_per_step(tmp_path: Path) -> None:
    """Step k trains on the data's prompts from k · prompts_per_step: another value on resume would
    train again on prompts already used (or skip some), so it is refused naming the key; a
    checkpoint from before the value was recorded is not judged by it."""
    from dataclasses import replace

    from nereus.spec import load_model, load_workload

    model, workload = load_model("tiny-llama"), load_workload("grpo-tiny")
    meta = signing.run_identity(dict.fromkeys(Role, model), workload, seed=3)
    halved = signing.run_identity(
        dict.fromkeys(Role, model), replace(workload, prompts_per_step=workload.prompts_per_step // 2), seed=3
    )
    with pytest.raises(ConfigError) as info:
        signing.check_identity(tmp_path, meta, halved)
    assert f"with prompts_per_step {workload.prompts_per_step}; this run's workload grpo-tiny has" in str(
        info.value
    )
    assert f"resume with prompts_per_step: {workload.prompts_per_step}" in str(info.value)
    del meta["prompts_per_step"]
    signing.check_identity(tmp_path, meta, halved)
