"""Every benchmark runs in --quick mode and writes its JSON (architecture §5 smoke test).

The benchmarks that run in one process (the planner's, admission, coordination, the DAG schedule,
fidelity: one busy core each) run two at a time, once per module, and their tests check what
each wrote; the ones that start processes of their own run alone, in their tests.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.bench]  # bench: tests/run_layers.sh runs these in its first phase

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, out: Path) -> subprocess.CompletedProcess[str]:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=420,  # a --quick run takes ~1 min alone; phase 1 shares two cores four ways
        check=False,
    )


def _doc(script: str, out: Path, proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc: dict[str, object] = json.loads((out / script.replace(".py", ".json")).read_text())
    return doc


def run_quick(script: str, out: Path) -> dict[str, object]:
    return _doc(script, out, _run(script, out))


Runs = dict[str, tuple[Path, Future[subprocess.CompletedProcess[str]]]]  # script -> (its folder, its run)
ONE_PROCESS = (
    "planner.py", "admission.py", "coordination.py", "dag_schedule.py", "fidelity.py", "class_plans.py",
)  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Each single-process benchmark's ``--quick`` run, two at a time (two cores): its folder and
    its process."""
    root = tmp_path_factory.mktemp("bench")
    folders = {script: root / script.removesuffix(".py") for script in ONE_PROCESS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {script: pool.submit(_run, script, folder) for script, folder in folders.items()}
        return {script: (folders[script], run) for script, run in runs.items()}


def quick_doc(runs: Runs, script: str) -> tuple[dict[str, object], Path]:
    out, run = runs[script]
    return _doc(script, out, run.result()), out  # a run that timed out fails its own test only


@pytest.mark.timeout(480)  # the first of these waits for all six runs
def test_planner_benchmark_quick(one_process: Runs) -> None:
    doc, out = quick_doc(one_process, "planner.py")
    assert {"benchmark", "git_sha", "date", "command", "machine", "targets", "results"} <= set(doc)
    rows = {r["gpus"]: r for r in doc["results"]}
    assert sorted(rows) == [8, 16, 32, 64, 128]
    for gpus in (8, 16, 32):
        assert rows[gpus]["exhaustive"]["gap"] == pytest.approx(0.0, abs=1e-9)
    assert (out / "planner.png").stat().st_size > 0


@pytest.mark.timeout(480)
def test_admission_benchmark_quick(one_process: Runs) -> None:
    doc, out = quick_doc(one_process, "admission.py")
    for scenario in doc["results"].values():
        policies = scenario["policies"]
        assert {"nereus", "static", "always", "periodic:3"} <= set(policies)
        assert policies["nereus"]["oom_steps"] == 0
    assert (out / "admission.png").stat().st_size > 0


@pytest.mark.timeout(480)
def test_risk_windows_reads_the_admission_benchmark(one_process: Runs, tmp_path: Path) -> None:
    doc, out = quick_doc(one_process, "admission.py")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "risk_windows.py"), "--results", str(out),
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = json.loads((tmp_path / "risk-windows.json").read_text())["results"]
    assert set(table) == set(doc["results"])
    for name, traces in table.items():
        windows = [w for p in doc["results"][name]["policies"].values() for w in p["windows"]]
        assert sum(e["seen"] for e in traces.values()) == sum(w["model"]["lost_tries"] for w in windows)
        for e in traces.values():
            assert 0 <= e["young_lost_ticks_windows"] <= e["young_held_ticks_windows"]
            assert e["young_held_ticks_windows"] <= e["young_held_ticks_trace"]
            assert 0 <= e["drop_ticks_windows"] <= e["held_ticks_windows"] <= e["held_ticks_trace"]
            assert 0 <= e["event_share_windows"] <= 1 and 0 < e["event_share_trace"] <= 1
            per = e["per_policy"]
            assert set(per) == set(doc["results"][name]["policies"])
            assert sum(p["seen"] for p in per.values()) == e["seen"]
            assert e["z_shared"] == pytest.approx(e["z_independent"] / len(per) ** 0.5)


@pytest.mark.timeout(480)
def test_coordination_benchmark_quick(one_process: Runs) -> None:
    doc, out = quick_doc(one_process, "coordination.py")
    summary = doc["summary"]
    assert isinstance(summary, dict) and set(summary) == {"SM-CS", "CM-SS", "CM-CS"}
    for s in summary.values():
        assert s["trials"] == 20
        assert s["memory_violations"] == 0 and s["stress_problems"] == 0
        assert s["nereus_deadlocks"] == 0 and s["builder_misses"] == 0
        assert s["nereus_success"] == 1.0
        assert 0.0 <= s["baseline_success"] <= 1.0 and 0.0 <= s["make_before_break_success"] <= 1.0
    assert (out / "coordination.png").stat().st_size > 0


@pytest.mark.timeout(480)
def test_dag_schedule_benchmark_quick(one_process: Runs) -> None:
    doc, out = quick_doc(one_process, "dag_schedule.py")
    assert {"benchmark", "git_sha", "date", "command", "machine", "targets", "results", "summary"} <= set(doc)
    rows = doc["results"]
    assert isinstance(rows, list)
    assert sorted({r["gpus"] for r in rows}) == [32, 128]
    for r in rows:
        assert r["feasible"] and r["greedy_plan_ms"] > 0
        if "scip" in r:  # pyscipopt installed
            assert r["scip"]["valid"] is not False
            assert r["scip"]["makespan_ticks"] <= r["greedy_ticks"]
    assert (out / "dag_schedule.png").stat().st_size > 0


@pytest.mark.timeout(480)
def test_class_plans_benchmark_quick(one_process: Runs) -> None:
    doc, out = quick_doc(one_process, "class_plans.py")
    summary = doc["summary"]
    assert isinstance(summary, dict) and summary["class_pairs"] == 4
    assert summary["executed_as_priced"] is True
    for r in doc["results"]:
        assert isinstance(r, dict)
        if "priced_s" in r:  # priced within 5% of the bound, or no longer than the per-unit greedy
            assert r["bound_s"] <= r["per_unit_s"] + 1e-9 and r["bound_s"] <= r["class_s"] + 1e-9
            assert r["priced_s"] <= max(1.05 * r["bound_s"], r["per_unit_s"]) + 1e-9
    assert (out / "class_plans.png").stat().st_size > 0


@pytest.mark.timeout(240)
def test_transition_cost_benchmark_quick(tmp_path: Path) -> None:
    doc = run_quick("transition_cost.py", tmp_path)
    rows = doc["results"]
    assert isinstance(rows, list) and {r["scenario"] for r in rows} == {"extend 2→4", "reshard tp2·pp2→tp4"}
    for r in rows:
        assert set(r["seconds"]) >= {"nereus", "unrecycled", "raw", "raw_fresh", "naive", "dcp", "restart"}
        assert r["raw_fresh_ratio"] > 0 and r["unrecycled_ratio"] > 0
        assert r["bytes_ratio"] is not None and r["bytes_ratio"] <= 1.05
        assert r["recycled_bytes"] >= 0  # tiny-llama's tp4 rank is 7% larger than its tp2·pp2 one: none here
    assert (tmp_path / "transition_cost.png").stat().st_size > 0


@pytest.mark.timeout(240)
def test_engine_benchmark_quick(tmp_path: Path) -> None:
    doc = run_quick("engine.py", tmp_path)
    assert {"benchmark", "git_sha", "date", "command", "machine", "targets", "results", "gpu"} <= set(doc)
    rows = doc["results"]
    assert isinstance(rows, list)
    wanted = doc["layouts"]
    assert isinstance(wanted, list) and len(wanted) == 2
    layouts = {(r["layout"]["tp"], r["layout"]["pp"], r["layout"]["dp"]) for r in rows}
    assert layouts == {tuple(x) for x in wanted} and (1, 1, 1) in layouts
    for r in rows:
        assert r["model"] == "tiny-llama"
        for op in ("gen", "train"):
            assert r[op]["tokens"] > 0 and r[op]["tokens_per_s"] > 0
    assert doc["threads_per_process"] == 1
    assert (tmp_path / "engine.png").stat().st_size > 0
    if importlib.util.find_spec("vllm") is None:
        assert doc["vllm"] is None
        return
    vllm = doc["vllm"]
    assert isinstance(vllm, list) and {(r["model"], r["tp"]) for r in vllm} == {
        ("tiny-llama-h32", 1),
        ("tiny-llama-h32", 2),
    }
    for r in vllm:
        for engine in ("native", "vllm"):
            assert r[engine]["tokens"] > 0 and r[engine]["tokens_per_s"] > 0
        ratio = r["vllm"]["tokens_per_s"] / r["native"]["tokens_per_s"]
        assert r["vllm_vs_native"] == pytest.approx(ratio)
        assert r["sync_s"] > 0 and r["rebuild_s"] > 0
    assert (tmp_path / "engine_vllm.png").stat().st_size > 0


@pytest.mark.timeout(120)
def test_engine_gpu_part_on_cpu_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-GPU part (``run_gpu``) run on gloo and the CPU: the same worker, timing and FLOP
    accounting as on a GPU; no known peak, so no MFU."""
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned worker imports the script by name too
    import engine  # type: ignore[import-not-found]

    sizes = {"gen_rows": 2, "prompt": 8, "new_tokens": 4, "train_rows": 2, "seq": 16, "micro_batches": 1}
    r = engine.run_gpu("tiny-llama", sizes, 1, backend="gloo", device="cpu")
    assert r["device_name"] == "cpu" and r["peak_bf16_flops"] is None and r["layout"]["tp"] == 1
    for op in ("gen", "train"):
        x = r[op]
        assert x["tokens"] > 0 and x["flops_per_s"] == pytest.approx(x["flops"] / x["seconds"])
        assert x["mfu"] is None


def test_engine_gpu_only_without_a_gpu_says_so(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu/run.sh runs the GPU part")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "engine.py"), "--gpu-only", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "no CUDA or ROCm GPU is visible" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.timeout(240)
def test_e2e_local_benchmark_quick(tmp_path: Path) -> None:
    doc = run_quick("e2e_local.py", tmp_path)
    assert {"benchmark", "git_sha", "date", "command", "machine", "targets", "results", "summary"} <= set(doc)
    results = doc["results"]
    assert isinstance(results, dict) and {"nereus", "static"} <= set(results)
    for policy in ("nereus", "static"):
        med = results[policy]["median"]
        assert med["tokens_per_s"] > 0 and med["accounted_s"] > 0 and med["wall_s"] >= med["accounted_s"]
        assert 0.0 <= med["transition_share"] < 1.0 and med["monitor_share_mean"] >= 0.0
        for run in results[policy]["runs"]:
            assert [s["step"] for s in run["per_step"]][-1] == doc["experiment"]["steps"] - 1
            assert run["transitions"] >= 1  # the drift loses a worker: something had to move
    assert doc["ratios"]["nereus/static"]["accounted_s"]["median"] > 0
    assert (tmp_path / "e2e_local.png").stat().st_size > 0


@pytest.mark.timeout(480)
def test_fidelity_benchmark_quick(one_process: Runs) -> None:
    doc, out = quick_doc(one_process, "fidelity.py")
    assert {"benchmark", "git_sha", "summary", "calibration", "verdict"} <= set(doc)
    assert {r["subset"] for r in doc["results"]} == {"calibration", "evaluation"}
    assert (out / "fidelity.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_admission_windows_quick_against_itself(tmp_path: Path) -> None:
    """The many-window comparison against HEAD (a worktree of the same code): the same windows
    give the same simulated seconds, so the ratio is exactly 0."""
    out = tmp_path / "windows"
    out.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "admission_windows.py"),
            "--quick",
            "--against",
            "HEAD",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "admission-windows.json").read_text())
    results = doc["results"]
    assert isinstance(results, dict)
    ((name, entry),) = results["summary"].items()
    assert name == "a100-8-32" and entry["windows"] == 2
    assert entry["ratio"] == 0.0 and entry["ratio_se"] == 0.0
    assert entry["mean_step_s"] == entry["base_mean_step_s"] > 0
    assert results["windows"] == results["base_windows"]
    assert (out / "admission-windows.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_admission_windows_quick_held_out_versus_another_policy(tmp_path: Path) -> None:
    """``--held-out --versus``: windows admission.py never runs, the policy against another on the
    same windows; a bad policy name exits 2 naming the flag and writes nothing."""
    out = tmp_path / "windows"
    out.mkdir()
    script = [sys.executable, str(BENCH / "admission_windows.py"), "--quick", "--out", str(out)]
    bad = subprocess.run(
        [*script, "--versus", "nosuch"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2 and "--versus" in bad.stderr and not list(out.iterdir())
    cmd = [*script, "--held-out", "--versus", "static", "--name", "held-out"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "held-out.json").read_text())
    results = doc["results"]
    assert isinstance(results, dict)
    rows = results["windows"]
    pairs = {(p, o) for p in ("nereus", "static") for o in (100, 300)}
    assert {(r["policy"], r["offset"]) for r in rows} == pairs
    ((name, entry),) = results["versus"]["static"].items()
    assert name == "a100-8-32" and entry["windows"] == 2 and 0 <= entry["faster_windows"] <= 2
    static = [r["mean_step_s"] for r in rows if r["policy"] == "static"]
    assert entry["base_mean_step_s"] == pytest.approx(sum(static) / 2)
    assert "vs static" in proc.stdout and (out / "held-out.png").stat().st_size > 0
