"""End to end through the ``nereus`` CLI: output shape, exit codes and one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nereus.cli import main
from nereus.spec import load_workload

pytestmark = pytest.mark.pure

TINY = ["plan", "--model", "tiny-llama", "--cluster", "local-cpu", "--gpus", "4", "--seq-len", "32"]
PLAN = [
    "plan",
    "--model",
    "llama-3.1-8b",
    "--algo",
    "ppo",
    "--cluster",
    "h200-ib",
    "--gpus",
    "64",
    "--seq-len",
    "4096",
]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*PLAN, "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert {"step_latency_s", "search_ms", "stages"} <= set(doc)
    names = [s["name"] for s in doc["stages"]]
    assert names == [m.name for m in load_workload("ppo").workflow().model_stages]
    for s in doc["stages"]:
        assert {"name", "stage", "tp", "pp", "dp", "gpus", "latency_s", "peak_mem_gib"} <= set(s)
        assert len(s["gpus"]) == s["tp"] * s["pp"] * s["dp"]
        assert s["peak_mem_gib"] <= 140 * 0.9 + 1e-9
    inf = [set(s["gpus"]) for s in doc["stages"] if s["stage"] == "inf"]
    assert all(not (a & b) for i, a in enumerate(inf) for b in inf[i + 1 :])


def test_plan_table_and_explain(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run([*PLAN, "--explain"], capsys)
    assert code == 0
    for word in ("actor.gen", "critic.train", "step latency", "decode", "bubble", "kv_cache", "co-resident"):
        assert word in out


def test_exhaustive_and_all(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        "tiny-llama",
        "--algo",
        "grpo",
        "--cluster",
        "local-cpu",
        "--gpus",
        "4",
        "--seq-len",
        "64",
    ]
    code, out, _ = run([*args, "--exhaustive", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    ex = doc["exhaustive"]
    assert ex["count"] > 0 and ex["best_step_latency_s"] == pytest.approx(doc["step_latency_s"])
    assert "plans" not in doc
    code, out, _ = run([*args, "--exhaustive", "--all", "--json"], capsys)
    plans = json.loads(out)["plans"]
    assert len(plans) == ex["count"]
    assert min(p["step_latency_s"] for p in plans) == pytest.approx(doc["step_latency_s"])


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--model", "gpt-5"], r"unknown model 'gpt-5' \(choices: .*llama-3.1-8b"),
        (["--cluster", "tpu-v5"], r"unknown cluster 'tpu-v5' \(choices: a100-64gb-hdr100"),
        (["--algo", "dpo"], r"unknown algorithm 'dpo' \(choices: ppo, grpo, remax"),
        (["--gpus", "65"], r"--gpus 65 exceeds cluster h200-ib \(64 GPUs\)"),
        (["--all"], r"--all lists the plans of --exhaustive"),
    ],
)
def test_bad_names_exit_2_with_one_line(
    args: list[str], pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    merged = list(PLAN)
    for flag, value in zip(args[::2], [*args[1::2], None], strict=False):
        if value is None:
            merged.append(flag)
        else:
            merged[merged.index(flag) + 1] = value
    code, out, err = run(merged, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    ("flag", "value", "pattern"),
    [
        ("--gpus", "0", "argument --gpus: must be a positive integer, got 0"),
        ("--seq-len", "-5", "argument --seq-len: must be a positive integer, got -5"),
        ("--max-tp", "3", "argument --max-tp: must be a power of two, got 3"),
        ("--headroom", "1.5", r"argument --headroom: must be a number in \[0, 1\), got 1.5"),
    ],
)
def test_bad_numbers_exit_2_naming_the_flag(
    flag: str, value: str, pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = list(PLAN)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert re.search(pattern, capsys.readouterr().err)


def test_no_feasible_plan_exits_3_with_binding_constraint(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "llama-3.3-70b", "--algo", "ppo", "--cluster", "a100-64gb-hdr100"]
    argv += ["--gpus", "4", "--seq-len", "2048"]
    code, out, err = run(argv, capsys)
    assert code == 3 and out == ""
    assert "actor.train needs ≥" in err and "capacity 57.6 GiB after 10% headroom" in err
    code, out, err = run([*argv, "--json"], capsys)  # a script's stdout: an object
    assert code == 3 and json.loads(out) == {"fits": False, "error": err.split(": error: ", 1)[1].strip()}


def test_unknown_yaml_key_exits_2_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "mine.yaml"
    workload.write_text("algorithm: ppo\nprompts_per_step: 64\nmicrobatch: 4\n")
    code, _, err = run(
        [*TINY, "--algo", str(workload)],
        capsys,
    )
    assert code == 2
    assert str(workload) in err and "unknown key 'microbatch'" in err and "micro_batch" in err
    workload.write_text("algorithm: ppo\nprompts_per_step: many\n")
    code, _, err = run(
        [*TINY, "--algo", str(workload)],
        capsys,
    )
    assert code == 2 and "key 'prompts_per_step': expected int, got 'many'" in err


def test_calibration_file_changes_the_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nereus.plan.calibration import CalibrationStore, Measurement
    from nereus.plan.opclass import OpClass

    path = tmp_path / "cal.json"
    store = CalibrationStore("h200-ib")
    store.update(Measurement(op, 1.0, 1.05) for op in OpClass)  # a well-tuned cluster
    store.save(path)
    _, base, _ = run([*PLAN, "--json"], capsys)
    _, tuned, _ = run([*PLAN, "--json", "--calibration", str(path)], capsys)
    assert json.loads(tuned)["step_latency_s"] < json.loads(base)["step_latency_s"]


def test_describe_and_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["describe", "model", "llama-3.1-8b", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["params"] == 8_030_261_248
    assert doc["kv_bytes_per_token"] == 131072 and doc["flops_per_token"] > 1.5e10
    code, out, _ = run(["describe", "cluster", "mi250x-slingshot", "--json"], capsys)
    assert json.loads(out)["total_gpus"] == 1024 and json.loads(out)["vendor"] == "amd"
    _, out, _ = run(["list", "models"], capsys)
    assert out.split() == [
        "llama-125m",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3.1-8b",
        "llama-3.3-70b",
        "qwen3-14b",
        "qwen3-32b",
        "tiny-llama",
        "tiny-llama-h32",
        "tiny-qwen2",
        "tiny-qwen3",
    ]
    _, out, _ = run(["list", "algos"], capsys)
    assert out.split() == ["ppo", "grpo", "remax"]


def test_console_script_runs() -> None:
    exe = Path(sys.executable).with_name("nereus")
    proc = subprocess.run(
        [str(exe), *PLAN, "--json"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stages"]


# ------------------------------------------------------------------ transition
PLAN_A100 = ["plan", "--model", "llama-3.1-8b", "--algo", "ppo", "--cluster", "a100-64gb-hdr100", "--json"]


def _plan_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, *extra: str) -> Path:
    code, out, _ = run([*PLAN_A100, *extra], capsys)
    assert code == 0
    path = tmp_path / name
    path.write_text(out)
    return path


def test_transition_prints_the_dag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _plan_file(tmp_path, capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    b = _plan_file(tmp_path, capsys, "b.json", "--gpus", "32", "--seq-len", "4096", "--anchor", str(a))
    code, out, _ = run(["transition", "--from", str(a), "--to", str(b), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert set(doc) >= {"nodes", "edges", "critical_path", "l_tran_s"}
    ids = {n["id"] for n in doc["nodes"]}
    assert {n["primitive"] for n in doc["nodes"]} <= {"split", "merge", "extend", "destroy"}
    assert all(set(n) >= {"id", "primitive", "stage", "gpus", "bytes", "est_s"} for n in doc["nodes"])
    assert all(
        e["src"] in ids and e["dst"] in ids and e["kind"] in ("local", "resource") for e in doc["edges"]
    )
    assert set(doc["critical_path"]) <= ids and doc["l_tran_s"] > 0
    code, out, _ = run(["transition", "--from", str(a), "--to", str(b)], capsys)
    assert code == 0 and "L_tran" in out
    code, out, _ = run(["transition", "--from", str(a), "--to", str(a), "--json"], capsys)
    assert code == 0 and json.loads(out)["l_tran_s"] == 0.0


def test_transition_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _plan_file(tmp_path, capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    other = tmp_path / "other.json"
    code, out, _ = run(
        [
            "plan",
            "--model",
            "qwen3-14b",
            *PLAN_A100[3:],
            "--gpus",
            "16",
            "--seq-len",
            "2048",
            "--pipelined-gen",
        ],
        capsys,
    )
    other.write_text(out)
    doc = json.loads(a.read_text())
    doc["stages"][0]["gpus"][0] = 999
    beyond = tmp_path / "beyond.json"
    beyond.write_text(json.dumps(doc))
    doc = json.loads(a.read_text())
    doc["stages"][1]["gpus"][0] = doc["stages"][2]["gpus"][0]  # two inference model-stages share a GPU
    overlap = tmp_path / "overlap.json"
    overlap.write_text(json.dumps(doc))
    for target, words in [
        (other, "different models"),
        (beyond, "outside the pool"),
        (overlap, "share GPU"),
        (tmp_path / "missing.json", "no such file"),
    ]:
        code, _, err = run(["transition", "--from", str(a), "--to", str(target)], capsys)
        assert code == 2, err
        assert words in err and len(err.strip().splitlines()) == 1


def test_transition_without_a_copy_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _plan_file(tmp_path, capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    doc = json.loads(a.read_text())
    doc["problem"]["gpus"] = 32
    for stage in doc["stages"]:
        stage["gpus"] = [g + 16 for g in stage["gpus"]]  # the same plan on the other 16 GPUs
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(doc))
    trainer = next(s for s in json.loads(a.read_text())["stages"] if s["name"] == "actor.train")
    lost = ",".join(str(g) for g in trainer["gpus"])
    code, _, err = run(["transition", "--from", str(a), "--to", str(moved), "--lost", lost], capsys)
    assert code == 3 and "no intact replica" in err and "actor.train" in err
    code, out, err = run(
        ["transition", "--json", "--from", str(a), "--to", str(moved), "--lost", lost], capsys
    )
    assert code == 3 and json.loads(out)["error"] in err  # a script reading stdout gets an object
    code, _, err = run(["transition", "--from", str(a), "--to", str(a), "--lost", lost], capsys)
    assert code == 2 and "lost GPUs" in err
