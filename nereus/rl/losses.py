"""The actor's and the critic's losses, in the engine's ``LossFn`` shape (pure torch).

``loss(scores (b, T), fields) -> scalar``: ``scores`` are the engine's per-token log-probs (or
values) of one micro-batch, ``fields`` the batch's per-token tensors cut to the same rows. Each
loss is a sum over valid tokens divided by a constant fixed at construction (``normaliser``: e.g.
the valid response tokens of the whole global batch, ``float(mask.sum())``), so the micro-batch
losses of all DP replicas add up to exactly the global batch's loss and gradients simply add.

The metrics of a call (clip fraction, approximate KL) are kept detached and normalised the same
way: they are contributions that add up over micro-batches and replicas like the loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from torch import Tensor

K3_CLAMP = 10.0  # verl's bound on the k3 estimate (core_algos.kl_penalty, "low_var_kl")
# verl's bound on a log-ratio before it is exponentiated (the policy ratio, k3): past it exp
# overflows in the backward pass and one token's NaN would spoil the whole update
LOG_RATIO_CLAMP = 20.0


class KLKind(StrEnum):
    K1 = "k1"  # log π − log π_ref (unbiased, high variance)
    K2 = "k2"  # ½ (log π − log π_ref)²
    K3 = "k3"  # π_ref/π − log(π_ref/π) − 1 (unbiased, ≥ 0, low variance; GRPO's eq. 4)


def kl_kind(value: KLKind | str) -> KLKind:
    """``value`` as a ``KLKind``, or a ValueError naming the allowed kinds."""
    try:
        return KLKind(value)
    except ValueError:
        allowed = ", ".join(k.value for k in KLKind)
        raise ValueError(f"kl_kind must be one of {allowed}, got {value!r}") from None


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind | str = KLKind.K3) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from tokens sampled from π (Schulman 2020, "Approximating
    KL Divergence"; k3 clamped to ≤ 10 as in verl)."""
    k = kl_kind(kind)
    diff = logp - ref_logp
    if k is KLKind.K1:
        return diff
    if k is KLKind.K2:
        return 0.5 * diff.square()
    back = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log(π_ref / π), bounded as verl's
    return (torch.exp(back) - back - 1).clamp(max=K3_CLAMP)


def _take(fields_: Mapping[str, Tensor], scores: Tensor, *names: str) -> list[Tensor]:
    missing = [n for n in names if n not in fields_]
    if missing:
        raise ValueError(f"loss needs fields {', '.join(names)}; missing {', '.join(missing)}")
    out = [fields_[n].to(torch.float32) for n in names]
    for n, t in zip(names, out, strict=True):
        if t.shape != scores.shape:
            raise ValueError(f"field {n!r} {tuple(t.shape)} must match scores {tuple(scores.shape)}")
    return out


def _check_normaliser(normaliser: float) -> None:
    if not normaliser > 0:
        raise ValueError(f"normaliser must be positive, got {normaliser}")


@dataclass(frozen=True, slots=True)
class PolicyMetrics:
    """Contributions to global-batch means (divide-by-``normaliser``): they add over calls."""

    pg_loss: float = 0.0  # the clipped surrogate, without the KL term
    clip_fraction: float = 0.0  # share of tokens whose gradient the clip (or the dual clip) removed
    approx_kl: float = 0.0  # KL(π_old ‖ π), k3 estimate: the policy's move this update
    ref_kl: float = 0.0  # KL(π ‖ π_ref) with the loss's estimator (0 without kl_coef)


@dataclass(frozen=True, slots=True)
class ValueMetrics:
    vf_loss: float = 0.0
    clip_fraction: float = 0.0  # share of tokens whose gradient the value clip removed


def _totals(rows: list[Tensor], width: int) -> list[float]:
    """The recorded metric rows added up, as floats (the only host sync)."""
    if not rows:
        return [0.0] * width
    return [float(x) for x in torch.stack(rows).sum(0).tolist()]


@dataclass(frozen=True, slots=True, eq=False)
class PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), plus ``kl_coef · KL(π ‖ π_ref)`` per
    token for GRPO's KL in the loss (Shao et al. 2024, eq. 3). With ``dual_clip`` (verl's
    ``clip_ratio_c``, default 3) a token with a negative advantage costs at most ``−A · dual_clip``
    (Ye et al. 2020, dual-clip PPO): a ratio far above 1 on a stale batch cannot blow up the update.
    The log-ratio is bounded by ±20 before it is exponentiated, as verl's.

    Fields: ``old_logprobs``, ``advantages``, ``mask`` and, when ``kl_coef > 0``, ``ref_logprobs``.
    """

    clip_eps: float
    normaliser: float
    kl_coef: float = 0.0
    kl_kind: KLKind = KLKind.K3
    dual_clip: float | None = 3.0
    _record: list[Tensor] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be above 1 (or None), got {self.dual_clip}")
        _check_normaliser(self.normaliser)
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be non-negative, got {self.kl_coef}")
        object.__setattr__(self, "kl_kind", kl_kind(self.kl_kind))

    def __call__(self, scores: Tensor, fields: Mapping[str, Tensor]) -> Tensor:
        names = ("old_logprobs", "advantages", "mask") + (("ref_logprobs",) if self.kl_coef > 0 else ())
        old, adv, mask, *ref = _take(fields, scores, *names)
        valid = mask.bool()
        logp = scores.float()
        bound = LOG_RATIO_CLAMP
        log_ratio = torch.where(valid, logp - old, 0.0).clamp(-bound, bound)  # padding: 0
        ratio = log_ratio.exp()
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps)
        pg = torch.maximum(unclipped, clipped)
        cut = clipped > unclipped  # the ratio clip took the gradient
        if self.dual_clip is not None:
            bound_pg = -adv * self.dual_clip
            cut = cut | ((adv < 0) & (bound_pg < pg))  # and so did the dual clip
            pg = torch.where(adv < 0, torch.minimum(pg, bound_pg), pg)
        per_token = pg
        kl = torch.zeros_like(pg)
        if ref:  # 0 off the mask, whatever the padding holds (an inf there would make NaN)
            kl = kl_penalty(torch.where(valid, logp, 0.0), torch.where(valid, ref[0], 0.0), self.kl_kind)
            per_token = pg + self.kl_coef * kl
        loss = (per_token * mask).sum() / self.normaliser
        with torch.no_grad():
            approx_kl = ratio - 1 - log_ratio  # Schulman 2020's k3 for KL(π_old ‖ π)
            parts = torch.stack([pg, cut.float(), approx_kl, kl])
            self._record.append((parts * mask).sum((1, 2)) / self.normaliser)
        return loss

    def last_metrics(self) -> PolicyMetrics:
        """The last call's contributions."""
        return PolicyMetrics(*_totals(self._record[-1:], 4))

    def metrics(self) -> PolicyMetrics:
        """The contributions of every call since construction (or ``reset``), added up."""
        return PolicyMetrics(*_totals(self._record, 4))

    def reset(self) -> None:
        self._record.clear()


@dataclass(frozen=True, slots=True, eq=False)
class ValueLoss:
    """½ max((V − R)², (V_clip − R)²) with V_clip = V_old + clip(V − V_old, ±clip), as OpenAI
    baselines' ppo2 and verl (``compute_value_loss``); ``clip=None`` is the plain squared error.

    Fields: ``old_values``, ``returns``, ``mask``.
    """

    clip: float | None
    normaliser: float
    _record: list[Tensor] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive or None, got {self.clip}")
        _check_normaliser(self.normaliser)

    def __call__(self, scores: Tensor, fields: Mapping[str, Tensor]) -> Tensor:
        old, returns, mask = _take(fields, scores, "old_values", "returns", "mask")
        v = scores.float()
        plain = (v - returns).square()
        per_token, clipped = plain, torch.zeros_like(plain)
        if self.clip is not None:
            v_clip = old + (v - old).clamp(-self.clip, self.clip)
            other = (v_clip - returns).square()
            per_token = torch.maximum(plain, other)
            clipped = (other > plain).float()
        loss = 0.5 * (per_token * mask).sum() / self.normaliser
        with torch.no_grad():
            parts = torch.stack([0.5 * per_token, clipped])
            self._record.append((parts * mask).sum((1, 2)) / self.normaliser)
        return loss

    def last_metrics(self) -> ValueMetrics:
        return ValueMetrics(*_totals(self._record[-1:], 2))

    def metrics(self) -> ValueMetrics:
        return ValueMetrics(*_totals(self._record, 2))

    def reset(self) -> None:
        self._record.clear()
