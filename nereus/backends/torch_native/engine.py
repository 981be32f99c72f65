"""``TorchNativeEngine``: the Backend, a ``BoundStage`` (``stage.py``) and, for a trainer, its
``Optimizer`` (``training.py``); every call is one of the concern modules' functions on them.
Edge module (torch.distributed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from nereus.backends.grid import Coord, Grid
from nereus.backends.groups import Groups
from nereus.backends.model import DecoderStage
from nereus.backends.optim import AdamWConfig, FlatAdamW
from nereus.backends.protocol import Capabilities, EngineOptions, Generation, LossFn, TokenBatch, TrainStats
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import generation, training, weights
from nereus.backends.torch_native.stage import BoundStage
from nereus.spec.model import ModelSpec
from nereus.state.buffers import BufferKind
from nereus.state.holder import RankState


class TorchNativeEngine:
    capabilities = Capabilities(
        train=True, generate=True, value_head=True, devices=("cpu", "cuda"),
        tensor_parallel="DTensor parallelize_module", pipeline_parallel="torch.distributed.pipelining",
    )  # fmt: skip

    def __init__(
        self, state: RankState, groups: Groups, optim: AdamWConfig | None = None,
        device: torch.device | str | None = None, *, options: EngineOptions | None = None,
    ) -> None:  # fmt: skip
        # ``options`` (the plan's limits for a generation engine) do not apply: the KV cache is
        # sized per call by the batch it decodes.
        self.optim_config = optim or AdamWConfig()
        self.device = torch.device(device) if device is not None else state.buffers[BufferKind.PARAM].device
        self._bind(state, groups)

    def _bind(self, state: RankState, groups: Groups) -> None:
        self.bound = BoundStage(state, groups, self.device)
        self.optimizer = training.Optimizer.of(self.bound, self.optim_config)

    # ------------------------------------------------------------------ the bound stage's view
    @property
    def state(self) -> RankState:
        return self.bound.state

    @property
    def groups(self) -> Groups:
        return self.bound.groups

    @property
    def grid(self) -> Grid:
        return self.bound.grid

    @property
    def coord(self) -> Coord:
        return self.bound.coord

    @property
    def model(self) -> ModelSpec:
        return self.bound.model

    @property
    def stage(self) -> DecoderStage:
        return self.bound.stage

    @property
    def trains(self) -> bool:
        return self.bound.trains

    @property
    def optim(self) -> FlatAdamW | None:
        return self.optimizer.adamw if self.optimizer is not None else None

    # ------------------------------------------------------------------ Backend
    def rebind(
        self, state: RankState, groups: Groups | None = None, options: EngineOptions | None = None
    ) -> None:
        if groups is None and self.bound.same_place(state):
            self.bound.rebind(state)
            return
        if groups is None:
            raise ValueError("a new layout or position needs the new grid's groups")
        self._bind(state, groups)

    def close(self) -> None:
        self.bound.close()

    def forward(self, batch: TokenBatch, micro_batches: int = 1, temperature: float = 1.0) -> Tensor:
        return self.bound.forward(batch, micro_batches, temperature)

    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, micro_batches: int = 1, temperature: float = 1.0
    ) -> TrainStats:
        return training.train_step(self.bound, self.optimizer, batch, loss_fn, micro_batches, temperature)

    def generate(self, prompts: TokenBatch, sample_ids: Sequence[int], params: SamplingParams) -> Generation:
        return generation.generate(self.bound, prompts, sample_ids, params)

    def load_hf(self, directory: Path) -> None:
        self.read_hf(directory)

    def read_hf(self, directory: Path) -> None:
        weights.load_hf(self.bound, directory)

    def reload(self) -> None:
        """The buffers are the weights: nothing to take."""

    def full_state(self, kind: BufferKind = BufferKind.PARAM) -> dict[str, Tensor] | None:
        """The whole model's tensors of buffer ``kind`` (parameters by default; master weights or
        Adam moments for a trainer) on replica 0's first rank, ``None`` elsewhere. Collective over
        replica 0."""
        return weights.full_state(self.bound, kind)

    def save_hf(self, directory: Path, companions: Sequence[Path] = ()) -> None:
        weights.save_hf(self.bound, directory, companions)
