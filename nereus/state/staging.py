"""Staging buffers for transitions: one reusable byte buffer per peer, kept across transitions.

A zero-copy transition reads and writes the slices that are contiguous in the flat state buffers
in place; only the others (a row-parallel cut along dimension 1, say) pass through staging. Each
round of a wave (one buffer kind) first asks ``prepare`` for the bytes it stages with every peer
(one region per staged message), then takes the regions in order. A peer's buffer is allocated
once, grown only when a round needs more than it holds, and reused by later rounds, waves and
transitions: after the first
transition of a kind, a transition allocates nothing here. ``nbytes`` is what the pool holds on
its device (what a memory bound must add); ``release`` frees it.
"""

from __future__ import annotations

import torch

from nereus.state.buffers import staged


class Staging:
    """Per-peer staging buffers on one device."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.buffers: dict[int, torch.Tensor] = {}  # peer rank → bytes
        self.allocations = 0  # buffers allocated so far (growth included)
        self._cursor: dict[int, int] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers.values())

    def prepare(self, need: dict[int, int]) -> None:
        """Start a wave that stages ``need[peer]`` bytes with each peer (regions aligned, as
        ``buffers.staged`` rounds them). Only call between rounds: a grown buffer replaces the old one."""
        self._cursor = dict.fromkeys(need, 0)
        for peer, n in need.items():
            have = self.buffers.get(peer)
            if n and (have is None or have.numel() < n):
                self.buffers.pop(peer, None)  # free the smaller one before allocating the larger
                self.buffers[peer] = torch.empty(n, dtype=torch.uint8, device=self.device)
                self.allocations += 1

    def take(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next region of ``peer``'s buffer as ``numel`` elements of ``dtype``."""
        at = self._cursor[peer]
        n = numel * dtype.itemsize
        end = at + staged(n)
        buf = self.buffers[peer]
        if end > buf.numel():
            raise RuntimeError(f"staging with rank {peer}: {end} bytes taken, {buf.numel()} prepared")
        self._cursor[peer] = end
        return buf[at : at + n].view(dtype)

    def rewind(self) -> None:
        """Start the next batch of a round: its regions are taken from the start again (the
        previous batch's messages have arrived and been copied out)."""
        self._cursor = dict.fromkeys(self._cursor, 0)

    def release(self) -> None:
        self.buffers.clear()
        self._cursor = {}


_POOLS: dict[torch.device, Staging] = {}


def pool(device: torch.device | str) -> Staging:
    """This process's staging pool for ``device`` (shared by every transition it runs)."""
    d = torch.device(device)
    if d not in _POOLS:
        _POOLS[d] = Staging(d)
    return _POOLS[d]


def release_all() -> None:
    """Free every pool's buffers (a process that needs the memory back between transitions)."""
    for p in _POOLS.values():
        p.release()
