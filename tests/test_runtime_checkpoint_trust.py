"""Checkpoints are trusted input: ``nereus run --resume`` loads only what its run signed.

A finished 2-step run (4 local workers) is copied and changed one way per case — a byte of
DCP's ``.metadata`` or of a shard, ``meta.json``, the manifest or its signature, an added file,
``latest`` pointing outside the checkpoint folder or to a missing folder, another run's key, or
another workload — and ``--resume`` exits 2 with one line naming the cause, changing nothing in
the folder (nothing is loaded: the refusal comes before any worker starts). The untouched copy
resumes. The workers verify again on their own: a run started past the preflight
(``launch_local`` directly) refuses a changed checkpoint with one line and exit 2, no traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BASE = """
name: trust
workload: {workload}
model: tiny-llama
workers: 4
steps: {steps}
seed: 3
policy: always
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, critic_lr: 0.01, kl_coef: 0.01}}
checkpoint_every: 1
"""


def experiment(folder: Path, steps: int, workload: str = "ppo-tiny") -> Path:
    exp = folder / f"trust-{workload}-{steps}.yaml"
    exp.write_text(BASE.format(steps=steps, workload=workload))
    return exp


def resume(exp: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out), "--resume"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.lstat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def finished(finished_ppo_run: Path) -> Path:
    """A finished 2-step run with checkpoints after steps 0 and 1 (``experiment(tmp, 2)``, run
    once per session by ``conftest.finished_ppo_run``); every test changes only a copy."""
    return finished_ppo_run


def latest(out: Path) -> Path:
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


def point(out: Path, target: str) -> None:
    (out / "checkpoints" / "latest").write_text(target + "\n")


def symlinked_out(out: Path) -> None:
    elsewhere = out.parent / "elsewhere"
    shutil.copytree(latest(out), elsewhere / "step_000007")
    (out / "checkpoints" / "step_000007").symlink_to(elsewhere / "step_000007")
    point(out, "step_000007")


def other_key(out: Path) -> None:
    (out / "checkpoint.key").write_text("ab" * 32 + "\n")


def rewrite_meta(out: Path) -> None:
    meta = json.loads((latest(out) / "meta.json").read_text())
    meta["step"] = 0
    (latest(out) / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def rewrite_manifest(out: Path) -> None:
    """A shard changed and the manifest made to match it: the signature gives it away."""
    ckpt = latest(out)
    flip(ckpt / "__1_0.distcp", 4000)
    import hashlib

    doc = json.loads((ckpt / "manifest.json").read_text())
    doc["files"]["__1_0.distcp"] = hashlib.sha256((ckpt / "__1_0.distcp").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


CASES: dict[str, tuple[Callable[[Path], object], str]] = {
    "metadata-byte": (
        lambda o: flip(latest(o) / ".metadata", 200),
        ".metadata: changed since the checkpoint",
    ),
    "shard-byte": (lambda o: flip(latest(o) / "__0_0.distcp", 3000), "__0_0.distcp: changed since the"),
    "meta-json": (rewrite_meta, "meta.json: changed since the checkpoint was signed"),
    "manifest": (rewrite_manifest, "the signature does not verify with this run's key"),
    "signature": (
        lambda o: (latest(o) / "manifest.sig").write_text("0" * 64 + "\n"),
        "the signature does not verify with this run's key",
    ),
    "added-file": (lambda o: (latest(o) / "x.distcp").write_bytes(b"x"), "x.distcp is not in the signed"),
    "unsigned": (
        lambda o: (latest(o) / "manifest.sig").unlink(),
        "not a signed checkpoint (no manifest.sig)",
    ),
    "latest-parent": (
        lambda o: point(o, "../../elsewhere"),
        "names '../../elsewhere' (allowed: a checkpoint",
    ),
    "latest-absolute": (lambda o: point(o, "/tmp"), "names '/tmp' (allowed: a checkpoint folder directly"),
    "latest-symlink": (symlinked_out, "names step_000007, a symbolic link"),
    "latest-missing": (lambda o: point(o, "step_000042"), "names step_000042, which does not exist"),
    "other-key": (other_key, "the signature does not verify with this run's key"),
    "missing-key": (lambda o: (o / "checkpoint.key").unlink(), "checkpoint.key is missing"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_changed_checkpoint_is_refused_before_anything_loads(
    finished: Path, tmp_path: Path, case: str
) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    tamper, message = CASES[case]
    tamper(out)
    before = snapshot(out)
    proc = resume(experiment(tmp_path, 3), out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("nereus run: error: --resume: ") and message in line, line
    assert snapshot(out) == before


@pytest.mark.timeout(120)
def test_another_workload_is_refused_naming_both(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    before = snapshot(out)
    proc = resume(experiment(tmp_path, 3, workload="grpo-tiny"), out)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"nereus run: error: --resume: {latest(out)} was written for model tiny-llama and workload "
        "ppo-tiny, with algorithm 'ppo'; this run's workload grpo-tiny has 'grpo' (its state does not fit)"
    ]
    assert snapshot(out) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "key", "value", "message"),
    [
        ("models", "intermediate_size", "128", "with intermediate_size 176 in its model; this run's model"),
        (
            "workloads",
            "precision",
            "bf16-mixed",
            "with precision 'fp32'; this run's workload ppo-tiny has 'bf16-mixed'",
        ),
    ],
)
def test_the_same_names_with_other_state_are_refused(
    finished: Path, tmp_path: Path, kind: str, key: str, value: str, message: str
) -> None:
    """Hugging Face folders are often all called ``model``, and a workload YAML is edited in
    place: a checkpoint of another architecture or precision under the same names is refused in
    one line before anything loads (it was a size mismatch or a missing key in every worker)."""
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    before = snapshot(out)
    source = (
        Path(__file__).parents[1]
        / "configs"
        / kind
        / f"{'tiny-llama' if kind == 'models' else 'ppo-tiny'}.yaml"
    )
    changed = tmp_path / source.name
    lines = [
        f"{key}: {value}" if line.startswith(f"{key}:") else line for line in source.read_text().splitlines()
    ]
    changed.write_text("\n".join(lines) + "\n")
    exp = experiment(tmp_path, 3)
    field = "model" if kind == "models" else "workload"
    exp.write_text(exp.read_text().replace(f"{field}: ", f"{field}: {changed} # ", 1))
    proc = resume(exp, out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert (
        line.startswith(f"nereus run: error: --resume: {latest(out)} was written for ") and message in line
    ), line
    assert snapshot(out) == before


@pytest.mark.timeout(150)
def test_the_untouched_checkpoint_resumes(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    proc = resume(experiment(tmp_path, 3), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    meta = json.loads((latest(out) / "meta.json").read_text())
    assert (meta["step"], meta["model"], meta["workload"]) == (2, "tiny-llama", "ppo-tiny")


@pytest.mark.timeout(150)
def test_the_workers_verify_on_their_own(finished: Path, tmp_path: Path) -> None:
    """Past the preflight (``launch_local`` called directly), the workers refuse a changed
    ``.metadata`` before DCP reads it: one line from the leader, exit 2, no traceback."""
    out = tmp_path / "out"
    shutil.copytree(finished, out, symlinks=True)
    flip(latest(out) / ".metadata", 200)
    rows = (out / "metrics.jsonl").read_text()
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from nereus.runtime.experiment import ExperimentSpec\n"
        "from nereus.runtime.local import launch_local\n"
        f"end = launch_local(ExperimentSpec.load(Path({str(experiment(tmp_path, 3))!r})), "
        f"Path({str(out)!r}), resume=True)\n"
        "sys.exit(end.code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("nereus run: error: ") and ".metadata: changed since the checkpoint" in line
    assert (out / "metrics.jsonl").read_text() == rows
