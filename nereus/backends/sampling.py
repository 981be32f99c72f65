"""Token sampling that depends only on the seed, the sample's global index and the step.

Each draw uses one uniform number from a counter-based hash of (seed, sample id, step), so a
sequence's tokens do not depend on which replica generates it, on the batch it shares, or on the
layout: generation under any (tp, pp, dp) draws the same tokens from the same distribution.
Temperature, top-p (nucleus; the most likely token is always kept), greedy (argmax). Pure torch
(and numpy for the hash, vectorised over the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be positive (or set greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.pad_token_id < 0 or any(t < 0 for t in self.stop_token_ids):
            raise ValueError("pad_token_id and stop_token_ids must be non-negative token ids")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` of every element of a uint64 array (its arithmetic wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def uniforms(seed: int, sample_ids: Sequence[int], step: int) -> Tensor:
    """One float64 in [0, 1) per sample for this step: the top 53 bits of the hash, exactly as
    ``_splitmix64`` on Python integers gives them (one vectorised pass over the batch)."""
    ids = np.fromiter((sid & MASK64 for sid in sample_ids), dtype=np.uint64, count=len(sample_ids))
    h = _splitmix64_array(
        _splitmix64_array(ids ^ np.uint64(_splitmix64(seed & MASK64))) ^ np.uint64(step & MASK64)
    )
    return torch.from_numpy((h >> np.uint64(11)).astype(np.float64) / float(1 << 53))


def sample(
    logits: Tensor, params: SamplingParams, sample_ids: Sequence[int], step: int
) -> tuple[Tensor, Tensor]:
    """Tokens (B,) and their log-probs (B,) under the temperature-scaled distribution.

    ``logits`` is (B, V) over the whole vocabulary."""
    z = logits.double()
    if params.greedy:
        tokens = z.argmax(-1)
        return tokens, torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1).float()
    logp = torch.log_softmax(z / params.temperature, -1)
    probs = logp.exp()
    u = uniforms(params.seed, sample_ids, step).to(probs.device)
    if params.top_p >= 1.0:  # no truncation: the inverse CDF in vocabulary order, no sort
        cdf = probs.cumsum(-1)
        index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)
        tokens = index.squeeze(-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1).float()
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # ties in vocabulary order, any device
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly ahead of each token
    sorted_p = torch.where(before < params.top_p, sorted_p, torch.zeros_like(sorted_p))
    sorted_p[:, 0] = torch.where(sorted_p[:, 0] > 0, sorted_p[:, 0], probs.max(-1).values)
    cdf = sorted_p.cumsum(-1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=cdf.shape[-1] - 1)
    tokens = order.gather(-1, index).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1).float()
