"""Bad command lines, as a careless or hostile user gives them: numbers in flags, plan JSON for
``nereus transition``, argparse errors, ``simulate --out`` folders. One line on stderr naming the
flag and what is allowed, exit 2 (infeasible: 3), no traceback, nothing half-written (issue 15).
Files and configs: ``test_bad_input.py``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nereus.spec.files import MARKER, brief, one_line
from nereus.spec.registry import config_root
from tests.bad_input import (  # noqa: F401 - _in_tmp: the autouse fixture
    CONFIGS,
    E_PLAN,
    E_SIM,
    E_TR,
    PLAN,
    SIM,
    TRACE,
    _in_tmp,
    cli,
    plan_file,
    refused,
    with_flag,
    write,
)

pytestmark = pytest.mark.pure


# ------------------------------------------------------------------ numbers in CLI flags
SPEEDUP = "argument --speedup: must be a number in [0.001, 1e+06], got"
NOISE = "argument --noise: must be a number in [0, 1], got"
STEPS = "argument --steps: must be an integer in [1, 100000], got"


@pytest.mark.parametrize(
    ("flag", "value", "line"),
    [
        ("--speedup", "nan", f"{SPEEDUP} 'nan'"),
        ("--speedup", "0", f"{SPEEDUP} '0'"),
        ("--speedup", "-1", f"{SPEEDUP} '-1'"),
        ("--speedup", "inf", f"{SPEEDUP} 'inf'"),
        ("--speedup", "1e-305", f"{SPEEDUP} '1e-305'"),
        ("--speedup", "０.５", f"{SPEEDUP} '０.５'"),  # float() takes full-width digits and "1_0"
        ("--noise", "0_1", f"{NOISE} '0_1'"),
        ("--noise", "nan", f"{NOISE} 'nan'"),
        ("--noise", "-0.1", f"{NOISE} '-0.1'"),
        ("--noise", "1e6", f"{NOISE} '1e6'"),
        ("--steps", "0", f"{STEPS} 0"),
        ("--steps", "-1", f"{STEPS} -1"),
        ("--steps", "1000000000", f"{STEPS} 1000000000"),
        ("--steps", "2.5", f"{STEPS} '2.5'"),
        ("--steps", "３", f"{STEPS} '３'"),  # int() takes full-width digits, "1_0" and "+1"
        ("--steps", "1_0", f"{STEPS} '1_0'"),
        ("--seed", "+1", "argument --seed: must be an integer in [0, 4294967295], got '+1'"),
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
            "--policies: 'periodic:0': periodic:K needs a whole number K in [1, 10,000,000]",
        ),
        (["--policies", "static,static"], "--policies names a run twice: 'static,static'"),
        (["--policies", "nereus", "--gamma", "0.5,0.5"], "--gamma names a value twice: 0.5,0.5"),
        (
            ["--max-gpus", "8", "--gpus-per-instance", "3", "--min-gpus", "7"],
            "--max-gpus 8 is not a whole number of instances of 3 GPUs (--gpus-per-instance): pass "
            "--max-gpus 6 or 9",
        ),
        (
            ["--max-gpus", "24", "--gpus-per-instance", "3", "--min-gpus", "7"],
            "--min-gpus 7 is not a whole number of instances of 3 GPUs (--gpus-per-instance): pass "
            "--min-gpus 6 or 9",
        ),
        (
            ["--seq-curve", "Growth"],
            "--seq-curve 'Growth': expected growth, growth:START:END:STEPS or a CSV file "
            "(step,mean_len,p95_len)",
        ),
        (
            ["--gpus-per-instance", "3"],
            "a100-64gb-hdr100's 256 GPUs are not a whole number of instances of 3 GPUs "
            "(--gpus-per-instance): pass --max-gpus 255",
        ),
        (
            ["--max-gpus", "4", "--gpus-per-instance", "8"],
            "--gpus-per-instance must be in [1, --max-gpus 4], got 8",
        ),
        (
            ["--episode", "0-5:all:nan"],
            "--episode '0-5:all:nan': episode factor must be in [0.001, 1], got nan",
        ),
        (
            ["--episode", "0-5:all:5e-324"],
            "--episode '0-5:all:5e-324': episode factor must be in [0.001, 1], got 5e-324",
        ),
        (
            ["--episode", "foo"],
            "--episode 'foo': expected START-END:SCOPE:FACTOR with SCOPE one of inter, intra, compute, "
            "all, e.g. 100-140:inter:0.5",
        ),
    ],
)
def test_bad_simulate_values(extra: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = SIM[:-2] + (extra if "--policies" in extra else [*SIM[-2:], *extra])
    assert refused(argv, capsys) == f"{E_SIM}{line}"


def test_a_cluster_larger_than_a_simulation_needs_a_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """A cluster file may name 2^26 GPUs; the simulated pool defaults to all of them, which held a
    set of every GPU id (a MemoryError). It asks for --max-gpus instead."""
    text = (config_root() / "clusters" / "local-cpu.yaml").read_text()
    write(
        "huge.yaml",
        text.replace("nodes: 1\n", "nodes: 65536\n").replace("gpus_per_node: 8", "gpus_per_node: 1024"),
    )
    argv = [*SIM[:8], "huge.yaml", *SIM[9:]]
    assert refused(argv, capsys) == (
        f"{E_SIM}huge has 67108864 GPUs, more than a simulation holds: cap the pool with --max-gpus "
        "(at most 1048576)"
    )


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
PROBLEM_KEYS = "algo, calibration, cluster, gpus, headroom, max_tp, mode, model, pipelined_gen, "
PROBLEM_KEYS += "prompt_len, seq_len, seq_len_p95, urgent"


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
        (
            lambda d: d["stages"][0].update(tp=64),
            "b.json: stages[0] (actor.gen): tp 64 must divide the 32 attention heads (llama-3.1-8b: 32 "
            "attention heads, 8 KV heads; allowed tp: 1, 2, 4, 8, 16, 32)",
        ),
        (
            lambda d: d["stages"][0].update(pp=64),
            "b.json: stages[0] (actor.gen): pp 64 exceeds llama-3.1-8b's 32 layers",
        ),
        (
            lambda d: d["stages"][5].update(dp=3),
            "b.json: stages[5] (actor.train): dp 3 must divide the global batch 128 (allowed dp: 1, 2, 4, 8, "
            "16, 32, 64, 128)",
        ),
        (
            lambda d: d["stages"][5].update(dp=2, micro_batch=24),
            "b.json: stages[5] (actor.train): micro_batch 24 must divide a replica's share of the global "
            "batch, 64 (allowed: 1, 2, 4, 8, 16, 32, 64)",
        ),
        (
            lambda d: d["stages"][1].update(dp=2, micro_batch=100000),
            "b.json: stages[1] (actor.inf): micro_batch 100000 exceeds ppo's inference_micro_batch 16 "
            "(allowed: 1 to 16)",
        ),
        (
            lambda d: d["stages"][1].update(dp=64, micro_batch=16),
            "b.json: stages[1] (actor.inf): micro_batch 16 exceeds a replica's 8 sequences",
        ),
        (
            lambda d: d["stages"][0].update(tp=8, dp=2),
            "b.json: stages[0] (actor.gen): tp 8 exceeds the 4 GPUs of a node of a100-64gb-hdr100 (tensor "
            "parallelism stays inside a node; --max-tp 8 lets it cross)",
        ),
        (
            lambda d: d["stages"][0].update(pp=2, dp=2),
            "b.json: stages[0] (actor.gen): pp 2: vLLM does not pipeline generation (--pipelined-gen plans "
            "the torch-native engine's)",
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
        ("", "--lost: expected GPU ids like 3,8-11, got ''"),  # given, naming none: not "no loss"
        (" ", "--lost: expected GPU ids like 3,8-11, got ' '"),
    ],
)
def test_transition_lost_gpus(lost: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    got = refused(["transition", "--from", "a.json", "--to", "a.json", "--lost", lost], capsys)
    assert got == f"{E_TR}{line}"


# ------------------------------------------------------------------ argparse errors
CHOICES = "(choose from 'models', 'clusters', 'algos', 'algorithms', 'traces')"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        ([], "nereus: error: the following arguments are required: command (see nereus --help)"),
        (
            ["fly"],
            "nereus: error: argument command: invalid choice: 'fly' (choose from 'plan', 'describe', "
            "'price', 'transition', 'simulate', 'run', 'node', 'list') (see nereus --help)",
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
        (  # Path("") is the current folder, which the simulation would write into
            ["simulate", "--out", ""],
            f"{E_SIM}argument --out: must be a path, got an empty value (see nereus simulate --help)",
        ),
        (
            ["run", "x.yaml", "--out", " "],
            "nereus run: error: argument --out: must be a path, got an empty value (see nereus run --help)",
        ),
    ],
)
def test_argparse_errors_are_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(argv, capsys) == line


def test_messages_stay_on_one_line() -> None:
    assert one_line("a\nb\rc\u2028d\x00") == "a\\nb\\rc\\u2028d\\x00"
    # bidirectional controls, which make a terminal show a name reordered ("Trojan Source")
    assert one_line("模型\u202eabc\u2066\u200f") == "模型\\u202eabc\\u2066\\u200f"
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
    assert got.startswith(f"{E_SIM}--policies: unknown policy 'greedy' (choices: nereus, static, always, ")
    assert got.endswith("oracle, static-best)")
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
    assert got == (
        f"{E_SIM}no plan fits the pool the trace gives from here (3 GPUs, where it settles; responses of "
        "500 tokens; generation at pp 1, as vLLM runs it)"
    )
    assert not Path("o").exists()
    write("t.json", json.dumps({"metadata": {"gap_seconds": 300}, "data": [3, 1]}))  # 3 did not fit either
    got = refused([*with_flag(SIM, "--trace", "t.json"), "--out", "o"], capsys, code=3)
    assert "(at most 3 GPUs, then 1 where it settles; responses of 500 tokens;" in got


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


@pytest.mark.parametrize(
    ("argv", "flag", "what"), [(PLAN, "--cluster", "cluster"), (SIM, "--trace", "trace")]
)
def test_an_empty_config_name_is_named(
    argv: list[str], flag: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "config .: is a folder, not a file": an empty name was the working folder."""
    line = refused(with_flag(argv, flag, ""), capsys)
    assert line.startswith(f"nereus {argv[0]}: error: {what}: empty name (choices: "), line


def test_json_commands_print_an_object_on_every_exit(capsys: pytest.CaptureFixture[str]) -> None:
    """A script reading ``--json`` output gets one object on stdout for bad input (exit 2, argparse's
    or the command's own) as on exit 3."""
    for argv, message in (
        ([*with_flag(PLAN, "--model", "nosuch"), "--json"], "unknown model 'nosuch'"),
        ([*with_flag(PLAN, "--gpus", "x"), "--json"], "argument --gpus: "),
        ([*with_flag(SIM, "--policies", "nosuch"), "--json"], "--policies"),
    ):
        code, out, err = cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1, err
        doc = json.loads(out)
        assert list(doc) == ["error"] and message in doc["error"] and doc["error"] in err, (doc, err)
    code, out, err = cli(["run", "x.yaml", "--json"], capsys)  # a command without --json: stdout stays empty
    assert code == 2 and out == "" and "unrecognized arguments: --json" in err


def test_a_plan_file_larger_than_a_config_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --exhaustive --all --json`` lists every plan (1.1 MB at 4 GPUs); ``transition`` and
    ``--anchor`` refused that file at the 1 MiB a config may take."""
    plan_file(capsys, "a.json", "--gpus", "16", "--seq-len", "2048")
    Path("big.json").write_text(Path("a.json").read_text() + " " * (2 << 20))
    code, out, err = cli(["transition", "--from", "a.json", "--to", "big.json", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["moved_bytes"] == 0


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (with_flag(PLAN, "--gpus", "４"), f"{E_PLAN}argument --gpus: must be a positive integer, got '４'"),
        (
            [*PLAN, "--headroom", "０.１"],
            f"{E_PLAN}argument --headroom: must be a number in [0, 1), got '０.１'",
        ),
        (
            ["price", "--model", "tiny-llama", "--cluster", "local-cpu", "--stage", "gen", "--tp", "1",
             "--pp", "1", "--dp", "١", "--sequences", "4", "--prompt-len", "8", "--seq-len", "8"],
            "nereus price: error: argument --dp: must be an integer, got '١'",
        ),
    ],
)  # fmt: skip
def test_integer_flags_take_ascii_digits_only(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``int`` and ``float`` read "４" (full width) and "١" (Arabic-Indic) as digits: a flag refuses
    them, in one line naming it, like any other non-number."""
    got = refused(argv, capsys)
    assert got.startswith(line), got


def test_a_negative_zero_headroom_is_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli([*PLAN, "--headroom", "-0.0"], capsys)
    assert code == 0 and "after 0% headroom" in out and "-0%" not in out
