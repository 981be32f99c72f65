"""Per-token scores from a stage's head output: log-probs of the tokens (vocabulary-parallel) or values.

Both are aligned with the tokens they score: entry ``i`` comes from the head at position ``i − 1``
(the state before token ``i``), entry 0 is 0. So a response token's log-prob and its value sit at
the token's own index, which is what the RL losses index by.

With tensor parallelism the LM head leaves each TP rank a contiguous ``torch.chunk`` of the
vocabulary; log-softmax is then Megatron's vocabulary-parallel cross-entropy: a max and a sum of
exponentials all-reduced over the TP group, and the target's logit taken from the rank that holds
it. The reductions' backward is the identity (every TP rank computes the same loss).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from nereus.backends.parallel import reduce_from_tp


def token_logprobs(
    logits: Tensor, ids: Tensor, vocab_start: int = 0, group: Any = None, temperature: float = 1.0
) -> Tensor:
    """(B, T) fp32: ``log p(ids[:, i] | ids[:, :i])``; ``logits`` (B, T, V_local) of this TP rank."""
    z = logits[:, :-1].float()
    if temperature != 1.0:  # in place on bf16/fp16 logits' fresh fp32 copy: no second (B, T, V) tensor
        z = z.div_(temperature) if logits.dtype != torch.float32 else z / temperature
    labels = ids[:, 1:]
    if group is None:
        lp = torch.log_softmax(z, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
        return F.pad(lp, (1, 0))
    v_local = z.shape[-1]
    m = z.detach().amax(-1, keepdim=True) if v_local else z.new_full((*z.shape[:-1], 1), -torch.inf)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    s = reduce_from_tp((z - m).exp().sum(-1), group)
    local = labels - vocab_start
    held = (local >= 0) & (local < v_local)
    if v_local:
        zt = z.gather(-1, local.clamp(0, v_local - 1)[..., None]).squeeze(-1) * held
    else:
        zt = z.new_zeros(labels.shape) + 0.0 * z.sum()
    lp = reduce_from_tp(zt, group) - m.squeeze(-1) - s.log()
    return F.pad(lp, (1, 0))


def token_values(values: Tensor) -> Tensor:
    """(B, T) fp32: the value head at position ``i − 1`` for token ``i``; entry 0 is 0."""
    return F.pad(values[:, :-1].float(), (1, 0))
