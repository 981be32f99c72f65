"""Decoding on one rank: the KV cache equals recomputation, and sampling depends only on
(seed, sample id, step), with temperature, top-p, greedy, stop tokens and length limits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from nereus.backends import hf
from nereus.backends.protocol import TokenBatch
from nereus.backends.sampling import SamplingParams, sample, uniforms
from nereus.backends.torch_native import TorchNativeEngine
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Stage
from tests.engine_oracle import (
    ATOL,
    KINDS,
    hf_lm_logits,
    left_padded,
    next_token_logprobs,
    one_rank_engine,
)

pytestmark = pytest.mark.pure


# ---------------------------------------------------------------------------- 3. KV cache
def _prompts(spec: ModelSpec, seed: int = 11) -> TokenBatch:
    return left_padded(3, 12, [0, 3, 7], spec.vocab_size, seed)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_logprobs_equal_recomputation(kind: str, checkpoints: dict) -> None:
    d, _ = checkpoints[kind]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
    prompts = _prompts(spec)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=5)
    gen = eng.generate(prompts, [0, 1, 2], params)
    assert gen.tokens.shape == gen.valid.shape == gen.logprobs.shape == (3, 8)
    assert gen.valid.all()  # no stop tokens
    seqs = gen.sequences()
    assert torch.equal(seqs.ids[:, :12], prompts.ids)
    plen = prompts.ids.shape[1]
    rescored = eng.forward(seqs, temperature=0.9)[:, plen:]
    live = gen.valid.bool()
    torch.testing.assert_close(rescored[live], gen.logprobs[live], atol=ATOL, rtol=0)
    assert (gen.logprobs < 0).all()  # real log-probs, not a placeholder
    # each token is `sample` of the recomputed logits with that step's draw
    with torch.no_grad():
        logits = eng.stage(seqs.ids, seqs.valid)
    for step in range(8):
        tok, _ = sample(logits[:, plen - 1 + step], params, [0, 1, 2], step)
        assert torch.equal(tok, gen.tokens[:, step]), step
    # and the cached decode agrees with transformers (positions 12 … 19 pass the RoPE scaling edge)
    _, theirs = checkpoints[kind]
    want = next_token_logprobs(hf_lm_logits(theirs, seqs.ids, seqs.valid), seqs.ids, 0.9)[:, plen:]
    torch.testing.assert_close(gen.logprobs[live], want[live], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_are_the_argmax_of_recomputation(kind: str, checkpoints: dict) -> None:
    d, _ = checkpoints[kind]
    spec = hf.read_config(d)
    eng = one_rank_engine(spec, Stage.INF, checkpoint=d)
    prompts = _prompts(spec, seed=12)
    gen = eng.generate(prompts, [7, 8, 9], SamplingParams(max_new_tokens=8, greedy=True, temperature=0.0))
    seqs = gen.sequences()
    plen = prompts.ids.shape[1]
    with torch.no_grad():
        logits = eng.stage(seqs.ids, seqs.valid)
    want = logits[:, plen - 1 : -1].argmax(-1)
    assert torch.equal(gen.tokens, want)
    assert len(set(gen.tokens.flatten().tolist())) > 3  # not a constant
    lp = eng.forward(seqs)[:, plen:]  # greedy log-probs are at temperature 1
    torch.testing.assert_close(gen.logprobs, lp, atol=ATOL, rtol=0)
    # the same greedy tokens from a different seed (no randomness involved)
    again = eng.generate(prompts, [0, 0, 0], SamplingParams(max_new_tokens=8, greedy=True, seed=99))
    assert torch.equal(again.tokens, gen.tokens)


# ---------------------------------------------------------------------------- 4. semantics
@pytest.fixture(scope="module")
def llama_engine(checkpoints: dict) -> TorchNativeEngine:
    d, _ = checkpoints["llama"]
    return one_rank_engine(hf.read_config(d), Stage.INF, checkpoint=d)


def test_generation_is_seeded(llama_engine: TorchNativeEngine) -> None:
    eng = llama_engine
    prompts = _prompts(eng.model)
    p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    a = eng.generate(prompts, [0, 1, 2], p)
    b = eng.generate(prompts, [0, 1, 2], p)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    c = eng.generate(prompts, [0, 1, 2], dataclasses.replace(p, seed=6))
    assert not torch.equal(a.tokens, c.tokens)
    for r in range(3):  # every row changes, not just one
        assert not torch.equal(a.tokens[r], c.tokens[r])
    d = eng.generate(prompts, [3, 4, 5], p)  # sample ids key the draws too
    assert not torch.equal(a.tokens, d.tokens)
    # what the engine did, as vLLM's reports it (metrics read 0 tokens for this engine)
    assert a.stats.tokens == int(a.valid.sum()) > 0 and a.stats.decode_steps == a.tokens.shape[1]
    assert 0.0 < a.stats.kv_usage <= 1.0 and a.stats.preemptions == 0


def test_row_does_not_depend_on_its_batch(llama_engine: TorchNativeEngine) -> None:
    """A sample's tokens depend on its prompt, seed and sample id only: not on the other rows,
    on its position in the batch, or on how much padding the batch gives it."""
    eng = llama_engine
    prompts = _prompts(eng.model, seed=13)
    p = SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.95, seed=21)
    ids = [40, 41, 42]
    batch = eng.generate(prompts, ids, p)
    for r in range(3):
        real = prompts.valid[r].bool()
        alone = TokenBatch(prompts.ids[r : r + 1, real], prompts.valid[r : r + 1, real])
        single = eng.generate(alone, [ids[r]], p)
        assert torch.equal(single.tokens[0], batch.tokens[r]), r
        torch.testing.assert_close(single.logprobs[0], batch.logprobs[r], atol=ATOL, rtol=0)
    # reversed batch order: the same tokens per sample
    rev = eng.generate(TokenBatch(prompts.ids.flip(0), prompts.valid.flip(0)), ids[::-1], p)
    assert torch.equal(rev.tokens.flip(0), batch.tokens)


def test_stop_tokens_end_a_row(llama_engine: TorchNativeEngine) -> None:
    eng = llama_engine
    prompts = _prompts(eng.model, seed=14)
    p = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, pad_token_id=127)
    free = eng.generate(prompts, [0, 1, 2], p)
    stop = int(free.tokens[0, 2])  # row 0 stops at step 2 at the latest
    stopped = eng.generate(prompts, [0, 1, 2], dataclasses.replace(p, stop_token_ids=(stop,)))
    n = stopped.tokens.shape[1]
    assert n <= 8
    ended_somewhere = False
    for r in range(3):
        row = free.tokens[r].tolist()
        end = row.index(stop) + 1 if stop in row else 8  # the stop token itself is kept
        ended_somewhere |= end < n
        assert stopped.valid[r, :end].all() and not stopped.valid[r, end:].any()
        assert torch.equal(stopped.tokens[r, :end], free.tokens[r, :end])
        assert (stopped.tokens[r, end:] == 127).all()
        assert (stopped.logprobs[r, end:] == 0).all()
        torch.testing.assert_close(stopped.logprobs[r, :end], free.logprobs[r, :end], atol=ATOL, rtol=0)
    assert ended_somewhere
    # every row stopping ends the loop early: all tokens are stop tokens
    many = dataclasses.replace(p, stop_token_ids=tuple(range(128)))
    short = eng.generate(prompts, [0, 1, 2], many)
    assert short.tokens.shape == (3, 1) and short.valid.all()


def test_max_new_tokens_and_max_positions(llama_engine: TorchNativeEngine) -> None:
    eng = llama_engine
    prompts = _prompts(eng.model)
    assert eng.model.max_position_embeddings == 64
    for n in (1, 3):
        gen = eng.generate(prompts, [0, 1, 2], SamplingParams(max_new_tokens=n, seed=1))
        assert gen.tokens.shape == (3, n)
    full = eng.generate(prompts, [0, 1, 2], SamplingParams(max_new_tokens=64 - 12, seed=1))
    assert full.tokens.shape == (3, 52) and full.valid.all()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.generate(prompts, [0, 1, 2], SamplingParams(max_new_tokens=64 - 11))
    with pytest.raises(ValueError, match="sample ids"):
        eng.generate(prompts, [0, 1], SamplingParams(max_new_tokens=2))


def test_value_head_cannot_generate(checkpoints: dict) -> None:
    d, _ = checkpoints["qwen3"]
    eng = one_rank_engine(hf.read_config(d).with_head(Head.VALUE), Stage.INF, checkpoint=d)
    with pytest.raises(RuntimeError, match="value head"):
        eng.generate(_prompts(eng.model), [0, 1, 2], SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------------------- 5. sampling
def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_tiny_top_p_and_greedy_take_the_argmax() -> None:
    z = _logits(64, 50, seed=1)
    ids = list(range(64))
    for step in range(4):
        tok, lp = sample(z, SamplingParams(max_new_tokens=1, top_p=1e-9, temperature=2.0), ids, step)
        assert torch.equal(tok, z.argmax(-1))
        want = torch.log_softmax(z.double() / 2.0, -1).gather(-1, tok[:, None]).squeeze(-1).float()
        torch.testing.assert_close(lp, want, atol=1e-6, rtol=0)
    tok, lp = sample(z, SamplingParams(max_new_tokens=1, greedy=True, temperature=0.0), ids, 0)
    assert torch.equal(tok, z.argmax(-1))
    want = torch.log_softmax(z.double(), -1).max(-1).values.float()
    torch.testing.assert_close(lp, want, atol=1e-6, rtol=0)


def test_sample_frequencies_follow_the_tempered_and_truncated_distribution() -> None:
    n = 20000
    ids = list(range(n))
    z = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))[None].repeat(n, 1)
    tok, _ = sample(z, SamplingParams(max_new_tokens=1, temperature=1.0, seed=3), ids, 0)
    freq = torch.bincount(tok, minlength=6).double() / n
    torch.testing.assert_close(freq, torch.softmax(z[0].double(), -1), atol=0.015, rtol=0)
    # temperature 0.5 squares and renormalises the probabilities
    tok, _ = sample(z, SamplingParams(max_new_tokens=1, temperature=0.5, seed=3), ids, 1)
    freq = torch.bincount(tok, minlength=6).double() / n
    torch.testing.assert_close(freq, torch.softmax(z[0].double() / 0.5, -1), atol=0.015, rtol=0)
    # top_p 0.7 keeps the tokens with less than 0.7 ahead of them: 0.4, 0.25, 0.15
    tok, lp = sample(z, SamplingParams(max_new_tokens=1, top_p=0.7, seed=3), ids, 2)
    freq = torch.bincount(tok, minlength=6).double() / n
    want = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0], dtype=torch.float64) / 0.8
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)
    # the log-prob is the full (untruncated) distribution's
    torch.testing.assert_close(lp, z[0].gather(-1, tok).float(), atol=1e-6, rtol=0)


def test_uniforms_are_deterministic_and_in_range() -> None:
    ids = list(range(5000))
    a = uniforms(7, ids, 3)
    assert a.dtype == torch.float64 and a.shape == (5000,)
    assert torch.equal(a, uniforms(7, ids, 3))
    assert ((a >= 0) & (a < 1)).all()
    assert abs(float(a.mean()) - 0.5) < 0.02 and abs(float(a.var()) - 1 / 12) < 0.005
    assert len(set(a.tolist())) == 5000
    for other in (uniforms(8, ids, 3), uniforms(7, ids, 4), uniforms(7, [i + 1 for i in ids], 3)):
        assert (a != other).float().mean() > 0.99
    # a sample's number does not depend on the others
    assert torch.equal(uniforms(7, [123], 3), uniforms(7, ids, 3)[123:124])
    assert torch.equal(uniforms(7, [2**70 + 5], 0), uniforms(7, [2**70 + 5], 0))


def test_uniforms_are_the_scalar_hash_bit_for_bit() -> None:
    """The vectorised draw is ``_splitmix64`` on Python integers (every 64-bit wrap and mask):
    a change would change every sampled token of every run."""
    import random

    from nereus.backends.sampling import MASK64, _splitmix64

    def scalar(seed: int, ids: list[int], step: int) -> list[float]:
        mixed = _splitmix64(seed & MASK64)
        return [
            (_splitmix64(_splitmix64(mixed ^ (i & MASK64)) ^ (step & MASK64)) >> 11) / 2.0**53 for i in ids
        ]

    rng = random.Random(5)
    for _ in range(100):
        ids = [rng.getrandbits(rng.choice((8, 63, 64, 70))) for _ in range(rng.randint(0, 40))]
        seed, step = rng.getrandbits(rng.choice((8, 64, 80))), rng.getrandbits(rng.choice((4, 64, 66)))
        assert uniforms(seed, ids, step).tolist() == scalar(seed, ids, step)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "pad_token_id": -1}, "pad_token_id"),
        ({"max_new_tokens": 4, "stop_token_ids": (3, -2)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_needs_no_temperature() -> None:
    assert SamplingParams(max_new_tokens=1, greedy=True, temperature=0.0).greedy
