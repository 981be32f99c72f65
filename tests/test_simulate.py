"""The trace-driven simulator: inputs, determinism, and the properties the controller promises."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from nereus.cli import main
from nereus.errors import ConfigError
from nereus.plan.problem import PlanningProblem
from nereus.sim import Episode, GpuSupply, Scenario, SeqCurve, SpotTrace, simulate
from nereus.sim.records import StepRecord, Summary
from nereus.spec import Role, load_cluster, load_model, load_workload, names
from nereus.spec.registry import config_root, load_role_models, trace_path
from nereus.spec.workload import ExecutionMode

pytestmark = pytest.mark.pure

SHIPPED = [trace_path(name) for name in names("traces")]


def write_trace(tmp_path: Path, data: object, gap: object = 300) -> Path:
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": data}))
    return p


@pytest.mark.parametrize(
    ("doc", "pattern"),
    [
        ("{not json", "line 1: not valid JSON"),
        (json.dumps({"metadata": {"gap_seconds": 300}}), "field 'data'"),
        (json.dumps({"metadata": {"gap_seconds": 0}, "data": [1]}), "field 'metadata.gap_seconds'"),
        (json.dumps({"metadata": {"gap_seconds": 300}, "data": [1, -2]}), r"field 'data\[1\]'"),
        (json.dumps([1, 2]), "expected a JSON object"),
    ],
)
def test_bad_traces_name_the_field(tmp_path: Path, doc: str, pattern: str) -> None:
    p = tmp_path / "bad.json"
    p.write_text(doc)
    with pytest.raises(ConfigError, match=pattern):
        SpotTrace.load(p)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("step,mean_len\n0,100\n", "missing column 'p95_len'"),
        ("step,step,mean_len,p95_len\n0,1,8,12\n", "line 1: column 'step' is named twice"),
        ("step,mean_len,p95_len\n0,100,120\n0,110,130\n", "line 3: field 'step': steps must increase"),
        ("step,mean_len,p95_len\n0,100,90\n", "line 2: field 'p95_len'"),
        ("step,mean_len,p95_len\n0,abc,90\n", "line 2: field 'mean_len'"),
    ],
)
def test_bad_curves_name_line_and_field(tmp_path: Path, text: str, pattern: str) -> None:
    p = tmp_path / "curve.csv"
    p.write_text(text)
    with pytest.raises(ConfigError, match=pattern):
        SeqCurve.load_csv(p)


def test_curve_interpolates_and_growth_matches_the_paper() -> None:
    c = SeqCurve((0, 10), (100.0, 200.0), (120.0, 240.0))
    assert c.at(5) == (150.0, 180.0) and c.at(99) == (200.0, 240.0)
    g = SeqCurve.growth()
    assert g.at(0)[0] == pytest.approx(500) and g.at(1000)[0] == pytest.approx(8000)


def test_supply_reserved_floor_and_seeded_revocations(tmp_path: Path) -> None:
    trace = SpotTrace.load(write_trace(tmp_path, [16, 16, 10, 10, 0, 16]))
    a = GpuSupply(trace, 2, 32, 8, seed=1)
    b = GpuSupply(trace, 2, 32, 8, seed=1)
    pools = [a.pool_at(t * 300.0) for t in range(6)]
    assert [len(p) for p in pools] == [32, 32, 20, 20, 8, 32]
    assert pools == [b.pool_at(t * 300.0) for t in range(6)]  # same seed, same revocations
    assert set(range(8)) <= set(pools[4])  # the reserved allocation never goes
    assert set(pools[2]) < set(pools[1])  # revocations remove instances, nothing new appears
    assert a.next_change_after(0.0) == 600.0 and a.next_change_after(1500.0) is None
    other = GpuSupply(trace, 2, 32, 8, seed=2)
    assert [len(other.pool_at(t * 300.0)) for t in range(6)] == [32, 32, 20, 20, 8, 32]


def _scenario(trace: Path, steps: int = 24, seed: int = 0, **kw: object) -> Scenario:
    model = load_model("llama-3.1-8b")
    return Scenario(
        load_workload("ppo"),
        {r: model for r in Role},
        load_cluster("a100-64gb-hdr100"),
        GpuSupply(SpotTrace.load(trace), 2, 32, 8, speedup=5.0, seed=seed),
        SeqCurve.growth(1147, 3722, 20),
        steps,
        seed,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("trace", SHIPPED, ids=lambda p: p.stem)
def test_nereus_never_runs_out_of_memory_on_the_shipped_traces(trace: Path) -> None:
    s = simulate(_scenario(trace), "nereus")
    assert s.oom_steps == 0
    assert len([r for r in s.records if not r.lost]) == 24


@pytest.mark.parametrize("policy", ["static", "nereus", "always", "periodic:3"])
def test_every_policys_dp_follows_the_pool(policy: str, tmp_path: Path) -> None:
    """The pool grows 8 → 32 GPUs while responses grow, so no plan fits without recomputation: no
    policy may answer a replan with "no option" (static kept dp 1-2 on 32 GPUs that way), and at the
    end each trainer spans its share of the 32 GPUs (actor and critic train side by side: 16 each;
    static and periodic hold TP/PP, so DP follows)."""
    trace = write_trace(tmp_path, [4, 4, 7, 9, 16, 16, 16, 16, 16, 16, 16, 16])  # 2 GPUs per instance
    supply = GpuSupply(SpotTrace.load(trace), 2, 32, 8, speedup=5.0, seed=11)
    model, cluster = load_model("llama-3.1-8b"), load_cluster("a100-64gb-hdr100")
    curve = SeqCurve.growth(1147.5, 3722, 25)
    scenario = Scenario(load_workload("ppo"), {r: model for r in Role}, cluster, supply, curve, 24, 11)
    s = simulate(scenario, policy)
    decisions = [r.decision for r in s.records if r.decision]
    assert decisions and all(d["reason"] != "no option" for d in decisions), [d["reason"] for d in decisions]
    last = s.records[-1]
    assert last.gpus == 32

    def spans(layout: str) -> int:
        tp, pp, dp = (int(part[2:]) for part in layout.split(" ", maxsplit=1)[0].split("·"))
        return tp * pp * dp

    assert spans(last.plan["actor.train"]) >= 16 and spans(last.plan["critic.train"]) >= 16, last.plan


def test_reference_policies_oracle_and_static_best() -> None:
    """The oracle replans every step with its moves and restarts free; static-best is the fastest
    of static runs started on the static policy's layouts or any the oracle used."""
    scenario = _scenario(SHIPPED[0], steps=12, seed=5)
    oracle = simulate(scenario, "oracle")
    moves = [t for r in oracle.records for t in r.transitions]
    assert moves and all(t.seconds == 0.0 for t in moves) and all(r.restart_s == 0.0 for r in oracle.records)
    assert oracle.replans >= 11  # a replan at every boundary
    static, best = simulate(scenario, "static"), simulate(scenario, "static-best")
    assert best.policy == "static-best" and best.total_s <= static.total_s
    assert all(not r.tp_pp_change for r in best.records)  # it holds its layouts, as static does


def test_gamma_zero_admits_only_urgent_transitions() -> None:
    """γ = 0: payback L_tran/ΔL ≤ 0 only for urgent moves and free ones (a shrink onto GPUs the
    plan already holds, priced at 0 s)."""
    s = simulate(_scenario(SHIPPED[0]), "nereus", gamma=0.0)
    admitted = [r.decision for r in s.records if r.decision and r.decision["verdict"] == "admit"]
    assert all(d["urgent"] or d["l_tran_s"] == 0.0 for d in admitted)
    assert any(d["urgent"] for d in admitted)
    kept = [r.decision for r in s.records if r.decision and r.decision["verdict"] == "keep"]
    assert kept and all(not d["urgent"] for d in kept)


def test_same_seed_same_output_and_episodes_slow_the_network() -> None:
    a = simulate(_scenario(SHIPPED[1], steps=12, seed=3), "always")
    b = simulate(_scenario(SHIPPED[1], steps=12, seed=3), "always")
    assert [r.to_json() for r in a.records] == [r.to_json() for r in b.records]
    slow = simulate(_scenario(SHIPPED[1], steps=12, seed=3, episodes=(Episode(0, 12, "all", 0.5),)), "always")
    assert slow.total_s > a.total_s
    with pytest.raises(ConfigError, match="episode scope must be one of inter, intra, compute, all"):
        Episode.parse("3-9:wifi:0.5")
    with pytest.raises(ConfigError, match="START-END:SCOPE:FACTOR"):
        Episode.parse("3-9:inter")
    # overlapping episodes compound, to 0.1% of the speed at most (1e-200 twice once divided by 0)
    from nereus.sim.truth.hardware import Hardware

    hw = Hardware(0, noise=0.0, episodes=(Episode(0, 5, "all", 1e-3), Episode(0, 5, "all", 1e-3)))
    assert hw.slowdown("gemm", 2) == 1e-3 and hw.run({"gemm": 1.0}, 2) == {"gemm": 1000.0}


def test_simulate_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    args = [
        "simulate", "--trace", str(SHIPPED[0]), "--model", "llama-3.1-8b", "--algo", "ppo",
        "--cluster", "a100-64gb-hdr100", "--gpus-per-instance", "2", "--max-gpus", "32",
        "--min-gpus", "8", "--steps", "10", "--seq-curve", "growth:1147:3722:20", "--speedup", "5",
        "--policies", "nereus,static,always,periodic:3", "--gamma", "0,0.5", "--out", str(out), "--json",
    ]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"nereus(γ=0)", "nereus(γ=0.5)", "static", "always", "periodic:3"}
    for summary in doc.values():
        assert {"mean_step_s", "total_s", "transitions", "tp_pp_transitions", "oom_steps"} <= set(summary)
    assert (out / "timeline.png").stat().st_size > 0 and (out / "summary.json").exists()
    rows = [json.loads(line) for line in (out / "steps-static.jsonl").read_text().splitlines()]
    assert len(rows) >= 10 and {"step", "plan", "step_s", "transition_s", "decision"} <= set(rows[0])


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        (["--policies", "nereus,greedy"], "unknown policy 'greedy'"),
        (["--gamma", "1.5"], r"--gamma '1.5': expected numbers in \[0, 1\]"),
        (["--max-gpus", "999"], r"--max-gpus must be in \[1, 256\]"),
        (["--seq-curve", "growth:a:b"], "expected growth:START:END:STEPS"),
    ],
)
def test_simulate_bad_flags_exit_2(
    extra: list[str], pattern: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["simulate", "--trace", str(SHIPPED[0]), "--model", "tiny-llama", "--algo", "ppo", "--cluster",
            "a100-64gb-hdr100", "--steps", "2"]  # fmt: skip
    assert main([*base, *extra]) == 2
    import re

    assert re.search(pattern, capsys.readouterr().err)


def test_breakdown_adds_up_and_the_model_is_compared_with_the_truth() -> None:
    """Where the wall time went (useful, lost, moves, restarts, stalled) adds up to the mean step;
    every completed step records the model's prediction and the truth's quiet step of its plan,
    and each admitted move the truth of the plan it left (its realized gain)."""
    s = simulate(_scenario(SHIPPED[0], steps=12, seed=5), "nereus")
    assert sum(s.breakdown().values()) == pytest.approx(s.mean_step_s)
    done = [r for r in s.records if not r.lost]
    assert all(r.predicted_s and r.quiet_s for r in done)
    assert all(set(r.stage_quiet_s or {}) == set(r.plan) for r in done)
    err = s.model_error()
    assert err["step_ratio"] is not None and 0.2 < err["step_ratio"] < 5.0
    assert set(err["stage_ratio"]) == set(s.records[0].plan)
    moved = [r for r in s.records if any(t.kind.value == "move" for t in r.transitions)]
    assert err["moves"] + err["urgent_moves"] == len(moved) and all(r.moved_from_s for r in moved)
    urgent = [r for r in moved if r.decision and r.decision.get("urgent")]
    assert err["urgent_moves"] == len(urgent)  # gains are read over the opportunistic moves only


def _record(k: int, step_s: float, decision: dict[str, object] | None, **kw: Any) -> StepRecord:
    plan = {"actor.gen": "tp1·pp1·dp8"}
    return StepRecord(k, 0.0, 8, 100.0, 120.0, plan, step_s, decision=decision, **kw)


def test_a_moves_predicted_gain_is_its_latencys_and_the_risk_is_checked_try_by_try() -> None:
    """ΔL holds the change in risk, which no quiet step shows: the predicted gain compared with
    the realized one is the latency's. A plan's risk R = L·p/(1 − p) counts the reruns a lost
    step needs, and each rerun is priced again: each try is checked against p = R/(L + R)."""
    move = {"urgent": False, "verdict": "admit", "current_latency_s": 300.0, "target_latency_s": 200.0,
            "delta_s": 60.0, "l_tran_s": 20.0, "current_risk_s": 0.0, "target_risk_s": 40.0}  # fmt: skip
    keep = {"urgent": False, "verdict": "keep", "current_latency_s": 170.0, "current_risk_s": 30.0,
            "target_risk_s": 90.0}  # fmt: skip
    records = (
        _record(0, 300.0, None),
        _record(1, 200.0, move, moved_from_s=290.0, quiet_s=195.0, transition_s=25.0),
        _record(2, 200.0, keep, preempted=True),  # lost: run again
        _record(2, 210.0, keep),
    )
    s = Summary("nereus", 300.0, 935.0, 1, 0, 0, 1, 0, 0.0, 3, records)
    err = s.model_error()
    assert err["moves"] == 1 and err["urgent_moves"] == 0
    assert err["move_gain_predicted_s"] == pytest.approx(100.0)  # 300 − 200, not ΔL's 60
    assert err["move_gain_realized_s"] == pytest.approx(95.0)
    assert err["move_risk_gain_predicted_s"] == pytest.approx(-40.0)
    assert err["move_cost_predicted_s"] == pytest.approx(20.0)
    assert err["priced_tries"] == 3 and err["lost_tries"] == 1
    # p: 40/240 on the target moved to, then 30/200 twice on the plan kept
    assert err["lost_tries_predicted"] == pytest.approx(40 / 240 + 2 * 30 / 200)
    assert err["lost_s_predicted"] == pytest.approx((200 * 40 / 240 + 2 * 170 * 30 / 200) / 3)
    assert err["lost_s_realized"] == pytest.approx(200.0 / 3)


@pytest.mark.parametrize("policy", ["static", "nereus"])
def test_a_pool_that_empties_mid_run_stalls_the_job_until_gpus_return(policy: str, tmp_path: Path) -> None:
    """Spot traces hold zeros (the shipped us-east-2b at ticks 89-91): with no reserved floor the
    boundary that finds no GPU waits for the pool to come back, and the run goes on."""
    trace = SpotTrace.load(write_trace(tmp_path, [16, 16, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16]))
    model = load_model("llama-3.1-8b")
    supply = GpuSupply(trace, 2, 32, 0, speedup=5.0, seed=3)
    scenario = Scenario(load_workload("ppo"), {r: model for r in Role}, load_cluster("a100-64gb-hdr100"),
                        supply, SeqCurve.growth(1147, 3722, 20), 6, 3)  # fmt: skip
    s = simulate(scenario, policy)
    assert len([r for r in s.records if not r.lost]) == 6
    assert sum(r.stalled_s for r in s.records) > 0


@pytest.mark.parametrize("policy", ["static", "nereus"])
def test_gpus_revoked_and_back_within_a_step_lose_the_step_and_their_state(
    policy: str, tmp_path: Path
) -> None:
    """The pool falls to its reserved floor for one tick inside a step and is whole again at its
    end: the step is lost all the same, and the trainers whose every replica sat on the revoked
    GPUs restart from the checkpoint (their replacements start empty)."""
    trace = SpotTrace.load(write_trace(tmp_path, [16] * 5 + [4] + [16] * 100))
    supply = GpuSupply(trace, 2, 32, 8, speedup=30.0, seed=0)
    gap = 300.0 / 30.0
    assert supply.pool_at(4 * gap) == supply.pool_at(6 * gap) == tuple(range(32))
    assert supply.held_through(4 * gap, 6 * gap) == frozenset(range(8))  # the floor only
    assert supply.held_through(4 * gap, 4.5 * gap) == frozenset(range(32))
    model = load_model("llama-3.1-8b")
    scenario = Scenario(load_workload("ppo"), {r: model for r in Role}, load_cluster("a100-64gb-hdr100"),
                        supply, SeqCurve.growth(1147, 3722, 20), 6, 0)  # fmt: skip
    s = simulate(scenario, policy)
    lost = [r for r in s.records if r.preempted]
    assert lost and all(r.start_s < 6 * gap for r in lost)
    assert s.restarts >= 1 and all(r.gpus == 32 for r in s.records)


GEMMA_LIKE = """family: llama
hidden_size: 3584
num_hidden_layers: 42
num_attention_heads: 16
num_key_value_heads: 8
head_dim: 256
intermediate_size: 14336
vocab_size: 256000
tie_word_embeddings: true
rms_norm_eps: 1.0e-6
rope_theta: 10000.0
max_position_embeddings: 8192
"""


def test_a_restart_runs_on_what_the_gpus_hold_before_it_waits_for_more(tmp_path: Path) -> None:
    """A 9B model with a 256k vocabulary on 64-GB A100s: the peaks the job measured put every plan
    on the 12–14 GPUs left after a revocation over the planner's budget (its 10% headroom on top),
    though the reserved floor ran one all along. The restart takes the calibrated model without
    the headroom (what running out of memory is) instead of waiting minutes for GPUs."""
    path = tmp_path / "gemma-like.yaml"
    path.write_text(GEMMA_LIKE)
    model = load_model(str(path))
    supply = GpuSupply(
        SpotTrace.load(trace_path("aws-08-27-2023_us-east-2b_v100_1")), 2, 32, 8, speedup=5.0, seed=0
    )
    scenario = Scenario(load_workload("ppo"), {r: model for r in Role}, load_cluster("a100-64gb-hdr100"),
                        supply, SeqCurve.growth(), 12, 0)  # fmt: skip
    s = simulate(scenario, "nereus")
    restarts = [r for r in s.records if r.restart_s > 0]
    assert restarts and any(r.gpus < 32 for r in restarts)
    assert s.oom_steps == 0 and sum(r.stalled_s for r in s.records) == 0.0


def test_a_tick_start_computed_in_floating_point_is_in_its_tick(tmp_path: Path) -> None:
    """At speed-up 7, 3·(300/7)·7/300 is 2.999…: the time the pool next changes must read as tick
    3, or a run waiting for it spins forever."""
    trace = SpotTrace.load(write_trace(tmp_path, list(range(1, 200))))
    for speedup in (7.0, 1000.0, 3.0, 0.3):
        supply = GpuSupply(trace, 1, 400, 0, speedup=speedup)
        gap = 300.0 / speedup
        assert [supply.tick(k * gap) for k in range(199)] == list(range(199))
        assert supply.next_change_after(5 * gap) == pytest.approx(6 * gap)


def test_a_trace_too_fast_to_price_or_empty_to_its_end_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["simulate", "--model", "llama-3.1-8b", "--algo", "ppo", "--cluster", "h200-ib", "--steps", "3"]
    fast = write_trace(tmp_path, [8, 0, 8, 0, 8, 0, 8, 0], gap=0.001)
    assert main([*base, "--trace", str(fast), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trace trace: revocations come 3.6e+06 times per simulated hour" in err
    assert "gap_seconds 0.001 at speed-up 1 is too fast" in err and not (tmp_path / "a").exists()
    (tmp_path / "ends").mkdir()
    empty = write_trace(tmp_path / "ends", [8, 8, 0, 0], gap=10)
    assert (
        main([*base, "--trace", str(empty), "--out", str(tmp_path / "b")]) == 3
    )  # cannot run, as infeasible
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the trace holds no GPU from tick 2 to its end (4 ticks)" in err
    assert not (tmp_path / "b").exists()
    assert main([*base, "--trace", str(empty), "--out", str(tmp_path / "b"), "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out) == {"error": err.removeprefix("nereus simulate: error: ").rstrip("\n")}


def test_simulate_reads_the_workloads_models_as_plan_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A workload YAML's ``models:`` gives each role its model in ``simulate`` as in ``plan``."""
    workload = tmp_path / "ppo-small.yaml"
    text = (config_root() / "workloads" / "ppo.yaml").read_text()
    workload.write_text(text + "models: {critic: llama-3.3-70b, reward: llama-3.3-70b}\n")
    trace = write_trace(tmp_path, [64, 64, 64, 64])  # 64 GPUs: room for 70B models
    steps = {}
    for algo in ("ppo", str(workload)):
        out = tmp_path / Path(algo).stem
        argv = ["simulate", "--trace", str(trace), "--model", "llama-3.1-8b", "--algo", algo, "--cluster"]
        assert main([*argv, "h200-ib", "--steps", "2", "--policies", "static", "--out", str(out)]) == 0
        steps[algo] = json.loads((out / "summary.json").read_text())
    small, large = (s["static"]["mean_step_s"] for s in steps.values())
    assert large > 1.1 * small  # a 70B critic and reward model price above 8B ones
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "models: {critic: nosuch}\n")
    other = tmp_path / "other.yaml"  # a reference model of another vocabulary reads other tokens
    other.write_text(text + "models: {ref: qwen3-14b}\n")
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3.1-8b", "--algo", str(other), "--cluster"]
    assert main([*argv, "h200-ib", "--steps", "2", "--out", str(tmp_path / "y")]) == 2
    assert (
        "other: key 'models.ref': qwen3-14b's vocabulary (151936) is not the actor" in capsys.readouterr().err
    )
    argv = ["simulate", "--trace", str(trace), "--model", "llama-3.1-8b", "--algo", str(bad), "--cluster"]
    assert main([*argv, "h200-ib", "--steps", "2", "--out", str(tmp_path / "x")]) == 2
    assert "bad: key 'models.critic': unknown model 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("pipelined", [False, True])
def test_every_plan_of_every_policy_keeps_generation_unpipelined_unless_asked(
    pipelined: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM, the default generation engine, does not pipeline: every problem any policy plans (first
    plan, replans, restarts, the oracle's probe, static-best's tries) keeps actor.gen at pp 1, as
    ``nereus run`` and ``nereus plan`` do; ``pipelined_gen`` (the torch-native engine) lifts it."""
    spaces: list[tuple[str, ...]] = []
    post = PlanningProblem.__post_init__

    def record(self: PlanningProblem) -> None:
        post(self)
        spaces.append(self.space.flat)

    monkeypatch.setattr(PlanningProblem, "__post_init__", record)
    trace = write_trace(tmp_path, [4, 4, 7, 9, 16, 16, 8, 16, 16, 16])
    model = load_model("llama-3.1-8b")
    for mode in ("sync", "async"):
        workload = replace(load_workload("grpo"), mode=ExecutionMode(mode))
        supply = GpuSupply(SpotTrace.load(trace), 2, 32, 8, speedup=5.0, seed=11)
        curve = SeqCurve.growth(1147.5, 3722, 25)
        scenario = Scenario(workload, {r: model for r in Role}, load_cluster("a100-64gb-hdr100"), supply,
                            curve, 10, 11, pipelined_gen=pipelined)  # fmt: skip
        assert scenario.space.flat == (() if pipelined else ("actor.gen",))
        for policy in ("nereus", "static-best"):
            simulate(scenario, policy)
    assert len(spaces) > 20
    assert set(spaces) == {() if pipelined else ("actor.gen",)}


def test_an_actor_override_of_another_vocabulary_names_models_actor() -> None:
    """The workload's own actor against the job's model, which the other roles run: the clash is
    the ``models.actor`` entry's, not the first role that runs the job's model."""
    workload = replace(load_workload("ppo"), models={"actor": "qwen3-14b"})
    with pytest.raises(ConfigError) as info:
        load_role_models(workload, load_model("llama-3.1-8b"))
    message = str(info.value)
    assert "key 'models.actor': qwen3-14b's vocabulary (151936)" in message
    assert "job's model llama-3.1-8b (128256), which critic, reward run" in message  # ref: the actor's


def test_gamma_labels_tell_every_value_apart() -> None:
    """Two γ that ``:g`` shows alike are two runs with two labels (they were refused as "--policies
    names a run twice"); -0 is 0."""
    from nereus.sim.command import _gammas, runs

    labels = [label for label, _, _ in runs("nereus,static", _gammas("0.5,0.1234567,0.1234568"))]
    assert labels == ["nereus(γ=0.5)", "nereus(γ=0.1234567)", "nereus(γ=0.1234568)", "static"]
    assert [label for label, _, _ in runs("nereus", _gammas("0.5,-0"))] == ["nereus(γ=0.5)", "nereus(γ=0)"]


def test_list_traces_offers_only_files_a_name_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hidden file, a folder named ``*.json`` or a broken link in traces/ is not listed, nor
    offered by the error that refuses its name; an empty folder offers none."""
    for kind in ("models", "clusters", "workloads", "traces"):
        (tmp_path / kind).mkdir()
    traces = tmp_path / "traces"
    (traces / "good.json").write_text((config_root() / "traces" / f"{names('traces')[0]}.json").read_text())
    (traces / ".hidden.json").write_text("{}")
    (traces / "adir.json").mkdir()
    (traces / "dangling.json").symlink_to(tmp_path / "gone.json")
    monkeypatch.setenv("NEREUS_CONFIGS", str(tmp_path))
    assert names("traces") == ["good"]
    with pytest.raises(ConfigError, match=r"unknown trace 'adir' \(choices: good, or a JSON file\)$"):
        trace_path("adir")
    (traces / "good.json").unlink()
    with pytest.raises(ConfigError, match=r"unknown trace 'x' \(choices: none shipped, or a JSON file\)$"):
        trace_path("x")
