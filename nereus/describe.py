"""``nereus describe``: the derived facts of a model or a cluster spec, and this node's GPUs
(``describe node``: what ``nereus.telemetry`` reads, their health and the links between them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nereus.errors import ConfigError
from nereus.plan.report import gpu_ranges
from nereus.spec import load_cluster, load_model
from nereus.spec.cluster import GIB
from nereus.telemetry import NodeInventory, fatal_event
from nereus.telemetry.inventory import LinkKind


def run(args: argparse.Namespace, out: Console, read_node: Callable[[], NodeInventory]) -> int:
    """``nereus describe model|cluster NAME`` or ``nereus describe node``; ``read_node`` reads this
    node (the CLI passes ``nereus.telemetry.read_node``)."""
    if args.kind == "node":
        return _describe_node(read_node(), args.json, out)
    if args.kind == "model":
        m = load_model(args.name)
        if args.seq_len and args.seq_len > m.max_position_embeddings:
            raise ConfigError(
                f"--seq-len {args.seq_len} exceeds {m.name}'s max_position_embeddings "
                f"{m.max_position_embeddings}"
            )
        # mean tokens attended per token of a causal pass ((L + 1) / 2; a sliding window caps it)
        ctx = float(m.causal_sum(float(args.seq_len))) / args.seq_len if args.seq_len else 0.0
        doc: dict[str, Any] = {
            "name": m.name,
            "family": m.family.value,
            "params": m.param_count(),
            "params_non_embedding": m.non_embedding_params(),
            "flops_per_token": m.forward_flops_per_token(ctx),
            "flops_per_token_train": 3 * m.forward_flops_per_token(ctx),
            "attention_flops_per_context_token": m.attention_flops_per_context_token(),
            "kv_bytes_per_token": m.kv_bytes_per_token(),
            "seq_len": args.seq_len,
            **{
                k: getattr(m, k)
                for k in (
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "intermediate_size",
                    "vocab_size",
                    "tie_word_embeddings",
                    "qk_norm",
                    "attention_bias",
                    "rms_norm_eps",
                    "rope_theta",
                    "max_position_embeddings",
                    "sliding_window",
                    "max_window_layers",
                )
            },
            "rope": m.rope_kind,
        }
    else:
        c = load_cluster(args.name)
        doc = {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(c).items()}
        doc["total_gpus"] = c.total_gpus
    if args.json:
        print(json.dumps(doc))
        return 0
    table = Table(title=f"{args.kind} {escape(str(doc['name']))}", title_justify="left", show_header=False)
    for k, v in doc.items():
        table.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else escape(str(v)))
    out.print(table)
    return 0


_LINK_CELL = {"nvlink": "NV", "xgmi": "XGMI", "pcie": "PCIe", "numa": "NUMA", "smp": "SMP"}


def _describe_node(inv: NodeInventory, as_json: bool, out: Console) -> int:
    """This node's GPUs (NVML, else amdsmi): a table, or ``--json``; no GPUs is an answer, exit 0."""
    if as_json:
        print(json.dumps(inv.to_json()))
        return 0
    if not inv.gpus:
        out.print(f"[bold]node {escape(inv.node)}[/]: no GPUs found")
        for line in inv.tried:
            out.print(f"  tried {escape(line)}")
        return 0
    title = f"node {escape(inv.node)}: {inv.gpu_count} GPUs via {inv.source}"
    table = Table(title=title, title_justify="left")
    for col in ("GPU", "model", "PCI bus", "memory GiB", "health", "problems / throttling"):
        table.add_column(col, justify="right" if col in ("GPU", "memory GiB") else "left")
    for g in inv.gpus:
        total, used = g.memory_total_bytes, g.memory_used_bytes
        mem = "?" if total is None else f"{total / GIB:.1f}"
        if used is not None:
            mem = f"{used / GIB:.1f} / {mem}"
        h = g.health
        notes = [*h.problems]
        minor = [e for e in h.xid_or_ras_events if fatal_event(e) is None]
        if minor:
            notes.append("events: " + ", ".join(minor))
        if h.throttle_reasons:
            notes.append("throttled: " + ", ".join(h.throttle_reasons))
        table.add_row(
            str(g.index),
            escape(g.model or "?"),
            escape(g.pci_bus_id or "?"),
            mem,
            "ok" if h.healthy else "[bold red]UNHEALTHY[/]",
            escape("; ".join(notes)) or "-",
        )
    out.print(table)
    if inv.links:
        ids = [g.index for g in inv.gpus]
        topo = Table()
        topo.add_column("")
        for j in ids:
            topo.add_column(str(j), justify="center")
        for i in ids:
            cells = ["X" if i == j else _LINK_CELL.get(inv.link(i, j) or "", "?") for j in ids]
            topo.add_row(str(i), *cells)
        out.print(topo)
        out.print("links: NV NVLink, XGMI Infinity Fabric, PCIe through PCIe switches or a host bridge,")
        out.print("       NUMA through the CPU, SMP across CPU sockets")
        direct: tuple[LinkKind, ...] = ("nvlink", "xgmi")
        for kind in direct:
            groups = [grp for grp in inv.islands(kind) if len(grp) > 1]
            if groups:
                out.print(f"{_LINK_CELL[kind]} islands: " + "  ".join(gpu_ranges(grp) for grp in groups))
    for line in inv.errors:
        out.print(f"failed call: {escape(line)}")
    for line in inv.tried:
        out.print(f"tried {escape(line)}")
    return 0
