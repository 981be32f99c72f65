"""Memory formulas against hand-computed cases (Korthikanti et al. 2022, Megatron mixed precision)."""

from __future__ import annotations

import numpy as np
import pytest

from nereus.plan.layout import Layout
from nereus.plan.memory import (
    generation_memory,
    inference_memory,
    layer_activation_bytes,
    trainer_memory,
)
from nereus.plan.replica import ReplicaFacts, layer_params_per_rank, stage_params
from nereus.spec import Head, ModelFamily, ModelSpec, Precision, Recompute, load_model

pytestmark = pytest.mark.pure


# A GPT-shaped model in SwiGLU clothing: MHA (kv heads = heads), I = 8h/3 so 3I = 8h like a 4h GeLU
# MLP's two saved tensors. Korthikanti's per-layer bytes without dropout masks then apply exactly.
def one(values: np.ndarray) -> float:
    return float(np.ravel(values)[0])


GPT_LIKE = ModelSpec(
    name="gpt-like",
    family=ModelFamily.LLAMA,
    hidden_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    vocab_size=1000,
)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [True, False])
def test_activations_match_korthikanti_without_dropout(tp: int, sp: bool) -> None:
    s, b, h, a = 128, 3, 96, 4
    tokens = np.asarray(float(s * b))
    got = layer_activation_bytes(
        GPT_LIKE, np.asarray(float(tp)), tokens, s, Recompute.NONE, sp, flash=False, act_b=2.0
    )
    # Korthikanti Tab. 2: sbh(34/t + 5as/(ht)) with SP, sbh(10 + 24/t + 5as/(ht)) without;
    # dropping the dropout masks (2sbh replicated, as·sb in the score term) leaves 32/t, 8 + 24/t, 4as.
    linear = 32 / tp if sp else 8 + 24 / tp
    expected = s * b * h * (linear + 4 * a * s / (h * tp))
    assert float(got) == pytest.approx(expected)
    # fused (flash) attention and selective recompute drop the score matrices
    flash = layer_activation_bytes(
        GPT_LIKE, np.asarray(float(tp)), tokens, s, Recompute.NONE, sp, flash=True, act_b=2.0
    )
    selective = layer_activation_bytes(
        GPT_LIKE, np.asarray(float(tp)), tokens, s, Recompute.SELECTIVE, sp, flash=False, act_b=2.0
    )
    assert float(flash) == float(selective) == pytest.approx(s * b * h * linear)
    full = layer_activation_bytes(
        GPT_LIKE, np.asarray(float(tp)), tokens, s, Recompute.FULL, sp, flash=False, act_b=2.0
    )
    assert float(full) == pytest.approx(2 * s * b * h / (tp if sp else 1))


def test_params_per_rank_by_hand() -> None:
    m = load_model("tiny-llama")  # h 64, 4 layers, 4 heads, 2 kv heads (hd 16), I 176, V 512
    # tp 2: q,o 64×32 each; k,v one kv head 64×16 each; MLP 3·64·88; two norms
    assert layer_params_per_rank(m, 2) == 2 * 64 * 32 + 2 * 64 * 16 + 3 * 64 * 88 + 2 * 64
    # tp 4 > kv heads: each rank keeps one (replicated) kv head
    assert layer_params_per_rank(m, 4) == 2 * 64 * 16 + 2 * 64 * 16 + 3 * 64 * 44 + 2 * 64
    first, last = stage_params(m, Layout(2, 2))
    layer = layer_params_per_rank(m, 2)
    assert first == 2 * layer + 256 * 64  # two layers + half the vocabulary's embedding
    assert last == 2 * layer + 64 + 256 * 64  # two layers + final norm + half the LM head
    assert sum(stage_params(m, Layout(1, 1))) == m.param_count()


def test_tied_head_copy_on_last_stage() -> None:
    m = load_model("tiny-qwen3")  # tied embeddings
    assert sum(stage_params(m, Layout(1, 1))) == m.param_count()
    assert sum(stage_params(m, Layout(1, 2))) == m.param_count() + m.vocab_size * m.hidden_size


def test_trainer_bytes_per_parameter_and_1f1b_in_flight() -> None:
    m = load_model("llama-3.1-8b")
    lay = Layout(1, 4)
    params = stage_params(m, lay)[0]  # stage 0 peaks: embedding + 4 micro-batches in flight
    mem = trainer_memory(
        m,
        ReplicaFacts.of(m, [lay]),
        np.asarray(2.0),
        np.asarray(8.0),
        1024,
        Precision.BF16_MIXED,
        Recompute.NONE,
        True,
        True,
    )
    assert one(mem.params) == pytest.approx(2 * params)  # bf16 weights
    assert one(mem.optimizer) == pytest.approx(12 * params)  # fp32 master + Adam m, v
    assert one(mem.grads) == pytest.approx(4 * params)  # fp32 main grads
    per_layer = float(
        layer_activation_bytes(m, np.asarray(1.0), np.asarray(2048.0), 1024, Recompute.NONE, True, True, 2.0)
    )
    # stage 0 of pp 4 holds 4 micro-batches of its 8 layers under 1F1B (the peak stage here)
    assert one(mem.activations) == pytest.approx(4 * 8 * per_layer)
    few = trainer_memory(
        m,
        ReplicaFacts.of(m, [lay]),
        np.asarray(2.0),
        np.asarray(2.0),
        1024,
        Precision.BF16_MIXED,
        Recompute.NONE,
        True,
        True,
    )
    assert one(few.activations) < one(mem.activations)  # only 2 micro-batches exist
    fp32 = trainer_memory(
        m,
        ReplicaFacts.of(m, [lay]),
        np.asarray(2.0),
        np.asarray(8.0),
        1024,
        Precision.FP32,
        Recompute.NONE,
        True,
        True,
    )
    # fp32 weights + Adam m, v, and the fp32 gradient buffer kept between steps (Megatron DDP)
    assert one(fp32.persistent) == pytest.approx(16 * params)
    assert one(fp32.checkpoint) == pytest.approx(12 * params)  # what a restart reads back


def test_full_recompute_saves_memory() -> None:
    """Layer activations shrink more than 5× (a critic: no LM-head logits); the loss's fp32
    logits and their gradient are not recomputed, so with an LM head they stay."""
    args = (np.asarray(4.0), np.asarray(16.0), 4096, Precision.BF16_MIXED)
    critic = load_model("llama-3.1-8b").with_head(Head.VALUE)
    none = trainer_memory(critic, ReplicaFacts.of(critic, [Layout(2, 2)]), *args, Recompute.NONE, True, True)
    full = trainer_memory(critic, ReplicaFacts.of(critic, [Layout(2, 2)]), *args, Recompute.FULL, True, True)
    assert one(full.activations) < one(none.activations) / 5
    actor = load_model("llama-3.1-8b")
    logits = 2 * 4 * 4096 * (actor.vocab_size / 2) * 4  # 2 copies · mb 4 · 4,096 tokens · vocab/tp · fp32
    full = trainer_memory(actor, ReplicaFacts.of(actor, [Layout(2, 2)]), *args, Recompute.FULL, True, True)
    assert one(full.activations) >= logits


def test_kv_cache_and_generation() -> None:
    m = load_model("llama-3.1-8b")
    conc = np.array([1.0, 64.0])
    mem = generation_memory(m, ReplicaFacts.of(m, [Layout(2, 1)] * 2), conc, 256, 4352, Precision.BF16_MIXED)
    kv_per_token = 2 * 32 * 4 * 128 * 2  # K and V, 32 layers, 4 of 8 kv heads per rank, bf16
    assert np.allclose(mem.kv_cache, conc * 4352 * kv_per_token)
    assert np.all(mem.grads == 0) and np.all(mem.optimizer == 0)
    assert one(mem.persistent) == pytest.approx(2 * max(stage_params(m, Layout(2, 1))))


def test_inference_logits_shard_with_tp() -> None:
    m = load_model("llama-3.1-8b")
    tp1 = inference_memory(
        m, ReplicaFacts.of(m, [Layout(1, 1)]), np.asarray(16.0), 4096, Precision.BF16_MIXED, True, True
    )
    two = inference_memory(
        m, ReplicaFacts.of(m, [Layout(2, 1)]), np.asarray(16.0), 4096, Precision.BF16_MIXED, True, True
    )
    logits_1 = 16 * 4096 * 128256 * 4
    assert one(tp1.activations) > logits_1 and one(two.activations) < 0.6 * one(tp1.activations)
    critic = inference_memory(
        m.with_head(Head.VALUE),
        ReplicaFacts.of(m.with_head(Head.VALUE), [Layout(1, 1)]),
        np.asarray(16.0),
        4096,
        Precision.BF16_MIXED,
        True,
        True,
    )
    assert one(critic.activations) < one(tp1.activations) - logits_1 * 0.99


def test_memory_correction_scales_active_only() -> None:
    m = load_model("tiny-llama")
    base = inference_memory(
        m, ReplicaFacts.of(m, [Layout(1, 1)]), np.asarray(4.0), 128, Precision.BF16_MIXED, True, True
    )
    corr = inference_memory(
        m, ReplicaFacts.of(m, [Layout(1, 1)]), np.asarray(4.0), 128, Precision.BF16_MIXED, True, True, 1.5
    )
    assert one(corr.active) == pytest.approx(1.5 * one(base.active))
    assert one(corr.persistent) == one(base.persistent)
