"""What building an engine and forming its process groups truly take (a transition's fixed costs).

A transition that re-lays out a model-stage (new TP or PP) rebuilds its engine; one that changes
only DP re-forms its process groups. Each has its own form, fitted to published logs
(``benchmarks/data/truth_engines.csv``, ``benchmarks/fit_truth.py``):

* **generation engine** (vLLM): profiling, KV-cache creation, ``torch.compile`` and CUDA-graph
  capture — the weights arrive with the transition, so loading them from disk is not part of it.
  ``engine_setup_s + layers · engine_{cold,warm}_layer_s``: compile and capture walk the decoder
  layers, and vLLM's compile cache (keyed by the model and its parallel layout) makes a layout
  built before much cheaper to build again (70B at TP4: 91.8 s cold, 44.6 s warm).
* **training / inference engine** (Megatron-style modules and optimizer on the GPUs, no checkpoint
  read): ``module_setup_s``, a constant (the only published point: 1.02 s for 64.7B at TP4 PP4).
* **process groups**: a rank joins one communicator per parallel dimension (TP, PP, DP) in turn,
  each initialised in ``comm_init_s · √ranks`` (NCCL communicator init over 8 and 32 ranks);
  groups of one rank need none.

Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nereus.sim.truth.params import TruthParams

GEN, INF, TRAIN = "gen", "inf", "train"


@dataclass(frozen=True, slots=True)
class Engine:
    """One model-stage's engine as built: its stage kind, decoder layers, parallel degrees."""

    stage: str  # "gen", "inf" or "train"
    layers: int
    tp: int
    pp: int
    dp: int
    key: str = ""  # what a compile cache is keyed by (model and layout); "" for none

    def __post_init__(self) -> None:
        if self.stage not in (GEN, INF, TRAIN):
            raise ValueError(f"engine stage must be one of gen, inf, train, got {self.stage!r}")
        if min(self.layers, self.tp, self.pp, self.dp) < 1:
            raise ValueError(f"an engine needs ≥ 1 layer and degrees ≥ 1, got {self}")


def comm_init_seconds(ranks: int, p: TruthParams) -> float:
    """Initialising one communicator over ``ranks`` ranks (none for a single rank)."""
    return p.comm_init_s * math.sqrt(ranks) if ranks > 1 else 0.0


def regroup_seconds(e: Engine, p: TruthParams) -> float:
    """Forming ``e``'s TP, PP and DP groups, one after another on each rank."""
    return sum(comm_init_seconds(n, p) for n in (e.tp, e.pp, e.dp))


def build_seconds(e: Engine, warm: bool, p: TruthParams) -> float:
    """Building ``e``'s engine (``warm``: its compile cache holds this layout already)."""
    if e.stage != GEN:
        return p.module_setup_s
    per_layer = p.engine_warm_layer_s if warm else p.engine_cold_layer_s
    return p.engine_setup_s + e.layers * per_layer


class CompileCache:
    """The layouts a job has compiled a generation engine for (vLLM's cache outlives an engine)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def build(self, e: Engine, p: TruthParams) -> float:
        """Seconds to build ``e``; afterwards its layout is cached."""
        warm = bool(e.key) and e.key in self._seen
        self.mark(e)
        return build_seconds(e, warm, p)

    def mark(self, e: Engine) -> None:
        """``e`` was built where its time is counted otherwise (a restart's relaunch)."""
        if e.key:
            self._seen.add(e.key)
