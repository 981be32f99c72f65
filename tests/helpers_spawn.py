"""Spawned gloo worlds for the ``dist`` tests, started from a fork server.

``mp.spawn`` starts each process from nothing: every one imports the test module, torch and the
engine anew (~4 CPU-s each, 16 for a world of 4 on the two cores they share). ``world`` starts
them from a fork server (as ``nereus.runtime.local`` starts a run's workers) that imported the
test module once: each process is a fork of a process that has run nothing but imports (no
threads, no torch state), so it starts as a spawned one would, without the imports. The server
is the pytest process's, started by the first world; a later world's module, missing from it,
is imported by each of its processes (the heavy part, torch and nereus, is already there).
A forked process has the server's environment (the pytest process's when the first world
started), not the caller's at the call: a world that needs variables a test sets uses ``mp.spawn``.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as torch_mp


def _run(rank: int, fn: Callable[..., None], args: tuple[Any, ...], threads: int) -> None:
    torch.set_num_threads(threads)
    fn(rank, *args)


def world(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, threads: int = 1) -> None:
    """``fn(rank, *args)`` on ``nprocs`` processes of ``threads`` torch threads each, joined (a
    failing rank raises here, as ``mp.spawn``); the fork server when the platform has one, else
    spawn. One thread, as a run's workers have on a shared node: with torch's default (a thread
    per core) every process's OpenMP threads spin after each small op on cores the others need
    (``test_engine_parallel``'s world took 278 CPU-s on two cores, 49 with one thread)."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        # the modules the server imports when it starts (no effect once it runs)
        mp.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", fn.__module__])
    torch_mp.start_processes(_run, args=(fn, args, threads), nprocs=nprocs, join=True, start_method=method)
