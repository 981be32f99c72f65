"""Generation on a bound stage: batched decoding with a KV cache.

The prompts run as one prefill pass, then one pass per new token; with PP, each pass goes stage
to stage by send/recv and the last stage's drawn tokens and their log-probs are broadcast to the
replica. The last stage samples from the full vocabulary: TP ranks all-gather their logits.
Edge module (torch.distributed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.protocol import Generation, GenerationStats, TokenBatch
from nereus.backends.sampling import SamplingParams, sample
from nereus.backends.torch_native.stage import BoundStage
from nereus.spec.model import Head
from nereus.state.geometry import chunk


def full_logits(b: BoundStage, local: Tensor) -> Tensor:
    """The whole vocabulary's logits (rows, vocab) from this TP rank's slice of them."""
    tp = b.state.layout.tp
    if tp == 1:
        return local
    vocab = b.model.vocab_size
    size = -(-vocab // tp)
    padded = torch.zeros((local.shape[0], size), dtype=local.dtype, device=local.device)
    padded[:, : local.shape[1]] = local
    pieces = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(pieces, padded, group=b.groups.tp)
    return torch.cat([pieces[i][:, : chunk(vocab, tp, i)[1] - chunk(vocab, tp, i)[0]] for i in range(tp)], -1)


@torch.no_grad()
def generate(
    b: BoundStage, prompts: TokenBatch, sample_ids: Sequence[int], params: SamplingParams
) -> Generation:
    """Batched decoding with a KV cache; ``sample_ids`` key each row's random draws."""
    if b.model.head is not Head.LM:
        raise RuntimeError(f"{b.state.model_stage} has a value head; it cannot generate")
    rows, plen = prompts.ids.shape
    if len(sample_ids) != rows:
        raise ValueError(f"{len(sample_ids)} sample ids for {rows} prompts")
    capacity = plen + params.max_new_tokens
    if capacity > b.model.max_position_embeddings:
        raise ValueError(f"prompt {plen} + max_new_tokens {params.max_new_tokens} exceed the model's "
                         f"max_position_embeddings {b.model.max_position_embeddings}")  # fmt: skip
    caches = b.stage.layer_caches(rows, capacity, b.stage.kv_heads(), b.dtype)
    ids = prompts.ids.to(b.device)
    valid = torch.zeros((rows, capacity), dtype=torch.long, device=b.device)
    valid[:, :plen] = prompts.valid.to(b.device).long()
    count = valid[:, :plen].sum(-1)
    stop = torch.tensor(params.stop_token_ids, dtype=torch.long, device=b.device)
    done = torch.zeros(rows, dtype=torch.bool, device=b.device)
    out = b.run_pass(ids, valid[:, :plen], caches, 0, None)
    tokens, alive, logps = [], [], []
    for step in range(params.max_new_tokens):
        tok = torch.full((rows,), params.pad_token_id, dtype=torch.long, device=b.device)
        lp = torch.zeros(rows, dtype=torch.float32, device=b.device)
        if b.last:
            drawn, drawn_lp = sample(full_logits(b, out[:, -1].float()), params, sample_ids, step)
            tok = torch.where(done, tok, drawn.to(b.device))
            lp = torch.where(done, lp, drawn_lp.to(b.device))
        if b.state.layout.pp > 1:  # one broadcast: ids are exact in float64
            both = b.from_last(torch.stack([tok.double(), lp.double()]))
            tok, lp = both[0].long(), both[1].float()
        tokens.append(tok)
        logps.append(lp)
        alive.append(~done)
        done = done | torch.isin(tok, stop)
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        slot = plen + step
        valid[:, slot] = alive[-1].long()
        out = b.run_pass(tok[:, None], valid[:, : slot + 1], caches, slot, (count + step)[:, None])
    kept = torch.stack(alive, 1).long().cpu()
    # what the engine did, as vLLM's reports it: tokens generated, passes over the batch (the
    # prefill and each decode), the share of the (preallocated) KV cache filled at the end
    stats = GenerationStats(int(kept.sum()), len(tokens), min(1.0, (plen + len(tokens)) / capacity))
    return Generation(
        prompts.ids, prompts.valid, torch.stack(tokens, 1).cpu(), kept, torch.stack(logps, 1).cpu(), stats
    )
