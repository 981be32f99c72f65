"""The main job's inputs (``nereus.rl.assets``): built in the formats a user brings, read back by
the code a user's folder goes through.

Checked: ``transformers`` loads the model folder (weights and tokenizer) and its config is what
``nereus`` reads; the tokenizer is a trained BPE with ChatML special tokens, digits one token each,
prompts through the chat template; the data set is verl's layout and reads back as the generated
task; a build is deterministic in its seed; a failed build leaves the previous one whole; bad
arguments are one-line errors with exit code 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.backends.hf import read_config
from nereus.rl import assets
from nereus.rl.assets import AssetSpec, build
from nereus.rl.data import PromptDataset
from nereus.rl.hf_tokenizer import HfTokenizer
from nereus.rl.layouts import RecordLayout
from nereus.rl.tasks import generate_tasks

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pq = pytest.importorskip("pyarrow.parquet")

pytestmark = pytest.mark.pure

SPEC = AssetSpec(n=64, vocab_size=400)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> assets.Assets:
    return build(tmp_path_factory.mktemp("assets") / "main-job", SPEC)


def test_transformers_loads_the_folder_nereus_reads(built: assets.Assets) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(built.model)
    tok = transformers.AutoTokenizer.from_pretrained(built.model)
    spec = read_config(built.model)
    assert model.config.vocab_size == spec.vocab_size == len(tok) <= SPEC.vocab_size
    assert (spec.hidden_size, spec.head_dim, spec.num_hidden_layers) == (64, 32, 4)  # tiny-llama-h32
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id


def test_a_bpe_with_a_chat_template_and_single_digit_tokens(built: assets.Assets) -> None:
    raw = json.loads((built.model / "tokenizer.json").read_text())
    assert raw["model"]["type"] == "BPE" and raw["model"]["merges"]
    tok = HfTokenizer(str(built.model))
    assert tok.templated
    ids = tok.encode("copy 2021=")
    text = transformers.AutoTokenizer.from_pretrained(built.model).decode(ids)
    assert text == "<|im_start|>user\ncopy 2021=<|im_end|>\n<|im_start|>assistant\n"
    digits = HfTokenizer(str(built.model), chat=False).encode("2021")
    assert [tok.decode([i]) for i in digits] == ["2", "0", "2", "1"]


def test_the_data_set_is_verls_layout_of_the_task(built: assets.Assets) -> None:
    rows = pq.read_table(built.train).to_pylist()
    want = generate_tasks(SPEC.kind, SPEC.n, SPEC.seed, SPEC.difficulty, SPEC.length)
    assert len(rows) == SPEC.n
    assert rows[5]["prompt"] == [{"role": "user", "content": want[5].prompt}]
    assert rows[5]["reward_model"] == {"style": "rule", "ground_truth": want[5].answer}
    data = PromptDataset.load(built.train, HfTokenizer(str(built.model)), 32, 0, RecordLayout("verl"))
    assert [(r.prompt, r.answer, r.id, r.source) for r in data.records[:3]] == [
        (w.prompt, w.answer, f"{assets.SOURCE}/{i}", assets.SOURCE) for i, w in enumerate(want[:3])
    ]


def test_a_build_is_deterministic_in_its_seed(built: assets.Assets, tmp_path: Path) -> None:
    again = build(tmp_path / "again", SPEC)
    other = build(tmp_path / "other", AssetSpec(n=64, vocab_size=400, seed=1))
    for name in ("tokenizer.json", "model.safetensors"):
        assert (again.model / name).read_bytes() == (built.model / name).read_bytes(), name
    weights = "model.safetensors"
    assert (other.model / weights).read_bytes() != (built.model / weights).read_bytes()


def test_a_failed_build_leaves_the_previous_one(
    built: assets.Assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "kept"
    first = build(out, SPEC)
    before = {p.name: p.read_bytes() for p in first.model.iterdir()}

    def broken(rows: object, path: Path) -> None:
        path.write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(assets, "write_parquet", broken)
    with pytest.raises(OSError, match="disk full"):
        build(out, SPEC)
    assert {p.name: p.read_bytes() for p in first.model.iterdir()} == before
    assert pq.read_table(first.train).num_rows == SPEC.n
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # no temporary folder left


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vocab-size", "100"], "vocab_size must be in [259, "),
        (["--n", "0"], "n must be positive"),
        (["--model", "no-such-model"], "no-such-model"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert assets.main([str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nereus assets: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_trimmed_install_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing(*args: object) -> int:
        raise ModuleNotFoundError("No module named 'tokenizers'")

    monkeypatch.setattr(assets, "build_tokenizer", missing)
    assert assets.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "needs transformers, tokenizers and pyarrow" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-built left behind
