"""Bad input found by probing the commands: each gets one line naming the field, exit 2.

Duplicate YAML keys (YAML keeps the last silently), speeds too small to price with, sequences
longer than the model's context or the workload's limits, ``0`` where "unset" was meant to be
left out, a micro-batch no replica can fill, plan JSON with keys ``nereus plan`` never writes,
a CSV with more fields than its header; and what must keep working: ``1e3`` in YAML, a CSV
with a byte-order mark.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from launch.experiment import check_plan
from nereus.errors import ConfigError
from nereus.plan.report import PLAN_KEYS, STAGE_REPORT_KEYS
from nereus.runtime.drift import DriftEvent
from nereus.runtime.experiment import ExperimentSpec
from nereus.spec.registry import config_root
from nereus.spec.schema import build
from tests.bad_input import (  # noqa: F401 - _in_tmp: the autouse fixture
    A100,
    E_PLAN,
    E_SIM,
    E_TR,
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

PRICE = ["price", "--model", "tiny-llama", "--cluster", "h100-ib", "--tp", "1", "--pp", "1", "--dp", "2"]
PRICE += ["--sequences", "256", "--prompt-len", "100", "--seq-len", "100"]
E_PRICE = "nereus price: error: "


def test_a_yaml_key_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    text = shipped("clusters", "h100-ib") + "gpus_per_node: 4\n"  # gpus_per_node is there already
    line = refused(with_flag(PLAN, "--cluster", write("c.yaml", text)), capsys)
    assert line.startswith(f"{E_PLAN}c.yaml: line ") and line.endswith("(key 'gpus_per_node' given twice)")


def test_yaml_exponents_without_a_dot_are_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """PyYAML reads ``1e3`` as text (YAML 1.1); a user who wrote a number gets one."""
    text = shipped("clusters", "h100-ib", peak_bf16_tflops="9.89e2", storage_read_gbs="2e0")
    code, _, err = cli(["describe", "cluster", write("c.yaml", text)], capsys)
    assert code == 0, err


@pytest.mark.parametrize("field", ["peak_bf16_tflops", "hbm_bandwidth_gbs", "inter_node_bandwidth_gbs"])
def test_a_speed_too_small_to_price_with_is_refused(field: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = shipped("clusters", "h100-ib", **{field: "1.0e-300"})
    line = refused(with_flag(PLAN, "--cluster", write("c.yaml", text)), capsys)
    assert line == f"{E_PLAN}c.yaml: {field} must be at least 0.001, got 1e-300"


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--prompt-len", "5000"], "--prompt-len 5000 exceeds ppo's max_prompt_len 1024"),
        (["--seq-len", "9000"], "--seq-len 9000 exceeds ppo's max_response_len 8192"),
        (
            ["--seq-len", "1000", "--seq-len-p95", "1900", "--prompt-len", "512"],
            "--prompt-len + --seq-len-p95: 512 + 1900 = 2412 tokens exceed tiny-llama's "
            "max_position_embeddings 2048",
        ),
        (
            ["--fix", "actor.train=tp1,pp1,dp2,mb0"],
            "--fix actor.train: mb must be in [1, 16777216], got 0",
        ),
        (["--fix", "actor.train=tp1,pp1,dp0"], "--fix actor.train: dp must be in [1, 1048576], got 0"),
        (
            ["--fix", "actor.train=tp\uff14,pp1,dp2"],  # a full-width digit is not a digit here
            "--fix: expected MODEL_STAGE=tpT,ppP,dpD[,mbB] (e.g. actor.train=tp4,pp1,dp2), "
            "got 'actor.train=tp\uff14,pp1,dp2'",
        ),
    ],
)
def test_plan_lengths_and_fixes_beyond_their_limits(
    extra: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a for a in PLAN if a not in ("--seq-len", "32")] if "--seq-len" in extra else [*PLAN]
    assert refused([*argv, *extra], capsys) == f"{E_PLAN}{line}"


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--micro-batch", "0"], "--micro-batch: expected a positive integer, got 0"),
        (["--concurrency", "0", "--stage", "gen"], "--concurrency: expected a positive integer, got 0"),
        (["--seq-len-p95", "0"], "--seq-len-p95: expected a positive integer, got 0"),
        (
            ["--micro-batch", "1000", "--stage", "inf"],
            "--micro-batch 1000: more than a replica's 128 sequences (--sequences 256 / --dp 2)",
        ),
        (
            ["--micro-batch", "8", "--stage", "gen"],
            "--micro-batch prices training and inference; --stage is gen",
        ),
        (
            ["--seq-len-p95", "4000", "--stage", "inf"],
            "--prompt-len + --seq-len(-p95): 100 + 4000 = 4100 tokens exceed tiny-llama's "
            "max_position_embeddings 2048",
        ),
    ],
)
def test_price_flags_that_are_not_a_choice(
    extra: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*PRICE, *extra] if "--stage" in extra else [*PRICE, "--stage", "inf", *extra]
    assert refused(argv, capsys) == f"{E_PRICE}{line}"
    code, _, err = cli([*PRICE, "--stage", "inf", "--micro-batch", "8", "--json"], capsys)
    assert code == 0, err  # a micro-batch a replica fills is priced


def test_plan_json_with_keys_nereus_plan_never_writes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli([*PLAN, "--json", "--exhaustive", "--all"], capsys)
    assert code == 0, err
    written = json.loads(out)  # every key nereus plan writes is one a plan read back may hold
    assert {"exhaustive", "plans", "problem"} <= set(written) <= PLAN_KEYS
    assert {k for stage in written["stages"] for k in stage} == STAGE_REPORT_KEYS | {
        "name", "tp", "pp", "dp", "gpus", "micro_batch", "recompute"
    }  # fmt: skip
    doc = plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "1024")
    write("b.json", json.dumps({**doc, "gpu": 16}))
    line = refused(["transition", "--from", "a.json", "--to", "b.json"], capsys)
    assert line.startswith(f"{E_TR}b.json: unknown key 'gpu' (allowed: capacity_gib, critical_path, ")
    doc["stages"][0]["stage"] = "foo"
    write("c.json", json.dumps(doc))
    line = refused(["transition", "--from", "a.json", "--to", "c.json"], capsys)
    assert line == f"{E_TR}c.json: stages[0] (actor.gen): key 'stage' is 'foo', not gen"
    doc["stages"][0] = {**doc["stages"][0], "stage": "gen", "tpp": 2}
    write("d.json", json.dumps(doc))
    line = refused(["transition", "--from", "a.json", "--to", "d.json"], capsys)
    assert line.startswith(f"{E_TR}d.json: key 'stages[0]': unknown key 'tpp' (allowed: ")


def test_plan_json_with_a_tp_the_heads_cannot_split(capsys: pytest.CaptureFixture[str]) -> None:
    """48 heads, 6 KV heads: tp 4 divides the heads but neither divides nor is a multiple of the KV
    heads; the planner never picks it, and a plan file holding it is refused where it is read."""
    config = {"model_type": "llama", "hidden_size": 6144, "intermediate_size": 16384,
              "num_attention_heads": 48, "num_key_value_heads": 6, "num_hidden_layers": 60,
              "vocab_size": 64000, "max_position_embeddings": 8192}  # fmt: skip
    model = str(Path(write("odd-30b/config.json", json.dumps(config))).parent.resolve())
    plan = ["plan", "--model", model, "--algo", "ppo", "--cluster", "h100-ib", "--seq-len", "2048"]
    plan.append("--pipelined-gen")  # at tp ≤ 2 generation needs pipeline stages to fit
    docs = {}
    for gpus in ("64", "128"):
        code, out, err = cli([*plan, "--gpus", gpus, "--json"], capsys)
        assert code == 0, err
        docs[gpus] = json.loads(out)
        assert {s["tp"] for s in docs[gpus]["stages"]} <= {1, 2}, docs[gpus]["stages"]
        write(f"{gpus}.json", out)
    code, _, err = cli(["transition", "--from", "64.json", "--to", "128.json", "--json"], capsys)
    assert code == 0, err  # the planner's own plans shard (tp4 crashed here in the state geometry)
    gen = next(i for i, s in enumerate(docs["64"]["stages"]) if s["name"] == "actor.gen")
    stage = docs["64"]["stages"][gen]
    stage["tp"], stage["pp"] = 4, max(stage["pp"] * stage["tp"] // 4, 1)  # the same GPUs at tp4
    stage["dp"] = max(len(stage["gpus"]) // (stage["tp"] * stage["pp"]), 1)
    write("bad.json", json.dumps(docs["64"]))
    want = (
        f"bad.json: stages[{gen}] (actor.gen): tp 4 and the 6 KV heads must divide one another "
        "(odd-30b: 48 attention heads, 6 KV heads; allowed tp: 1, 2)"
    )
    assert refused(["transition", "--from", "bad.json", "--to", "128.json"], capsys) == f"{E_TR}{want}"
    assert refused([*plan, "--gpus", "64", "--anchor", "bad.json"], capsys) == f"{E_PLAN}--anchor {want}"


def test_sequence_curves_beyond_the_context_and_rows_beyond_the_header(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused([*SIM, "--seq-curve", "growth:3000:4000:10"], capsys)
    assert line.startswith(f"{E_SIM}--seq-curve (its p95): ") and "max_position_embeddings 2048" in line
    write("long.csv", "step,mean_len,p95_len\n0,500,800,9\n")
    line = refused([*SIM, "--seq-curve", "long.csv"], capsys)
    assert line == f"{E_SIM}long.csv: line 2: 4 fields, the header names 3 (step, mean_len, p95_len)"
    write("bom.csv", "\ufeffstep,mean_len,p95_len\n0,100,120\n5,200,240\n")  # as Excel writes UTF-8
    code, _, err = cli([*SIM, "--seq-curve", "bom.csv", "--out", "sim"], capsys)
    assert code == 0, err


def test_a_curve_above_the_workloads_response_limit_is_cut_there_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ppo's max_response_len is 8192: a curve to a p95 of 13,800 runs at 8192 (the engine's max_tokens),
    with a warning, and the context check reads the lengths that run."""
    argv = [*SIM, "--seq-curve", "growth:9000:12000:1", "--out", "sim", "--json"]
    argv[argv.index("tiny-llama")] = "llama-3.1-8b"
    code, _, err = cli(argv, capsys)
    assert code == 0, err
    assert err == (
        "nereus simulate: warning: --seq-curve reaches a p95 of 13800 tokens, above ppo's "
        "max_response_len 8192: responses are cut at 8192\n"
    )
    steps = [json.loads(line) for line in Path("sim/steps-static.jsonl").read_text().splitlines()]
    assert {(s["seq_len_mean"], s["seq_len_p95"]) for s in steps} == {(8192, 8192)}


def test_the_default_curve_is_cut_at_the_response_limit_without_a_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A workload whose max_response_len is 256: the default growth curve (from 500 tokens) is cut
    there in silence; the same curve named by the user is cut with the warning."""
    body = (config_root() / "workloads" / "ppo.yaml").read_text()
    write("short.yaml", body.replace("max_response_len: 8192", "max_response_len: 256"))
    argv = [*SIM, "--out", "sim"]
    argv[argv.index("ppo")] = "short.yaml"
    code, _, err = cli(argv, capsys)
    assert (code, err) == (0, "")
    steps = [json.loads(line) for line in Path("sim/steps-static.jsonl").read_text().splitlines()]
    assert {s["seq_len_p95"] for s in steps} == {256}
    code, _, err = cli([*argv, "--seq-curve", "growth"], capsys)
    assert code == 0 and err == (
        "nereus simulate: warning: --seq-curve reaches a p95 of 577 tokens, above short's "
        "max_response_len 256: responses are cut at 256\n"
    )
    line = refused([*argv, "--seq-curve", ""], capsys)  # not the default's None
    assert line.startswith(f"{E_SIM}--seq-curve '': expected growth, growth:START:END:STEPS or a CSV")


def test_a_trace_folder_and_an_empty_model_name(capsys: pytest.CaptureFixture[str]) -> None:
    write("tr/x.json", "{}")
    line = refused(["simulate", "--trace", "tr", *SIM[3:]], capsys)
    assert line == f"{E_SIM}trace tr: is a folder, not a file"
    line = refused(["plan", "--model", "", *PLAN[3:]], capsys)
    assert line == (
        f"{E_PLAN}model: empty name (allowed: a shipped model, a model YAML, a config.json or its folder)"
    )


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        ({"workload": "nonexistent"}, "workload: unknown algorithm 'nonexistent'"),
        ({"policy": "bogus"}, "policy: unknown policy 'bogus'"),
        ({"seed": "-1"}, "seed must be non-negative, got -1"),
    ],
)
def test_experiment_errors_name_their_key(
    changes: dict[str, str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write("e.yaml", shipped("experiments", "grpo-tiny", **changes))
    assert line in refused(["run", path, "--out", "out"], capsys)


def test_run_steps_beyond_the_limit_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    path = write("e.yaml", shipped("experiments", "grpo-tiny"))
    line = refused(["run", path, "--steps", "10000001", "--out", "out"], capsys)
    assert line == "nereus run: error: --steps: steps must be at most 10000000, got 10000001"


def test_a_held_layout_that_cannot_exist_says_what_holding_it_asks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = refused([*PLAN, "--fix", "actor.train=tp1,pp1,dp2,mb3"], capsys)  # no pool runs it: bad input
    assert line.startswith(
        f"{E_PLAN}--fix actor.train: mb 3 must divide a replica's share of the global batch"
    )
    assert line.endswith("(allowed: 1, 2, 4, 8, 16, 32, 64)")


def test_flags_that_would_do_nothing_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused([*SIM, "--max-staleness", "3"], capsys)
    assert line == f"{E_SIM}--max-staleness sets asynchronous RL; ppo runs sync here (add --mode async)"
    plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "1024")
    line = refused(["transition", "--from", "a.json", "--to", "a.json", "--lost", ",,,"], capsys)
    assert line == f"{E_TR}--lost: expected GPU ids like 3,8-11, got ',,,'"
    line = refused([*SIM, "--gamma", "0.3"], capsys)  # static admits by its own rule
    assert line == f"{E_SIM}--gamma sets nereus's payback bar; --policies 'static' has no nereus"
    line = refused(["describe", "cluster", "h100-ib", "--seq-len", "1024"], capsys)
    assert line.startswith(
        "nereus describe: error: describe cluster takes no --seq-len (it sets a model's attention"
    )
    code, _, err = cli(["describe", "model", "tiny-llama", "--seq-len", "64"], capsys)
    assert code == 0, err


def test_a_model_the_runtime_cannot_rotate_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An odd head_dim prices (the planner needs no rotation) but cannot run: RoPE rotates pairs."""
    model = write("odd.yaml", shipped("models", "tiny-llama", hidden_size="66", num_attention_heads="2",
                                      num_key_value_heads="1"))  # fmt: skip
    code, _, err = cli(with_flag(PLAN, "--model", model), capsys)
    assert code == 0, err
    exp = write("e.yaml", shipped("experiments", "grpo-tiny", model=str(Path(model).resolve())))
    line = refused(["run", exp, "--out", "out"], capsys)
    assert line == (
        "nereus run: error: model: odd's head_dim 33 is odd; the runtime's rotary embeddings need an even "
        "head_dim (set head_dim, or hidden_size / num_attention_heads, to an even number)"
    )
    assert not Path("out").exists()  # nothing written
    spec = build(ExperimentSpec, yaml.safe_load(Path(exp).read_text()), exp)
    with pytest.raises(ConfigError, match="head_dim 33 is odd"):  # the login node's check too
        check_plan(spec, 4)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_out_folder_the_file_system_refuses_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``access`` says root may write /proc; creating a folder there fails. That is found before
    the simulation runs, not after it."""
    line = refused([*SIM, "--out", "/proc/x"], capsys)
    assert line == f"{E_SIM}--out /proc/x: cannot create it (/proc is not writable)"


def test_simulates_default_folder_stays_under_runs_sim_whatever_the_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = shipped("models", "tiny-llama") + 'name: "../../escaped/meta-llama/x"\n'
    model = write("m.yaml", text)
    code, _, err = cli(with_flag(SIM, "--model", model), capsys)
    assert code == 0, err
    made = [p for p in Path(".").rglob("summary.json")]
    assert len(made) == 1 and made[0].parent.parent == Path("runs/sim"), made
    assert ".." not in made[0].parent.name and "/" not in made[0].parent.name


def test_a_json_key_given_twice_is_refused_as_in_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    config = '{"model_type": "llama", "hidden_size": 64, "hidden_size": 128, "num_attention_heads": 4}'
    line = refused(["describe", "model", write("config.json", config)], capsys)
    assert line == "nereus describe: error: config.json: not valid JSON: key 'hidden_size' given twice"
    trace = write("t.json", '{"metadata": {"gap_seconds": 300}, "data": [8, 8], "data": [1]}')
    line = refused(with_flag(SIM, "--trace", trace), capsys)
    assert line == f"{E_SIM}t.json: not valid JSON: key 'data' given twice"


@pytest.mark.parametrize("value", ["020", "1:20", "0b11", "-07"])
def test_yaml_11_octal_binary_and_base_60_numbers_are_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """PyYAML reads ``nodes: 020`` as 16 and ``1:20`` as 80 (YAML 1.1): a user meant neither."""
    line = refused(
        ["describe", "cluster", write("c.yaml", shipped("clusters", "h100-ib", nodes=value))], capsys
    )
    assert line.startswith("nereus describe: error: c.yaml: line ") and line.endswith(
        f"is not valid YAML ('{value}' reads as octal, binary or base 60 in YAML 1.1; write it in decimal)"
    )
    code, _, err = cli(
        ["describe", "cluster", write("c.yaml", shipped("clusters", "h100-ib", nodes="0x10"))], capsys
    )
    assert code == 0, err  # hexadecimal is YAML 1.2 too


def test_a_plan_for_a_cluster_named_by_its_file_is_the_same_cluster(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "1024")  # --cluster a100-64gb-hdr100
    path = str(config_root() / "clusters" / "a100-64gb-hdr100.yaml")
    argv = with_flag(A100, "--cluster", path)
    code, _, err = cli([*argv, "--gpus", "16", "--seq-len", "1500", "--anchor", "a.json"], capsys)
    assert code == 0, err
    other = with_flag(A100, "--cluster", "h100-ib")
    line = refused([*other, "--gpus", "16", "--seq-len", "1500", "--anchor", "a.json"], capsys)
    assert line.startswith(
        f"{E_PLAN}--anchor a.json: the plan is for cluster 'a100-64gb-hdr100', not 'h100-ib'"
    )
    shipped = (config_root() / "clusters" / "a100-64gb-hdr100.yaml").read_text()
    write("mine.yaml", shipped)  # a copy under another name (its name is the file's): the same cluster
    code, _, err = cli([*with_flag(A100, "--cluster", "mine.yaml"), "--gpus", "16", "--seq-len", "1500",
                        "--anchor", "a.json"], capsys)  # fmt: skip
    assert code == 0, err
    write("mine.yaml", shipped.replace("gpus_per_node: 4", "gpus_per_node: 8"))
    line = refused([*with_flag(A100, "--cluster", "mine.yaml"), "--gpus", "16", "--seq-len", "1500",
                    "--anchor", "a.json"], capsys)  # fmt: skip
    assert line.startswith(f"{E_PLAN}--anchor a.json: the plan is for cluster 'a100-64gb-hdr100', not")


def test_describe_and_the_config_root_refuse_what_they_cannot_use(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    line = refused(["describe", "model", "tiny-llama", "--seq-len", "100000"], capsys)
    assert (
        line == "nereus describe: error: --seq-len 100000 exceeds tiny-llama's max_position_embeddings 2048"
    )
    monkeypatch.setenv("NEREUS_CONFIGS", "/nonexistent-configs")
    line = refused(["describe", "model", "tiny-llama"], capsys)
    assert line == (
        "nereus describe: error: NEREUS_CONFIGS=/nonexistent-configs: not a folder "
        "(unset it for the shipped configs/)"
    )
    empty = tmp_path / "configs"  # a folder, but not laid out as configs/ is: it listed nothing
    empty.mkdir()
    monkeypatch.setenv("NEREUS_CONFIGS", str(empty))
    for argv in (["list", "models"], ["plan", "--model", "tiny-llama", "--algo", "ppo", "--cluster", "x",
                                       "--gpus", "2", "--seq-len", "10"]):  # fmt: skip
        line = refused(argv, capsys)
        assert line.endswith(f"NEREUS_CONFIGS={empty}: no models/ folder in it (it replaces the shipped "
                             "configs/, whose layout it needs: models/, clusters/, workloads/, traces/; "
                             "unset it for those)"), line  # fmt: skip


def test_a_workloads_response_limit_past_the_context_does_not_refuse_a_shorter_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """max_response_len is what the planner prices; a run generates max_new_tokens (the README's
    Qwen2.5-Math-1.5B, 4096 positions, under grpo's 1024 + 8192, was refused)."""
    from nereus.runtime.command import preflight

    workload = shipped("workloads", "grpo-tiny").replace("max_response_len:", "max_response_len: 8192 #")
    if "max_response_len: 8192" not in workload:
        workload += "max_response_len: 8192\n"
    write("wl.yaml", workload)
    path = write("e.yaml", shipped("experiments", "grpo-tiny", workload="wl.yaml"))
    spec = ExperimentSpec.load(Path(path))
    assert preflight(spec, Path("out"), resume=False, child=False) == 0


def test_an_experiment_a_worker_would_crash_on_is_refused_before_it_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A top_p of 0 (the sampler keeps at least one token) and responses past the model's
    context (vLLM refuses its max_model_len) used to start the workers and die with a traceback."""
    path = write("e.yaml", shipped("experiments", "grpo-tiny").replace("rl:\n", "rl:\n  top_p: 0\n"))
    line = refused(["run", path, "--out", "out"], capsys)
    assert line == "nereus run: error: e.yaml: 'rl' top_p must be in (0, 1], got 0.0"
    for knob, message in (  # the losses' own bounds: they crashed the job in its first training
        ("clip_eps: 1.5", "clip_eps must be in (0, 1), got 1.5"),
        ("vf_clip: 0", "vf_clip must be in (0, 1e6] or null (off), got 0.0"),
    ):
        path = write("e.yaml", shipped("experiments", "grpo-tiny").replace("rl:\n", f"rl:\n  {knob}\n"))
        assert refused(["run", path, "--out", "out"], capsys) == f"nereus run: error: e.yaml: 'rl' {message}"
    for extra, message in (  # nothing rewards; a weight of a reward model the workload lacks
        ("verifier: none\n", "verifier: none leaves no reward: workload grpo-tiny has reward_model: false"),
        ("reward_coef: -5\n", "reward_coef: weighs the reward model's score; workload grpo-tiny has "),
    ):
        path = write("e.yaml", shipped("experiments", "grpo-tiny") + extra)
        assert refused(["run", path, "--out", "out"], capsys).startswith(f"nereus run: error: {message}")
    rm = shipped("experiments", "ppo-tiny-rm", verifier="none", reward_coef="0")  # a reward model weighed 0
    path = write("e.yaml", rm)
    message = "nereus run: error: verifier: none leaves no reward: reward_coef: 0"
    assert refused(["run", path, "--out", "out"], capsys).startswith(message)
    assert not Path("out").exists()
    path = write("e.yaml", shipped("experiments", "grpo-tiny").replace("rl:\n", "rl:\n  vf_clip: null\n"))
    assert ExperimentSpec.load(Path(path)).rl.vf_clip is None  # value clipping off (ValueLoss's None)
    path = write("e.yaml", shipped("experiments", "grpo-tiny", max_new_tokens="3000"))
    line = refused(["run", path, "--out", "out"], capsys)
    assert line.endswith("max_prompt_len + max_new_tokens: 32 + 3000 = 3032 tokens exceed tiny-llama-h32's "
                         "max_position_embeddings 2048")  # fmt: skip
    assert not Path("out").exists()
    spec = build(ExperimentSpec, yaml.safe_load(shipped("experiments", "grpo-tiny")), "e.yaml")
    late = replace(spec, drift=(*spec.drift, DriftEvent(step=100, max_new_tokens=1_000_000)))
    assert late.longest_response() == spec.longest_response()  # after the last step: never asked for
