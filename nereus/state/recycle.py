"""Recycled host buffers: what a GPU's caching allocator does for state buffers, on the CPU.

A transition allocates the new rank's buffers kind by kind and frees the old rank's kind j once
round j has arrived (``execute.Executor._round``). On a GPU the caching allocator hands the freed
block to the next kind's buffer; on the CPU every new buffer of more than a few MiB is a fresh
``mmap`` whose pages the kernel faults in and zeroes on first touch, while the freed one goes back
to the kernel. ``take`` and ``offer`` keep those blocks in the process instead:

* ``take(numel, dtype, device)``: a flat buffer. On the CPU, the smallest kept block that holds
  it (at most twice as large, or as large as a new one) whose memory nothing else references any
  more; else a new block with a little room to spare (1/64, rounded up to 2 MiB; 512 bytes below
  1 MiB), so that a rank of another layout, a few KiB larger, still fits a block freed by this
  one. Anywhere else (a GPU): ``torch.empty``, the caching allocator's business.
* ``offer(buf)``: the caller is done with ``buf``; its block is kept (at most ``KEEP`` blocks,
  the oldest dropped first) and handed out again only once no tensor, view or parameter shares its
  memory — the storage's use count is the test, so a buffer something still reads is never reused.
* ``release()``: drop every kept block (the runtime does it after each transition, so the memory
  a step sees is the memory the ledger counts).

Edge module (torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

KEEP = 64  # blocks kept at most
_SMALL = 1 << 20  # below: rounded to 512 bytes, above: to 2 MiB
_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def capacity(nbytes: int) -> int:
    """The bytes of a new block for a buffer of ``nbytes``: 1/64 to spare, rounded up."""
    grain = 512 if nbytes < _SMALL else 2 << 20
    want = nbytes + nbytes // 64
    return -(-want // grain) * grain


@dataclass(slots=True)
class Counts:
    taken: int = 0  # buffers handed out on the CPU
    reused: int = 0  # of which from a kept block
    reused_bytes: int = 0


class HostCache:
    """Blocks of freed CPU buffers, handed out again once nothing references them."""

    def __init__(self, keep: int = KEEP) -> None:
        if keep < 0:
            raise ValueError(f"keep: expected a count of blocks >= 0, got {keep}")
        self.keep = keep
        self.blocks: list[torch.Tensor] = []  # uint8 tensors over whole storages
        self.counts = Counts()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        device = torch.device(device)
        if device.type != "cpu" or _use_count is None:
            return torch.empty(numel, dtype=dtype, device=device)
        need = numel * dtype.itemsize
        self.counts.taken += 1
        found = self._free_block(need)
        if found is None:
            block = torch.empty(capacity(need), dtype=torch.uint8)
        else:
            block = self.blocks.pop(found)
            self.counts.reused += 1
            self.counts.reused_bytes += need
        return torch.empty(0, dtype=dtype).set_(block.untyped_storage(), 0, (numel,), (1,))

    def offer(self, buf: torch.Tensor) -> None:
        """Keep ``buf``'s block for a later ``take`` (CPU only; the caller lets go of ``buf``)."""
        if buf.device.type != "cpu" or _use_count is None or self.keep == 0:
            return
        storage = buf.untyped_storage()
        if any(b.untyped_storage().data_ptr() == storage.data_ptr() for b in self.blocks):
            return
        self.blocks.append(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
        if len(self.blocks) > self.keep:
            self.blocks.pop(0)

    def release(self) -> None:
        self.blocks.clear()

    def _free_block(self, need: int) -> int | None:
        """The index of the smallest kept block that fits ``need`` bytes (at most twice them, or
        what a new block would be) and that only this cache references (its tensor and the
        storage asked for the count: 2)."""
        best, best_size, most = None, 0, max(2 * need, capacity(need))
        for i, block in enumerate(self.blocks):
            size = block.numel()
            if need <= size <= most and (best is None or size < best_size):
                assert _use_count is not None
                if _use_count(block.untyped_storage()._cdata) <= 2:
                    best, best_size = i, size
        return best


_CACHE = HostCache()


def cache() -> HostCache:
    """This process's host cache (shared by every transition and state it makes)."""
    return _CACHE


def take(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return _CACHE.take(numel, dtype, device)


def offer(buf: torch.Tensor) -> None:
    _CACHE.offer(buf)


def release() -> None:
    _CACHE.release()
