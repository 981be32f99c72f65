"""``nereus price``: the command line of ``nereus.plan.price`` (no torch; a login node runs it).

Prints the latency of one model-stage in the named layout (total, per term and per op class) and
its peak memory per GPU against the capacity; ``--json`` prints ``{"latency_s", "peak_mem_gib",
"fits", "by_class", ...}``. Exit 0 when it fits, 3 (with the same output) when it does not, 2 on
bad input (one line naming the flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nereus.errors import ConfigError
from nereus.plan.calibration import CalibrationStore
from nereus.plan.price import Price, PriceQuery, price
from nereus.spec import load_cluster, load_model
from nereus.spec.files import float_flag, int_flag
from nereus.spec.model import Head, check_context
from nereus.spec.workload import Precision, Recompute, Stage

NOT_FITTING = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser("price", help="latency and memory of one model-stage in a layout you name")
    p.add_argument("--model", required=True, help="shipped name, our YAML, or HF config.json/dir")
    p.add_argument("--cluster", required=True, help="shipped name or a cluster YAML")
    p.add_argument("--stage", required=True, choices=[s.value for s in Stage])
    p.add_argument(
        "--head", choices=[h.value for h in Head], default=Head.LM.value,
        help="lm: the actor's or reference's; value: a critic's or reward model's (inf, train)",
    )  # fmt: skip
    for flag in ("tp", "pp", "dp"):
        p.add_argument(f"--{flag}", required=True, type=int_flag)
    p.add_argument(
        "--gpus", type=int_flag, default=None,
        help="place the layout on a pool of this many GPUs, as plan --gpus does (default: tp·pp·dp)",
    )  # fmt: skip
    p.add_argument("--sequences", required=True, type=int_flag, help="sequences the stage processes")
    p.add_argument("--prompt-len", required=True, type=int_flag, help="mean prompt tokens")
    p.add_argument("--seq-len", required=True, type=int_flag, help="mean response tokens")
    p.add_argument("--seq-len-p95", type=int_flag, default=None, help="p95 response tokens (memory)")
    p.add_argument("--micro-batch", type=int_flag, default=None, help="per-replica micro-batch (train, inf)")
    p.add_argument("--global-batch", type=int_flag, default=None, help="train: sequences per optimizer step")
    p.add_argument("--recompute", choices=[r.value for r in Recompute], default=Recompute.NONE.value)
    p.add_argument(
        "--concurrency", type=int_flag, default=None,
        help="gen: sequences decoded at once per replica (default: all of its share; exit 3 if "
        "their KV cache does not fit)",
    )  # fmt: skip
    p.add_argument("--precision", choices=[x.value for x in Precision], default=Precision.BF16_MIXED.value)
    p.add_argument(
        "--overlap-dp-sync",
        action="store_true",
        help="train: price an engine that overlaps the DP all-reduce with backward (Megatron, DDP, FSDP)",
    )
    p.add_argument(
        "--paged-kv",
        action="store_true",
        help="gen: price an engine with a paged KV pool at mean occupancy (vLLM-style preemption)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="train: price an engine that shards its state over DP and gathers parameters behind "
        "compute (FSDP, ZeRO-3: verl's and torchtitan's trainers)",
    )
    p.add_argument(
        "--kv-memory-fraction",
        type=float_flag,
        default=None,
        help="gen: the engine's KV cache takes this share, in (0, 1], of the memory free after weights "
        "(TensorRT-LLM free_gpu_memory_fraction; default: the planner's headroom)",
    )
    p.add_argument(
        "--pipelined-gen",
        action="store_true",
        help="gen: price generation over pipeline stages (the torch-native engine; vLLM keeps pp 1)",
    )
    p.add_argument("--calibration", type=Path, help="calibration JSON (efficiencies per op class)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


OPTIONAL = ("seq_len_p95", "micro_batch", "global_batch", "concurrency")  # unset: the default


def run(args: argparse.Namespace, out: Console) -> int:
    for name in OPTIONAL:  # 0 is not "unset": a value given must be one
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: expected a positive integer, got {value}")
    if args.kv_memory_fraction is not None and not 0.0 < args.kv_memory_fraction <= 1.0:
        raise ConfigError(f"--kv-memory-fraction: expected a number in (0, 1], got {args.kv_memory_fraction}")
    p95, micro, batch, concurrency = (getattr(args, name) or 0 for name in OPTIONAL)
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    check_context(model, args.prompt_len, max(args.seq_len, p95), "--prompt-len + --seq-len(-p95)")
    query = PriceQuery(
        Stage(args.stage), args.tp, args.pp, args.dp, args.sequences, args.prompt_len, args.seq_len,
        p95, micro, batch, Recompute(args.recompute), concurrency,
        Precision(args.precision), overlap_dp_sync=args.overlap_dp_sync, paged_kv=args.paged_kv,
        kv_memory_fraction=args.kv_memory_fraction or 0.0, fsdp=args.fsdp,
        pipelined_gen=args.pipelined_gen, head=Head(args.head), pool=args.gpus,
    )  # fmt: skip
    efficiencies = None
    if args.calibration:
        try:
            store = CalibrationStore.load(args.calibration, cluster.name, strict=True)
        except ConfigError as exc:
            raise ConfigError(f"--calibration {str(exc).removeprefix('calibration file ')}") from None
        for what in store.clipped():
            print(f"nereus price: warning: --calibration {args.calibration}: {what}", file=sys.stderr)
        efficiencies = store.efficiencies()
    result = price(model, cluster, query, efficiencies)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        _print(result, model.name, cluster.name, out)
    return 0 if result.fits else NOT_FITTING


def _print(p: Price, model: str, cluster: str, out: Console) -> None:
    gib = 1 << 30
    fsdp = ", FSDP over DP" if p.fsdp else ""
    out.print(
        f"{p.model_stage} of {escape(model)} on {escape(cluster)}: {p.shape}{fsdp} ({p.shape.num_gpus} GPUs)"
    )
    table = Table("term", "seconds", "op class", "seconds")
    terms = [(k, v) for k, v in p.by_term.items() if v > 0]
    classes = [(k, v) for k, v in p.by_class.items() if v > 0]
    for i in range(max(len(terms), len(classes))):
        t = terms[i] if i < len(terms) else ("", None)
        c = classes[i] if i < len(classes) else ("", None)
        table.add_row(
            t[0], "" if t[1] is None else f"{t[1]:.3f}", c[0], "" if c[1] is None else f"{c[1]:.3f}"
        )
    out.print(table)
    verdict = "fits" if p.fits else "does NOT fit"
    out.print(
        f"latency {p.latency_s:.3f} s · peak {p.peak_bytes / gib:.1f} GiB per GPU of "
        f"{p.limit_bytes / gib:.1f} GiB usable: {verdict}"
    )
