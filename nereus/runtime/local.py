"""``nereus run``: the job as local worker processes on this machine (one per virtual GPU)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from torch.multiprocessing.spawn import spawn

from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import run_worker


def launch_local(spec: ExperimentSpec, out: Path, resume: bool = False) -> Path:
    """Run ``spec`` on ``spec.workers`` processes; results under ``out``."""
    out = Path(out)
    if not resume and out.exists():
        for name in ("metrics.jsonl", "report.png"):
            (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / "tensorboard", ignore_errors=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nereus-rdzv-") as tmp:
        spawn(  # type: ignore[no-untyped-call]
            run_worker,
            args=(spec.workers, spec, str(out), str(Path(tmp) / "store"), resume),
            nprocs=spec.workers,
        )
    return out
