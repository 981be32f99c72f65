"""Property-based fuzz of ``nereus-launch`` (issue 15): random flags and values for every
subcommand, with submission through a fake executor and SLURM's client commands stubbed, so no
process starts and nothing is queued.

Whatever the input: the exit code is 0 or 2; stderr holds no traceback; a refusal is exactly one
line; and nothing is written outside the jobs root (each case runs in a fresh folder that is
compared before and after, as is the repository's configs/ and slurm/).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launch.cli import main
from tests.test_launch import PPO_TINY, ROOT, SWEEP, FakeExecutor

pytestmark = pytest.mark.pure

SCALE = int(os.environ.get("NEREUS_FUZZ_SCALE", "1"))
FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

TEXT = st.one_of(
    st.sampled_from(
        ["", "gpu", "debug", "acct", "30", "1:00:00", "nan", "-1", "1e9", "0", "%j", "a b", "../x"]
    ),
    st.text(max_size=24),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), max_size=12),
)
COMMANDS = ["submit", "array", "status", "logs", "cancel", "grow", "shrink"]
FLAGS = ["--nodes", "--partition", "--account", "--time", "--site", "--jobs-root", "--dry-run", "--local",
         "--follow", "--bogus"]  # fmt: skip


def _runner(argv: list[str], **_: Any) -> tuple[int, str, str]:
    """SLURM's client commands, stubbed: nothing is known about any job."""
    return 1, "", "slurm_load_jobs error: Invalid job id specified"


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@settings(FUZZ, max_examples=150 * SCALE)
@given(
    command=st.sampled_from(COMMANDS),
    target=st.sampled_from(["experiment", "sweep", "folder", "text"]),
    flags=st.lists(st.tuples(st.sampled_from(FLAGS), TEXT), max_size=4),
    raw=TEXT,
)
def test_fuzz_the_launcher(command: str, target: str, flags: list[tuple[str, str]], raw: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        jobs = home / "jobs"
        thing = {"experiment": str(PPO_TINY), "sweep": str(SWEEP), "folder": str(home), "text": raw}[target]
        argv = [command, thing]
        for flag, value in flags:
            argv += [flag] if flag in ("--dry-run", "--local", "--follow") else [flag, value]
        if command in ("submit", "array"):
            argv += ["--dry-run"]  # never a real submission, whatever else is drawn
            argv = [a for a in argv if a != "--local"]  # --local starts processes
        if command == "logs":
            argv = [a for a in argv if a != "--follow"]  # follows until the job ends
        argv += ["--jobs-root", str(jobs)] if "--jobs-root" not in argv else []
        before_repo = _snapshot(ROOT / "configs"), _snapshot(ROOT / "slurm")
        before = _snapshot(home)
        out, err = io.StringIO(), io.StringIO()
        factory: Callable[..., Any] = FakeExecutor
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(home):
            try:
                code = main(argv, factory=factory, runner=_runner)
            except SystemExit as exc:  # argparse's --help
                code = exc.code if isinstance(exc.code, int) else 2
        text = err.getvalue()
        assert code in (0, 2), (argv, code, text)
        assert "Traceback" not in text, (argv, text)
        if code == 2:
            assert len(text.strip().splitlines()) == 1, (argv, text)
        after = _snapshot(home)
        changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
        assert all(k.startswith("jobs") for k in changed), (argv, sorted(changed))
        assert (_snapshot(ROOT / "configs"), _snapshot(ROOT / "slurm")) == before_repo
