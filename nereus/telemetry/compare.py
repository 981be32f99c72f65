"""The cluster spec against what a node measured: ``compare`` names the fields that differ,
``reconcile`` puts the measured values in their place. Model names match by product token
(``NVIDIA H200`` ~ ``H200-SXM-141GB``), memory within ``MEMORY_TOLERANCE``."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from nereus.errors import ConfigError
from nereus.spec.cluster import GIB, ClusterSpec

if TYPE_CHECKING:
    from nereus.telemetry.inventory import NodeInventory

MEMORY_TOLERANCE = 0.05  # a measured memory within 5% of the spec's gpu_memory_gib matches it
_GENERIC = re.compile(r"\d+gb|hbm\d*e?|sxm\d*|pcie|nvl|oam|gcd")


def _model_tokens(name: str) -> set[str]:
    """``NVIDIA H200`` → {h200}; ``H200-SXM-141GB`` → {h200}; ``AMD Instinct MI250X / MI250`` →
    {mi250x, mi250}: the letter+digit tokens that name a product, less sizes and form factors."""
    tokens = re.findall(r"[a-z0-9]+", name.lower())
    return {t for t in tokens if re.fullmatch(r"[a-z]+\d+[a-z]*", t) and not _GENERIC.fullmatch(t)}


def _same_model(measured: str, spec: str) -> bool:
    a, b = _model_tokens(measured), _model_tokens(spec)
    if a and b:
        return bool(a & b)
    return re.sub(r"[^a-z0-9]", "", measured.lower()) == re.sub(r"[^a-z0-9]", "", spec.lower())


def _gib(n_bytes: int) -> float:
    return round(n_bytes / GIB, 1)


def compare(inventory: NodeInventory, cluster: ClusterSpec) -> list[str]:
    """Where ``cluster`` differs from what ``inventory`` measured, one entry per field
    (``"gpus_per_node 8 → 4"``); empty when they agree or nothing was measured (source "none":
    CPU workers may emulate a GPU cluster). Memory matches within ``MEMORY_TOLERANCE``; model
    names match when they share a product token (``NVIDIA H200`` ~ ``H200-SXM-141GB``)."""
    if inventory.source == "none" or not inventory.gpus:
        return []
    out = []
    if inventory.gpu_count != cluster.gpus_per_node:
        out.append(f"gpus_per_node {cluster.gpus_per_node} → {inventory.gpu_count}")
    mem = inventory.memory_per_gpu_bytes
    if mem is not None:
        measured = _gib(mem)
        if abs(measured - cluster.gpu_memory_gib) > MEMORY_TOLERANCE * cluster.gpu_memory_gib:
            out.append(f"gpu_memory_gib {cluster.gpu_memory_gib:g} → {measured:g}")
    model = inventory.model
    if model is not None and cluster.gpu_model and not _same_model(model, cluster.gpu_model):
        out.append(f"gpu_model {cluster.gpu_model} → {model}")
    return out


def reconcile(inventory: NodeInventory, cluster: ClusterSpec) -> tuple[ClusterSpec, str | None]:
    """The cluster spec with the measured values in place of those that differ, and the one
    warning line that says so (None when nothing differs). ConfigError when the measured values
    make no valid spec (a GPU smaller than the spec's runtime reserve)."""
    diffs = compare(inventory, cluster)
    if not diffs:
        return cluster, None
    changes: dict[str, Any] = {}
    if inventory.gpu_count != cluster.gpus_per_node:
        changes["gpus_per_node"] = inventory.gpu_count
    mem = inventory.memory_per_gpu_bytes
    if mem is not None and any(d.startswith("gpu_memory_gib") for d in diffs):
        changes["gpu_memory_gib"] = _gib(mem)
    if any(d.startswith("gpu_model") for d in diffs) and inventory.model is not None:
        changes["gpu_model"] = inventory.model
    line = (
        f"node {inventory.node}: cluster {cluster.name} differs from the GPUs measured by "
        f"{inventory.source} ({'; '.join(diffs)}); the measured values are used"
    )
    try:
        return replace(cluster, **changes), line
    except ValueError as exc:
        raise ConfigError(f"{line}, but they make no valid cluster: {exc}") from None
