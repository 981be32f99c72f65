"""The truth's free parameters: fitted ones (``params.json``, written by ``benchmarks/fit_truth.py``
from the published points in ``benchmarks/data/truth_*.csv``) and fixed ones (spec-sheet facts,
framework defaults, and the few modelling assumptions no published measurement pins down).

Fitted (see ``fit_truth.py`` for the data sets and the per-point error):
* GEMM: ``gemm_peak_nvidia``/``gemm_peak_amd`` (best achieved fraction of the dense peak),
  ``gemm_mn_half`` (output elements m·n at which tile occupancy reaches half), ``gemm_k_half``
  (reduction depth at which the main loop amortises prologue/epilogue by half), ``gemm_launch_s``.
* Collectives: ``coll_alpha_intra_s``/``coll_alpha_inter_s`` (per-call latency inside a node /
  across nodes, as a PyTorch-level benchmark that waits for each call sees it),
  ``coll_eff_intra``/``coll_eff_inter`` (best
  achieved fraction of a link's per-direction rate), ``coll_half_intra``/``coll_half_inter``
  (message bytes at half of it), ``coll_shape_intra``/``coll_shape_inter`` (steepness of that rise).
* Decode: ``decode_hbm_eff`` (achieved fraction of HBM bandwidth streaming weights and KV),
  ``decode_step_s`` (per-iteration scheduler and launch overhead).
* Engines (``engines.py``): ``engine_setup_s`` (a vLLM engine's profiling and KV-cache creation),
  ``engine_cold_layer_s``/``engine_warm_layer_s`` (compile and graph capture per decoder layer,
  without and with a compile cache), ``module_setup_s`` (a trainer's or scorer's modules and
  optimizer built on its GPUs), ``comm_init_s`` (a communicator's init, times √ranks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PARAMS_PATH = Path(__file__).with_name("params.json")

# ---- fixed, not fitted --------------------------------------------------------------------------
# vLLM's default max_num_batched_tokens for chunked prefill (vLLM engine-args docs).
PREFILL_CHUNK_TOKENS = 8192
# vLLM's default KV block size (tokens): memory is handed out in whole blocks (Kwon et al. 2023 §4.1).
KV_BLOCK_TOKENS = 16
# PyTorch DDP's default gradient bucket (bucket_cap_mb=25, torch.nn.parallel docs): DP gradient
# all-reduces are issued bucket by bucket, each at its own message size.
GRAD_BUCKET_BYTES = 25 * 2**20
# Fused Adam, bytes of HBM traffic per parameter: read fp32 grad, master, m, v (16); write master,
# m, v (12) and the bf16 copy (2); zero the fp32 grad buffer (4).
ADAM_TRAFFIC_PER_PARAM = 34.0
# Mixed-precision trainer state per parameter: bf16 weights 2, fp32 grad buffer 4 (kept between
# steps by Megatron-style DDP), fp32 master + Adam m, v 12 (Megatron-LM distributed-optimizer guide).
TRAIN_WEIGHT_B, TRAIN_GRAD_B, TRAIN_OPTIM_B = 2.0, 4.0, 12.0
# Modelling assumptions (no published measurement found to fit them; stated, not tuned):
# * the caching allocator's fragmentation: a fraction of the activation working set that saturates
#   with the number of allocate/free cycles (micro-batches) a step goes through;
FRAG_MAX = 0.12
FRAG_CYCLES = 4.0
# * the tail of generation: the last sequences (above the mean length) decode at this fraction of
#   the steady concurrency (continuous batching runs dry).
TAIL_BATCH_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class TruthParams:
    gemm_peak_nvidia: float
    gemm_peak_amd: float
    gemm_mn_half: float
    gemm_k_half: float
    gemm_launch_s: float
    coll_alpha_intra_s: float
    coll_alpha_inter_s: float
    coll_eff_intra: float
    coll_eff_inter: float
    coll_half_intra: float
    coll_half_inter: float
    coll_shape_intra: float
    coll_shape_inter: float
    decode_hbm_eff: float
    decode_step_s: float
    engine_setup_s: float
    engine_cold_layer_s: float
    engine_warm_layer_s: float
    module_setup_s: float
    comm_init_s: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, float) and value > 0 and value < 1e12):
                raise ValueError(f"truth parameter {f.name} must be a positive float, got {value!r}")
        for name in (
            "gemm_peak_nvidia",
            "gemm_peak_amd",
            "coll_eff_intra",
            "coll_eff_inter",
            "decode_hbm_eff",
        ):
            if getattr(self, name) > 1.0:
                raise ValueError(f"truth parameter {name} is a fraction of peak, got {getattr(self, name)}")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TruthParams:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"truth parameters missing: {sorted(missing)}")
        return cls(**{k: float(data[k]) for k in names})

    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load(path: Path = PARAMS_PATH) -> TruthParams:
    return TruthParams.from_json(json.loads(path.read_text()))
