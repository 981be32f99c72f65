"""Throughput of the torch-native engine (``nereus.backends.torch_native``) per (tp, pp, dp) layout.

Two models, ``tiny-llama`` and ``llama-125m`` (~125M parameters, Adam in fp32), under the layouts
(tp, pp, dp) ∈ {(1,1,1), (2,1,1), (1,2,1), (2,2,1), (1,1,2)}, each rank a process spawned by
``torch.multiprocessing`` with gloo on CPU (one world of up to 4 processes; every layout gets
fresh process groups, ranks outside it wait at the barriers). Each process runs with
``torch.set_num_threads(1)``.

* ``gen``: ``generate`` on a batch of prompts (8 × 32 tokens, 64 new tokens, temperature 1, no
  stop tokens); tokens/s = generated tokens (all replicas) / wall time of the call.
* ``train``: ``train_step`` on a batch of 8 × 128 tokens (every token valid, a policy-gradient
  style loss), 2 micro-batches under every layout (pipelining needs them to divide a replica's
  rows); tokens/s = trained tokens (all replicas) / wall time of the call (forward, backward,
  gradient reductions, clipping and the AdamW update).

Every replica gets its own rows (DP replicas split the batch); every rank of a replica the same
rows. Only the operation is timed: state building, engine construction and process start are
not. A world barrier precedes and follows each timed call; one warm-up call, then the median of
the repeats (3; 1 in quick mode).

On this kind of machine (few cores, here 2) more processes do not mean more compute: with one
thread each, (1,1,1) uses one core, a layout of 2 processes can use both, and one of 4 shares
those 2 (oversubscribed: every collective may wait for a descheduled peer). The numbers to read
are each layout's tokens/s relative to (1,1,1) measured in the same run (``*_vs_111``): the
engine's communication and scheduling overheads against at most 2× the compute, not a scaling
curve. The load average before
and after is recorded: other work on the same cores skews the numbers.

Where CUDA is present, ``llama-125m`` also runs on one GPU (tp = pp = dp = 1, NCCL) in
bf16-mixed precision, with larger batches, and reports MFU: achieved FLOPs / peak dense bf16
FLOPs of the GPU (a table by ``torch.cuda.get_device_name``). FLOPs are
``ModelSpec.forward_flops_per_token(context)`` × 3 for training (mean context (T+1)/2) and × 1
for generation (prefill, then each decoding pass at its context). On CPU ``gpu`` is ``null``.

Where vLLM is installed, ``engine_vllm.py`` adds vLLM against torch-native generation tokens/s for
the same model and batch (side by side, a ratio), and the seconds of a weight sync and an engine
rebuild (``vllm`` in ``engine.json``, ``engine_vllm.png``); ``vllm`` is ``null`` without it.

Targets: none numeric (issues: "tokens/s per layout; MFU on GPU"; "vLLM vs torch-native tokens/s,
the cost of one weight sync and one rebuild").
``--quick`` (smoke test): tiny-llama only, layouts (1,1,1) and (2,2,1), small batches.
Writes ``benchmarks/results/engine.json`` and ``engine.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import RESULTS, fork_server, write
from engine_vllm import plot as plot_vllm
from engine_vllm import run_vllm
from torch import Tensor

from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.optim import AdamWConfig
from nereus.backends.protocol import TokenBatch
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState

TARGETS = {"numeric": None, "issue": "tokens/s per layout; MFU on GPU"}
LAYOUTS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2))
QUICK_LAYOUTS = ((1, 1, 1), (2, 2, 1))
THREADS = 1  # torch threads per process
FULL_SIZES = {"gen_rows": 8, "prompt": 32, "new_tokens": 64, "train_rows": 8, "seq": 128, "micro_batches": 2}
QUICK_SIZES = {"gen_rows": 4, "prompt": 16, "new_tokens": 16, "train_rows": 4, "seq": 32, "micro_batches": 2}
GPU_SIZES = {
    "gen_rows": 64,
    "prompt": 128,
    "new_tokens": 128,
    "train_rows": 16,
    "seq": 1024,
    "micro_batches": 2,
}
PEAK_BF16 = {  # dense bf16 FLOP/s, by a substring of torch.cuda.get_device_name
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "MI250X": 191.5e12,  # per GCD (one device as torch sees it)
}


def label(layout: tuple[int, int, int]) -> str:
    tp, pp, dp = layout
    return f"tp{tp}·pp{pp}·dp{dp}"


def full_tensors(model: ModelSpec) -> Callable[[BufferKind, str], Tensor]:
    """``full(kind, name)`` for ``RankState.from_full``: seeded normal·0.02 weights (norms 1) for the
    parameters and their fp32 master copy, zeros for Adam's moments; the same on every rank, cached
    across layouts."""
    shapes = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}
    cache: dict[str, Tensor] = {}

    def full(kind: BufferKind, name: str) -> Tensor:
        if kind not in (BufferKind.PARAM, BufferKind.MASTER):
            return torch.zeros(shapes[name])
        if name not in cache:
            if name.endswith("norm.weight"):
                cache[name] = torch.ones(shapes[name])
            else:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                cache[name] = torch.randn(shapes[name], generator=g) * 0.02
        return cache[name]

    return full


def loss_fn(scores: Tensor, fields: Mapping[str, Tensor]) -> Tensor:
    """A policy-gradient loss, normalised by the global token count carried in ``norm``."""
    return -(scores * fields["adv"] * fields["mask"]).sum() / fields["norm"][0, 0]


def batches(model: ModelSpec, sizes: dict[str, int]) -> tuple[TokenBatch, TokenBatch]:
    """The global generation prompts and training batch (same on every rank)."""
    g = torch.Generator().manual_seed(0)
    rows, plen = sizes["gen_rows"], sizes["prompt"]
    prompts = TokenBatch(
        torch.randint(0, model.vocab_size, (rows, plen), generator=g),
        torch.ones(rows, plen, dtype=torch.long),
    )
    rows, seq = sizes["train_rows"], sizes["seq"]
    ids = torch.randint(0, model.vocab_size, (rows, seq), generator=g)
    valid = torch.ones(rows, seq, dtype=torch.long)
    fields = {
        "adv": torch.randn(rows, seq, generator=g),
        "mask": valid.float(),
        "norm": torch.full((rows, seq), float(valid.sum())),
    }
    return prompts, TokenBatch(ids, valid, fields)


def replica_rows(batch: TokenBatch, dp_rank: int, dp: int) -> TokenBatch:
    n = batch.rows // dp
    rows = slice(dp_rank * n, (dp_rank + 1) * n)
    return TokenBatch(batch.ids[rows], batch.valid[rows], {k: v[rows] for k, v in batch.fields.items()})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0, out


def _measure(
    rank: int,
    world: int,
    model: ModelSpec,
    layout: tuple[int, int, int],
    sizes: dict[str, int],
    repeats: int,
    precision: Precision,
    device: torch.device,
    full: Callable[[BufferKind, str], Tensor],
) -> dict[str, Any]:
    """Warm-up and ``repeats`` timed calls of generate and train_step under one layout; collective
    over the world (ranks outside the layout take part in the barriers only)."""
    tp, pp, dp = layout
    lay = Layout(tp, pp)
    grid = Grid.single(lay, dp)
    groups = Groups.build(grid, model, rank)
    prompts, train = batches(model, sizes)
    engine = None
    gen_batch = train_batch = None
    sample_ids: list[int] = []
    if rank in grid.ranks:
        c = grid.coord(rank)
        policy = StatePolicy.of(Stage.TRAIN, precision)
        rs = RankState.from_full("actor", model, lay, c.t, c.p, policy, full)
        if device.type != "cpu":
            rs.buffers = {k: v.to(device) for k, v in rs.buffers.items()}
        engine = TorchNativeEngine(rs, groups, AdamWConfig(lr=1e-5), device=device)
        gen_batch = replica_rows(prompts, c.dp, dp)
        train_batch = replica_rows(train, c.dp, dp)
        n = prompts.rows // dp
        sample_ids = list(range(c.dp * n, (c.dp + 1) * n))
    params = SamplingParams(max_new_tokens=sizes["new_tokens"], temperature=1.0, seed=0)

    def gen() -> int:
        if engine is None:
            return 0
        out = engine.generate(gen_batch, sample_ids, params)  # type: ignore[arg-type]
        return int(out.valid.sum())

    def step() -> int:
        if engine is None:
            return 0
        stats = engine.train_step(train_batch, loss_fn, micro_batches=sizes["micro_batches"])  # type: ignore[arg-type]
        return stats.tokens

    def counted(n: int) -> int:
        """Tokens over all replicas (each replica's first rank contributes its count)."""
        c = grid.coord(rank) if rank in grid.ranks else None
        x = torch.tensor([n if c is not None and c.t == 0 and c.p == 0 else 0], dtype=torch.long)
        if world > 1:
            dist.all_reduce(x)
        return int(x)

    out: dict[str, Any] = {}
    for op, fn in (("gen", gen), ("train", step)):
        _timed(fn, device)  # warm-up
        runs, tokens = [], 0
        for _ in range(repeats):
            seconds, n = _timed(fn, device)
            runs.append(seconds)
            tokens = counted(n)
        med = statistics.median(runs)
        out[op] = {"tokens": tokens, "seconds": med, "runs": runs, "tokens_per_s": tokens / med}
    if engine is not None:
        engine.close()
    dist.barrier()
    groups.destroy()
    return out


def _worker(
    rank: int,
    world: int,
    model_name: str,
    layouts: list[tuple[int, int, int]],
    sizes: dict[str, int],
    repeats: int,
    store: str,
    out: str,
) -> None:
    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = load_model(model_name)
    full = full_tensors(model)
    rows = []
    for layout in layouts:
        t0 = time.perf_counter()
        res = _measure(rank, world, model, layout, sizes, repeats, Precision.FP32, torch.device("cpu"), full)
        rows.append({"layout": layout, **res, "layout_seconds": time.perf_counter() - t0})
        if rank == 0:
            g, t = res["gen"], res["train"]
            print(
                f"{model_name:<11} {label(layout):<12} gen {g['tokens_per_s']:9.1f} tok/s "
                f"({g['seconds']:.2f}s)  train {t['tokens_per_s']:9.1f} tok/s ({t['seconds']:.2f}s)",
                flush=True,
            )
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_model(
    model_name: str,
    layouts: list[tuple[int, int, int]],
    sizes: dict[str, int],
    repeats: int,
    start_method: str = "spawn",
) -> list[dict[str, Any]]:
    world = max(tp * pp * dp for tp, pp, dp in layouts)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker,
            args=(world, model_name, layouts, sizes, repeats, str(Path(tmp) / "store"), tmp),
            nprocs=world,
            join=True,
            start_method=start_method,
        )
        raw = json.loads(Path(tmp, "result.json").read_text())
    base = next(r for r in raw if tuple(r["layout"]) == (1, 1, 1))
    rows = []
    for r in raw:
        tp, pp, dp = r["layout"]
        rows.append(
            {
                "model": model_name,
                "layout": {"tp": tp, "pp": pp, "dp": dp},
                "label": label((tp, pp, dp)),
                "processes": tp * pp * dp,
                "world": world,
                "gen": r["gen"],
                "train": r["train"],
                "gen_vs_111": r["gen"]["tokens_per_s"] / base["gen"]["tokens_per_s"],
                "train_vs_111": r["train"]["tokens_per_s"] / base["train"]["tokens_per_s"],
                "layout_seconds": r["layout_seconds"],
            }
        )
    return rows


# ---------------------------------------------------------------------------- GPU (MFU)
def peak_bf16(name: str) -> float | None:
    for key, peak in PEAK_BF16.items():
        if key.lower() in name.lower():
            return peak
    return None


def gen_flops(model: ModelSpec, rows: int, plen: int, new: int) -> float:
    """Prefill of ``plen`` tokens, then ``new − 1`` single-token passes (the last token drawn needs
    none), each at its context."""
    per_row = model.sequence_forward_flops(plen) + sum(
        model.forward_flops_per_token(plen + s + 1) for s in range(new - 1)
    )
    return rows * per_row


def train_flops(model: ModelSpec, rows: int, seq: int) -> float:
    return 3.0 * rows * seq * model.forward_flops_per_token((seq + 1) / 2)


def _gpu_worker(
    _rank: int,
    model_name: str,
    sizes: dict[str, int],
    repeats: int,
    store: str,
    out: str,
    backend: str,
    device: str,
) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)  # set_device needs an index: "cuda" alone is refused
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=0,
        world_size=1,
        device_id=dev if dev.type == "cuda" else None,
    )
    model = load_model(model_name)
    res = _measure(0, 1, model, (1, 1, 1), sizes, repeats, Precision.BF16_MIXED, dev, full_tensors(model))
    Path(out, "gpu.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def run_gpu(
    model_name: str, sizes: dict[str, int], repeats: int, backend: str = "nccl", device: str = "cuda"
) -> dict[str, Any]:
    """llama-125m on one device in bf16-mixed; MFU against the device's dense bf16 peak."""
    name = torch.cuda.get_device_name(0) if device == "cuda" else device
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _gpu_worker,
            args=(model_name, sizes, repeats, str(Path(tmp) / "store"), tmp, backend, device),
            nprocs=1,
            join=True,
        )
        res = json.loads(Path(tmp, "gpu.json").read_text())
    model = load_model(model_name)
    peak = peak_bf16(name)
    flops = {
        "gen": gen_flops(model, sizes["gen_rows"], sizes["prompt"], sizes["new_tokens"]),
        "train": train_flops(model, sizes["train_rows"], sizes["seq"]),
    }
    for op, r in res.items():
        r["flops"] = flops[op]
        r["flops_per_s"] = flops[op] / r["seconds"]
        r["mfu"] = r["flops_per_s"] / peak if peak else None
    return {
        "device_name": name,
        "peak_bf16_flops": peak,
        "model": model_name,
        "precision": Precision.BF16_MIXED.value,
        "layout": {"tp": 1, "pp": 1, "dp": 1},
        "sizes": sizes,
        **res,
    }


# ---------------------------------------------------------------------------- output
def plot(rows: list[dict[str, Any]], gpu: dict[str, Any] | None, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    w = 0.38
    for ax, m in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == m]
        xs = range(len(mine))
        for j, op in enumerate(("gen", "train")):
            vals = [r[op]["tokens_per_s"] for r in mine]
            bars = ax.bar([x + (j - 0.5) * w for x in xs], vals, w, label=op)
            for b, r in zip(bars, mine, strict=True):
                ax.annotate(
                    f"×{r[f'{op}_vs_111']:.2f}",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(list(xs), [r["label"] for r in mine], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (median)")
        ax.set_title(f"{m}: torch_native, gloo on CPU, {THREADS} thread/process")
        ax.set_ylim(top=3 * max(r[op]["tokens_per_s"] for r in mine for op in ("gen", "train")))
        ax.legend(fontsize=8, ncol=2, loc="upper right")
    if gpu is not None:
        mfu = {op: gpu[op]["mfu"] for op in ("gen", "train")}
        text = ", ".join(f"{op} MFU {v:.2%}" if v is not None else f"{op} MFU n/a" for op, v in mfu.items())
        fig.suptitle(f"{gpu['model']} on {gpu['device_name']} (bf16-mixed): {text}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "engine.png", dpi=120)
    plt.close(fig)


def print_gpu(gpu: dict[str, Any]) -> None:
    for op in ("gen", "train"):
        r = gpu[op]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (unknown peak)"
        print(f"gpu {gpu['device_name']}: {op} {r['tokens_per_s']:.0f} tok/s, MFU {mfu}", flush=True)


def gpu_only(out: Path, repeats: int) -> None:
    """``--gpu-only``: llama-125m on one GPU, bf16-mixed, written to ``engine_gpu.json``."""
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/engine.py --gpu-only: no CUDA or ROCm GPU is visible")
    started, load_before = time.perf_counter(), os.getloadavg()
    gpu = run_gpu("llama-125m", GPU_SIZES, repeats)
    print_gpu(gpu)
    extra = {
        "mode": "gpu-only",
        "torch": torch.__version__,
        "seconds": {"total": time.perf_counter() - started},
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }
    print(f"wrote {write('engine_gpu', TARGETS, gpu, extra, out)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny-llama only, two layouts, small batches, one repeat, workers from a fork server",
    )
    ap.add_argument(
        "--gpu-only",
        action="store_true",
        help="only the one-GPU bf16 part (engine_gpu.json): for a GPU box whose CPU layouts are not wanted",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.gpu_only:
        gpu_only(args.out, args.repeats)
        return
    started, load_before = time.perf_counter(), os.getloadavg()
    models = ["tiny-llama"] if args.quick else ["tiny-llama", "llama-125m"]
    layouts = list(QUICK_LAYOUTS if args.quick else LAYOUTS)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    repeats = 1 if args.quick else args.repeats
    start_method = fork_server(globals()) if args.quick else "spawn"
    rows: list[dict[str, Any]] = []
    model_seconds = {}
    for m in models:
        t0 = time.perf_counter()
        rows += run_model(m, layouts, sizes, repeats, start_method)
        model_seconds[m] = time.perf_counter() - t0
    vllm = None
    if importlib.util.find_spec("vllm") is not None:
        vllm_models = ["tiny-llama-h32"] if args.quick else ["tiny-llama-h32", "llama-125m"]
        t0 = time.perf_counter()
        vllm = run_vllm(vllm_models, sizes, repeats)
        model_seconds["vllm"] = time.perf_counter() - t0
    else:
        print("no vLLM installed: the vLLM comparison is skipped (vllm: null)", flush=True)
    gpu = None
    if torch.cuda.is_available():
        gpu = run_gpu("llama-125m", GPU_SIZES, repeats)
        print_gpu(gpu)
    else:
        print("no CUDA: GPU/MFU part skipped (gpu: null)", flush=True)
    print(
        f"{'model':<11} {'layout':<12} {'gen tok/s':>10} {'×(1,1,1)':>9} {'train tok/s':>12} {'×(1,1,1)':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<11} {r['label']:<12} {r['gen']['tokens_per_s']:10.1f} {r['gen_vs_111']:9.2f} "
            f"{r['train']['tokens_per_s']:12.1f} {r['train_vs_111']:9.2f}"
        )
    extra = {
        "mode": "quick" if args.quick else "full",
        "models": models,
        "layouts": [list(x) for x in layouts],
        "sizes": sizes,
        "repeats": repeats,
        "threads_per_process": THREADS,
        "backend": "gloo",
        "precision": Precision.FP32.value,
        "optimizer": "AdamW (FlatAdamW), lr 1e-5",
        "note": "on few cores more processes share the same compute: compare layouts by *_vs_111, same run",
        "gpu": gpu,
        "vllm": vllm,
        "seconds": {"models": model_seconds, "total": time.perf_counter() - started},
        "load_average": {"before": load_before, "after": os.getloadavg()},  # other work on the cores
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write("engine", TARGETS, rows, extra, args.out)
    plot(rows, gpu, args.out)
    if vllm:
        plot_vllm(vllm, args.out)
    print(
        f"wrote {args.out / 'engine.json'} and {args.out / 'engine.png'} ({extra['seconds']['total']:.0f}s)"
    )


if __name__ == "__main__":
    main()
