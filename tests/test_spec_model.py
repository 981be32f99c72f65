"""ModelSpec: exact parameter counts, FLOPs and KV bytes; Hugging Face config.json loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.spec import Head, ModelFamily, load_model
from nereus.spec.model import check_runnable
from nereus.spec.registry import config_root

pytestmark = pytest.mark.pure

# Totals are what each model's safetensors index sums to (bf16 total_size / 2); the model cards
# round them to 8B, 14.8B (13.2B non-embedding), 32.8B (31.2B non-embedding) and 70B.
EXACT = {
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "llama-3.3-70b": 70_553_706_496,
}
CARD = {"llama-3.1-8b": 8.0, "qwen3-14b": 14.8, "qwen3-32b": 32.8, "llama-3.3-70b": 70.6}
CARD_NON_EMBEDDING = {"qwen3-14b": 13.2, "qwen3-32b": 31.2}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_parameter_counts_are_exact(name: str) -> None:
    m = load_model(name)
    assert m.param_count() == EXACT[name]
    assert round(m.param_count() / 1e9, 1) == CARD[name]


@pytest.mark.parametrize("name", sorted(CARD_NON_EMBEDDING))
def test_non_embedding_counts_match_qwen_cards(name: str) -> None:
    assert round(load_model(name).non_embedding_params() / 1e9, 1) == CARD_NON_EMBEDDING[name]


def test_llama_8b_breakdown_by_hand() -> None:
    m = load_model("llama-3.1-8b")
    h, inter, v = 4096, 14336, 128256
    attn = h * h * 2 + 2 * h * 1024
    assert m.attention_params() == attn
    assert m.layer_params() == attn + 3 * h * inter + 2 * h
    assert m.param_count() == 2 * v * h + 32 * m.layer_params() + h
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB


def test_value_head_replaces_lm_head() -> None:
    actor = load_model("llama-3.1-8b")
    critic = actor.with_head(Head.VALUE)
    assert critic.param_count() == actor.param_count() - 128256 * 4096 + 4096
    assert critic.head_matmul_params() == 4096


def test_tied_embeddings_count_once() -> None:
    m = load_model("tiny-qwen3")
    assert m.tie_word_embeddings and m.qk_norm
    layer = m.layer_params()
    assert m.param_count() == m.vocab_size * m.hidden_size + m.num_hidden_layers * layer + m.hidden_size


def test_flops_per_token() -> None:
    m = load_model("llama-3.1-8b")
    non_embedding_matmul = m.param_count() - m.embedding_params() - 32 * 2 * 4096 - 4096
    assert m.matmul_params() == non_embedding_matmul
    assert m.forward_flops_per_token(0) == 2 * m.matmul_params()
    assert m.forward_flops_per_token(1000) == 2 * m.matmul_params() + 4 * 32 * 4096 * 1000
    # causal pass over s tokens: mean context (s + 1) / 2
    s = 7
    per_token = [m.forward_flops_per_token(c) for c in range(1, s + 1)]
    assert m.sequence_forward_flops(s) == pytest.approx(sum(per_token))


def _hf_config(tmp_path: Path, **overrides: object) -> Path:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    d = tmp_path / "Llama-3.1-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_hf_config_matches_shipped_yaml(tmp_path: Path) -> None:
    d = _hf_config(tmp_path)
    from_dir = load_model(str(d))
    from_file = load_model(str(d / "config.json"))
    shipped = load_model("llama-3.1-8b")
    for m in (from_dir, from_file):
        assert m.param_count() == shipped.param_count()
        assert m.head_dim == 128 and m.family is ModelFamily.LLAMA and not m.qk_norm


def test_hf_qwen3_gets_qk_norm(tmp_path: Path) -> None:
    d = _hf_config(
        tmp_path,
        model_type="qwen3",
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=40,
        num_hidden_layers=40,
        vocab_size=151936,
        head_dim=128,
    )
    m = load_model(str(d))
    assert m.qk_norm and m.param_count() == EXACT["qwen3-14b"]


def test_hf_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key 'model_type': expected one of llama, .*got 'gpt2'"):
        load_model(str(_hf_config(tmp_path, model_type="gpt2")))
    bad = tmp_path / "x"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_model(str(bad))


def test_a_yarn_model_is_priced_to_its_longer_context_and_not_run(tmp_path: Path) -> None:
    """Qwen2.5's long-context setup (its model card): YaRN, factor 4 over 32,768 positions. The
    planner prices any RoPE alike; the runtime applies default and llama3 RoPE only."""
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    d = _hf_config(tmp_path, model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                   num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064,
                   max_position_embeddings=32768, rope_scaling=yarn, attention_bias=False)  # fmt: skip
    m = load_model(str(d))
    assert m.rope_kind == "yarn" and m.rope_scaling is None and m.max_position_embeddings == 131072
    assert m.attention_bias  # transformers' Qwen2 has q/k/v biases whatever the key says
    assert m.param_count() == 7_615_616_512  # Qwen2.5-7B's card
    with pytest.raises(ConfigError, match="rope_type yarn is priced but not run"):
        check_runnable(m)
    assert (
        load_model("llama-3.1-8b").rope_kind == "llama3" and load_model("tiny-llama").rope_kind == "default"
    )
    (tmp_path / "su").mkdir()
    with pytest.raises(ConfigError, match=r"key 'rope_type': expected one of default, llama3, .*got 'su'"):
        load_model(str(_hf_config(tmp_path / "su", rope_scaling={"type": "su", "factor": 2.0})))


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'llama-9b' \(choices: .*llama-3.1-8b"):
        load_model("llama-9b")


def test_a_yaml_naming_an_unmodelled_rope_with_llama3_factors_is_refused(tmp_path: Path) -> None:
    """``rope_scaling`` holds llama3's factors only: beside ``rope_type: yarn`` they would be
    read as neither (yarn's own factors are not modelled), so the file is refused in one line."""
    text = (config_root() / "models" / "llama-3.1-8b.yaml").read_text()
    path = tmp_path / "m.yaml"
    path.write_text(text + "rope_type: yarn\n")
    with pytest.raises(ConfigError, match=r"rope_type yarn: rope_scaling holds llama3's factors"):
        load_model(str(path))
    path.write_text(text + "rope_type: llama3\n")
    assert load_model(str(path)).rope_kind == "llama3"
