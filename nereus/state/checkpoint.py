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
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from nereus.devices import CPU
from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state.geometry import shards, tensors_at
from nereus.state.holder import RankState


def _tp_group(layout: Layout, ranks: list[int]) -> list[int] | None:
    """The ranks of this rank's TP group among the DP replicas of ``layout`` over ``ranks``
    (rank order p·tp + t within a replica); None where this rank is not among them."""
    if len(ranks) % layout.size:
        raise ValueError(f"{len(ranks)} ranks do not split into replicas of {layout}")
    me = dist.get_rank()
    if me not in ranks:
        return None
    first = ranks.index(me) // layout.tp * layout.tp
    return ranks[first : first + layout.tp]


def layout_mesh(layout: Layout, ranks: list[int], device: str = CPU.type) -> DeviceMesh | None:
    """This rank's TP mesh (``tp``) among the DP replicas of ``layout`` over ``ranks``, which
    its shards are DTensors on; None where this rank is not among ``ranks``.

    No process group is built (``_init_backend=False``): DCP plans its save and load over the
    world's group and reads only the mesh's coordinates. Building the mesh's groups was a
    collective at every checkpoint, whose store barrier waited the boundary's whole timeout
    (30 minutes) for a peer that died just before it."""
    group = _tp_group(layout, ranks)
    if group is None:
        return None
    return DeviceMesh(device, torch.tensor(group), mesh_dim_names=("tp",), _init_backend=False)


def kv_mesh(model: ModelSpec, layout: Layout, ranks: list[int], device: str = CPU.type) -> DeviceMesh | None:
    """This rank's (KV head, replica) view of its TP group when tp exceeds the KV heads, else
    (or where this rank is not among ``ranks``) ``None``. No process group, as ``layout_mesh``."""
    kv = model.num_key_value_heads
    group = _tp_group(layout, ranks)
    if layout.tp <= kv or group is None:
        return None
    grid = torch.tensor(group).view(kv, layout.tp // kv)
    return DeviceMesh(device, grid, mesh_dim_names=("kvh", "kvrep"), _init_backend=False)


def to_dtensors(rs: RankState, mesh: DeviceMesh | None, kv: DeviceMesh | None = None) -> dict[str, DTensor]:
    """This rank's buffers as DTensors sharing their memory (load writes straight into them).

    ``mesh`` is ``layout_mesh(...)``; ``kv`` is ``kv_mesh(...)``, needed when tp exceeds the KV
    heads."""
    if mesh is None:
        raise ValueError(f"{rs.model.name}: this rank holds state but is not on its layout's mesh")
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
                    rs.view(kind, slot.name), kv, [Shard(0), Replicate()], run_check=False,
                    shape=torch.Size(full), stride=torch.empty(full).stride(),
                )  # fmt: skip
                continue
            dims = [d for d, (a, b) in enumerate(slot.region) if (a, b) != (0, full[d])]
            if len(dims) > 1:
                raise ValueError(f"{slot.name}: region {slot.region} is not one DTensor shard")
            place = Shard(dims[0]) if dims else Replicate()
            out[f"{kind.value}/{slot.name}"] = DTensor.from_local(
                rs.view(kind, slot.name), mesh, [place], run_check=False,
                shape=torch.Size(full), stride=torch.empty(full).stride(),
            )  # fmt: skip
    return out
