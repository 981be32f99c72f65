"""Shared pieces of the bad-input tests (``test_bad_input.py``: files and configs;
``test_bad_flags.py``: command-line flags, plan JSON, argparse and output folders): the CLI run
that captures its one error line, shipped configs with changed keys, and a test's own folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nereus.cli import main
from nereus.plan.opclass import OpClass
from nereus.spec import names
from nereus.spec.registry import config_root, trace_path

CONFIGS = config_root()
TRACE = str(trace_path(names("traces")[0]))
PLAN = ["plan", "--model", "tiny-llama", "--algo", "ppo", "--cluster", "local-cpu", "--gpus", "4"]
PLAN += ["--seq-len", "32"]
SIM = ["simulate", "--trace", TRACE, "--model", "tiny-llama", "--algo", "ppo", "--cluster"]
SIM += ["a100-64gb-hdr100", "--steps", "2", "--policies", "static"]
A100 = ["plan", "--model", "llama-3.1-8b", "--algo", "ppo", "--cluster", "a100-64gb-hdr100", "--json"]
E_PLAN, E_SIM, E_TR = "nereus plan: error: ", "nereus simulate: error: ", "nereus transition: error: "
OPS = ", ".join(op.value for op in OpClass)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own folder, so error lines hold short relative paths."""
    monkeypatch.chdir(tmp_path)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def refused(argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    """The one error line of a refused command (asserting exit code, one line, and stdout: empty,
    or with ``--json`` the line as ``{"error"}``, ``{"fits": false, "error"}`` for plan's exit 3)."""
    got, out, err = cli(argv, capsys)
    assert got == code, err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    if "--json" not in argv:
        assert out == ""
    else:  # the message without "nereus <cmd>: error: " and argparse's "(see … --help)"
        doc = json.loads(out)
        fits = {"fits": False} if code == 3 and argv[0] == "plan" else {}
        assert doc == {**fits, "error": doc["error"]} and doc["error"] in err, (out, err)
    return err.rstrip("\n")


def write(name: str, content: str | bytes) -> str:
    path = Path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return name


def shipped(kind: str, name: str, **changes: str) -> str:
    """A shipped YAML config as text, with some keys' values replaced (or added)."""
    lines = (CONFIGS / kind / f"{name}.yaml").read_text().splitlines()
    for key, value in changes.items():
        hits = [i for i, line in enumerate(lines) if line.startswith(f"{key}:")]
        if hits:
            lines[hits[0]] = f"{key}: {value}"
        else:
            lines.append(f"{key}: {value}")
    return "\n".join(lines) + "\n"


def plan_file(capsys: pytest.CaptureFixture[str], name: str, *extra: str) -> dict[str, Any]:
    code, out, err = cli([*A100, *extra], capsys)
    assert code == 0, err
    write(name, out)
    doc: dict[str, Any] = json.loads(out)
    return doc


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv
