"""Data sets in the layouts users bring (``nereus.rl.layouts``): verl's (chat messages,
``reward_model.ground_truth``, ``data_source``, ``extra_info.index``) in Parquet and JSONL, a
``{question, answer}`` layout through a template, configurable columns, and a one-line error
naming the file, the row and the column for rows that do not fit. Chat prompts need a tokenizer
with a chat template; the experiment file's ``data:`` key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.rl.assets import write_parquet
from nereus.rl.data import PromptDataset, collate, prompt_ids
from nereus.rl.hf_tokenizer import HfTokenizer
from nereus.rl.layouts import RecordLayout
from nereus.rl.tokenizer import CharTokenizer
from nereus.runtime.experiment import DataSpec, ExperimentSpec
from tests.test_hf_tokenizer import build

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

pytestmark = pytest.mark.pure

VERL = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"Natalia sold {n} clips."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * n)},
        "extra_info": {"split": "train", "index": n},
    }
    for n in range(5)
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(str(build(tmp_path_factory.mktemp("tok"))))


def test_a_verl_parquet_file(tok: HfTokenizer, tmp_path: Path) -> None:
    data = PromptDataset.load(
        write_parquet(VERL, tmp_path / "train.parquet"), tok, 64, 0, RecordLayout("verl")
    )
    r = data.records[3]
    assert r.messages == (("user", "Natalia sold 3 clips."),)
    assert (r.prompt, r.answer, r.id, r.source) == (
        r.messages[0][1],
        "6",
        "openai/gsm8k/3",
        "openai/gsm8k",
    )  # ids per source
    want = tok.encode_messages([{"role": "user", "content": r.prompt}])
    assert prompt_ids(tok, r) == want == tok.encode(r.prompt)  # a one-turn chat is the templated text
    _ids, valid, _ = collate(data.samples(0, 5), tok)
    assert int(valid.sum(1).max()) == max(len(prompt_ids(tok, x)) for x in data.records)


def test_verl_in_jsonl_with_a_system_turn_and_other_columns(tok: HfTokenizer, tmp_path: Path) -> None:
    rows = [
        {
            "src": "math",
            "chat": [{"role": "system", "content": "Box it."}, {"role": "user", "content": "1+1?"}],
            "gt": {"answer": "\\boxed{2}"},
        }
    ]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n")
    layout = RecordLayout("verl", prompt_key="chat", answer_key="gt.answer", source_key="src")
    r = PromptDataset.load(path, tok, 64, 0, layout).records[0]
    assert (r.prompt, r.answer, r.source, r.id) == ("1+1?", "\\boxed{2}", "math", "1")
    assert len(r.messages) == 2 and prompt_ids(tok, r) != tok.encode("1+1?")


def test_the_qa_layout_through_a_template(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"{n}+1", "answer": n + 1}) + "\n" for n in range(3)))
    layout = RecordLayout("qa", template="what is {question}?")
    data = PromptDataset.load(path, CharTokenizer(), 32, 0, layout)
    assert [(r.prompt, r.answer) for r in data.records] == [(f"what is {n}+1?", str(n + 1)) for n in range(3)]
    with pytest.raises(ValueError, match="must contain"):
        RecordLayout("qa", template="no question")
    with pytest.raises(ValueError, match="layout: expected one of nereus, verl, qa"):
        RecordLayout("alpaca")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({**VERL[0], "prompt": "plain text"}, "column 'prompt': expected a non-empty list"),
        ({**VERL[0], "prompt": [{"role": "user"}]}, "message 0: expected {role: str, content: str}"),
        (
            {k: v for k, v in VERL[0].items() if k != "reward_model"},
            "missing column 'reward_model.ground_truth'",
        ),
        (
            {**VERL[0], "reward_model": {"ground_truth": ""}},
            "column 'reward_model.ground_truth': must not be",
        ),
        ({**VERL[0], "data_source": 7}, "column 'data_source': expected a string"),
        (  # valid JSON ("\ud800"), not text: it was blamed on the tokenizer's chat template
            {**VERL[0], "prompt": [{"role": "user", "content": "copy \ud800="}]},
            "column 'prompt': message 0: content: not text (a lone surrogate \\ud800 at character 5)",
        ),
        (
            {**VERL[0], "extra_info": {"index": "a\ud800"}},
            "column 'extra_info.index': not text (a lone surrogate \\ud800 at character 1)",
        ),
        (
            {**VERL[0], "reward_model": {"ground_truth": "7\udfff"}},
            "column 'reward_model.ground_truth': not text (a lone surrogate \\udfff at character 1)",
        ),
        (
            {**VERL[0], "extra_info": {"index": [1]}},
            "column 'extra_info.index': expected a string or an integer",
        ),
    ],
)
def test_a_row_that_does_not_fit_names_file_row_and_column(
    tok: HfTokenizer, tmp_path: Path, row: dict[str, object], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(VERL[1]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: ") as info:
        PromptDataset.load(path, tok, 64, 0, RecordLayout("verl"))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_chat_prompts_need_a_chat_template(tmp_path: Path) -> None:
    row = {"prompt": [{"role": "user", "content": "what is 1+1?"}], "reward_model": {"ground_truth": "2"}}
    path = write_parquet([row], tmp_path / "train.parquet")
    with pytest.raises(ConfigError, match="chat-message prompts need a Hugging Face tokenizer"):
        PromptDataset.load(path, CharTokenizer(), 64, 0, RecordLayout("verl"))


def test_the_experiment_names_its_data(tmp_path: Path) -> None:
    exp = tmp_path / "e.yaml"
    exp.write_text(
        "name: e\nworkload: grpo-tiny\nmodel: tiny-llama\nverifier: gsm8k\n"
        "data: {train: t.parquet, layout: qa, template: 'Q: {question}', answer_key: label}\n"
    )
    spec = ExperimentSpec.load(exp)
    assert spec.data == DataSpec("t.parquet", "qa", "Q: {question}", answer_key="label")
    assert spec.data.record_layout().answer == "label"
    exp.write_text(
        "name: e\nworkload: grpo-tiny\nmodel: tiny-llama\ndataset: a.jsonl\ndata: {train: b.jsonl}\n"
    )
    with pytest.raises(ConfigError, match="dataset and data: name one prompt file"):
        ExperimentSpec.load(exp)
    exp.write_text(  # a task's settings beside a prompt file would do nothing
        "name: e\nworkload: grpo-tiny\nmodel: tiny-llama\ntask: {kind: copy, n: 64}\ndata: {train: b.jsonl}\n"
    )
    with pytest.raises(ConfigError, match="task and data: the generated task's settings do nothing"):
        ExperimentSpec.load(exp)
    exp.write_text("name: e\nworkload: grpo-tiny\nmodel: tiny-llama\ndata: {train: t, colour: 1}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'data\.colour' \(allowed: answer_key, layout"):
        ExperimentSpec.load(exp)
    exp.write_text("name: e\nworkload: grpo-tiny\nmodel: tiny-llama\ndata: {train: ''}\n")
    with pytest.raises(
        ConfigError, match=r"'data' train must name a JSONL, JSON or Parquet file or a list of them, got ''"
    ):
        ExperimentSpec.load(exp)
    exp.write_text(
        "name: e\nworkload: grpo-tiny\nmodel: tiny-llama\nverifier: by_source\ndata: {train: t, layout: qa}\n"
    )
    with pytest.raises(ConfigError, match="by_source scores each row by its data_source column, which only"):
        ExperimentSpec.load(exp)
    exp.write_text("name: e\nworkload: grpo-tiny\nmodel: tiny-llama\ndata: {train: [a.parquet, b.parquet]}\n")
    assert ExperimentSpec.load(exp).data.files == ("a.parquet", "b.parquet")  # type: ignore[union-attr]
    exp.write_text("name: e\nworkload: grpo-tiny\nmodel: tiny-llama\ndata: {train: [a.parquet, a.parquet]}\n")
    with pytest.raises(ConfigError, match=r"train names 'a\.parquet' twice"):
        ExperimentSpec.load(exp)


def test_verl_sources_mixed_and_checked_by_source(tok: HfTokenizer, tmp_path: Path) -> None:
    """GSM8K and MATH rows (each source's extra_info.index from 0) in one file or in two, as
    verl's train_files mixes them; under by_source an unknown or missing data_source names its row."""
    math = [{**r, "data_source": "DigitalLearningGmbH/MATH-lighteval"} for r in VERL]
    both = write_parquet([*VERL, *math], tmp_path / "both.parquet")
    layout = RecordLayout("verl", by_source=True)
    assert len(PromptDataset.load(both, tok, 64, 0, layout)) == 10
    two = [write_parquet(VERL, tmp_path / "gsm8k.parquet"), write_parquet(math, tmp_path / "math.parquet")]
    assert len(PromptDataset.load(two, tok, 64, 0, layout)) == 10
    again = write_parquet(VERL, tmp_path / "again.parquet")  # the same source's rows twice: refused
    with pytest.raises(
        ConfigError, match=r"again\.parquet:row 1: column 'extra_info\.index': 'openai/gsm8k/0' repeats"
    ):
        PromptDataset.load([two[0], again], tok, 64, 0, layout)
    private = write_parquet([{**VERL[0], "data_source": "my_private_set"}], tmp_path / "private.parquet")
    with pytest.raises(
        ConfigError, match=r"private\.parquet:row 1: column 'data_source': unknown data_source"
    ):
        PromptDataset.load(private, tok, 64, 0, layout)
    assert len(PromptDataset.load(private, tok, 64, 0, RecordLayout("verl"))) == 1  # another verifier: fine
    nameless = [{k: v for k, v in r.items() if k != "data_source"} for r in VERL]
    with pytest.raises(ConfigError, match=r"nameless\.parquet:row 1: missing column 'data_source'"):
        PromptDataset.load(write_parquet(nameless, tmp_path / "nameless.parquet"), tok, 64, 0, layout)
    nulls = [{**r, "data_source": None} for r in VERL]  # a null source: fine unless by_source routes by it
    loaded = PromptDataset.load(
        write_parquet(nulls, tmp_path / "n.parquet"), tok, 64, 0, RecordLayout("verl")
    )
    assert len(loaded) == len(VERL) and {r.source for r in loaded.records} == {""}
    with pytest.raises(ConfigError, match=r"n\.parquet:row 1: column 'data_source'"):
        PromptDataset.load(tmp_path / "n.parquet", tok, 64, 0, layout)
    floats = [{**r, "extra_info": {"index": float(i)}} for i, r in enumerate(VERL)]  # pandas, with nulls
    loaded = PromptDataset.load(write_parquet(floats, tmp_path / "floats.parquet"), tok, 64, 0, layout)
    assert loaded.records[2].id == "openai/gsm8k/2"


@pytest.mark.parametrize("template", ["{question.__class__} {question}", "{question} {question!r}",
                                      "{question} {question:>10}", "{x} {question}"])  # fmt: skip
def test_a_template_substitutes_a_bare_question_only(template: str) -> None:
    with pytest.raises(ValueError, match=r"only a bare \{question\} may be substituted"):
        RecordLayout("qa", template=template)
    assert RecordLayout("qa", template="Q: {question} {{A}}:").template == "Q: {question} {{A}}:"


def test_a_float_answer_column_reads_as_written_in_positional_notation() -> None:
    """Parquet float columns: str(1e16) is '1e+16', which a verifier reads as 1."""
    from nereus.rl.layouts import _text

    assert [_text(v, "f: row 0", "answer") for v in (1e16, 72.0, 3.5, 2.5e-3, 18)] == [
        "10000000000000000", "72", "3.5", "0.0025", "18",
    ]  # fmt: skip
