"""Dense matmul throughput as a function of shape (the truth's, not the planner's η·peak).

A GEMM C[m×n] = A[m×k]·B[k×n] on a tensor-core GPU reaches its best achieved rate only when it
fills the machine and amortises its pipeline:

* tile occupancy: C is cut into output tiles spread over the SMs/CUs; few output elements leave
  units idle and the last wave partly empty. Achieved fraction ∝ x/(1+x), x = m·n / mn_half (a
  smooth stand-in for wave quantisation, whose sawtooth the published points average over);
* main-loop depth: each tile pays a prologue/epilogue (loads, the C write) that a short reduction
  cannot amortise: ∝ k/(k + k_half);
* the roofline: never faster than moving A, B and C through HBM once at the spec bandwidth;
* a fixed launch cost.

Fitted (``fit_truth.py``, ``benchmarks/data/truth_gemm.csv``): the best fraction of peak per vendor,
``mn_half``, ``k_half`` and the launch cost, from cuBLAS square GEMMs on A100 (triton issue 3551)
and the best-shape "maximum achievable matmul FLOPS" rows of A100, H100, GH200, B200, MI300X and
MI325X (stas00/ml-engineering). Peak FLOP/s and HBM bandwidth come from the cluster spec.
"""

from __future__ import annotations

from nereus.sim.truth.params import TruthParams
from nereus.spec.cluster import ClusterSpec, Vendor

BF16 = 2.0


def best_fraction(vendor: Vendor | str, p: TruthParams) -> float:
    return p.gemm_peak_amd if str(vendor) == Vendor.AMD.value else p.gemm_peak_nvidia


def achieved_fraction(m: float, n: float, k: float, best: float, p: TruthParams) -> float:
    """Fraction of the dense peak a GEMM of this shape sustains in its main loop."""
    x = m * n / p.gemm_mn_half
    return best * (x / (1.0 + x)) * (k / (k + p.gemm_k_half))


def gemm_seconds_raw(
    m: float,
    n: float,
    k: float,
    peak_flops: float,
    best: float,
    p: TruthParams,
    hbm_bytes_s: float | None = None,
) -> float:
    """Seconds of one GEMM (no batching) at a device of ``peak_flops``."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops = 2.0 * m * n * k
    t = p.gemm_launch_s + flops / (peak_flops * achieved_fraction(m, n, k, best, p))
    if hbm_bytes_s is not None:
        t = max(t, BF16 * (m * k + k * n + m * n) / hbm_bytes_s)
    return t


def gemm_seconds(
    m: float, n: float, k: float, cluster: ClusterSpec, p: TruthParams, count: float = 1.0
) -> float:
    """Seconds of ``count`` GEMMs of shape m×n×k on one GPU of ``cluster``."""
    best = best_fraction(cluster.vendor, p)
    return count * gemm_seconds_raw(m, n, k, cluster.peak_flops, best, p, cluster.hbm_bandwidth_gbs * 1e9)


def training_gemms_seconds(
    m: float, n: float, k: float, cluster: ClusterSpec, p: TruthParams
) -> tuple[float, float]:
    """(forward, backward) seconds of a weight GEMM: backward is the input gradient (m×k×n) and
    the weight gradient (k×n×m), each at its own shape."""
    fwd = gemm_seconds(m, n, k, cluster, p)
    bwd = gemm_seconds(m, k, n, cluster, p) + gemm_seconds(k, n, m, cluster, p)
    return fwd, bwd
