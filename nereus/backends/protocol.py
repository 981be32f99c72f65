"""The Backend protocol: what every engine of a model-stage offers the runtime.

An engine is built for one rank of one EMU from that rank's state (``RankState``: flat buffers,
layout, position) and the rank's process groups; it never owns the state, it views it. Every rank
of a replica is given the same batch. Calls are collective over the replica (and, for training,
over the model-stage's DP replicas). ``torch_native`` implements it; Megatron-core (training) and
``vllm`` serves generation; a Megatron-core training adapter is to come behind the same protocol.

This is the one module a runtime imports from the backends for types: besides the protocol and
its values it re-exports ``Groups``, ``Grid``, ``Coord``, ``SamplingParams`` and ``AdamWConfig``.
Engines are found by name through ``nereus.backends.registry``; an ``EngineFactory`` builds one,
given the plan's ``EngineOptions`` for it (a generation engine's concurrency and KV room).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from torch import Tensor

from nereus.backends.grid import Coord, Grid
from nereus.backends.groups import Groups
from nereus.backends.optim import AdamWConfig
from nereus.backends.sampling import SamplingParams
from nereus.state.holder import RankState

__all__ = [
    "AdamWConfig",
    "Backend",
    "Capabilities",
    "Coord",
    "EngineFactory",
    "EngineOptions",
    "Generation",
    "GenerationStats",
    "Grid",
    "Groups",
    "LossFn",
    "SamplingParams",
    "TokenBatch",
    "TrainStats",
]

LossFn = Callable[[Tensor, Mapping[str, Tensor]], Tensor]
"""``loss(scores, fields)`` for one micro-batch: ``scores`` (b, T) are the engine's per-token
log-probs (or values), ``fields`` the batch's per-token float tensors cut to the same rows. It
returns a scalar already normalised for the whole global batch (e.g. divided by the global token
count), so micro-batch and replica gradients simply add up."""


@dataclass(frozen=True, slots=True, eq=False)
class TokenBatch:
    """Token ids (B, T), a 0/1 validity mask (B, T) and per-token float fields (B, T)."""

    ids: Tensor
    valid: Tensor
    fields: Mapping[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.ids.dtype.is_floating_point:
            raise ValueError(
                f"ids must be an integer (B, T) tensor, got {self.ids.dtype} {tuple(self.ids.shape)}"
            )
        if self.valid.shape != self.ids.shape:
            raise ValueError(f"valid {tuple(self.valid.shape)} must match ids {tuple(self.ids.shape)}")
        for name, t in self.fields.items():
            if t.shape != self.ids.shape:
                raise ValueError(f"field '{name}' {tuple(t.shape)} must match ids {tuple(self.ids.shape)}")

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])

    def split(self, parts: int) -> list[TokenBatch]:
        """``parts`` micro-batches of equal size (``tensor_split`` order, as pipelining does)."""
        if parts <= 0 or self.rows % parts:
            raise ValueError(f"micro_batches {parts} must divide the batch of {self.rows} rows")
        ids, valid = self.ids.tensor_split(parts), self.valid.tensor_split(parts)
        fields = {k: v.tensor_split(parts) for k, v in self.fields.items()}
        return [TokenBatch(ids[i], valid[i], {k: v[i] for k, v in fields.items()}) for i in range(parts)]


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """What one replica's generation did, for telemetry and calibration: tokens generated, engine
    steps (one prefill or decode pass over the running batch each), the largest share of the KV
    cache in use, and sequences preempted (evicted for lack of KV room and recomputed)."""

    tokens: int = 0
    decode_steps: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.decode_steps < 0 or self.preemptions < 0:
            raise ValueError("generation counts must be non-negative")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")

    def plus(self, other: GenerationStats) -> GenerationStats:
        """Two calls' statistics together (the KV share: the larger)."""
        return GenerationStats(
            self.tokens + other.tokens, self.decode_steps + other.decode_steps,
            max(self.kv_usage, other.kv_usage), self.preemptions + other.preemptions,
        )  # fmt: skip

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": float(self.tokens), "decode_steps": float(self.decode_steps),
            "kv_usage": self.kv_usage, "preemptions": float(self.preemptions),
        }  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class Generation:
    """Prompts as given and responses: tokens, validity (0 after a stop token) and log-probs
    (B, N) of each sampled token under the sampling distribution; ``stats`` what the engine did."""

    prompt: Tensor
    prompt_valid: Tensor
    tokens: Tensor
    valid: Tensor
    logprobs: Tensor
    stats: GenerationStats = field(default_factory=GenerationStats)

    def sequences(self) -> TokenBatch:
        """Prompt and response as one batch (for scoring by the other model-stages)."""
        import torch

        return TokenBatch(
            torch.cat([self.prompt, self.tokens], 1), torch.cat([self.prompt_valid, self.valid], 1)
        )


@dataclass(frozen=True, slots=True)
class TrainStats:
    loss: float  # sum of the micro-batch losses over all replicas (the global batch's loss)
    grad_norm: float  # global gradient norm before clipping
    tokens: int  # valid tokens this replica trained on
    seconds: float
    dp_allreduce_s: float = 0.0  # of which the data-parallel gradient all-reduce
    dp_allreduce_bytes: int = 0  # this rank's gradient bytes in that all-reduce (0: no DP group)


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """What the plan tells an engine beyond its state and groups. For a generation replica:
    ``max_num_seqs`` its concurrency (sequences decoded together), ``kv_cache_bytes`` the KV room
    the planner's memory budget gives it per rank, ``max_model_len`` the longest prompt plus
    response of the workload, ``workdir`` a folder of the run for the engine's files (caches,
    sockets), ``sleep`` whether it shares its GPUs with a trainer and frees them while that trains.
    Engines take what applies to them; the defaults are no limits of the plan's."""

    max_num_seqs: int = 0  # 0: the engine's own
    kv_cache_bytes: int = 0  # 0: the engine's own
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    workdir: Path | None = None
    sleep: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 0 or self.kv_cache_bytes < 0 or self.max_model_len < 0:
            raise ValueError("max_num_seqs, kv_cache_bytes and max_model_len must be non-negative")


@dataclass(frozen=True, slots=True)
class Capabilities:
    train: bool
    generate: bool
    value_head: bool
    devices: tuple[str, ...]
    tensor_parallel: str
    pipeline_parallel: str


class Backend(Protocol):
    """One rank's engine of one model-stage: everything a runtime calls on it."""

    capabilities: Capabilities

    @property
    def coord(self) -> Coord:
        """This rank's place in its grid (replica, pipeline stage, TP rank)."""
        ...

    def forward(self, batch: TokenBatch, micro_batches: int = 1, temperature: float = 1.0) -> Tensor:
        """Per-token log-probs (LM head) or values (value head), (B, T) fp32, on every rank."""
        ...

    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, micro_batches: int = 1, temperature: float = 1.0
    ) -> TrainStats:
        """Gradient accumulation over micro-batches, DP all-reduce, clipping, one AdamW update;
        log-probs at ``temperature`` (the sampling's, so the ratio is of the policy that sampled)."""
        ...

    def generate(self, prompts: TokenBatch, sample_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Batched decoding with a KV cache; ``sample_ids`` key each row's random draws."""
        ...

    def rebind(
        self, state: RankState, groups: Groups | None = None, options: EngineOptions | None = None
    ) -> None:
        """Use new buffers after a transition or a weight sync: a re-view for the same layout and
        position, a rebuild (with the new grid's ``groups``, and the plan's ``options``) for
        another. An engine that keeps its own copy of the weights (vLLM) reloads them here."""
        ...

    def load_hf(self, directory: Path) -> None:
        """Read this rank's shards of a Hugging Face checkpoint into the state buffers (``read_hf``
        then ``reload``)."""
        ...

    def read_hf(self, directory: Path) -> None:
        """``load_hf``'s part that is not collective: this rank's shards into the state buffers
        only, or a ``ConfigError`` with the buffers untouched. The job agrees on every rank's
        errors before any ``reload``, so a rank whose shards are bad never leaves its peers waiting."""
        ...

    def reload(self) -> None:
        """An engine that keeps its own copy of the weights (vLLM) takes the state buffers'
        (collective over the replica); others do nothing."""
        ...

    def save_hf(self, directory: Path, companions: Sequence[Path] = ()) -> None:
        """Write the model-stage's weights as a Hugging Face checkpoint (from replica 0), with
        copies of the ``companions`` files (a tokenizer's, a generation config) beside them."""
        ...

    def close(self) -> None:
        """Drop the model (the state buffers stay the holder's)."""
        ...


class EngineFactory(Protocol):
    """What the registry builds an engine with (an engine class is one): the rank's state, its
    process groups on the model-stage's grid, for a trainer the optimizer's settings, and the
    plan's options for it."""

    def __call__(
        self, state: RankState, groups: Groups, optim: AdamWConfig | None = None, *,
        options: EngineOptions | None = None,
    ) -> Backend: ...  # fmt: skip
