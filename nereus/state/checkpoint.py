"""EMU state as DTensors for torch.distributed.checkpoint: save under one layout, load under any.

Each rank's shard of a tensor becomes a DTensor on its pipeline stage's TP mesh: ``Shard(d)``
along the one dimension its region cuts (our chunks are ``torch.chunk``'s, as DTensor's), or
``Replicate()`` where it holds the whole tensor. When tp exceeds the KV heads, rank t holds KV
head ``t // (tp / kv)``: not a shard of a 1-D TP mesh, so k/v tensors live on a 2-D (head,
replica) view of the TP ranks (``kv_mesh``) as ``[Shard(0), Replicate()]``. DCP then reshards on
load and deduplicates replicas on save. Keys are ``<kind>/<tensor name>``. Edge module
(torch.distributed).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from nereus.devices import CPU
from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state.geometry import shards, tensors_at
from nereus.state.holder import RankState


def layout_mesh(layout: Layout, ranks: list[int], device: str = CPU.type) -> DeviceMesh:
    """The (dp, pp, tp) mesh of DP replicas of ``layout`` over ``ranks`` (rank order p·tp + t).

    Every rank of the world must call it (DeviceMesh builds its groups collectively)."""
    if len(ranks) % layout.size:
        raise ValueError(f"{len(ranks)} ranks do not split into replicas of {layout}")
    shape = (len(ranks) // layout.size, layout.pp, layout.tp)
    return DeviceMesh(device, torch.tensor(ranks).view(shape), mesh_dim_names=("dp", "pp", "tp"))


def kv_mesh(model: ModelSpec, layout: Layout, ranks: list[int], device: str = CPU.type) -> DeviceMesh | None:
    """The (dp, pp, kv head, replica) mesh when tp exceeds the KV heads, else ``None``.

    Collective over the world, like ``layout_mesh``."""
    kv = model.num_key_value_heads
    if layout.tp <= kv:
        return None
    if len(ranks) % layout.size:
        raise ValueError(f"{len(ranks)} ranks do not split into replicas of {layout}")
    shape = (len(ranks) // layout.size, layout.pp, kv, layout.tp // kv)
    return DeviceMesh(device, torch.tensor(ranks).view(shape), mesh_dim_names=("dp", "pp", "kvh", "kvrep"))


def to_dtensors(rs: RankState, mesh: DeviceMesh, kv: DeviceMesh | None = None) -> dict[str, DTensor]:
    """This rank's buffers as DTensors sharing their memory (load writes straight into them).

    ``kv`` is ``kv_mesh(...)``, needed when tp exceeds the KV heads."""
    out = {}
    cut = {s.name: s for s in shards(rs.model, rs.layout, rs.t, rs.p)}
    is_kv = {spec.at(layer) for spec, layer in tensors_at(rs.model, rs.layout.pp, rs.p) if spec.kv}
    replicated_heads = rs.layout.tp > rs.model.num_key_value_heads
    if replicated_heads and kv is None:
        raise ValueError(f"{rs.model.name}: tp {rs.layout.tp} > KV heads needs the kv_mesh")
    for kind in rs.buffers:
        for slot in rs.layout_of().slots:
            full = cut[slot.name].full_shape
            if replicated_heads and slot.name in is_kv:
                assert kv is not None
                out[f"{kind.value}/{slot.name}"] = DTensor.from_local(
                    rs.view(kind, slot.name), kv["kvh", "kvrep"], [Shard(0), Replicate()], run_check=False,
                    shape=torch.Size(full), stride=torch.empty(full).stride(),
                )  # fmt: skip
                continue
            dims = [d for d, (a, b) in enumerate(slot.region) if (a, b) != (0, full[d])]
            if len(dims) > 1:
                raise ValueError(f"{slot.name}: region {slot.region} is not one DTensor shard")
            place = Shard(dims[0]) if dims else Replicate()
            out[f"{kind.value}/{slot.name}"] = DTensor.from_local(
                rs.view(kind, slot.name), mesh["tp"], [place], run_check=False,
                shape=torch.Size(full), stride=torch.empty(full).stride(),
            )  # fmt: skip
    return out
