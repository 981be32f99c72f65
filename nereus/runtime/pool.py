"""Pool changes: who is in the job's next generation, and the shrink requests that ask for less.

``nereus-launch shrink JOB --nodes K`` writes ``control/shrink-<unix_ms>.json`` (``{"nodes": K}``)
into the job folder; at its next step boundary the job's leader reads every request, renames it
``.done-…`` (or ``.bad-…`` with the reason logged), and drains that many whole nodes — the most
recently added first, never the leader's — by moving the plan off them while they still hold
their state. A drain the job cannot carry out (too few nodes could leave, or what is left holds
no plan) renames its requests ``.refused-…`` with the reason, for ``nereus-launch status``. A
drain whose move failed (a peer lost in it: the step rolled back, the nodes still hold state) puts
its requests back (``retake_shrinks``), to be drained at the next boundary. Both sides use this
module: ``launch/`` writes requests with ``ShrinkRequest`` and reads refusals with
``refused_shrinks``; the runtime reads requests with ``read_shrink_requests``, picks the GPUs
with ``drain_gpus``, refuses with ``refuse_shrinks`` and puts back with ``retake_shrinks``.

A ``Change`` is what the leader decided at a boundary and every member learns: the next
generation's members, who leaves (a scripted loss), who joins (newcomers admitted through the
store), who drains (a shrink). Pure: no torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

SHRINK_GLOB = "shrink-*.json"


@dataclass(frozen=True, slots=True)
class ShrinkRequest:
    """``control/shrink-<unix_ms>.json``: ``{"nodes": K}``, drained at the next step boundary."""

    nodes: int
    unix_ms: int = field(default_factory=lambda: int(datetime.now(UTC).timestamp() * 1000))

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes <= 0:
            raise ValueError(f"nodes: expected a positive integer, got {self.nodes!r}")

    @property
    def file(self) -> str:
        return f"shrink-{self.unix_ms}.json"

    def body(self) -> str:
        return json.dumps({"nodes": self.nodes}) + "\n"

    @classmethod
    def parse(cls, path: Path) -> ShrinkRequest:
        """A request file as the launcher wrote it; ValueError naming what is wrong otherwise."""
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable ({exc})") from None
        if not isinstance(data, dict) or set(data) != {"nodes"}:
            raise ValueError(f'expected {{"nodes": K}}, got {data!r}')
        stamp = path.stem.removeprefix("shrink-")
        return cls(data["nodes"], int(stamp) if stamp.isdigit() else 0)


def read_shrink_requests(control: Path | None, log: Callable[[str], None]) -> tuple[int, tuple[Path, ...]]:
    """The nodes every pending request in ``control`` asks to drain, and the requests read: each
    file is renamed ``.done-<name>`` once read (those are returned), or ``.bad-<name>`` (and
    logged) when it is not a valid request."""
    if control is None or not control.is_dir():
        return 0, ()
    nodes, done = 0, []
    for path in sorted(control.glob(SHRINK_GLOB)):
        try:
            nodes += ShrinkRequest.parse(path).nodes
        except ValueError as exc:
            log(f"ignored shrink request {path.name}: {exc}")
            os.replace(path, path.with_name(f".bad-{path.name}"))
            continue
        done.append(path.with_name(f".done-{path.name}"))
        os.replace(path, done[-1])
    return nodes, tuple(done)


REFUSED = ".refused-"  # a request the job did not carry out: ``{"nodes": K, "refused": why}``


def refuse_shrinks(done: Sequence[Path], why: str) -> None:
    """Requests ``done`` (``.done-<name>``, read) were not carried out: each becomes
    ``.refused-<name>`` with ``why``, so the launcher counts their nodes as still in the job."""
    for path in done:
        try:
            nodes = ShrinkRequest.parse(path).nodes
            target = path.with_name(REFUSED + path.name.removeprefix(".done-"))
            target.write_text(json.dumps({"nodes": nodes, "refused": why}) + "\n")
            path.unlink()
        except (OSError, ValueError):
            continue  # a request the launcher no longer knows, or a folder gone: nothing to tell


def retake_shrinks(done: Sequence[Path]) -> None:
    """Requests ``done`` (``.done-<name>``, read) were not carried out and are asked again: each is
    renamed back to ``<name>``, which the next boundary reads (a request the launcher wrote again
    meanwhile under that name is kept, and the read one dropped)."""
    for path in done:
        original = path.with_name(path.name.removeprefix(".done-"))
        try:
            if original.exists():
                path.unlink()
            else:
                os.replace(path, original)
        except OSError:
            continue  # a folder gone: nothing to ask again


def refused_shrinks(control: Path) -> dict[str, str]:
    """Request file names (``shrink-<unix_ms>.json``) the job refused, and why."""
    out = {}
    for path in sorted(control.glob(f"{REFUSED}{SHRINK_GLOB}")) if control.is_dir() else ():
        try:
            doc = json.loads(path.read_text())
            out[path.name.removeprefix(REFUSED)] = str(doc["refused"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def drain_gpus(
    nodes: int, members: Sequence[int], hosts: Mapping[int, str], leader: int
) -> tuple[tuple[int, ...], str]:
    """The GPUs of ``nodes`` whole nodes to drain — the most recently added first (the node with
    the highest GPU id), never the leader's — or () and why that many cannot leave."""
    if nodes <= 0:
        return (), ""
    mine = hosts.get(leader)
    by_host: dict[str, list[int]] = {}
    for g in members:
        by_host.setdefault(hosts.get(g, f"gpu{g}"), []).append(g)
    candidates = sorted((h for h in by_host if h != mine), key=lambda h: -max(by_host[h]))
    if nodes > len(candidates):
        return (), f"shrink by {nodes} nodes refused: only {len(candidates)} can leave"
    return tuple(sorted(g for h in candidates[:nodes] for g in by_host[h])), ""


@dataclass(frozen=True, slots=True)
class Change:
    """A pool change the leader decided at the boundary before ``step``."""

    step: int
    members: tuple[int, ...]  # of the next generation
    generation: int
    leaving: tuple[int, ...] = ()  # processes that stop (a scripted loss)
    joining: tuple[int, ...] = ()  # newcomers' GPU ids
    draining: tuple[int, ...] = ()  # processes that hand their state over, then stop (a shrink)

    def __post_init__(self) -> None:
        if set(self.leaving) & set(self.members) or not set(self.joining) <= set(self.members):
            raise ValueError(f"step {self.step}: leavers must not be members and joiners must be")

    @property
    def reforms(self) -> bool:
        """Whether the world re-forms at this boundary (someone leaves or joins now)."""
        return bool(self.leaving or self.joining)

    @property
    def after_drain(self) -> tuple[int, ...]:
        """Members once the drained processes are gone."""
        return tuple(g for g in self.members if g not in self.draining)


def lowest_free(taken: set[int]) -> int:
    """The lowest GPU id not in ``taken``."""
    g = 0
    while g in taken:
        g += 1
    return g


def node_blocks(hosts: dict[int, str], per_node: int) -> dict[str, int]:
    """Each member node's block of GPU ids (block b: ids b·per_node … (b+1)·per_node − 1): where
    its lowest id lies. The planner reads node k as ids k·per_node … (``ClusterSpec.node_of``)."""
    out: dict[str, int] = {}
    for g, host in sorted(hosts.items()):
        if host:
            out.setdefault(host, g // per_node)
    return out


def joiner_gpu(node: str, taken: set[int], blocks: dict[str, int], per_node: int, limit: int) -> int:
    """The GPU id of a newcomer on ``node``: the lowest free id in its node's block, a node new to
    the job taking the lowest block none of whose ids is taken (``blocks`` learns it), so that a
    node's GPUs are one node to the planner and to the failure domains whatever order its
    processes ask in; the lowest free id where no block fits."""
    block = blocks.get(node)
    if block is None:
        used = set(blocks.values()) | {g // per_node for g in taken}
        block = next((b for b in range(limit // per_node) if b not in used), None)
        if block is None:
            return lowest_free(taken)
        blocks[node] = block
    free = [g for g in range(block * per_node, (block + 1) * per_node) if g not in taken]
    return free[0] if free else lowest_free(taken)
