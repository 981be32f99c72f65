"""What the CLI prints is the user's text as written: names with Rich markup or TeX in them, JSON
without infinities, a full disk or a reader that leaves (exit 1 and 141, one line, no traceback),
and the flags an error names."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nereus.cli import main
from nereus.control.admission import Decision, Verdict
from nereus.plan.calibration import CalibrationStore, Measurement
from nereus.plan.opclass import OpClass
from nereus.spec.registry import config_root, trace_path

pytestmark = pytest.mark.pure

NEREUS = str(Path(sys.executable).with_name("nereus"))
PLAN = ["plan", "--algo", "ppo", "--gpus", "16", "--seq-len", "1024"]


def _model(tmp_path: Path, name: str) -> Path:
    body = (config_root() / "models" / "llama-3.1-8b.yaml").read_text()
    lines = [line for line in body.splitlines() if not line.startswith("name:")]
    path = tmp_path / "model.yaml"
    path.write_text(f"name: {json.dumps(name)}\n" + "\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name", ["llama[/]", "[bold]x", "a[/b]c"])
def test_names_with_rich_markup_print_as_written(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(_model(tmp_path, name))
    assert main(["describe", "model", model]) == 0
    assert name in capsys.readouterr().out
    price = ["price", "--model", model, "--cluster", "h200-ib", "--stage", "inf", "--tp", "1", "--pp", "1",
             "--dp", "1", "--sequences", "16", "--prompt-len", "100", "--seq-len", "100"]  # fmt: skip
    assert main(price) == 0
    assert name in capsys.readouterr().out
    cluster = tmp_path / "cluster.yaml"
    body = (config_root() / "clusters" / "h200-ib.yaml").read_text().splitlines()
    cluster.write_text("\n".join(f"gpu_model: {json.dumps(name)}" if s.startswith("gpu_model:") else s
                                 for s in body) + "\n")  # fmt: skip
    assert main([*PLAN, "--model", "llama-3.1-8b", "--cluster", str(cluster)]) == 0
    assert name in capsys.readouterr().out


def test_a_trace_named_like_tex_simulates_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "a$^$.json"
    shutil.copy(trace_path("aws-08-27-2023_us-east-2b_v100_1"), trace)
    out = tmp_path / "out[/]"
    args = ["simulate", "--trace", str(trace), "--model", "llama-3.1-8b", "--algo", "grpo", "--cluster",
            "h200-ib", "--gpus-per-instance", "8", "--steps", "2", "--policies", "static",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert (out / "timeline.png").stat().st_size > 0 and (out / "summary.json").exists()
    assert str(out) in capsys.readouterr().out


def test_a_decision_that_never_pays_back_is_valid_json() -> None:
    d = Decision(
        3, 1.0, (), False, Verdict.KEEP, "no gain", 10.0, payback_steps=math.inf, horizon_steps=math.inf
    )
    doc = json.loads(json.dumps(d.to_json(), allow_nan=False))
    assert doc["payback_steps"] is None and doc["horizon_steps"] is None and doc["current_latency_s"] == 10.0


def test_a_full_disk_on_stdout_is_one_line_and_exit_1() -> None:
    for args in (["describe", "model", "llama-3.1-8b"], [*PLAN, "--model", "llama-3.1-8b", "--cluster",
                                                         "h200-ib", "--json"]):  # fmt: skip
        with open("/dev/full", "w") as full:
            proc = subprocess.run(
                [NEREUS, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, check=False
            )
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.splitlines() == [
            f"nereus {args[0]}: error: cannot write its output (No space left on device)"
        ]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_ctrl_c_is_one_line_and_exit_130(
    json_flag: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*_: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("nereus.cli._dispatch", interrupted)
    assert main([*PLAN, "--model", "llama-3.1-8b", "--cluster", "h200-ib", *json_flag]) == 130
    got = capsys.readouterr()
    assert got.err.splitlines() == ["nereus plan: stopped by SIGINT"]
    assert got.out == ('{"error": "stopped by SIGINT"}\n' if json_flag else "")


def test_a_reader_that_leaves_a_table_early_is_exit_141() -> None:
    args = ["plan", "--model", "llama-125m", "--algo", "grpo", "--cluster", "h200-ib", "--gpus", "6",
            "--seq-len", "1024", "--exhaustive", "--all"]  # fmt: skip
    proc = subprocess.Popen([NEREUS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""


def test_price_names_the_flag_and_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["price", "--model", "llama-125m", "--cluster", "h200-ib", "--stage", "inf", "--tp", "1",
            "--pp", "1", "--dp", "1", "--sequences", "70000", "--micro-batch", "70000",
            "--prompt-len", "16", "--seq-len", "16"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err == "nereus price: error: --micro-batch: expected an integer in [1, 65536], got 70000"


def test_a_compute_class_curve_never_prices_above_the_peak() -> None:
    """Sized GEMM samples that claim η 50 (a calibration file can): the curve keeps GEMM at 1,
    while a collective's may pass its ring ideal."""
    store = CalibrationStore("h200-ib")
    sizes = np.geomspace(1e9, 1e12, 8)
    store.update([Measurement(OpClass.GEMM, 50.0, 1.0, size=float(s)) for s in sizes])
    store.update([Measurement(OpClass.ALLREDUCE_INTER, 3.0, 1.0, size=float(s), group=8.0) for s in sizes])
    gemm, ring = store.curve(OpClass.GEMM), store.curve(OpClass.ALLREDUCE_INTER)
    assert gemm is not None and ring is not None
    assert float(gemm.eta(1e10).max()) == 1.0 and float(ring.eta(1e10, 8.0).max()) > 2.5


def test_a_name_on_two_lines_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["describe", "model", str(_model(tmp_path, "a\nb"))]) == 2
    assert "key 'name': expected one line of printable text" in capsys.readouterr().err


def test_a_plan_file_naming_a_model_stage_twice_names_the_duplicate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, "--model", "llama-3.1-8b", "--cluster", "h200-ib", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    good = tmp_path / "a.json"
    good.write_text(json.dumps(doc))
    doc["stages"][2]["name"] = doc["stages"][0]["name"]
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps(doc))
    assert main(["transition", "--from", str(good), "--to", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "key 'stages[2].name'" in err and "of stages[0] again" in err and len(err.splitlines()) == 1


def test_a_run_past_the_traces_end_is_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "short.json"
    trace.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": [16, 12, 8]}))
    args = ["simulate", "--trace", str(trace), "--model", "llama-3.1-8b", "--algo", "ppo", "--cluster",
            "a100-64gb-hdr100", "--gpus-per-instance", "2", "--min-gpus", "8", "--max-gpus", "32",
            "--speedup", "5", "--steps", "3", "--policies", "static", "--out", str(tmp_path / "o"),
            "--json"]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["static"]["mean_step_s"] > 0
    assert err.startswith("nereus simulate: warning: the trace ends 180 simulated s into the run (tick 3)")
    assert "static " in err and len(err.splitlines()) == 1
