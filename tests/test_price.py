"""``nereus price`` and ``nereus plan --fix``: pricing a layout a user names (issue 19).

Checked: the price of a shape is the planner's own estimate of it (same model, same numbers, the
weight sync left out); ``--json`` gives latency, peak memory, fit and seconds per op class that add
up; a layout that does not fit exits 3 with the same output; bad flags exit 2 naming the flag;
``--fix`` holds the named layouts (tp, pp, dp, micro-batch) and searches the rest, exits 2 on a bad
spec and 3 when the held layout cannot run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from nereus.cli import main
from nereus.plan.candidates import Shape, estimate
from nereus.plan.cost import CostModel
from nereus.plan.layout import Layout
from nereus.plan.price import PriceQuery, price
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.replica import stage_params
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.model import Head
from nereus.spec.workload import Stage

pytestmark = pytest.mark.pure

MODEL, CLUSTER = "llama-3.1-8b", "h100-ib"
BASE = ["price", "--model", MODEL, "--cluster", CLUSTER]


@pytest.mark.parametrize(
    ("stage", "name", "shape", "extra"),
    [
        (Stage.TRAIN, "actor.train", Shape(Layout(4, 1), 2, 4), {"global_batch": 128, "micro_batch": 4}),
        (Stage.INF, "ref.inf", Shape(Layout(2, 1), 4, 16), {"micro_batch": 16}),
        (Stage.GEN, "actor.gen", Shape(Layout(2, 1), 8, 64), {"concurrency": 64}),
        # --head value: a critic's (or reward model's) scalar head in place of the vocabulary's
        (Stage.TRAIN, "critic.train", Shape(Layout(4, 2), 1, 4), {"global_batch": 128, "head": Head.VALUE}),
        (Stage.INF, "critic.inf", Shape(Layout(1, 1), 8, 16), {"micro_batch": 16, "head": Head.VALUE}),
    ],
)
def test_a_price_is_the_planners_estimate_of_that_shape(
    stage: Stage, name: str, shape: Shape, extra: dict[str, Any]
) -> None:
    model, cluster, workload = load_model(MODEL), load_cluster(CLUSTER), load_workload("ppo")
    seq = SeqStats(workload.prompt_len, 2048, 3072)
    problem = PlanningProblem(workload, dict.fromkeys(Role, model), cluster, tuple(range(32)), seq)
    ms = problem.workflow.get(name)
    planner = estimate(CostModel(problem), ms, shape)
    want = sum(float(v) for k, v in planner.latency.terms.items() if k != "weight_sync")
    query = PriceQuery(
        stage, shape.layout.tp, shape.layout.pp, shape.dp, 512, workload.prompt_len, 2048, 3072, **extra
    )
    got = price(model, cluster, query)
    assert got.model_stage == name and got.shape == shape
    assert got.latency_s == pytest.approx(want, rel=1e-9)
    assert got.peak_bytes == pytest.approx(planner.active_bytes, rel=1e-9)
    assert sum(got.by_class.values()) == pytest.approx(got.latency_s)
    assert sum(got.by_term.values()) == pytest.approx(got.latency_s)


def test_price_on_the_plans_pool_is_the_plans_price(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On nodes of 6, TP-4 groups packed on their own 16 GPUs straddle nodes; on a 24-GPU pool, as
    ``plan --gpus 24`` places them, they stay inside one node each and ``price --gpus 24`` is the
    plan's own number."""
    six = tmp_path / "six.yaml"
    six.write_text(
        (Path(__file__).parents[1] / "configs" / "clusters" / "h100-ib.yaml")
        .read_text()
        .replace("nodes: 16", "nodes: 4")
        .replace("gpus_per_node: 8", "gpus_per_node: 6")
    )
    fix = "actor.train=tp4,pp2,dp2,mb4"
    argv = ["plan", "--model", MODEL, "--algo", "grpo", "--cluster", str(six), "--gpus", "24", "--seq-len",
            "2048", "--fix", fix, "--json"]  # fmt: skip
    assert main(argv) == 0
    (train,) = [s for s in json.loads(capsys.readouterr().out)["stages"] if s["name"] == "actor.train"]
    flags = [*BASE[:3], "--cluster", str(six), "--stage", "train", "--tp", "4", "--pp", "2", "--dp", "2",
             "--sequences", "512", "--prompt-len", "256", "--seq-len", "2048", "--global-batch", "128",
             "--micro-batch", "4", "--json"]  # fmt: skip
    assert main([*flags, "--gpus", "24"]) == 0
    assert json.loads(capsys.readouterr().out)["latency_s"] == pytest.approx(train["latency_s"], rel=1e-9)
    assert main(flags) == 0  # contiguous on 16 GPUs: groups across nodes, slower
    assert json.loads(capsys.readouterr().out)["latency_s"] > 2 * train["latency_s"]
    assert main([*flags, "--gpus", "8"]) == 2
    assert "--gpus: expected an integer in [16, 1048576]" in capsys.readouterr().err
    assert main([*flags, "--gpus", "25"]) == 2
    assert "--gpus 25 exceeds cluster six (24 GPUs)" in capsys.readouterr().err


def test_json_fit_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--stage", "train", "--tp", "4", "--pp", "1", "--sequences", "256", "--prompt-len", "512",
             "--seq-len", "2048", "--global-batch", "128", "--micro-batch", "16", "--json"]  # fmt: skip
    assert main([*BASE, *flags, "--dp", "2", "--recompute", "full"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert {"latency_s", "peak_mem_gib", "fits", "by_class"} <= set(fits) and fits["fits"] is True
    assert main([*BASE, *flags, "--dp", "2"]) == 3  # without recomputation the activations do not fit
    tight = json.loads(capsys.readouterr().out)
    assert tight["fits"] is False and tight["peak_mem_gib"] > tight["limit_gib"] > fits["peak_mem_gib"]
    assert tight["latency_s"] < fits["latency_s"]  # recomputation costs time
    assert main([*BASE, *flags[:-1], "--dp", "2", "--recompute", "full"]) == 0
    text = capsys.readouterr().out
    assert "actor.train of llama-3.1-8b on h100-ib: tp4·pp1·dp2 mb16" in text and ": fits" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "3"], "--tp: expected a power of two"),
        (["--dp", "0"], "--dp: expected an integer in [1, "),
        (["--tp", "16"], "--tp 16 exceeds the 8 GPUs of a node"),
        (["--pp", "64"], "--pp 64 exceeds the model's 32 layers"),
        (["--seq-len-p95", "100"], "--seq-len-p95 100 must be at least --seq-len 2048"),
        (["--global-batch", "100"], "--global-batch 100: must divide --sequences 256"),
        (["--micro-batch", "3"], "--micro-batch 3: must divide a replica's share"),
        (["--concurrency", "8"], "--concurrency prices generation"),
        (["--stage", "gen", "--global-batch", "8"], "--global-batch prices training; --stage is gen"),
        (["--stage", "inf", "--recompute", "full"], "--recompute prices training; --stage is inf"),
        (["--stage", "gen", "--pp", "2"], "--pp 2: vLLM does not pipeline generation (--pipelined-gen"),
        (["--dp", "64"], "= 256 GPUs exceeds cluster h100-ib (128)"),
        (
            ["--stage", "gen", "--head", "value"],
            "--head value prices a critic or reward model's inf or train",
        ),
        (["--stage", "fly"], "argument --stage: invalid choice"),
        (["--sequences", "x"], "argument --sequences: must be an integer, got 'x'"),
        (["--calibration", "/nonexistent.json"], "--calibration"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--stage": "train", "--tp": "4", "--pp": "1", "--dp": "2", "--sequences": "256",
            "--prompt-len": "512", "--seq-len": "2048"}  # fmt: skip
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        base[flag] = value
    with pytest.raises(SystemExit) if "argument" in message else _NoRaise():
        code = main([*BASE, *(x for kv in base.items() for x in kv)])
        assert code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_pipelined_generation_is_priced_when_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    gen = ["--stage", "gen", "--tp", "2", "--pp", "2", "--dp", "2", "--sequences", "256",
           "--prompt-len", "512", "--seq-len", "2048", "--json"]  # fmt: skip
    assert main([*BASE, *gen, "--pipelined-gen"]) in (0, 3)
    assert json.loads(capsys.readouterr().out)["latency_s"] > 0
    train = ["--stage", "train", "--tp", "4", "--pp", "1", "--dp", "2", "--sequences", "256",
             "--prompt-len", "512", "--seq-len", "2048", "--pipelined-gen"]  # fmt: skip
    assert main([*BASE, *train]) == 2
    assert "--pipelined-gen prices generation; --stage is train" in capsys.readouterr().err


def test_a_calibration_far_past_its_bounds_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cal = tmp_path / "cal.json"
    entry = {"window": 8, "samples": {"gemm": [[1e-12, 1e12]]}, "memory": {}}
    cal.write_text(json.dumps({"format": 2, "clusters": {CLUSTER: entry}}))
    train = ["--stage", "train", "--tp", "4", "--pp", "1", "--dp", "2", "--sequences", "256",
             "--prompt-len", "512", "--seq-len", "2048", "--json", "--calibration", str(cal)]  # fmt: skip
    main([*BASE, *train])
    cap = capsys.readouterr()
    assert json.loads(cap.out)["latency_s"] > 0
    assert (
        f"nereus price: warning: --calibration {cal}: gemm efficiency 1e-24 is outside [0.01, 1]" in cap.err
    )
    main([*PLAN, "--calibration", str(cal)])
    assert f"nereus plan: warning: --calibration {cal}: gemm efficiency 1e-24" in capsys.readouterr().err


class _NoRaise:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


PLAN = [
    "plan",
    "--model",
    MODEL,
    "--algo",
    "ppo",
    "--cluster",
    CLUSTER,
    "--gpus",
    "32",
    "--seq-len",
    "2048",
    "--json",
]


def test_fix_holds_the_named_layouts_and_searches_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN) == 0
    free = json.loads(capsys.readouterr().out)
    assert main([*PLAN, "--fix", "actor.train=tp4,pp1,dp2,mb2", "--fix", "actor.gen=tp2,pp1,dp8"]) == 0
    held = json.loads(capsys.readouterr().out)
    stages = {s["name"]: s for s in held["stages"]}
    train, gen = stages["actor.train"], stages["actor.gen"]
    assert (train["tp"], train["pp"], train["dp"], train["micro_batch"]) == (4, 1, 2, 2)
    assert (gen["tp"], gen["pp"], gen["dp"]) == (2, 1, 8)
    assert held["step_latency_s"] >= free["step_latency_s"]  # the free search is at least as good


@pytest.mark.parametrize(
    ("fix", "code", "message"),
    [
        ("actor.trian=tp4,pp1,dp2", 2, "ppo has no model-stage 'actor.trian' (allowed: actor.gen"),
        ("actor.train=tp3,pp1,dp2", 2, "--fix actor.train: tp must be a power of two"),
        ("actor.train=4,1,2", 2, "--fix: expected MODEL_STAGE=tpT,ppP,dpD[,mbB]"),
        (f"actor.train=tp1,pp1,dp{'1' * 5000}", 2, "--fix: expected MODEL_STAGE=tpT,ppP,dpD[,mbB]"),
        ("actor.train=tp8,pp1,dp8", 2, "--fix actor.train: tp8·pp1·dp8 needs 64 GPUs, more than the 32"),
        (
            "actor.train=tp4,pp1,dp3",
            2,
            "--fix actor.train: dp 3 must divide the global batch 128 (allowed dp: 1, 2,",
        ),
        (
            "actor.train=tp4,pp1,dp4,mb3",
            2,
            "--fix actor.train: mb 3 must divide a replica's share of the global",
        ),
        ("foo=tp2,pp1,dp8", 2, "ppo has no model-stage 'foo' (allowed: actor.gen"),
        ("actor.gen=tp16,pp1,dp1", 2, "--fix actor.gen: tp 16 exceeds the 8 GPUs of a node of"),  # as price
        # the engines run at most the workload's concurrency (it was priced at a replica's share)
        (
            "actor.gen=tp4,pp1,dp4,mb1000",
            2,
            "--fix actor.gen: mb 1000 exceeds ppo's max_num_seqs 256 (allowed: 1 to",
        ),
        (
            "ref.inf=tp1,pp1,dp4,mb17",
            2,
            "--fix ref.inf: mb 17 exceeds ppo's inference_micro_batch 16 (allowed: 1",
        ),
        # verl's FSDP layout on our ZeRO-0 trainer: says where an FSDP trainer is priced
        (
            "actor.train=tp1,pp1,dp8",
            3,
            "Nereus's trainers shard nothing over DP (ZeRO-0): `nereus price "
            "--fsdp` prices an FSDP trainer (verl's) in this layout",
        ),
    ],
)
def test_bad_or_impossible_fixes(
    fix: str, code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*PLAN, "--fix", fix]) == code
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_model_stage_fixed_twice_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PLAN, "--fix", "actor.train=tp4,pp1,dp2", "--fix", "actor.train=tp2,pp1,dp4"]) == 2
    assert (
        "--fix: model-stage actor.train is named twice (one --fix per model-stage)" in capsys.readouterr().err
    )


def _hf(folder: Path, heads: int, kv: int) -> str:
    """A Llama config.json with ``heads`` attention heads and ``kv`` KV heads (head_dim 128)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 128 * heads, "intermediate_size": 512 * heads,
        "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 60,
        "vocab_size": 64000, "max_position_embeddings": 8192,
    }))  # fmt: skip
    return str(folder)


@pytest.mark.parametrize(
    ("heads", "kv", "tp", "message"),
    [
        (48, 6, 4, "--tp 4 and the 6 KV heads must divide one another (m: 48 attention heads, 6 KV heads; "
                   "allowed tp: 1, 2)"),
        (6, 3, 2, "--tp 2 and the 3 KV heads must divide one another (m: 6 attention heads, 3 KV heads; "
                  "allowed tp: 1)"),
        (12, 12, 8, "--tp 8 must divide the 12 attention heads (m: 12 attention heads, 12 KV heads; "
                    "allowed tp: 1, 2, 4)"),
        (28, 4, 8, "--tp 8 must divide the 28 attention heads (m: 28 attention heads, 4 KV heads; "
                   "allowed tp: 1, 2, 4)"),
    ],
)  # fmt: skip
def test_a_tp_the_heads_cannot_split_is_refused(
    heads: int, kv: int, tp: int, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runtime's rule (nereus.state.geometry.check_layout): tp divides the attention heads, and
    tp and the KV heads divide one another. A tp that breaks it is not priced (3 // 2 KV heads)."""
    model = _hf(tmp_path / "m", heads, kv)
    flags = ["--stage", "gen", "--pp", "1", "--dp", "1", "--sequences", "8", "--prompt-len", "8",
             "--seq-len", "8"]  # fmt: skip
    assert main(["price", "--model", model, "--cluster", CLUSTER, *flags, "--tp", str(tp)]) == 2
    err = capsys.readouterr().err
    assert err == f"nereus price: error: {message}\n", err
    assert main(["price", "--model", model, "--cluster", CLUSTER, *flags, "--tp", "1"]) in (0, 3)


def test_a_fix_the_heads_cannot_split_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _hf(tmp_path / "m", 48, 6)
    plan = ["plan", "--model", model, "--algo", "ppo", "--cluster", CLUSTER, "--gpus", "64", "--seq-len",
            "2048"]  # fmt: skip
    for fix, message in (
        ("actor.gen=tp4,pp1,dp1", "--fix actor.gen: tp 4 and the 6 KV heads must divide one another (m: 48 "
                                  "attention heads, 6 KV heads; allowed tp: 1, 2)"),
        ("actor.train=tp64,pp1,dp1", "--fix actor.train: tp 64 must divide the 48 attention heads (m: 48 "
                                     "attention heads, 6 KV heads; allowed tp: 1, 2)"),
        ("actor.train=tp2,pp64,dp1", "--fix actor.train: pp 64 exceeds m's 60 layers"),
    ):  # fmt: skip
        assert main([*plan, "--fix", fix]) == 2
        assert capsys.readouterr().err == f"nereus plan: error: {message}\n"


def test_engine_flags_price_overlap_and_paged_kv(capsys: pytest.CaptureFixture[str]) -> None:
    train = ["--stage", "train", "--tp", "4", "--pp", "1", "--dp", "8", "--sequences", "256",
             "--prompt-len", "512", "--seq-len", "2048", "--global-batch", "128", "--micro-batch", "4",
             "--recompute", "full", "--json"]  # fmt: skip
    assert main([*BASE, *train]) == 0
    serial = json.loads(capsys.readouterr().out)
    assert main([*BASE, *train, "--overlap-dp-sync"]) == 0
    overlapped = json.loads(capsys.readouterr().out)
    assert overlapped["by_term"]["dp_sync"] < serial["by_term"]["dp_sync"]
    assert main([*BASE, *train, "--paged-kv"]) == 2  # a generation engine's property
    assert "--paged-kv prices generation" in capsys.readouterr().err


def test_fsdp_prices_gathers_and_reduce_scatters_behind_compute(capsys: pytest.CaptureFixture[str]) -> None:
    train = ["--stage", "train", "--tp", "1", "--pp", "1", "--dp", "64", "--sequences", "64",
             "--prompt-len", "1", "--seq-len", "8191", "--global-batch", "64", "--micro-batch", "1",
             "--recompute", "selective", "--json"]  # fmt: skip
    a100 = ["price", "--model", MODEL, "--cluster", "a100-80gb-dgx"]
    assert main([*a100, *train]) == 3  # 8B unsharded (our engine, ZeRO-0) does not fit
    serial = json.loads(capsys.readouterr().out)
    assert main([*a100, *train, "--fsdp"]) == 0  # torchtitan's layout: state sharded over 64 GPUs
    fsdp = json.loads(capsys.readouterr().out)
    assert fsdp["fits"] and fsdp["peak_mem_gib"] < serial["peak_mem_gib"] - 100
    assert fsdp["fsdp"] and not serial["fsdp"]  # the answer says which trainer it priced
    half = list(train)
    half[half.index("--dp") + 1] = "32"
    assert main([*a100, *half, "--fsdp"]) == 0
    # the sharded state (fp32 master, Adam's moments, fp32 gradients: 16 B a parameter) over dp,
    # nothing else: 32 → 64 GPUs frees 16·P/64 bytes
    params = stage_params(load_model(MODEL), Layout(1, 1))[0]
    assert json.loads(capsys.readouterr().out)["peak_mem_gib"] - fsdp["peak_mem_gib"] == pytest.approx(
        16 * params / 64 / 2**30, rel=1e-9
    )
    assert 0 < fsdp["by_term"]["dp_sync"] < serial["by_term"]["dp_sync"]
    assert (
        fsdp["by_class"]["allgather.inter"] > 0 and fsdp["by_term"]["compute"] == serial["by_term"]["compute"]
    )
    assert main([*BASE, "--stage", "gen", "--tp", "1", "--pp", "1", "--dp", "1", "--sequences", "8",
                 "--prompt-len", "8", "--seq-len", "8", "--fsdp"]) == 2  # fmt: skip
    assert "--fsdp prices training" in capsys.readouterr().err


def test_kv_memory_fraction_sizes_the_engines_kv_from_free_memory(capsys: pytest.CaptureFixture[str]) -> None:
    model, cluster = load_model("llama-3.3-70b"), load_cluster("a100-80gb-dgx")
    q = PriceQuery(Stage.GEN, 2, 1, 1, 3000, 128, 2048, concurrency=24)
    own = price(model, cluster, q)
    assert not own.fits  # the planner's 10% headroom leaves ~4 GiB of KV at TP2
    trt = price(model, cluster, PriceQuery(Stage.GEN, 2, 1, 1, 3000, 128, 2048, concurrency=24,
                                           kv_memory_fraction=0.9))  # fmt: skip
    assert trt.fits and trt.peak_bytes == own.peak_bytes and trt.latency_s == own.latency_s
    problem = PlanningProblem(
        q.workload(), dict.fromkeys(Role, model), cluster, (0, 1), SeqStats(128, 2048, 2048), space=q.space()
    )
    est = estimate(CostModel(problem), problem.workflow.get("actor.gen"), q.shape())
    rest = own.peak_bytes - float(est.memory.kv_cache)
    reserve = cluster.runtime_reserved_gib * (1 << 30)
    assert trt.limit_bytes == pytest.approx(rest + 0.9 * (cluster.gpu_memory_bytes - reserve - rest))
    gen = ["--stage", "gen", "--tp", "1", "--pp", "1", "--dp", "1", "--sequences", "8", "--prompt-len", "8",
           "--seq-len", "8"]  # fmt: skip
    for bad in ("1.5", "0"):  # 0 given is not "unset": the KV would get no memory
        assert main([*BASE, *gen, "--kv-memory-fraction", bad]) == 2
        assert "--kv-memory-fraction: expected a number in (0, 1]" in capsys.readouterr().err
    assert main([*BASE, *gen, "--concurrency", "100000"]) == 2  # more than a replica decodes
    assert "--concurrency 100000: more than a replica's" in capsys.readouterr().err
    train = ["--stage", "train", "--tp", "1", "--pp", "1", "--dp", "1", "--sequences", "8",
             "--prompt-len", "8", "--seq-len", "8", "--kv-memory-fraction", "0.9"]  # fmt: skip
    assert main([*BASE, *train]) == 2
    assert "--kv-memory-fraction prices generation" in capsys.readouterr().err


def test_a_refusal_says_that_urgent_has_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """70B PPO on 64 H100s fits only with recomputation or micro-batch 1: the refusal said no
    combination fits, and named --pipelined-gen but not --urgent, which has a plan (at the step
    latency it quotes)."""
    plan = ["plan", "--model", "llama-3.3-70b", "--algo", "ppo", "--cluster", "h100-ib", "--seq-len", "2048",
            "--gpus", "64"]  # fmt: skip
    assert main(plan) == 3
    err = capsys.readouterr().err
    hint = re.search(r"with --urgent, which also tries .* it has a plan \((\d+\.\d) s per step\)", err)
    assert hint is not None, err
    assert main([*plan, "--urgent", "--json"]) == 0
    assert f"{json.loads(capsys.readouterr().out)['step_latency_s']:.1f}" == hint[1]
    assert main([*plan[:-1], "8"]) == 3 and "--urgent" not in capsys.readouterr().err  # nothing fits


def test_generation_is_planned_at_pp_1_as_vllm_runs_it(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM (the default generation engine) does not pipeline: ``nereus plan`` keeps generation at
    pp 1 as ``nereus run`` does, unless ``--pipelined-gen`` (the torch-native engine) says
    otherwise; a held generation layout with pp > 1 needs the flag."""
    plan = ["plan", "--model", "llama-3.3-70b", "--algo", "ppo", "--cluster", "h100-ib", "--seq-len", "1024",
            "--json"]  # fmt: skip
    assert main([*plan, "--gpus", "64", "--pipelined-gen"]) == 0
    free = {s["name"]: s for s in json.loads(capsys.readouterr().out)["stages"]}
    assert free["actor.gen"]["pp"] > 1  # what the torch-native engine would run here
    assert main([*plan, "--gpus", "64"]) == 3  # vLLM's tp8·pp1 does not fit beside the trainers
    assert (
        "--pipelined-gen, the torch-native engine's pipelined generation, has a plan"
        in capsys.readouterr().err
    )
    assert main([*plan, "--gpus", "8"]) == 3  # nothing fits either way: no hint
    assert "--pipelined-gen" not in capsys.readouterr().err
    assert main([*plan, "--gpus", "128"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {s["name"]: s["pp"] for s in doc["stages"]}["actor.gen"] == 1
    assert doc["problem"]["pipelined_gen"] is False
    assert main([*plan, "--gpus", "128", "--fix", "actor.gen=tp8,pp2,dp2"]) == 2
    assert "--fix actor.gen: pp 2: vLLM does not pipeline generation" in capsys.readouterr().err
