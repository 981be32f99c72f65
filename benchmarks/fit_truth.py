"""Fit the simulator's hardware truth to published measurements (``benchmarks/data/truth_*.csv``).

Four data sets, fitted in order (decode uses the GEMM fit):
* ``truth_gemm.csv``: achieved TFLOP/s of single GEMMs by shape (cuBLAS square sizes on A100;
  best shapes of the "maximum achievable matmul FLOPS" table) → GEMM parameters;
* ``truth_collectives.csv``: all-reduce busBW by payload on one and four 8-GPU nodes → collective
  parameters;
* ``truth_decode.csv``: vLLM time per output token by batch (rows with fit=1) → decode parameters;
* ``truth_engines.csv``: vLLM engine start-up (cold and warm compile cache), NCCL communicator init
  and Megatron model-and-optimizer setup, from published logs → the engine parameters (a
  transition's fixed costs, ``nereus/sim/truth/engines.py``).

Each fit is Levenberg-Marquardt on r = log(model time) − log(measured time) under a robust
(Cauchy, scale 0.25) loss, so a few points a smooth model cannot follow (a B200 4-node sweep's
first, rounded 0.01-0.04 GB/s rows) do not drag the rest; over the logarithms of the parameters
(logits for fractions of peak, so they stay in (0, 1)), from fixed starting points: the result is
deterministic, and ``tests/test_truth.py`` checks that refitting reproduces the shipped file.

    python benchmarks/fit_truth.py            # fit, print per-point error and MAPE per data set
    python benchmarks/fit_truth.py --write    # ... and write nereus/sim/truth/params.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from nereus.sim.truth import collectives, engines
from nereus.sim.truth.decode import decode_step_seconds
from nereus.sim.truth.gemm import gemm_seconds_raw
from nereus.sim.truth.params import PARAMS_PATH, TruthParams, load
from nereus.spec import load_model
from nereus.spec.cluster import ClusterSpec, CollectiveLibrary, Vendor

DATA = Path(__file__).parent / "data"
GEMM = ("gemm_peak_nvidia", "gemm_peak_amd", "gemm_mn_half", "gemm_k_half", "gemm_launch_s")
COLL = (
    "coll_alpha_intra_s",
    "coll_alpha_inter_s",
    "coll_eff_intra",
    "coll_eff_inter",
    "coll_half_intra",
    "coll_half_inter",
    "coll_shape_intra",
    "coll_shape_inter",
)
DECODE = ("decode_hbm_eff", "decode_step_s")
ENGINES = ("engine_setup_s", "engine_cold_layer_s", "engine_warm_layer_s", "module_setup_s", "comm_init_s")
START = TruthParams(
    gemm_peak_nvidia=0.8,
    gemm_peak_amd=0.6,
    gemm_mn_half=1e6,
    gemm_k_half=256.0,
    gemm_launch_s=5e-6,
    coll_alpha_intra_s=3e-5,
    coll_alpha_inter_s=3e-4,
    coll_eff_intra=0.8,
    coll_eff_inter=0.7,
    coll_half_intra=3e7,
    coll_half_inter=3e7,
    coll_shape_intra=1.0,
    coll_shape_inter=1.0,
    decode_hbm_eff=0.7,
    decode_step_s=5e-4,
    engine_setup_s=5.0,
    engine_cold_layer_s=1.0,
    engine_warm_layer_s=0.5,
    module_setup_s=1.0,
    comm_init_s=1.0,
)


def rows(name: str) -> list[dict[str, str]]:
    with open(DATA / name, newline="") as f:
        return list(csv.DictReader(f))


def levenberg_marquardt(
    residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, iters: int = 200
) -> np.ndarray:
    """Minimise ‖residuals(x)‖² (numeric Jacobian, adaptive damping)."""
    x, lam = x0.astype(np.float64), 1e-2
    r = residuals(x)
    for _ in range(iters):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = 1e-6
            jac[:, j] = (residuals(x + dx) - r) / 1e-6
        g, a = jac.T @ r, jac.T @ jac
        step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), -g)
        try:
            trial = residuals(x + step)
        except ValueError:  # a step out of the parameters' domain: damp harder
            lam *= 4
            continue
        if np.all(np.isfinite(trial)) and trial @ trial < r @ r:
            x, r, lam = x + step, trial, lam / 3
            if np.max(np.abs(step)) < 1e-10:
                break
        else:
            lam *= 4
    return x


CAUCHY = 0.25  # scale of the robust loss in log space: errors well above ~25% count less than squared
FRACTIONS = {"gemm_peak_nvidia", "gemm_peak_amd", "coll_eff_intra", "coll_eff_inter", "decode_hbm_eff"}


def fit(
    params: TruthParams,
    names: Sequence[str],
    model: Callable[[TruthParams], np.ndarray],
    measured: np.ndarray,
) -> TruthParams:
    """Fractions of peak are fitted through a logit (they stay in (0, 1)), the rest through a log."""

    def value(name: str, v: float) -> float:
        v = float(np.clip(v, -50.0, 50.0))
        return float(1.0 / (1.0 + np.exp(-v))) if name in FRACTIONS else float(np.exp(v))

    def with_x(x: np.ndarray) -> TruthParams:
        return replace(params, **{n: value(n, v) for n, v in zip(names, x, strict=True)})

    x0 = np.array(
        [
            np.log(v / (1 - v)) if n in FRACTIONS else np.log(v)
            for n, v in ((n, getattr(params, n)) for n in names)
        ]
    )

    def residuals(x: np.ndarray) -> np.ndarray:
        r = np.log(model(with_x(x))) - np.log(measured)
        robust: np.ndarray = np.sign(r) * CAUCHY * np.sqrt(np.log1p((r / CAUCHY) ** 2))  # Cauchy loss
        return robust

    x = levenberg_marquardt(residuals, x0)
    return with_x(x)


# ------------------------------------------------------------------ data sets
def gemm_set() -> tuple[Callable[[TruthParams], np.ndarray], np.ndarray, list[str]]:
    data = rows("truth_gemm.csv")
    shape = [(float(r["m"]), float(r["n"]), float(r["k"])) for r in data]
    measured = np.array(
        [2 * m * n * k / (float(r["tflops"]) * 1e12) for (m, n, k), r in zip(shape, data, strict=True)]
    )

    def model(p: TruthParams) -> np.ndarray:
        out = []
        for (m, n, k), r in zip(shape, data, strict=True):
            best = p.gemm_peak_amd if r["vendor"] == "amd" else p.gemm_peak_nvidia
            out.append(gemm_seconds_raw(m, n, k, float(r["peak_tflops"]) * 1e12, best, p))
        return np.array(out)

    return model, measured, [f"{r['gpu']} {r['m']}x{r['n']}x{r['k']}" for r in data]


def collective_set() -> tuple[Callable[[TruthParams], np.ndarray], np.ndarray, list[str]]:
    data = rows("truth_collectives.csv")
    measured = []
    for r in data:
        n, size = int(r["ranks"]), float(r["size_bytes"])
        measured.append(2 * (n - 1) / n * size / (float(r["busbw_gbs"]) * 1e9))

    def model(p: TruthParams) -> np.ndarray:
        out = []
        for r in data:
            nodes = int(r["nodes"])
            group = collectives.Group(int(r["ranks"]) // nodes, nodes)
            out.append(
                collectives.seconds(
                    r["collective"],
                    group,
                    float(r["size_bytes"]),
                    float(r["intra_gbs"]) * 1e9,
                    float(r["inter_gbs"]) * 1e9,
                    p,
                )
            )
        return np.array(out)

    return model, np.array(measured), [f"{r['system']} {r['size_bytes']}B" for r in data]


def _device(r: dict[str, str]) -> ClusterSpec:
    """A one-GPU 'cluster' with the row's peak and HBM rates (link rates are unused at TP 1)."""
    return ClusterSpec(
        name=r["gpu"],
        vendor=Vendor.NVIDIA,
        collective_library=CollectiveLibrary.NCCL,
        nodes=1,
        gpus_per_node=1,
        gpu_model=r["gpu"],
        gpu_memory_gib=80,
        peak_bf16_tflops=float(r["peak_tflops"]),
        hbm_bandwidth_gbs=float(r["hbm_gbs"]),
        intra_node_bandwidth_gbs=1.0,
        inter_node_bandwidth_gbs=1.0,
    )


def decode_set() -> tuple[Callable[[TruthParams], np.ndarray], np.ndarray, list[str]]:
    data = [r for r in rows("truth_decode.csv") if r["fit"] == "1"]
    models = {r["model"]: load_model(r["model"]) for r in data}
    measured = np.array([float(r["tpot_ms"]) / 1e3 for r in data])

    def model(p: TruthParams) -> np.ndarray:
        return np.array(
            [
                decode_step_seconds(models[r["model"]], _device(r), float(r["batch"]), float(r["context"]), p)
                for r in data
            ]
        )

    return model, measured, [f"{r['gpu']} batch {r['batch']}" for r in data]


def engine_set() -> tuple[Callable[[TruthParams], np.ndarray], np.ndarray, list[str]]:
    data = rows("truth_engines.csv")
    measured = np.array([float(r["seconds"]) for r in data])

    def one(r: dict[str, str], p: TruthParams) -> float:
        if r["kind"] == "comm_init":
            return engines.comm_init_seconds(int(r["ranks"]), p)
        stage = engines.GEN if r["kind"].startswith("gen") else engines.TRAIN
        e = engines.Engine(stage, int(r["layers"]), 1, 1, 1)
        return engines.build_seconds(e, r["kind"] == "gen_warm", p)

    def model(p: TruthParams) -> np.ndarray:
        return np.array([one(r, p) for r in data])

    return model, measured, [f"{r['kind']} {r['model']} ({r['ranks']} ranks)" for r in data]


SETS = {
    "gemm": (gemm_set, GEMM),
    "collectives": (collective_set, COLL),
    "decode": (decode_set, DECODE),
    "engines": (engine_set, ENGINES),
}


def fit_all() -> TruthParams:
    params = START
    for make, names in SETS.values():
        model, measured, _ = make()
        params = fit(params, names, model, measured)
    return params


def report(params: TruthParams) -> dict[str, float]:
    """Per-point relative error and MAPE per data set (printed); returns the MAPEs."""
    mapes = {}
    for name, (make, _) in SETS.items():
        model, measured, labels = make()
        err = model(params) / measured - 1.0
        print(f"\n{name}:")
        for label, e in zip(labels, err, strict=True):
            print(f"  {label:40s} {100 * e:+7.1f}%")
        mapes[name] = float(np.mean(np.abs(err)) * 100)
        print(f"  MAPE {mapes[name]:.1f}% over {len(err)} points")
    return mapes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the fitted parameters to {PARAMS_PATH}")
    args = parser.parse_args(argv)
    params = fit_all()
    report(params)
    print("\n" + json.dumps(params.to_json(), indent=1))
    if args.write:
        PARAMS_PATH.write_text(json.dumps(params.to_json(), indent=1) + "\n")
        print(f"wrote {PARAMS_PATH}")
    elif params != load():
        print(f"(differs from the shipped {PARAMS_PATH.name}; --write to update it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
