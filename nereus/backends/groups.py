"""Process groups from a Grid: this rank's communicators for one model-stage's grid.

``Groups.build`` creates the communicators a ``Grid`` names. It is collective over the whole world
(``new_group`` is): every rank builds the same grids in the same order, members or not.
Edge module (torch.distributed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from nereus.backends.grid import Coord, Grid
from nereus.spec.model import ModelSpec

# groups whose coordinate is the group rank (torch sorts a group's ranks): a TP rank's vocabulary
# shard and DTensor mesh coordinate, a pipeline stage's peers; the others only sum or gather by rank
ORDERED = frozenset({"tp", "pp"})


@dataclass(slots=True)
class Groups:
    """This rank's communicators for one grid (``None`` where the group has one rank)."""

    grid: Grid
    rank: int
    coord: Coord
    tp: Any = None
    pp: Any = None
    dp: Any = None
    unit: Any = None
    tie: Any = None
    kv: Any = None
    created: list[Any] = field(default_factory=list)
    _tp_mesh: DeviceMesh | None = None

    @classmethod
    def build(cls, grid: Grid, model: ModelSpec, rank: int, timeout: timedelta | None = None) -> Groups:
        """Collective over the world: every rank calls it for the same grids in the same order."""
        g = cls(grid, rank, grid.coord(rank) if rank in grid.ranks else Coord(-1, -1, -1))
        for kind, ranks in grid.all_groups(model):
            if kind in ORDERED and list(ranks) != sorted(ranks):  # torch sorts a group's ranks
                raise ValueError(
                    f"{kind} group {list(ranks)}: ranks must ascend with the coordinate (a pipeline "
                    "stage's peer, a vocabulary shard's offset and a mesh coordinate are the group rank)"
                )
            pg = dist.new_group(list(ranks), timeout=timeout)
            if rank in ranks:
                setattr(g, kind, pg)
                g.created.append(pg)
        return g

    def time_out(self, timeout: timedelta) -> None:
        """Each later collective on these groups fails after ``timeout``."""
        for pg in self.created:
            pg.set_timeout(timeout)

    def require(self, model: ModelSpec) -> None:
        """Raise unless this rank has every group ``model`` needs on this grid (groups built for
        a model with other KV heads or an untied head would silently skip a reduction)."""
        needed = {kind for kind, ranks in self.grid.all_groups(model) if self.rank in ranks}
        missing = sorted(kind for kind in needed if getattr(self, kind) is None)
        if missing:
            raise ValueError(
                f"rank {self.rank}: groups lack {missing} needed by {model.name} on {self.grid.layout}"
            )

    def tp_mesh(self, device_type: str) -> DeviceMesh | None:
        if self.tp is None:
            return None
        if self._tp_mesh is None:
            # DTensor caches sharding decisions by mesh equality (ranks, device, dim names), not
            # by communicator; a unique dim name keeps a rebuilt group's mesh from aliasing an
            # earlier, destroyed one over the same ranks.
            name = f"tp_{self.tp.group_name}"
            self._tp_mesh = DeviceMesh.from_group(self.tp, device_type, mesh_dim_names=(name,))
        return self._tp_mesh

    def destroy(self) -> None:
        for pg in self.created:
            dist.destroy_process_group(pg)
        self.created.clear()
        self.tp = self.pp = self.dp = self.unit = self.tie = self.kv = None
        self._tp_mesh = None
