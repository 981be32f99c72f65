"""The trained models' Hugging Face export, ``<out>/hf/actor`` (and ``hf/critic`` under PPO: the
value-head model, which a later run's ``init: {critic: DIR}`` or a reward model's folder reads),
and its mark.

A run writes the export once its last step is trained (``JobLoop._finish``), from the trainers,
with the tokenizer's files beside each, and then its mark, ``hf/.exported``: how many steps
the export holds. A run that ended after its last checkpoint but before its export (a full disk,
a kill) has every step checkpointed and no export of them: ``nereus run --resume`` reads the mark
(``exported_steps``, torch-free) and starts the workers to write the export from that checkpoint,
training nothing. The mark reads ``exporting N`` while an export is written, so one cut short
(which may have replaced an earlier export) is written again; a run from before the mark counts
as exported when ``hf/actor`` is there. A write that fails is one line on every rank, naming the
folder, and the checkpoint stays what a resume writes the export from.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nereus.errors import NereusError

ACTOR = Path("hf") / "actor"
CRITIC = Path("hf") / "critic"
EXPORTS = {"actor.train": ACTOR, "critic.train": CRITIC}  # the trainer each folder is written from
MARK = Path("hf") / ".exported"


def exported_steps(out: Path) -> int | None:
    """The steps ``out``'s export holds (its mark); None when there is no mark, or the mark says
    an export was being written (``exporting``: it may not have ended)."""
    with contextlib.suppress(OSError, ValueError):
        return int((out / MARK).read_text().strip())
    return None


def exported(out: Path, steps: int) -> bool:
    """Whether ``out`` holds the export after ``steps`` steps: its mark says so, or (a run from
    before the mark) there is no mark and ``hf/actor`` holds a config."""
    if (out / MARK).exists() or (out / MARK).is_symlink():
        return exported_steps(out) == steps
    return (out / ACTOR / "config.json").is_file()


def _mark(out: Path, text: str) -> None:
    mark = out / MARK
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        tmp = mark.with_name(f"{mark.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, mark)
    except OSError as exc:
        raise NereusError(f"{mark}: {exc.strerror or exc}") from None


def export_models(worker: Any, companions: Sequence[Path], out: Path, steps: int, leader: bool) -> None:
    """The trained models after ``steps`` steps into ``out/hf/actor`` and ``out/hf/critic`` (one
    collective each, in that order: a trainer gathers its weights on its first replica's first
    rank, which writes them); then, on the ``leader``, the mark. A failed write is the same
    ``NereusError`` on every rank."""
    from safetensors import SafetensorError

    from nereus.runtime.comm import all_gather

    error = None
    if leader:  # until the export is whole, a resume writes it again (an earlier one may be replaced)
        try:
            _mark(out, f"exporting {steps}\n")
        except NereusError as exc:  # told after the collective saves below, which every rank joins
            error = str(exc)
    for stage, folder in EXPORTS.items():
        if stage not in worker.engines:
            continue
        try:
            worker.engines[stage].save_hf(out / folder, companions)
        except (OSError, SafetensorError) as exc:
            why = f"{exc.strerror or type(exc).__name__}" if isinstance(exc, OSError) else str(exc)
            error = error or (
                f"the Hugging Face export to {out / folder} could not be written ({why}); the checkpoint "
                f"after step {steps - 1} holds the trained {folder.name}: resume the run to write it "
                "(nereus run --resume; a launched job: nereus-launch resume)"
            )
    first = next((e for e in all_gather(error, str | None) if e is not None), None)
    if first is not None:
        raise NereusError(first)
    if leader:
        _mark(out, f"{steps}\n")
