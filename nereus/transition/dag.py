"""The transition DAG's values: primitives, nodes, edges (paper §2.11–2.13).

The units a transition creates or consumes are EMUs (``nereus.state.emu.Emu``) named by their
``id``. A ``Node`` is one primitive applied to units; it reads its
``inputs``, creates its ``outputs`` and frees the units in ``frees`` when it finishes. Memory is
taken at a node's start (``acquire``) and given back at its finish (``release``), per GPU, so the
ledger of a schedule is exact at every instant. ``bytes`` is what crosses links (the geometry's
minimum), ``flows`` says into which GPU and over which link, and ``sends``/``recvs`` are the GPU
ports a node occupies (transfers on one port serialise: shared-link contention).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from nereus.plan.opclass import Link
from nereus.state.emu import Emu


class Primitive(StrEnum):
    SPLIT = "split"
    MERGE = "merge"
    EXTEND = "extend"
    DESTROY = "destroy"


class EdgeKind(StrEnum):
    LOCAL = "local"  # the model-stage's own Split → Destroy → Extend → Merge order
    RESOURCE = "resource"  # a release another acquisition waits for (memory on shared GPUs)


@dataclass(frozen=True, slots=True)
class Flow:
    """Bytes that arrive at ``dst`` over ``link`` (None: read from shared storage)."""

    dst: int
    bytes: int
    link: Link | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    """One primitive applied to units (built by keyword: ``Node(id=…, primitive=…, …)``)."""

    id: int
    primitive: Primitive
    model_stage: str
    gpus: tuple[int, ...]  # every GPU the node touches
    bytes: int  # bytes crossing links (local copies excluded)
    est_s: float
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()
    acquire: tuple[tuple[int, int], ...] = ()  # (GPU, bytes) taken at start
    release: tuple[tuple[int, int], ...] = ()  # (GPU, bytes) given back at finish
    flows: tuple[Flow, ...] = ()
    sends: tuple[int, ...] = ()
    recvs: tuple[int, ...] = ()
    source: str = ""  # a restore's source: a model-stage (weight sync) or "storage"

    @property
    def acquires(self) -> bool:
        return any(b > 0 for _, b in self.acquire)

    @property
    def ports(self) -> tuple[tuple[int, int], ...]:
        """(GPU, 0 = send / 1 = receive) ports the node occupies while it runs."""
        return tuple((g, 0) for g in self.sends) + tuple((g, 1) for g in self.recvs)

    def describe(self) -> str:
        src = f" ← {self.source}" if self.source else ""
        ins = ",".join(self.inputs)
        outs = ",".join(self.outputs)
        arrow = f"{ins} → {outs}" if outs else ins
        return f"{self.primitive.value} {self.model_stage} {arrow}{src}"


@dataclass(frozen=True, slots=True)
class Edge:
    src: int
    dst: int
    kind: EdgeKind


@dataclass(frozen=True, slots=True)
class TransitionDag:
    """The global DAG, with the memory bound its edges guarantee.

    ``units`` holds every unit a node reads, creates or frees (units nothing touches stay as they
    are, named ``<model-stage>/u<i>`` after the i-th intact current unit). ``order`` is the greedy
    commit order (a topological order); ``peak`` the largest bytes any
    execution that respects the edges can hold on each GPU (state + staging, no runtime reserve).
    ``feasible`` is False when some acquisition could not be given the memory it needs; then
    ``reason`` says which and where, and the DAG is not to be run.
    """

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    units: dict[str, Emu]
    order: tuple[int, ...]
    peak: dict[int, int]
    capacity: dict[int, int]
    feasible: bool
    reason: str = ""

    @property
    def resource_edges(self) -> int:
        return sum(1 for e in self.edges if e.kind is EdgeKind.RESOURCE)

    def preds(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for e in self.edges:
            out[e.dst].append(e.src)
        return out

    def critical_path(self) -> tuple[float, tuple[int, ...]]:
        """Longest path by ``est_s`` through the edges (no port contention)."""
        preds = self.preds()
        finish = [0.0] * len(self.nodes)
        best: list[int] = [-1] * len(self.nodes)
        for n in self.order:
            start = 0.0
            for p in preds[n]:
                if finish[p] > start:
                    start, best[n] = finish[p], p
            finish[n] = start + self.nodes[n].est_s
        if not self.nodes:
            return 0.0, ()
        end = max(range(len(self.nodes)), key=lambda i: finish[i])
        path = [end]
        while best[path[-1]] >= 0:
            path.append(best[path[-1]])
        return finish[end], tuple(reversed(path))

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "id": n.id,
                    "primitive": n.primitive.value,
                    "stage": n.model_stage,
                    "gpus": list(dict.fromkeys(n.gpus)),  # each GPU once (an extend's sources, then targets)
                    "bytes": n.bytes,
                    "est_s": n.est_s,
                }
                for n in self.nodes
            ],
            "edges": [{"src": e.src, "dst": e.dst, "kind": e.kind.value} for e in self.edges],
        }
