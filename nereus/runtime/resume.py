"""``nereus run --resume``: what a resume may continue, checked before anything starts (torch-free).

The latest checkpoint verifies with the run's key and belongs to the same model and workload
(``check_checkpoint``); a run on the generated task resumes on the prompts it trained on
(``check_task``); rows a user cut from ``metrics.jsonl`` are found (``missing_rows``) so the
resume can say they will not come back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.runtime import signing
from nereus.runtime.metrics import read_rows


def check_checkpoint(folder: Path, expected: dict[str, Any]) -> int:
    """``--resume``: the latest checkpoint under ``folder`` verifies with the run's key and was
    written for ``expected``'s model and workload. Returns its step."""
    ckpts = folder / "checkpoints"
    try:
        path = signing.latest(ckpts)
        if path is None:
            found = [p.name for p in signing.checkpoints(ckpts)]
            if not found:
                raise ConfigError(f"no checkpoint under {ckpts}")
            raise ConfigError(
                f"{ckpts / signing.LATEST} is missing, though checkpoints are there "
                f"({', '.join(found[-3:])}); write the name of the one to resume from into it (the "
                f"newest: {found[-1]})"
            )
        key_file = folder / signing.KEY_FILE
        if not key_file.is_file():
            raise ConfigError(
                f"{key_file} is missing: a checkpoint is loaded only with the key of the run that wrote it"
            )
        meta = signing.verify(path, signing.read_key(key_file)).meta()
        signing.check_identity(path, meta, expected)
        step = meta.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"{path}/{signing.META}: key 'step': expected a non-negative integer")
    except ConfigError as exc:
        raise ConfigError(f"--resume: {exc}") from None
    return step


def check_task(spec: Any, folder: Path) -> None:
    """``--resume`` of a run on the generated task: the task the experiment names now is the one
    its ``tasks.jsonl`` records (the prompts its steps trained on), which a start would otherwise
    overwrite with another; without that record (removed, or the run trained on a prompt file)
    they are not known, and the resume is refused. A prompt file (``data:``, ``dataset:``) is the
    user's and not checked."""
    from nereus.rl.tasks import generate_tasks, jsonl_text

    path = folder / "tasks.jsonl"
    if spec.data is not None or spec.dataset:
        return
    t = spec.task
    if not path.is_file():
        raise ConfigError(
            f"--resume: {path} is missing: the prompts the run trained on are not known, so the task "
            f"(task: {t.kind} n={t.n} seed={t.seed}) cannot be checked against them; restore the file "
            "(or the run's data: setting), or start a new run"
        )
    want = jsonl_text(generate_tasks(t.kind, t.n, t.seed, t.difficulty, t.length))
    try:
        same = path.read_text(encoding="utf-8") == want
    except (OSError, UnicodeDecodeError):
        same = False
    if not same:
        raise ConfigError(
            f"--resume: task: {t.kind} n={t.n} seed={t.seed} difficulty={t.difficulty} length={t.length} "
            f"is not the task {path} records (the prompts the run trained on); resume with the run's "
            "task settings, or start a new run"
        )


def missing_rows(path: Path, first: int) -> list[int]:
    """The steps before ``first`` without a row in metrics file ``path`` (cut or removed; the
    resume's output-folder check has read the file as UTF-8 already)."""
    seen = {step for step, _ in read_rows(path)}
    return [s for s in range(first) if s not in seen]
