"""The simulator's hardware truth: its own model (nothing from the planner), fitted to published
points that each name their source, and physically sane."""

from __future__ import annotations

import ast
import csv
import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

import nereus
from nereus.sim.truth import PARAMS, Lengths, Placement, run_stage
from nereus.sim.truth import collectives as coll
from nereus.sim.truth.decode import decode_step_seconds
from nereus.sim.truth.gemm import achieved_fraction, gemm_seconds
from nereus.sim.truth.params import load
from nereus.spec import load_cluster, load_model, load_workload
from nereus.spec.workload import Recompute, Stage
from tests.helpers import benchmark_module

pytestmark = pytest.mark.pure

ROOT = Path(nereus.__file__).parent
TRUTH = ROOT / "sim" / "truth"
DATA = ROOT.parent / "benchmarks" / "data"
CSVS = sorted(DATA.glob("truth_*.csv"))
A100 = load_cluster("a100-64gb-hdr100")
MODEL = load_model("llama-3.1-8b")
PPO = load_workload("ppo")


def test_every_published_point_names_its_source() -> None:
    assert len(CSVS) >= 3
    for path in CSVS:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, path
        for i, row in enumerate(rows, start=2):
            assert row["source"].startswith("https://"), f"{path.name}:{i} has no source URL"
            assert "note" in row


def test_refitting_from_the_csvs_reproduces_the_shipped_parameters() -> None:
    fitted = benchmark_module("fit_truth").fit_all().to_json()
    shipped = load().to_json()
    assert fitted.keys() == shipped.keys()
    for name, value in shipped.items():
        assert fitted[name] == pytest.approx(value, rel=1e-4, abs=1e-15), name


def test_the_truth_imports_nothing_from_the_planner_the_controller_or_the_transition_planner() -> None:
    for f in TRUTH.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            bad = [n for n in names if n.startswith(("nereus.plan", "nereus.control", "nereus.transition"))]
            assert not bad, f"{f.name} imports {bad}"
    code = (
        "import sys, nereus.sim.truth; "
        "print(sorted(m for m in sys.modules "
        "if m.startswith(('nereus.plan', 'nereus.control', 'nereus.transition'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_gemm_efficiency_rises_with_size_and_saturates() -> None:
    best = PARAMS.gemm_peak_nvidia
    fractions = [achieved_fraction(s, s, s, best, PARAMS) for s in (256, 1024, 4096, 16384)]
    assert fractions == sorted(fractions) and fractions[-1] < best
    assert fractions[-1] - fractions[-2] < 0.1 * fractions[-1]  # saturated
    rate = [2 * s**3 / gemm_seconds(s, s, s, A100, PARAMS) for s in (128, 1024, 8192)]
    assert rate == sorted(rate) and rate[-1] < A100.peak_flops


def test_bus_bandwidth_rises_with_message_size_and_leaving_the_node_is_slower() -> None:
    intra, inter = A100.intra_node_bandwidth_gbs * 1e9, A100.inter_node_bandwidth_gbs * 1e9
    node, two = coll.Group(4, 1), coll.Group(4, 2)
    sizes = [2**k for k in range(12, 34, 3)]
    bw = [coll.busbw_of("allreduce", node, s, intra, inter, PARAMS) for s in sizes]
    assert bw == sorted(bw) and bw[-1] <= intra
    for s in sizes:
        assert coll.seconds("allreduce", two, s, intra, inter, PARAMS) > coll.seconds(
            "allreduce", node, s, intra, inter, PARAMS
        )
    # hierarchical: far cheaper than pushing the whole ring through one NIC
    big = 2**30
    flat = 2 * 7 / 8 * big / inter
    assert coll.seconds("allreduce", two, big, intra, inter, PARAMS) < flat / 2


def test_decode_throughput_rises_with_batch_sublinearly_and_kv_reads_cost() -> None:
    tput = [b / decode_step_seconds(MODEL, A100, b, 2048, PARAMS) for b in (1, 4, 16, 64, 256)]
    assert tput == sorted(tput)
    gains = [b / a for a, b in itertools.pairwise(tput)]
    assert all(g < 4 for g in gains) and gains[-1] < gains[0]  # each 4× batch gains less than 4×
    assert decode_step_seconds(MODEL, A100, 64, 8192, PARAMS) > decode_step_seconds(
        MODEL, A100, 64, 512, PARAMS
    )


def _gen(free_gib: float) -> tuple[float, float, float]:
    pl = Placement.of(1, 1, 4, tuple(range(4)), 4, micro_batch=256)
    r = run_stage(MODEL, PPO, A100, Stage.GEN, pl, 512, Lengths(256, 2000, 3000), free_gib * 2**30)
    return r.preempted, r.total, r.peak_bytes


def test_kv_preemption_only_past_the_cache_capacity() -> None:
    roomy, tight, tighter = _gen(60), _gen(30), _gen(24)
    assert roomy[0] == 0.0  # 128 sequences of 2256 tokens at 128 KiB of KV per token fit
    assert 0 < tight[0] < tighter[0]
    assert roomy[1] < tight[1] < tighter[1]  # recomputed prefills and a smaller batch cost time
    assert tight[2] <= 30 * 2**30 * 1.01  # the pool is sized to what is free: no OOM


def test_full_recompute_costs_about_one_more_forward_and_saves_memory() -> None:
    lengths = Lengths(256, 1024, 1500)

    def train(recompute: Recompute) -> tuple[float, float]:
        pl = Placement.of(4, 1, 4, tuple(range(16)), 4, micro_batch=4, recompute=recompute)
        r = run_stage(MODEL, PPO, A100, Stage.TRAIN, pl, 512, lengths)
        return r.seconds["gemm"] + r.seconds["attention"], r.peak_bytes

    (t0, m0), (t1, m1) = train(Recompute.NONE), train(Recompute.FULL)
    assert 1.2 < t1 / t0 < 1.45  # forward ≈ 1/3 of forward + backward
    assert m1 < m0


def test_memory_exceeds_a_gpu_when_the_state_cannot_fit() -> None:
    """An 8B trainer on one GPU (18 B/param of state) cannot fit 64 GiB: the truth says so, and
    the simulator's OOM check (peak + reserve > capacity) would fire."""
    pl = Placement.of(1, 1, 1, (0,), 4, micro_batch=1)
    r = run_stage(MODEL, PPO, A100, Stage.TRAIN, pl, 128, Lengths(256, 512, 600))
    assert r.peak_bytes > A100.gpu_memory_bytes
    fits = run_stage(
        MODEL,
        PPO,
        A100,
        Stage.TRAIN,
        Placement.of(4, 2, 1, tuple(range(8)), 4, 1),
        128,
        Lengths(256, 512, 600),
    )
    assert fits.peak_bytes < A100.gpu_memory_bytes


def test_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="fraction of peak"):
        dataclasses.replace(PARAMS, coll_eff_intra=1.5)
    with pytest.raises(ValueError, match="missing"):
        type(PARAMS).from_json({})
