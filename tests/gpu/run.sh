#!/usr/bin/env bash
# Every check that needs a GPU, in one place, for the GPU box (CUDA or ROCm torch installed:
# `make install TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'`).
# On a CPU machine the tests skip and the benchmark records no GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/nereus-gpu}
mkdir -p "$OUT"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())'
"$PY" -m pytest -q -rs tests/gpu
"$PY" benchmarks/engine.py --out "$OUT"
