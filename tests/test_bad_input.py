"""Bad input, as a careless or hostile user gives it: one line on stderr naming the field and what
is allowed, exit 2 (infeasible: 3), no traceback, nothing half-written (issue 15)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nereus.cli import main
from nereus.errors import ConfigError
from nereus.plan.calibration import CalibrationStore, Measurement
from nereus.plan.opclass import OpClass
from nereus.runtime.experiment import ExperimentSpec
from nereus.spec import ModelSpec, names
from nereus.spec.files import MARKER, brief, one_line
from nereus.spec.registry import config_root, trace_path

pytestmark = pytest.mark.pure

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
    """The one error line of a refused command (asserting exit code, one line, empty stdout)."""
    got, out, err = cli(argv, capsys)
    assert got == code, err
    assert out == "" and "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
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


# ------------------------------------------------------------------ non-UTF-8 bytes
@pytest.mark.parametrize(
    ("argv", "name", "prefix"),
    [
        (with_flag(PLAN, "--model", "m.yaml"), "m.yaml", E_PLAN),
        (with_flag(PLAN, "--cluster", "c.yaml"), "c.yaml", E_PLAN),
        (with_flag(PLAN, "--algo", "w.yaml"), "w.yaml", E_PLAN),
        (with_flag(PLAN, "--model", "hf/config.json"), "hf/config.json", E_PLAN),
        ([*PLAN, "--calibration", "cal.json"], "cal.json", E_PLAN + "--calibration "),
        ([*PLAN, "--anchor", "a.json"], "a.json", E_PLAN + "--anchor "),
        (["transition", "--from", "a.json", "--to", "a.json"], "a.json", E_TR),
        (with_flag(SIM, "--trace", "t.json"), "t.json", E_SIM),
        ([*SIM, "--seq-curve", "c.csv"], "c.csv", E_SIM),
        (["describe", "cluster", "c.yaml"], "c.yaml", "nereus describe: error: "),
    ],
)
def test_non_utf8_bytes_in_any_file(
    argv: list[str], name: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write(name, b"name: caf\xe9\n")
    assert refused(argv, capsys) == f"{prefix}{name}: not UTF-8 text (byte 0xe9 at offset 9)"


def test_non_utf8_experiment() -> None:
    write("exp.yaml", b"name: x\nworkload: ppo-tiny\nmodel: tiny-llama # \xff\n")
    with pytest.raises(ConfigError) as err:
        ExperimentSpec.load(Path("exp.yaml"))
    assert str(err.value) == "exp.yaml: not UTF-8 text (byte 0xff at offset 47)"


# ------------------------------------------------------------------ numbers in configs
FINITE = "expected a finite number, got"


@pytest.mark.parametrize(
    ("kind", "flag", "changes", "line"),
    [
        ("models", "--model", {"rms_norm_eps": ".nan"}, f"key 'rms_norm_eps': {FINITE} nan"),
        ("models", "--model", {"rope_theta": ".inf"}, f"key 'rope_theta': {FINITE} inf"),
        ("models", "--model", {"rms_norm_eps": "-1.0e-5"}, "rms_norm_eps must be positive, got -1e-05"),
        ("models", "--model", {"hidden_size": "1e30"}, "key 'hidden_size': expected int, got '1e30'"),
        ("models", "--model", {"hidden_size": "1.0e+30"}, "key 'hidden_size': expected int, got 1e+30"),
        (
            "models",
            "--model",
            {"hidden_size": "1" + "0" * 20},
            "key 'hidden_size': expected int of at most 2^53, got an integer of 21 digits",
        ),
        (
            "models",
            "--model",
            {"hidden_size": "9" * 5000},
            "line 3 is not valid YAML (an integer of 5000 digits, at most 30 allowed)",
        ),
        (
            "models",
            "--model",
            {"vocab_size": "10000000000"},
            "vocab_size must be at most 16777216, got 10000000000",
        ),
        (
            "models",
            "--model",
            {"num_hidden_layers": "100000"},
            "num_hidden_layers must be at most 4096, got 100000",
        ),
        ("clusters", "--cluster", {"gpu_memory_gib": "-1"}, "gpu_memory_gib must be positive, got -1.0"),
        ("clusters", "--cluster", {"gpu_memory_gib": ".nan"}, f"key 'gpu_memory_gib': {FINITE} nan"),
        ("clusters", "--cluster", {"peak_bf16_tflops": ".inf"}, f"key 'peak_bf16_tflops': {FINITE} inf"),
        (
            "clusters",
            "--cluster",
            {"intra_node_latency_us": "-5"},
            "intra_node_latency_us must be non-negative, got -5.0",
        ),
        (
            "clusters",
            "--cluster",
            {"gpus_per_node": "100000"},
            "gpus_per_node must be at most 1024, got 100000",
        ),
        (
            "clusters",
            "--cluster",
            {"inter_node_bandwidth_gbs": "1.0e+300"},
            "inter_node_bandwidth_gbs must be at most 1000000, got 1e+300",
        ),
        (
            "workloads",
            "--algo",
            {"prompts_per_step": "100000000"},
            "prompts_per_step must be at most 16777216, got 100000000",
        ),
        ("workloads", "--algo", {"epochs": "-1"}, "epochs must be positive, got -1"),
        (
            "workloads",
            "--algo",
            {"max_response_len": ".nan"},
            "key 'max_response_len': expected int, got nan",
        ),
    ],
)
def test_bad_numbers_in_configs(
    kind: str, flag: str, changes: dict[str, str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"models": "tiny-llama", "clusters": "local-cpu", "workloads": "ppo"}[kind]
    write("bad.yaml", shipped(kind, base, **changes))
    assert refused(with_flag(PLAN, flag, "bad.yaml"), capsys) == f"{E_PLAN}bad.yaml: {line}"


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        ("rl: {lr: .nan}", f"key 'rl.lr': {FINITE} nan"),
        ("rl: {lr: -0.1}", "'rl' lr must be positive, got -0.1"),
        ("rl: {kl_coef: .inf}", f"key 'rl.kl_coef': {FINITE} inf"),
        ("workers: 1000000000000", "workers must be at most 65536, got 1000000000000"),
        ("steps: -3", "steps must be positive, got -3"),
        ("reward_coef: .nan", f"key 'reward_coef': {FINITE} nan"),
        (
            "drift: [{step: 1, lose: [1], max_new_tokens: -1}]",
            "'drift[0]' max_new_tokens must be in [0, 16777216], got -1",
        ),
        (
            "drift: [{step: 1, lose: [1], unhealthy: [1]}]",
            "'drift[0]' step 1: a worker cannot be lost, killed, unhealthy or gained at once",
        ),
        (
            "drift: [{step: 1, unhealthy: [0]}]",
            "drift at step 1: worker 0 hosts the controller and cannot leave",
        ),
        ("drift: [{step: 1, unhealthy: [9]}]", "drift at step 1: worker 9 outside 0…3"),
    ],
)
def test_bad_numbers_in_experiments(extra: str, line: str) -> None:
    write("exp.yaml", f"name: x\nworkload: ppo-tiny\nmodel: tiny-llama\n{extra}\n")
    with pytest.raises(ConfigError) as err:
        ExperimentSpec.load(Path("exp.yaml"))
    assert str(err.value) == f"exp.yaml: {line}"


GAP = "field 'metadata.gap_seconds': expected a number of seconds in [0.001, 1e+09], got"
COUNT = "field 'data[1]': expected an instance count in [0, 1048576], got"


@pytest.mark.parametrize(
    ("doc", "line"),
    [
        (
            '{"metadata": {"gap_seconds": NaN}, "data": [4]}',
            "not valid JSON: NaN is not a number (allowed: finite numbers)",
        ),
        (
            '{"metadata": {"gap_seconds": 1e999}, "data": [4]}',
            "not valid JSON: '1e999' is out of range (allowed: finite numbers)",
        ),
        ('{"metadata": {"gap_seconds": -300}, "data": [4]}', f"{GAP} -300"),
        ('{"metadata": {"gap_seconds": 300}, "data": [4, -1]}', f"{COUNT} -1"),
        ('{"metadata": {"gap_seconds": 300}, "data": [4, 1e20]}', f"{COUNT} 1e+20"),
        (
            '{"metadata": {"gap_seconds": 300}, "data": [' + "7" * 400 + "]}",
            "not valid JSON: an integer of 400 digits (allowed: at most 30)",
        ),
        ("[" * 10000 + "]" * 10000, "not valid JSON (nested deeper than 32 levels)"),
    ],
)
def test_bad_traces(doc: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    write("t.json", doc)
    assert refused(with_flag(SIM, "--trace", "t.json"), capsys) == f"{E_SIM}t.json: {line}"


TOKENS = "expected a number of tokens in (0, 16777216], got"


@pytest.mark.parametrize(
    ("rows", "line"),
    [
        ("0,nan,nan", f"line 2: field 'mean_len': {TOKENS} 'nan'"),
        ("0,100,inf", f"line 2: field 'p95_len': {TOKENS} 'inf'"),
        ("0,-100,200", f"line 2: field 'mean_len': {TOKENS} '-100'"),
        ("0,1e30,1e31", f"line 2: field 'mean_len': {TOKENS} '1e30'"),
        ("-5,100,200", "line 2: field 'step': expected an integer in [0, 1000000000], got -5"),
        ("0,1\x0000,200", "line 2: field 'mean_len': expected a number, got '1\\x0000'"),
    ],
)
def test_bad_sequence_length_curves(rows: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    write("c.csv", f"step,mean_len,p95_len\n{rows}\n")
    assert refused([*SIM, "--seq-curve", "c.csv"], capsys) == f"{E_SIM}c.csv: {line}"


# ------------------------------------------------------------------ numbers in CLI flags
SPEEDUP = "argument --speedup: must be a number in (0, 1e+06], got"
NOISE = "argument --noise: must be a number in [0, 1], got"
STEPS = "argument --steps: must be an integer in [1, 100000], got"


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        ("--speedup", "nan", f"{SPEEDUP} 'nan'"),
        ("--speedup", "0", f"{SPEEDUP} '0'"),
        ("--speedup", "-1", f"{SPEEDUP} '-1'"),
        ("--speedup", "inf", f"{SPEEDUP} 'inf'"),
        ("--noise", "nan", f"{NOISE} 'nan'"),
        ("--noise", "-0.1", f"{NOISE} '-0.1'"),
        ("--noise", "1e6", f"{NOISE} '1e6'"),
        ("--steps", "0", f"{STEPS} 0"),
        ("--steps", "-1", f"{STEPS} -1"),
        ("--steps", "1000000000", f"{STEPS} 1000000000"),
        ("--steps", "2.5", f"{STEPS} '2.5'"),
        ("--seed", "-1", "argument --seed: must be an integer in [0, 4294967295], got -1"),
        ("--max-gpus", "0", "argument --max-gpus: must be an integer in [1, 1048576], got 0"),
        (
            "--gpus-per-instance",
            "100000",
            "argument --gpus-per-instance: must be an integer in [1, 1024], got 100000",
        ),
    ],
)
def test_bad_simulate_flags(flag: str, value: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    got = refused([*SIM, flag, value, "--out", "o"], capsys)
    assert got == f"{E_SIM}{line} (see nereus simulate --help)"
    assert not Path("o").exists()


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (
            ["--seq-curve", "growth:1:2:0"],
            "--seq-curve 'growth:1:2:0': over_steps must be in [1, 1000000], got 0",
        ),
        (
            ["--seq-curve", "growth:nan:10:9"],
            "--seq-curve 'growth:nan:10:9': start must be in [1, 14588883] tokens, got nan",
        ),
        (
            ["--policies", "periodic:0"],
            "--policies: 'periodic:0': periodic:K needs an integer K in [1, 999999999]",
        ),
        (["--policies", "static,static"], "--policies names a run twice: 'static,static'"),
        (
            ["--max-gpus", "4", "--gpus-per-instance", "8"],
            "--gpus-per-instance must be in [1, --max-gpus 4], got 8",
        ),
        (
            ["--episode", "0-5:all:nan"],
            "--episode '0-5:all:nan': expected START-END:SCOPE:FACTOR with SCOPE one of inter, intra, "
            "compute, all (episode factor must be in (0, 1], got nan)",
        ),
    ],
)
def test_bad_simulate_values(extra: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = SIM[:-2] + (extra if "--policies" in extra else [*SIM[-2:], *extra])
    assert refused(argv, capsys) == f"{E_SIM}{line}"


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        ("--gpus", "0", "argument --gpus: must be a positive integer, got 0"),
        ("--gpus", "-3", "argument --gpus: must be a positive integer, got -3"),
        ("--gpus", "1e12", "argument --gpus: must be a positive integer, got '1e12'"),
        ("--gpus", "1000000000000", "argument --gpus: must be at most 1048576, got 1000000000000"),
        ("--seq-len", "1000000000000", "argument --seq-len: must be at most 16777216, got 1000000000000"),
        ("--seq-len", "9" * 5000, "argument --seq-len: must be a positive integer, got " + brief("9" * 5000)),
        ("--max-tp", "2048", "argument --max-tp: must be at most 1024, got 2048"),
        ("--headroom", "nan", "argument --headroom: must be a number in [0, 1), got nan"),
    ],
)
def test_bad_plan_flags(flag: str, value: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(with_flag(PLAN, flag, value), capsys) == f"{E_PLAN}{line} (see nereus plan --help)"


def test_plan_gpus_beyond_the_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    got = refused(with_flag(PLAN, "--gpus", "9"), capsys)
    assert got == f"{E_PLAN}--gpus 9 exceeds cluster local-cpu (8 GPUs)"


# ------------------------------------------------------------------ plan JSON for transition
Change = Callable[[dict[str, Any]], object]
PROBLEM_KEYS = "algo, calibration, cluster, gpus, headroom, max_tp, mode, model, prompt_len, seq_len, "
PROBLEM_KEYS += "seq_len_p95, urgent"


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (lambda d: d["problem"].update(gpus="16"), "b.json: key 'problem.gpus': expected int, got '16'"),
        (lambda d: d["problem"].update(gpus=16.5), "b.json: key 'problem.gpus': expected int, got 16.5"),
        (
            lambda d: d["problem"].update(gpus=10**12),
            "b.json: key 'problem.gpus': expected an integer in [1, 1048576], got 1000000000000",
        ),
        (
            lambda d: d["problem"].update(gpus=512),
            "b.json: key 'problem.gpus': 512 exceeds cluster a100-64gb-hdr100 (256 GPUs)",
        ),
        (
            lambda d: d["problem"].update(gpus=8),
            "b.json: stages[0] (actor.gen): gpus [8, 9, 10, 11, 12, 13, ...] outside the pool 0-7",
        ),
        (
            lambda d: d["problem"].update(seq_len=None),
            "b.json: key 'problem.seq_len': expected int, got None",
        ),
        (
            lambda d: d["problem"].update(headroom="x"),
            "b.json: key 'problem.headroom': expected float, got 'x'",
        ),
        (
            lambda d: d["problem"].update(max_tp=3),
            "b.json: key 'problem.max_tp': expected null or a power of two up to 1024, got 3",
        ),
        (
            lambda d: d["problem"].update(mode="warp"),
            "b.json: key 'problem.mode': expected one of sync|async, got 'warp'",
        ),
        (lambda d: d["problem"].update(model=["x"]), "b.json: key 'problem.model': expected str, got ['x']"),
        (lambda d: d["problem"].pop("cluster"), "b.json: missing key 'problem.cluster' (expected str)"),
        (
            lambda d: d["problem"].update(zzz=1),
            f"b.json: unknown key 'problem.zzz' (allowed: {PROBLEM_KEYS})",
        ),
        (lambda d: d.pop("stages"), "b.json: missing key 'stages' (write it with nereus plan --json)"),
        (lambda d: d.update(stages=5), "b.json: key 'stages': expected a list of 1 to 64 model-stages"),
        (lambda d: d["stages"].__setitem__(0, 7), "b.json: key 'stages[0]': expected a mapping, got 7"),
        (lambda d: d["stages"][0].update(tp=4.9), "b.json: key 'stages[0].tp': expected int, got 4.9"),
        (lambda d: d["stages"][0].update(tp=True), "b.json: key 'stages[0].tp': expected int, got True"),
        (
            lambda d: d["stages"][0].update(tp=3),
            "b.json: 'stages[0]' tp must be a power of two up to 1024, got 3",
        ),
        (lambda d: d["stages"][0].pop("dp"), "b.json: missing key 'stages[0].dp' (expected int)"),
        (
            lambda d: d["stages"][0].update(gpus="0123"),
            "b.json: key 'stages[0].gpus': expected list of int, got '0123'",
        ),
        (
            lambda d: d["stages"][0].update(recompute="sometimes"),
            "b.json: key 'stages[0].recompute': expected one of none|selective|full, got 'sometimes'",
        ),
        (
            lambda d: d["stages"][0]["gpus"].__setitem__(0, -1),
            "b.json: stages[0] (actor.gen): gpus [-1] outside the pool 0-15",
        ),
        (
            lambda d: d["problem"].update(cluster="h200-ib"),
            "plans are for different clusters: 'a100-64gb-hdr100' (a.json) vs 'h200-ib' (b.json)",
        ),
    ],
)
def test_malformed_plan_json(change: Change, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    change(doc)
    write("b.json", json.dumps(doc))
    assert refused(["transition", "--from", "a.json", "--to", "b.json"], capsys) == f"{E_TR}{line}"


def test_plan_json_that_is_not_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["transition", "--from", "b.json", "--to", "b.json"]
    write("b.json", '{"problem": NaN}')
    line = "b.json: not valid JSON: NaN is not a number (allowed: finite numbers)"
    assert refused(argv, capsys) == f"{E_TR}{line}"
    write("b.json", "[1, 2]")
    line = "b.json: not a plan JSON (expected an object; write it with nereus plan --json)"
    assert refused(argv, capsys) == f"{E_TR}{line}"


@pytest.mark.parametrize(
    ("lost", "line"),
    [
        ("999", "--lost: GPU 999 is outside the pool of a.json (0-15)"),
        ("0-100000000000", "--lost: expected GPU ids like 3,8-11, got '0-100000000000'"),
        ("3-1", "--lost: bad range '3-1' (expected LOW-HIGH)"),
        ("-3", "--lost: expected GPU ids like 3,8-11, got '-3'"),
        ("x" * 500, "--lost: expected GPU ids like 3,8-11, got " + brief("x" * 500)),
    ],
)
def test_transition_lost_gpus(lost: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    got = refused(["transition", "--from", "a.json", "--to", "a.json", "--lost", lost], capsys)
    assert got == f"{E_TR}{line}"


# ------------------------------------------------------------------ experiment names
@pytest.mark.parametrize(
    "name", ["my exp", "a/b", "x;rm -rf ~", "$(id)", "-x", ".hidden", "a" * 65, "", "naïve", "a\nb"]
)
def test_bad_experiment_names(name: str) -> None:
    write("exp.yaml", f"name: {json.dumps(name)}\nworkload: ppo-tiny\nmodel: tiny-llama\n")
    with pytest.raises(ConfigError) as err:
        ExperimentSpec.load(Path("exp.yaml"))
    assert str(err.value) == (
        "exp.yaml: key 'name': expected a letter or digit, then letters, digits, '.', '_' or '-', "
        f"at most 64 characters (it names the results folder and the job), got {brief(name)}"
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["a", "ppo-tiny", "Run_2.v3", "a" * 64])
def test_good_experiment_names(name: str) -> None:
    write("exp.yaml", f"name: {name}\nworkload: ppo-tiny\nmodel: tiny-llama\n")
    assert ExperimentSpec.load(Path("exp.yaml")).name == name


def test_shipped_experiments_pass() -> None:
    for path in sorted((CONFIGS / "experiments").glob("*.yaml")):
        assert ExperimentSpec.load(path).name == path.stem


# ------------------------------------------------------------------ calibration and anchor
CAL = '{"format": 1, "clusters": {"local-cpu": %s}}'
ENTRY = '{"window": 8, "samples": %s, "memory": %s}'


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("{", "line 1: not valid JSON (Expecting property name enclosed in double quotes)"),
        ('{"format": 2, "clusters": {}}', "key 'format': expected 1"),
        ('{"format": 1, "clusters": []}', "key 'clusters': expected a mapping"),
        (
            '{"format": 1, "clusters": {"h200-ib": {}}}',
            "no calibration for cluster local-cpu (clusters in it: h200-ib)",
        ),
        (
            CAL % "[1]",
            "key 'clusters.local-cpu': malformed calibration (expected a mapping of window, samples, memory)",
        ),
        (
            CAL % '{"window": 1e20, "samples": {}, "memory": {}}',
            "key 'clusters.local-cpu.window': expected an integer in [1, 65536], got 1e+20",
        ),
        (
            CAL % (ENTRY % ("[]", "{}")),
            f"key 'clusters.local-cpu.samples': expected a mapping of {OPS}, got []",
        ),
        (
            CAL % (ENTRY % ('{"gemm": [[1, 0]]}', "{}")),
            "key 'clusters.local-cpu.samples.gemm': expected a list of [ideal_s, measured_s] pairs "
            "(numbers in [1e-12, 1e+12])",
        ),
        (
            CAL % (ENTRY % ('{"tpu": []}', "{}")),
            f"key 'clusters.local-cpu.samples.tpu': malformed calibration (allowed: {OPS})",
        ),
        (
            CAL % (ENTRY % ("{}", '{"train": [-1]}')),
            "key 'clusters.local-cpu.memory.train': expected a list of ratios (numbers in [1e-12, 1e+12])",
        ),
    ],
)
def test_malformed_calibration(text: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    write("cal.json", text)
    assert refused([*PLAN, "--calibration", "cal.json"], capsys) == f"{E_PLAN}--calibration cal.json: {line}"


def test_missing_calibration_and_a_good_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*PLAN, "--calibration", "cal.json"]
    assert refused(argv, capsys) == f"{E_PLAN}--calibration cal.json: no such file"
    store = CalibrationStore("local-cpu")
    store.update(Measurement(op, 1.0, 1.1) for op in OpClass)
    store.save(Path("cal.json"))
    assert cli(argv, capsys)[0] == 0


def test_anchor_from_another_model_or_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    base = ["plan", "--model", "llama-3.1-8b", "--algo", "ppo", "--gpus", "16", "--seq-len", "2048"]
    got = refused([*base, "--cluster", "h200-ib", "--anchor", "a.json"], capsys)
    assert got == (
        f"{E_PLAN}--anchor a.json: the plan is for cluster 'a100-64gb-hdr100', not 'h200-ib' "
        "(allowed: a plan of the same model, algo, cluster, mode)"
    )
    got = refused([*base, "--cluster", "a100-64gb-hdr100", "--mode", "async", "--anchor", "a.json"], capsys)
    assert "the plan is for mode 'sync', not 'async'" in got
    assert cli([*base, "--cluster", "a100-64gb-hdr100", "--anchor", "a.json"], capsys)[0] == 0


# ------------------------------------------------------------------ YAML bombs and odd files
def _bomb(levels: int = 9) -> str:
    """A billion-laughs document: each anchor holds nine aliases of the one before."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\nname: *a8\n"


def test_yaml_bomb_is_refused_before_it_expands(capsys: pytest.CaptureFixture[str]) -> None:
    text = _bomb()
    assert len(text) < 800
    write("m.yaml", text)
    start = time.perf_counter()
    got = refused(with_flag(PLAN, "--model", "m.yaml"), capsys)
    assert time.perf_counter() - start < 1.0
    assert got == f"{E_PLAN}m.yaml: line 2 is not valid YAML (more than 8 aliases (*name))"


def test_yaml_size_depth_and_odd_files(capsys: pytest.CaptureFixture[str]) -> None:
    argv = with_flag(PLAN, "--model", "m.yaml")
    write("m.yaml", "hf_repo: " + "x" * (1 << 20) + "\n")
    assert refused(argv, capsys) == f"{E_PLAN}config m.yaml: 1048586 bytes (allowed: at most 1048576)"
    write("m.yaml", "a: " + "[" * 100 + "]" * 100 + "\n")
    assert refused(argv, capsys) == f"{E_PLAN}m.yaml: line 1 is not valid YAML (nested deeper than 32 levels)"
    write("m.yaml", "family: " + "x" * 5000 + "\n")
    line = refused(argv, capsys)
    assert len(line) < 200 and line.startswith(f"{E_PLAN}m.yaml: key 'family': expected one of")
    Path("m.yaml").unlink()
    Path("m.yaml").mkdir()
    assert refused(argv, capsys) == f"{E_PLAN}model directory m.yaml has no config.json"
    Path("c.yaml").mkdir()
    assert (
        refused(with_flag(PLAN, "--cluster", "c.yaml"), capsys)
        == f"{E_PLAN}config c.yaml: is a folder, not a file"
    )
    if hasattr(os, "mkfifo"):
        os.mkfifo("f.yaml")  # reading it would block forever
        assert (
            refused(with_flag(PLAN, "--model", "f.yaml"), capsys)
            == f"{E_PLAN}config f.yaml: not a regular file"
        )
    got = refused(with_flag(PLAN, "--model", "/dev/zero"), capsys)
    assert got == f"{E_PLAN}config /dev/zero: not a regular file"
    got = refused(["describe", "model", "x" * 5000], capsys)
    assert got.startswith("nereus describe: error: unknown model 'xxxxxxxx") and len(got) < 300


def test_hf_config_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = with_flag(PLAN, "--model", "hf/config.json")
    write("hf/config.json", "[1, 2]")
    assert refused(argv, capsys) == f"{E_PLAN}hf/config.json: top level must be a JSON object, got list"
    good = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    good |= {"intermediate_size": 128, "vocab_size": 256}
    write("hf/config.json", json.dumps({**good, "rms_norm_eps": 0.0}))
    assert refused(argv, capsys) == f"{E_PLAN}hf/config.json: rms_norm_eps must be positive, got 0.0"
    write("hf/config.json", json.dumps(good))
    assert ModelSpec.from_hf_config(Path("hf/config.json")).hidden_size == 64


# ------------------------------------------------------------------ argparse errors
CHOICES = "(choose from 'models', 'clusters', 'algos', 'traces')"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        ([], "nereus: error: the following arguments are required: command (see nereus --help)"),
        (
            ["fly"],
            "nereus: error: argument command: invalid choice: 'fly' (choose from 'plan', 'describe', "
            "'transition', 'simulate', 'run', 'node', 'list') (see nereus --help)",
        ),
        (
            ["plan"],
            "nereus plan: error: the following arguments are required: --model, --algo, --cluster, --gpus, "
            "--seq-len (see nereus plan --help)",
        ),
        ([*PLAN, "--bogus"], "nereus plan: error: unrecognized arguments: --bogus (see nereus plan --help)"),
        (
            ["list", "foo"],
            f"nereus list: error: argument kind: invalid choice: 'foo' {CHOICES} (see nereus list --help)",
        ),
        (
            ["list", "y" * 300],
            f"nereus list: error: argument kind: invalid choice: {brief('y' * 300)} {CHOICES} "
            "(see nereus list --help)",
        ),
        (
            ["describe", "model"],
            "nereus describe: error: the following arguments are required: name (see nereus describe --help)",
        ),
        (
            ["transition", "--from", "a.json"],
            f"{E_TR}the following arguments are required: --to (see nereus transition --help)",
        ),
        (
            ["simulate", "--trace"],
            f"{E_SIM}argument --trace: expected one argument (see nereus simulate --help)",
        ),
    ],
)
def test_argparse_errors_are_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(argv, capsys) == line


def test_messages_stay_on_one_line() -> None:
    assert one_line("a\nb\rc\u2028d\x00") == "a\\nb\\rc\\u2028d\\x00"
    assert brief("x" * 1000) == "'" + "x" * 27 + "..." + "x" * 28 + "'"
    assert brief(10**5000) == "an integer of over 4000 digits"
    assert brief(10**40) == "an integer of 41 digits"
    nested: list[object] = []
    for _ in range(10_000):
        nested = [nested, nested]  # 2^10000 leaves if printed in full
    assert len(brief(nested)) <= 60


# ------------------------------------------------------------------ simulate --out
OUTPUTS = {"steps-static.jsonl", "summary.json", "timeline.png"}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_out_folder_with_other_files_is_refused_and_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    write("o/keep.txt", "precious")
    write("o/sub/keep.txt", "precious too")
    before = _tree(Path("o"))
    assert refused([*SIM, "--out", "o"], capsys) == (
        f"{E_SIM}--out o: folder is not empty and was not written by nereus simulate; allowed: "
        "a new or empty folder, or one nereus simulate wrote (add --force to write into it)"
    )
    assert _tree(Path("o")) == before and sorted(os.listdir(".")) == ["o"]
    code, _, err = cli([*SIM, "--out", "o", "--force"], capsys)
    assert code == 0, err
    after = _tree(Path("o"))
    assert {k: after[k] for k in before} == before  # nothing of the user's changed
    assert set(after) - set(before) == OUTPUTS  # and no marker: the folder is not ours


def test_out_folder_that_is_a_file_or_blocked(capsys: pytest.CaptureFixture[str]) -> None:
    write("o", "a file")
    line = f"{E_SIM}--out o: is a file, not a folder (allowed: a new or empty folder)"
    assert refused([*SIM, "--out", "o"], capsys) == line
    assert refused([*SIM, "--out", "o/deeper"], capsys) == f"{E_SIM}--out o/deeper: o is a file, not a folder"
    assert Path("o").read_text() == "a file"
    Path("p").mkdir()
    write(f"p/{MARKER}", "simulate\n")
    Path("p/summary.json").mkdir()
    assert refused([*SIM, "--out", "p"], capsys) == (
        f"{E_SIM}--out p: summary.json in it is a folder; nereus simulate writes a file there"
    )
    write(f"q/{MARKER}", "run\n")
    write("q/metrics.jsonl", "{}")
    assert refused([*SIM, "--out", "q"], capsys).startswith(
        f"{E_SIM}--out q: folder is not empty and was not written by nereus simulate "
        "(it holds output of nereus 'run');"
    )
    if os.geteuid() != 0:  # root may write anywhere
        Path("r").mkdir(mode=0o500)
        assert refused([*SIM, "--out", "r"], capsys) == f"{E_SIM}--out r: folder is not writable"
        got = refused([*SIM, "--out", "r/new"], capsys)
        assert got == f"{E_SIM}--out r/new: cannot create it (r is not writable)"


def test_out_folder_of_our_own_is_rewritten(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli([*SIM[:-2], "--policies", "static,always", "--out", "runs/a/b"], capsys)
    assert code == 0, err
    folder = Path("runs/a/b")
    assert (folder / MARKER).read_text().splitlines()[0] == "simulate"
    assert {"steps-static.jsonl", "steps-always.jsonl"} <= set(os.listdir(folder))
    write("runs/a/b/notes.txt", "mine")
    code, _, err = cli([*SIM, "--out", "runs/a/b"], capsys)  # our folder: allowed again
    assert code == 0, err
    assert sorted(os.listdir(folder)) == sorted({MARKER, "notes.txt", *OUTPUTS})  # stale run gone
    Path("empty").mkdir()
    assert cli([*SIM, "--out", "empty"], capsys)[0] == 0
    assert set(os.listdir("empty")) == {MARKER, *OUTPUTS}  # no temp files left
    umask = os.umask(0o022)
    os.umask(umask)
    assert Path("empty/summary.json").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_nothing_is_written_when_a_later_check_fails(capsys: pytest.CaptureFixture[str]) -> None:
    got = refused([*SIM[:-2], "--policies", "nereus,greedy", "--out", "new/o"], capsys)
    assert got.startswith(f"{E_SIM}unknown policy 'greedy'")
    assert os.listdir(".") == []


def test_default_output_folder_is_named_after_the_workload_not_its_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    write("w/mine.yaml", (CONFIGS / "workloads" / "ppo.yaml").read_text())
    code, _, err = cli(with_flag(SIM, "--algo", "w/mine.yaml"), capsys)
    assert code == 0, err
    assert os.listdir("runs/sim") == [f"{Path(TRACE).stem}-tiny-llama-mine"]


def test_infeasible_simulation_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    write("t.json", json.dumps({"metadata": {"gap_seconds": 300}, "data": [3]}))
    got = refused([*with_flag(SIM, "--trace", "t.json"), "--out", "o"], capsys, code=3)
    assert got == f"{E_SIM}no plan fits the 3 GPUs the trace settles at (responses of 500 tokens)"
    assert not Path("o").exists()


def test_exhaustive_too_large_is_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import nereus.cli
    from nereus.plan.exhaustive import ExhaustiveTooLargeError

    def too_large(*args: object, **kwargs: object) -> None:
        raise ExhaustiveTooLargeError("more than 30,000,000 tuples")

    monkeypatch.setattr(nereus.cli, "exhaustive", too_large)
    got = refused([*PLAN, "--exhaustive", "--all"], capsys)
    assert (
        got
        == f"{E_PLAN}--all: the plan space is too large to list (more than 30,000,000 tuples); lower --gpus"
    )
    monkeypatch.setattr(nereus.cli, "solve", too_large)
    got = refused([*PLAN, "--solver", "exhaustive"], capsys)
    assert got == (
        f"{E_PLAN}--solver exhaustive: more than 30,000,000 tuples (allowed: fewer --gpus, or --solver dp)"
    )
