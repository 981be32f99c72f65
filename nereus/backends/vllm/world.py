"""The replica's ranks as vLLM's world, inside our larger one.

vLLM keeps its process groups (world, TP, PP, DP, ...) as process-wide globals and builds them
from ``torch.distributed``'s world: ranks ``0..n-1`` where ``n`` is the world size, every rank of
the world calling ``new_group`` for every group. A generation replica is a few ranks of ours (the
others run other model-stages or other replicas). While vLLM builds, ``replica_world(ranks)``
shows it a world of ``len(ranks)`` ranks, maps each group it asks for onto the replica's global
ranks, and creates only this rank's groups with local synchronization (``new_group(...,
use_local_synchronization=True)``: only members take part, and torch's group counter, which our
own collective group creation relies on, is not advanced). Its coordinators then hold global
ranks, so vLLM's collectives address the right processes. Torch names a locally synchronised
group after its ranks and the number of groups alive, so a rebuild over the same ranks would
reuse an earlier, destroyed group's name and meet its stale rendezvous keys in the store; while
vLLM builds, its groups are named after the build's ``ident`` instead. A GPU world binds its device
(``init_process_group(device_id=...)``), and torch then creates every new NCCL group by
``ncclCommSplit`` of the world's communicator, a collective over every rank of the world, which the
ranks outside a locally synchronised group never join: a replica smaller than the world would hang
in its first group. While vLLM builds, the world's binding is set aside (its groups initialise their
communicators lazily, among their members only) and restored after. ``release()`` drops vLLM's groups
without touching our world; ``keeping_ours()`` keeps vLLM's own engine shutdown from destroying
the default process group.
Edge module (torch.distributed, vLLM).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# vLLM's group globals (``vllm.distributed.parallel_state``); each version has a subset.
_GROUPS = (
    "_TP",
    "_ETP",
    "_ENGRAM_DP",
    "_DCP",
    "_PCP",
    "_PP",
    "_DP",
    "_EP",
    "_EPLB",
    "_INNER_DP_WORLD",
    "_WORLD",
)


@contextmanager
def replica_world(ranks: Sequence[int], ident: str) -> Iterator[None]:
    """vLLM builds its groups over ``ranks`` (global ranks of our world, this one among them).
    ``ident``, the same on every rank of the replica and new for each build, names the shared
    memory segments of vLLM's CPU communicator (it would name them after its init method,
    ``env://``, the same for every job on the node)."""
    import vllm.distributed.parallel_state as ps

    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not in the replica {list(ranks)}")
    replica = list(ranks)
    world_size, new_group, init = dist.get_world_size, dist.new_group, ps.GroupCoordinator.__init__
    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide

    def replica_size(group: Any = None) -> int:
        return len(replica) if group is None else world_size(group)

    def local_group(ranks: Any = None, *args: Any, **kwargs: Any) -> Any:
        if ranks is None or me not in ranks:
            return dist.GroupMember.NON_GROUP_MEMBER
        kwargs["use_local_synchronization"] = True
        return new_group(list(ranks), *args, **kwargs)

    def on_replica(self: Any, group_ranks: list[list[int]], *args: Any, **kwargs: Any) -> None:
        init(self, [[replica[i] for i in g] for g in group_ranks], *args, **kwargs)

    release()
    dist.get_world_size, dist.new_group = replica_size, local_group
    ps.GroupCoordinator.__init__ = on_replica  # type: ignore[method-assign]
    with _unbound(), _group_names(ident), _shm_names(ident):
        try:
            yield
        finally:
            dist.get_world_size, dist.new_group = world_size, new_group
            ps.GroupCoordinator.__init__ = init  # type: ignore[method-assign]
            torch.set_num_threads = set_threads


@contextmanager
def _unbound() -> Iterator[None]:
    """The world's bound device set aside: no new group splits the world's communicator."""
    import torch.distributed.distributed_c10d as c10d

    world = c10d._get_default_group()
    bound = world.bound_device_id
    world.bound_device_id = None
    try:
        yield
    finally:
        world.bound_device_id = bound


@contextmanager
def _group_names(ident: str) -> Iterator[None]:
    """Locally synchronised groups named after ``ident``, their ranks and how many groups over
    the same ranks this build made before (the same on every member)."""
    import torch.distributed.distributed_c10d as c10d

    original = c10d._process_group_name
    made: dict[tuple[int, ...], int] = {}

    def named(ranks: Any, use_hashed_name: bool) -> Any:
        if not use_hashed_name:
            return original(ranks, use_hashed_name)
        key = tuple(ranks)
        made[key] = made.get(key, 0) + 1
        text = f"nereus-vllm/{ident}/{'_'.join(map(str, key))}/{made[key]}"
        return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()

    c10d._process_group_name = named
    try:
        yield
    finally:
        c10d._process_group_name = original


@contextmanager
def _shm_names(ident: str) -> Iterator[None]:
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc
    except ImportError:  # a GPU build without the CPU communicator
        yield
        return
    shm = getattr(cc, "_CPUSHMDistributed", None)
    if shm is None:
        yield
        return
    original = shm.__dict__["make_group_name"]

    def named(communicator: Any) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"nereus-{ident}-{communicator.unique_name}-[{ranks}]-cpushm"

    shm.make_group_name = staticmethod(named)
    try:
        yield
    finally:
        shm.make_group_name = original


@contextmanager
def keeping_ours() -> Iterator[None]:
    """While vLLM shuts an engine down: its teardown of "the distributed environment" drops its
    own groups only, never our world's default process group."""
    import vllm.distributed.parallel_state as ps

    teardown = ps.destroy_distributed_environment
    ps.destroy_distributed_environment = release
    try:
        yield
    finally:
        ps.destroy_distributed_environment = teardown


def release() -> None:
    """Forget vLLM's groups (destroyed when our world is still the one they were made in)."""
    import vllm.distributed.parallel_state as ps

    for name in _GROUPS:
        group = getattr(ps, name, None)
        if group is None:
            continue
        with suppress(Exception):  # a group of an earlier world: only dropped
            group.destroy()
        setattr(ps, name, None)


def release_all() -> None:
    """After a failed world: shut this process's vLLM engine down (it holds our groups of that
    world) and forget vLLM's groups."""
    from nereus.backends.vllm import engine

    engine.close_all()
    release()


def time_out(timeout: timedelta) -> None:
    """Each later collective on vLLM's groups (this rank's replica's) fails after ``timeout``."""
    import vllm.distributed.parallel_state as ps

    for name in _GROUPS:
        group = getattr(ps, name, None)
        for pg in (getattr(group, "device_group", None), getattr(group, "cpu_group", None)):
            if isinstance(pg, dist.ProcessGroup):
                pg.set_timeout(timeout)
