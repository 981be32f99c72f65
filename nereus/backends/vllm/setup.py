"""The vLLM engine's settings, without importing vLLM: the environment it runs in, its KV room and
the folder it reads the model's config from (what it can serve: ``support.py``).

vLLM reads a Hugging Face folder; the engine gives it one holding only ``config.json`` and loads
dummy weights, then the rank's real weights in place (``engine.py``), so no checkpoint is written.
vLLM writes sockets to a default place: they go under the run's folder instead. Its cache (the
model classes it has inspected, compiled graphs) outlives the run in a per-user folder
(``cache_root``), and usage statistics are off. Edge module (files, environment).
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from nereus.backends import hf
from nereus.backends.protocol import EngineOptions
from nereus.spec.model import ModelSpec
from nereus.state.buffers import BufferKind
from nereus.state.holder import TORCH_DTYPE, RankState

KV_ROUNDING = 128  # tokens: vLLM's CPU block size, the largest of its block sizes
MIN_KV_BYTES = 1 << 20
# vLLM's max_num_batched_tokens, set for a sliding-window model (whose admission depends on it):
# the chunked-prefill default the planner prices (``nereus.plan.memory.PREFILL_CHUNK_TOKENS``)
PREFILL_CHUNK_TOKENS = 8192
# vLLM's gpu_memory_utilization: at most its default share; on a GPU it may share with a trainer,
# the share of the device that is free, less a margin for the communicators it initialises first
MAX_UTILIZATION = 0.9
UTILIZATION_MARGIN = 1 << 30


def dtype_of(state: RankState) -> torch.dtype:
    return TORCH_DTYPE[dict(state.policy.kinds)[BufferKind.PARAM]]


def kv_cache_bytes(state: RankState, options: EngineOptions, max_model_len: int) -> int:
    """Per-rank KV room: the plan's budget when it gives one, else room for ``max_num_seqs``
    sequences of ``max_model_len`` tokens (rounded up to whole blocks) in the weights' dtype; with
    a sliding window, of what vLLM admits a sequence for (``ModelSpec.kv_held``: the window and
    a prefill chunk) and one more block, where the window starts mid-block."""
    if options.kv_cache_bytes:
        return max(options.kv_cache_bytes, MIN_KV_BYTES)
    m, tp = state.model, state.layout.tp
    kv_heads = max(1, m.num_key_value_heads // tp)
    per_token = 2 * m.num_hidden_layers * kv_heads * m.head_dim * dtype_of(state).itemsize
    held = float(m.kv_held(float(max_model_len), PREFILL_CHUNK_TOKENS))
    tokens = -(-math.ceil(held) // KV_ROUNDING) * KV_ROUNDING
    if held < max_model_len:
        tokens += KV_ROUNDING
    return max(MIN_KV_BYTES, max(1, options.max_num_seqs or 1) * tokens * per_token)


def memory_utilization(device: torch.device) -> float:
    """vLLM's ``gpu_memory_utilization`` on ``device``. On a GPU vLLM refuses to start when less than
    that share of the device is free, even though its KV room is given (``kv_cache_bytes``): on a
    GPU that holds a trainer's state, vLLM's default share (0.9) is never free. The share of it
    that is free now (our allocator's cache emptied, as vLLM empties it) is asked for instead. On
    a CPU the cap (vLLM's CPU worker checks no share when the KV room is given)."""
    if device.type != "cuda":
        return MAX_UTILIZATION
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return utilization(free, total)


def utilization(free: int, total: int) -> float:
    """The share of a device of ``total`` bytes, ``free`` of them free, that vLLM may ask for."""
    if total <= 0 or not 0 <= free <= total:
        raise ValueError(f"device memory: {free} bytes free of {total}")
    share = (free - min(UTILIZATION_MARGIN, free // 10)) / total
    return min(MAX_UTILIZATION, max(0.001, math.floor(share * 1000) / 1000))


def max_batched_tokens(model: ModelSpec) -> int | None:
    """vLLM's max_num_batched_tokens: for a sliding-window model the prefill chunk its KV budget
    assumes (``kv_cache_bytes``); None (vLLM's default) otherwise."""
    return PREFILL_CHUNK_TOKENS if model.sliding_window else None


def model_folder(root: Path, state: RankState) -> Path:
    """A folder with the model's ``config.json`` only (vLLM builds from it with dummy weights)."""
    folder = root / "model"
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(hf.hf_config(state.model, dtype_of(state)), indent=2, sort_keys=True)
    path = folder / "config.json"
    if not path.is_file() or path.read_text() != text:
        tmp = folder / f".config.json.{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(path)
    return folder


def cache_root(root: Path, env: Mapping[str, str] | None = None) -> Path:
    """vLLM's cache folder: ``VLLM_CACHE_ROOT`` when set, else ``nereus/vllm`` under
    ``XDG_CACHE_HOME`` (or ``~/.cache``), created private; ``root/cache`` when that cannot be
    created. It outlives the run: vLLM inspects a model class it has not cached in a subprocess
    that imports vLLM again (~9 CPU-s per worker and model class), and its entries are keyed by
    the model code's hash, so runs can share them."""
    env = os.environ if env is None else env
    if env.get("VLLM_CACHE_ROOT"):
        return Path(env["VLLM_CACHE_ROOT"])
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    shared = base / "nereus" / "vllm"
    try:
        shared.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:  # a read-only or missing home: the run's own folder
        return root / "cache"
    return shared


def environment(root: Path) -> dict[str, str]:
    """vLLM's process-wide settings: in-process engine core, no usage statistics, its sockets
    under ``root`` and its cache in ``cache_root``, no OpenMP thread binding (the worker owns its
    threads), and only its errors logged (each engine build would otherwise print its performance
    hints on every rank; ``VLLM_LOGGING_LEVEL=WARNING`` shows them)."""
    cache = cache_root(root)
    for folder in (root / "rpc", cache):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "VLLM_RPC_BASE_PATH": str(root / "rpc"),
        "VLLM_CACHE_ROOT": str(cache),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "TOKENIZERS_PARALLELISM": "false",
    }


class _KnownNoise(logging.Filter):
    """Drops vLLM warnings that say nothing about this engine:

    * "<Layer>: Failed to load weights" for rotary embeddings, whose only loadable tensor is the
      cos/sin cache vLLM computes itself: every weight reload names them although no checkpoint
      holds them, and vLLM puts them back;
    * "Chat template warmup failed" with the traceback of "Tokenizer not available": the engine
      is built without a tokenizer (``skip_tokenizer_init``; prompts arrive as token ids), and
      "Using None for EOS token id" for the same reason (stop ids come with each request);
    * "CPU backend doesn't allow to use `torch.set_num_threads`": vLLM's own warm-up calls it
      while its CPU worker holds the function; the worker's threads are restored after the build
      (``world.replica_world``)."""

    QUIET = (
        "Using None for EOS token id because tokenizer is not initialized",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
    )
    ROTARY = ("RotaryEmbedding", "Llama3RotaryEmbedding", "MRotaryEmbedding", "YaRNScalingRotaryEmbedding")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(": Failed to load weights"):
            return not message.startswith(self.ROTARY)
        if message.startswith("Chat template warmup failed") and record.exc_info:
            return "Tokenizer not available" not in str(record.exc_info[1])
        return not message.startswith(self.QUIET)


NOISY_LOGGERS = (
    "vllm.model_executor.model_loader.reload.layerwise",
    "vllm.renderers.base",
    "vllm.v1.worker.cpu_worker",
)


def quiet_known_noise() -> None:
    """Install the filter once on each of vLLM's noisy loggers (its other warnings stay), and
    ignore the deprecation of ``torch.distributed.reduce_op`` its import trips over."""
    warnings.filterwarnings("ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownNoise) for f in logger.filters):
            logger.addFilter(_KnownNoise())


@contextmanager
def launcher_env(rank: int, local_rank: int, world_size: int) -> Iterator[None]:
    """The variables vLLM's external launcher reads while it builds (its rank in the replica,
    the local device index), restored after: the worker's own (torchrun's) stay as they were."""
    values = {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
    }  # fmt: skip
    saved: Mapping[str, str | None] = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
