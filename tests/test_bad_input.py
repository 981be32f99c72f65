"""Bad files, as a careless or hostile user gives them: non-UTF-8 bytes, numbers out of range in
configs, traces and curves, experiment names, anchors, YAML bombs and odd files (calibration files:
``test_bad_calibration.py``).
One line on stderr naming the field and what is allowed, exit 2, no traceback, nothing
half-written (issue 15). Command-line flags: ``test_bad_flags.py``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.runtime.command import check_tokenizer, check_weights
from nereus.runtime.experiment import ExperimentSpec
from nereus.spec import ModelSpec
from nereus.spec.files import brief
from tests.bad_input import (  # noqa: F401 - _in_tmp: the autouse fixture
    A100,
    CONFIGS,
    E_PLAN,
    E_SIM,
    E_TR,
    OPS,
    PLAN,
    SIM,
    _in_tmp,
    cli,
    plan_file,
    refused,
    shipped,
    with_flag,
    write,
)

pytestmark = pytest.mark.pure


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
        ("models", "--model", {"hidden_size": "1e30"}, "key 'hidden_size': expected int, got 1e+30"),
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
    ("kind", "flag"), [("models", "--model"), ("clusters", "--cluster"), ("workloads", "--algo")]
)
def test_a_blank_name_in_a_spec_is_refused(kind: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Errors name a spec by its name: a blank one left them nameless (``: key 'models.critic'``)."""
    base = {"models": "tiny-llama", "clusters": "local-cpu", "workloads": "ppo"}[kind]
    text = "\n".join(x for x in shipped(kind, base).splitlines() if not x.startswith("name:"))
    write("bad.yaml", f"name: '  '\n{text}\n")
    line = "key 'name': expected a non-empty name (or leave it out: the file's stem)"
    assert refused(with_flag(PLAN, flag, "bad.yaml"), capsys) == f"{E_PLAN}bad.yaml: {line}"


def test_a_model_yaml_naming_a_head_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Each role sets its model's head: a model YAML's ``head: value`` did nothing, silently."""
    write("bad.yaml", shipped("models", "tiny-llama", head="value"))
    line = refused(with_flag(PLAN, "--model", "bad.yaml"), capsys)
    assert line == (
        f"{E_PLAN}bad.yaml: key 'head': set by the role that runs the model (the critic and reward model "
        "take a value head, the actor and reference an LM head); remove it"
    )


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
            "'drift[0]' step 1: a worker cannot be lost, killed or unhealthy at once, nor lost or "
            "unhealthy as it is gained (gained and killed: it dies as it joins)",
        ),
        (
            "drift: [{step: 3, kill: [2]}, {step: 3, gain: [2]}]",
            "drift: two events at step 3; put one step's changes in one event (their order within a "
            "step is the runtime's: losses, then gains)",
        ),
        ("drift: [{step: 3, kill: [2, 2]}]", "'drift[0]' step 3: kill names a worker twice ([2, 2])"),
        (
            "drift: [{step: 1, unhealthy: [0]}]",
            "drift at step 1: worker 0 hosts the controller and cannot leave or hang",
        ),
        (
            "drift: [{step: 1, kill: [1], hang: [0]}]",
            "drift at step 1: worker 0 hosts the controller and cannot leave or hang",
        ),
        (
            "drift: [{step: 1, kill: [1], hang: [1]}]",
            "'drift[0]' step 1: a worker that hangs is not lost, gained or out of memory",
        ),
        (
            "drift: [{step: 1, kill: [1], hang: [2], hang_s: 0}]",
            "'drift[0]' hang_s must be in (0, 600] seconds, got 0.0",
        ),
        ("drift: [{step: 1, kill: [1], hang: [7]}]", "drift at step 1: worker 7 outside 0…3"),
        (
            "drift: [{step: 1, freeze: [2], hang: [2], kill: [1]}]",
            "'drift[0]' step 1: a worker that freezes is not lost, gained, out of memory or hung",
        ),
        (
            "drift: [{step: 1, freeze: [0]}]",
            "drift at step 1: worker 0 hosts the controller and cannot leave or hang",
        ),
        ("drift: [{step: 1, freeze: [4]}]", "drift at step 1: worker 4 outside 0…3"),
        (
            "drift: [{step: 2, hang_s: 30}]",
            "'drift[0]' step 2: hang_s is how long hang or freeze workers stop; name some",
        ),
        (
            "drift: [{step: 2, oom_stage: critic.train}]",
            "'drift[0]' step 2: oom_stage is where oom workers run out of memory; name some",
        ),
        (
            "drift: [{step: 2}]",
            "'drift[0]' step 2: the event changes nothing (name lose, kill, gain, oom, unhealthy, hang, "
            "freeze or max_new_tokens)",
        ),
        ("rl: {temperature: 1.0e-300}", "'rl' temperature must be in [0.01, 1e6], got 1e-300"),
        ("collective_timeout_s: 0.5", "collective_timeout_s must be in [1, 86400] seconds, got 0.5"),
        ("collective_timeout_s: .nan", f"key 'collective_timeout_s': {FINITE} nan"),
        ("drift: [{step: 1, unhealthy: [9]}]", "drift at step 1: worker 9 outside 0…3"),
        ("checkpoint_keep: 0", "checkpoint_keep must be positive, got 0"),
        (
            "data: {train: t.jsonl, layout: nereus, prompt_key: text}",
            "'data' prompt_key: layout nereus does not read it (the keys it reads: none: its columns are "
            "prompt, answer and id; layout qa takes any question and answer columns through question_key, "
            "answer_key and template)",
        ),
        (
            "data: {train: t.parquet, template: 'Q: {question} A:'}",
            "'data' template: layout verl does not read it (the keys it reads: prompt_key, answer_key, "
            "source_key; layout qa takes any question and answer columns through question_key, answer_key "
            "and template)",
        ),
        ("data: {train: t.parquet, prompt_key: ''}", "'data' prompt_key must not be empty"),
    ],
)
def test_bad_numbers_in_experiments(extra: str, line: str) -> None:
    write("exp.yaml", f"name: x\nworkload: ppo-tiny\nmodel: tiny-llama\n{extra}\n")
    with pytest.raises(ConfigError) as err:
        ExperimentSpec.load(Path("exp.yaml"))
    assert str(err.value) == f"exp.yaml: {line}"


def test_a_model_folder_without_safetensors_is_refused_not_started_from_random_weights() -> None:
    """A Hugging Face folder whose weights are a ``pytorch_model.bin`` (or absent) would start every
    role from random weights and the bundled tokenizer: refused in one line naming what is there.
    ``model:`` naming the folder's ``config.json`` is that folder."""
    config = json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                         "vocab_size": 512})  # fmt: skip
    write("m/config.json", config)
    write("m/pytorch_model.bin", "x")
    for model in ("m", "m/config.json"):
        write("exp.yaml", f"name: x\nworkload: ppo-tiny\nmodel: {model}\n")
        spec = ExperimentSpec.load(Path("exp.yaml"))
        with pytest.raises(ConfigError) as err:
            check_weights(spec)
        assert str(err.value).startswith("model: m holds no *.safetensors weights (found pytorch_model.bin)")
    write("m/model.safetensors", "x")  # (its contents are the engines' to check)
    assert spec.weights_of("actor") == "m" and spec.weights_of("critic") == "m"
    check_weights(spec)
    write("exp.yaml", "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\n")  # shipped: random by design
    shipped_spec = ExperimentSpec.load(Path("exp.yaml"))
    check_weights(shipped_spec)
    assert shipped_spec.weights_of("actor") == ""


def test_a_model_folder_without_a_tokenizer_is_refused_not_run_on_the_character_one() -> None:
    config = json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                         "vocab_size": 512})  # fmt: skip
    write("m/config.json", config)
    write("m/model.safetensors", "x")
    write("exp.yaml", "name: x\nworkload: ppo-tiny\nmodel: m\n")
    with pytest.raises(ConfigError) as err:
        check_tokenizer(ExperimentSpec.load(Path("exp.yaml")))
    assert str(err.value).startswith("model: m holds no Hugging Face tokenizer (expected tokenizer.json")
    write("tok/tokenizer.json", "{}")
    write("exp.yaml", "name: x\nworkload: ppo-tiny\nmodel: m\ntokenizer: tok\n")  # named elsewhere
    check_tokenizer(ExperimentSpec.load(Path("exp.yaml")))
    write("exp.yaml", "name: x\nworkload: ppo-tiny\nmodel: m\ninit: {actor: tok}\n")  # the actor's init
    check_tokenizer(ExperimentSpec.load(Path("exp.yaml")))
    write("m/tokenizer.json", "{}")  # its own
    write("exp.yaml", "name: x\nworkload: ppo-tiny\nmodel: m\n")
    check_tokenizer(ExperimentSpec.load(Path("exp.yaml")))
    write("exp.yaml", "name: x\nworkload: ppo-tiny\nmodel: tiny-llama\n")  # shipped: the bundled tasks'
    check_tokenizer(ExperimentSpec.load(Path("exp.yaml")))


def test_init_weights_for_a_model_the_workload_does_not_run_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    write("c/config.json", "{}")
    write("exp.yaml", "name: x\nworkload: grpo-tiny\nmodel: tiny-llama\ninit: {critic: c}\n")
    got = refused(["run", "exp.yaml", "--out", "o"], capsys)
    assert got == "nereus run: error: init.critic: grpo-tiny has no critic model (its models: actor, ref)"
    assert not Path("o").exists()


GAP = "field 'metadata.gap_seconds': expected a number of seconds in [0.001, 1e+09], got"
COUNT = "field 'data[1]': expected a whole instance count in [0, 1048576], got"


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
        ('{"metadata": {"gap_seconds": 300}, "data": [4, 2.5]}', f"{COUNT} 2.5"),
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


def test_whole_counts_written_as_floats_are_counts() -> None:
    """numpy and pandas dump integer columns as 8.0 (or 8e0): the same trace as 8."""
    from nereus.sim import SpotTrace

    write("t.json", '{"metadata": {"gap_seconds": 300}, "data": [4, 8.0, 16e0]}')
    assert SpotTrace.load(Path("t.json")).counts == (4, 8, 16)


TOKENS = "expected a number of tokens in [1, 16777216], got"


@pytest.mark.parametrize(
    ("rows", "line"),
    [
        ("0,nan,nan", f"line 2: field 'mean_len': {TOKENS} 'nan'"),
        ("0,100,inf", f"line 2: field 'p95_len': {TOKENS} 'inf'"),
        ("0,-100,200", f"line 2: field 'mean_len': {TOKENS} '-100'"),
        ("0,1e30,1e31", f"line 2: field 'mean_len': {TOKENS} '1e30'"),
        ("0,0.001,0.002", f"line 2: field 'mean_len': {TOKENS} '0.001'"),  # fractions of a token
        ("-5,100,200", "line 2: field 'step': expected an integer in [0, 1000000000], got -5"),
        ("0,1\x0000,200", "line 2: field 'mean_len': expected a number, got '1\\x0000'"),
    ],
)
def test_bad_sequence_length_curves(rows: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    write("c.csv", f"step,mean_len,p95_len\n{rows}\n")
    assert refused([*SIM, "--seq-curve", "c.csv"], capsys) == f"{E_SIM}c.csv: {line}"


def test_a_curve_written_with_spaces_after_its_commas_reads(capsys: pytest.CaptureFixture[str]) -> None:
    write("c.csv", "step, mean_len, p95_len\n0, 100, 120\n1, 110, 130\n")
    code, _, err = cli([*SIM, "--seq-curve", "c.csv"], capsys)
    assert code == 0, err


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


def test_a_plan_names_its_files_so_another_folder_reads_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan file keeps a cluster named by a relative path as an absolute one (a shipped name as
    it is): ``transition`` and ``--anchor`` from another folder read the same file."""
    Path("sub").mkdir()
    write("sub/c.yaml", (CONFIGS / "clusters" / "h200-ib.yaml").read_text())
    argv = [*with_flag(A100, "--cluster", "sub/c.yaml"), "--seq-len", "2048"]
    for name, gpus in (("sub/a.json", "32"), ("sub/b.json", "24")):
        code, out, err = cli([*argv, "--gpus", gpus], capsys)
        assert code == 0, err
        write(name, out)
    doc = json.loads(Path("sub/a.json").read_text())["problem"]
    assert doc["cluster"] == str(Path("sub/c.yaml").resolve()) and doc["model"] == "llama-3.1-8b"
    monkeypatch.chdir("sub")
    assert cli(["transition", "--from", "a.json", "--to", "b.json"], capsys)[0] == 0
    again = [*with_flag(argv, "--cluster", "c.yaml"), "--gpus", "24", "--anchor", "a.json"]
    assert cli(again, capsys)[0] == 0


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
    write("m.txt", "hidden_size: 64\n")  # a file of another kind is named as a file, not an unknown name
    got = refused(["describe", "model", "m.txt"], capsys)
    assert got.startswith("nereus describe: error: model file m.txt: expected a .yaml, .yml or .json file")


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


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_staleness", "-1", "max_staleness must be 0…16, got -1"),
        ("max_staleness", "1.5", "key 'max_staleness': expected int, got 1.5 (allowed: a whole number 0…16)"),
        ("in_flight", "keep", "key 'in_flight': expected one of drain|drop, got 'keep'"),
    ],
)
def test_run_refuses_a_bad_async_setting(
    key: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write("async.yaml", shipped("workloads", "grpo-tiny", mode="async", **{key: value}))
    write("exp.yaml", "name: x\nworkload: async.yaml\nmodel: tiny-llama\nworkers: 2\nsteps: 1\n")
    got = refused(["run", "exp.yaml", "--out", "out"], capsys)
    assert message in got and "async.yaml" in got, got
    assert not Path("out").exists()  # nothing half-written


@pytest.mark.parametrize(("key", "value"), [("max_staleness", "2"), ("in_flight", "drop")])
def test_run_refuses_an_async_setting_in_a_sync_workload(
    key: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    write("sync.yaml", shipped("workloads", "grpo-tiny", mode="sync", **{key: value}))
    write("exp.yaml", "name: x\nworkload: sync.yaml\nmodel: tiny-llama\nworkers: 2\nsteps: 1\n")
    got = refused(["run", "exp.yaml", "--out", "out"], capsys)
    assert f"sync.yaml: key '{key}' applies to mode: async only" in got, got
    assert not Path("out").exists()


def test_plan_mode_async_takes_a_workload_naming_async_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """``--mode async`` sets the mode the file's ``max_staleness`` acts in; without it, the refusal."""
    write("w.yaml", shipped("workloads", "grpo", mode="sync", max_staleness="3"))
    argv = [*A100[:-1], "--gpus", "16", "--seq-len", "2048"]
    argv[argv.index("ppo")] = "w.yaml"
    assert "w.yaml: key 'max_staleness' applies to mode: async only" in refused(argv, capsys)
    sync = refused([*argv, "--mode", "sync"], capsys)  # the file and the flag agree: still refused
    assert "w.yaml: key 'max_staleness' applies to mode: async only" in sync
    code, out, err = cli([*argv, "--mode", "async", "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["mode"] == "async" and doc["problem"]["mode"] == "async", doc["problem"]


def test_a_trace_that_is_not_json_says_what_a_trace_is(capsys: pytest.CaptureFixture[str]) -> None:
    write("t/trace.csv", "a,b\n1,2\n")
    assert refused(with_flag(SIM, "--trace", "t/trace.csv"), capsys) == (
        f"{E_SIM}t/trace.csv: line 1: not valid JSON (Expecting value) (a trace is a JSON file: "
        '{"metadata": {"gap_seconds": S}, "data": [...]})'
    )
