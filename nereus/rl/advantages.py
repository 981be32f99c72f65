"""Rewards and advantages per token for PPO, GRPO and ReMax (pure torch).

Every tensor is (B, T) and aligned with the tokens of prompt ++ response (``nereus.backends.
logprobs``: a token's log-prob and value sit at the token's own index); ``mask`` is 1 on valid
response tokens and 0 on the prompt, padding and anything after the stop token (the stop token
itself is valid). Response token t is the action taken in state s_t, whose value V(s_t) the critic
reports at index t. Outputs are 0 wherever ``mask`` is 0.

Whitening uses statistics of the batch it is given: compute advantages over the whole global
batch before it is dealt to DP replicas, so every replica sees the same normalisation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _same_shape(mask: Tensor, **tensors: Tensor | None) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be (B, T), got {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must match mask {tuple(mask.shape)}")


def _per_row(mask: Tensor, **scores: Tensor) -> None:
    _same_shape(mask)
    for name, s in scores.items():
        if s.shape != mask.shape[:1]:
            raise ValueError(f"{name} must be (B,) = ({mask.shape[0]},), got {tuple(s.shape)}")


def last_valid(mask: Tensor) -> Tensor:
    """(B,) index of each row's last valid token; every row must have one."""
    _same_shape(mask)
    m = mask.bool()
    if not bool(m.any(-1).all()):
        raise ValueError(f"rows {m.any(-1).logical_not().nonzero().flatten().tolist()} have no valid token")
    return mask.shape[1] - 1 - m.flip(-1).float().argmax(-1)


def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """The sequence score on the last valid token, minus ``kl_coef · kl`` on every valid token.

    KL in the reward as in InstructGPT (Ouyang et al. 2022 §3.5, eq. 2) and verl's ``apply_kl_penalty``.
    """
    _per_row(mask, scores=scores)
    _same_shape(mask, kl=kl)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be non-negative, got {kl_coef}")
    m = mask.to(scores.dtype)
    r = torch.zeros_like(m) if kl is None or kl_coef == 0 else -kl_coef * kl.to(scores.dtype) * m
    return r.scatter_add(1, last_valid(mask)[:, None], scores[:, None])


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x − mean) / std over the valid entries (unbiased variance), 0 elsewhere.

    As ``masked_whiten`` in verl and TRL (PPO's advantage normalisation, Schulman et al. 2017 via
    OpenAI baselines ppo2); with ``shift_mean=False`` the mean is added back.
    """
    _same_shape(mask, x=x)
    m = mask.to(x.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 valid entries, got {int(n)}")
    mean = (x * m).sum() / n
    var = ((x - mean).square() * m).sum() / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, whiten_advantages: bool = True
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid response tokens: (advantages, returns).

    Schulman et al. 2016 eq. 16: δ_t = r_t + γ V(s_{t+1}) − V(s_t), A_t = Σ_l (γλ)^l δ_{t+l}, and
    returns R_t = A_t + V(s_t) (before whitening). Invalid tokens are skipped (the next state of a
    valid token is the next valid one); after the last valid token V = 0.
    """
    _same_shape(mask, rewards=rewards, values=values)
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must be in [0, 1], got {gamma}, {lam}")
    m = mask.bool()
    r, v = rewards.float(), values.float().detach()
    adv = torch.zeros_like(r)
    next_v = r.new_zeros(r.shape[0])
    next_a = r.new_zeros(r.shape[0])
    for t in reversed(m.any(0).nonzero().flatten().tolist()):  # columns holding no response token add nothing
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(m[:, t], a, 0.0)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        next_a = torch.where(m[:, t], a, next_a)
    returns = (adv + v) * m
    if whiten_advantages:
        adv = whiten(adv, mask)
    return adv, returns


def grpo_advantages(
    scores: Tensor, group_size: int, mask: Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """(r − mean_group) / (std_group + ε) on every valid token of the response.

    Shao et al. 2024 (DeepSeekMath) §4.1.2, outcome supervision. Groups are ``group_size``
    (``WorkloadSpec.samples_per_prompt``) consecutive rows, as ``collate`` lays them out; std is
    unbiased, as in verl. ``scale_by_std=False`` keeps only the mean baseline (Dr. GRPO, Liu et al.
    2025, "Understanding R1-Zero-Like Training").
    """
    _per_row(mask, scores=scores)
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(
            f"group_size {group_size} must be at least 2 and divide the batch of {scores.shape[0]}"
        )
    g = scores.float().view(-1, group_size)
    a = g - g.mean(-1, keepdim=True)
    if scale_by_std:
        a = a / (g.std(-1, keepdim=True) + eps)
    return a.reshape(-1, 1) * mask.float()


def remax_advantages(scores: Tensor, baseline_scores: Tensor, mask: Tensor) -> Tensor:
    """r(sampled) − r(greedy) of the same prompt on every valid token (Li et al. 2023, ReMax, Alg. 1)."""
    _per_row(mask, scores=scores, baseline_scores=baseline_scores)
    return (scores.float() - baseline_scores.float())[:, None] * mask.float()
