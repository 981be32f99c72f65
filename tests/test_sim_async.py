"""Asynchronous RL in the simulator: the truth's pipeline (overlap, staleness wait, weight sync)
and async runs of every policy."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest

from nereus.control.action import RecordKind
from nereus.plan.overlap import step_latency
from nereus.sim import GpuSupply, Scenario, SeqCurve, SpotTrace, simulate
from nereus.sim.records import StepRecord
from nereus.sim.truth.asynchrony import Pipeline, sync_step, weight_sync_seconds
from nereus.spec import Role, load_cluster, load_model, load_workload, names
from nereus.spec.registry import trace_path
from nereus.spec.workload import Algorithm, ExecutionMode

pytestmark = pytest.mark.pure

SHIPPED = [trace_path(name) for name in names("traces")]
A100 = load_cluster("a100-64gb-hdr100")
MODEL = load_model("llama-3.1-8b")


def _steps(p: Pipeline, gen: float, trainer: float, sync: float, n: int) -> list[float]:
    return [p.step(gen, trainer, sync).step_s for _ in range(n)]


@pytest.mark.parametrize(("gen", "trainer"), [(30.0, 50.0), (50.0, 30.0), (40.0, 40.0)])
def test_steady_state_is_the_slower_side_plus_the_sync(gen: float, trainer: float) -> None:
    p = Pipeline()
    first, *rest = _steps(p, gen, trainer, 2.0, 6)
    assert first == pytest.approx(gen + max(gen, trainer) + 2.0)  # filling: the first batch alone
    assert rest == pytest.approx([max(gen, trainer) + 2.0] * 5)
    a = p.step(gen, trainer, 2.0)
    assert a.staleness == 1 and a.ahead == 1 and a.sync_s == 2.0
    assert a.overlap_s == pytest.approx(min(gen, trainer))  # both sides busy


def test_staleness_zero_is_the_synchronous_sum_plus_the_sync() -> None:
    p = Pipeline(max_staleness=0)
    for _ in range(4):
        a = p.step(30.0, 50.0, 2.0)
        assert a.step_s == pytest.approx(30.0 + 50.0 + 2.0)
        assert a.overlap_s == 0.0 and a.staleness == 0 and a.ahead == 0
        assert a.gen_wait_s == pytest.approx(50.0) and a.train_wait_s == pytest.approx(30.0)


def test_generation_waits_when_it_is_max_staleness_ahead() -> None:
    p = Pipeline(max_staleness=1)
    _steps(p, 10.0, 50.0, 1.0, 2)
    a = p.step(10.0, 50.0, 1.0)
    assert a.gen_wait_s == pytest.approx(40.0) and a.train_wait_s == 0.0 and a.ahead == 1
    deep = Pipeline(max_staleness=3)
    _steps(deep, 10.0, 50.0, 1.0, 3)
    b = deep.step(10.0, 50.0, 1.0)  # three batches ahead at most, then the staleness wait
    assert b.ahead == 3 and b.step_s == pytest.approx(51.0) and b.staleness == 3
    assert b.gen_wait_s == pytest.approx(40.0)


def test_training_waits_when_generation_is_slower() -> None:
    p = Pipeline()
    _steps(p, 70.0, 30.0, 1.0, 2)
    a = p.step(70.0, 30.0, 1.0)
    assert a.train_wait_s == pytest.approx(40.0) and a.gen_wait_s == 0.0
    assert a.step_s == pytest.approx(71.0) and a.staleness == 1


def test_drain_keeps_and_drop_refills() -> None:
    kept, dropped = Pipeline(), Pipeline()
    for p in (kept, dropped):
        _steps(p, 30.0, 50.0, 1.0, 3)
    assert kept.flush(keep=True) == 0 and dropped.flush(keep=False) == 1
    assert kept.step(30.0, 50.0, 1.0).step_s == pytest.approx(51.0)  # the kept batch goes on
    refill = dropped.step(30.0, 50.0, 1.0)
    assert refill.step_s == pytest.approx(81.0) and refill.staleness == 0 and refill.train_wait_s == 30.0


def test_the_sync_sum_is_the_planners_synchronous_step_bit_for_bit() -> None:
    rng = random.Random(7)
    for algo, reward in itertools.product(Algorithm, (True, False)):
        w = dataclasses.replace(load_workload(algo.value), reward_model=reward)
        wf = w.workflow()
        for _ in range(20):
            times = {m.name: rng.uniform(0.0, 500.0) for m in wf.model_stages}
            ours = sync_step([times[m.name] for m in wf.by_stage(s)] for s in wf.stages)
            assert ours == step_latency(wf, ExecutionMode.SYNC, times)


def test_the_weight_sync_is_a_broadcast_of_the_actors_bf16_weights() -> None:
    inside = weight_sync_seconds(MODEL, A100, (0, 1), (2, 3))
    across = weight_sync_seconds(MODEL, A100, tuple(range(4)), tuple(range(4, 8)))
    assert set(inside) == {"broadcast.intra"} and set(across) == {"broadcast.inter"}
    # 16 GB at tens of GB/s within a node, slower across nodes
    assert 0.05 < inside["broadcast.intra"] < across["broadcast.inter"] < 60.0
    with pytest.raises(ValueError, match="trainer and generator"):
        weight_sync_seconds(MODEL, A100, (), (1,))


def _async(trace: Path, steps: int = 10, seed: int = 0, **kw: object) -> Scenario:
    w = load_workload("grpo")
    w = dataclasses.replace(w, prompts_per_step=512 // w.samples_per_prompt, mode=ExecutionMode.ASYNC)
    return Scenario(
        w,
        {r: MODEL for r in Role},
        A100,
        GpuSupply(SpotTrace.load(trace), 2, 32, 8, speedup=5.0, seed=seed),
        SeqCurve.growth(1147.5, 3722.0, 25, 1.12),
        steps,
        seed,
        **kw,  # type: ignore[arg-type]
    )


def _moved(r: StepRecord) -> bool:
    return any(t.kind in (RecordKind.MOVE, RecordKind.RESTART) for t in r.transitions)


@pytest.mark.parametrize("policy", ["nereus", "static", "always", "periodic:3", "static-best", "oracle"])
def test_every_policy_runs_async_without_running_out_of_memory(policy: str) -> None:
    s = simulate(_async(SHIPPED[1], steps=8), policy)
    assert s.oom_steps == 0 and len([r for r in s.records if not r.lost]) == 8
    pipelined = [r.pipeline for r in s.records]
    assert all(a is not None and a.step_s == r.step_s for a, r in zip(pipelined, s.records, strict=True))
    assert any(a is not None and a.overlap_s > 0 and a.staleness == 1 for a in pipelined)
    assert s.records[0].to_json()["async"]["staleness"] == 0  # the first batch: fresh weights
    assert {"mean_overlap_s", "mean_staleness", "dropped_rollouts"} <= set(s.to_json())


def test_a_transition_drains_or_drops_the_rollouts_generated_ahead() -> None:
    drained = simulate(_async(SHIPPED[0], steps=12), "always")
    dropped = simulate(_async(SHIPPED[0], steps=12, in_flight="drop"), "always")
    per_batch = 512
    for s, keep in ((drained, True), (dropped, False)):
        # a move whose step then crashed (its GPUs revoked) drops what ran ahead as a crash does
        rs = s.records
        moves = [i for i, r in enumerate(rs) if _moved(r) and i > 0 and not rs[i - 1].lost and not r.lost]
        assert moves, "the scenario moves at least once"
        for i in moves:
            r = s.records[i]
            assert r.dropped_rollouts == 0 if keep else r.dropped_rollouts >= per_batch
            assert r.pipeline is not None and (r.pipeline.staleness == 0) != keep
        crashed = [r for r in s.records if r.lost]
        assert all(r.dropped_rollouts >= per_batch for r in crashed)  # a crash drops what ran ahead
    assert dropped.dropped_rollouts > drained.dropped_rollouts
    with pytest.raises(ValueError, match="in_flight"):
        _async(SHIPPED[0], in_flight="keep")


def test_simulate_cli_runs_async_workloads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from nereus.cli import main

    args = [
        "simulate", "--trace", str(SHIPPED[1]), "--model", "llama-3.1-8b", "--algo", "grpo",
        "--mode", "async", "--max-staleness", "1", "--in-flight", "drop", "--cluster", "a100-64gb-hdr100",
        "--gpus-per-instance", "2", "--max-gpus", "32", "--min-gpus", "8", "--steps", "3",
        "--seq-curve", "growth:1147:3722:20", "--speedup", "5", "--policies", "static",
        "--out", str(tmp_path / "run"), "--json",
    ]  # fmt: skip
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"mean_overlap_s", "mean_staleness", "dropped_rollouts"} <= set(doc["static"])
    row = json.loads((tmp_path / "run" / "steps-static.jsonl").read_text().splitlines()[-1])
    assert row["async"]["step_s"] == row["step_s"]
    with pytest.raises(SystemExit) as exc:
        main([*args[:-3], "--in-flight", "keep"])
    assert exc.value.code == 2
    assert "--in-flight" in capsys.readouterr().err
