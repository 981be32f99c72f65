"""RL data: the tokenizer, generated tasks, verifiers, dataset validation (every bad record names
file:line and field), the global sample order under any DP split, and collation."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from nereus.errors import ConfigError
from nereus.rl.data import PromptDataset, collate
from nereus.rl.tasks import TaskKind, TaskRecord, generate_tasks, write_jsonl
from nereus.rl.tokenizer import ALPHABET, BOS_ID, EOS_ID, PAD_ID, UNKNOWN, CharTokenizer
from nereus.rl.verifiers import exact_answer, exact_match, get_verifier, score
from nereus.spec import load_model
from nereus.state.emu import sample_range

pytestmark = pytest.mark.pure

TOK = CharTokenizer()


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_ids_are_fixed_and_round_trip() -> None:
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert TOK.encode("1+2=") == [1, 4, 13, 5, 16]  # golden: reordering the alphabet breaks checkpoints
    assert TOK.encode("ab", bos=False, eos=True) == [18, 19, EOS_ID]
    assert TOK.decode(TOK.encode(ALPHABET, eos=True)) == ALPHABET
    assert TOK.decode([PAD_ID, PAD_ID, BOS_ID, 4, EOS_ID, 5, 6]) == "1"  # pads skipped, stops at eos
    assert TOK.decode(torch.tensor([4, 500, 5])) == f"1{UNKNOWN}2"  # a model's id past the alphabet
    assert TOK.vocab_size == 3 + len(ALPHABET)
    for name in ("tiny-llama", "tiny-qwen3"):
        assert TOK.vocab_size <= load_model(name).vocab_size


def test_tokenizer_errors_name_the_culprit() -> None:
    with pytest.raises(ValueError, match=r"character 'Q' at position 2 is not in the tokenizer's alphabet"):
        TOK.encode("12Q")
    with pytest.raises(ValueError, match="token id -1 is negative"):
        TOK.decode([4, -1])
    with pytest.raises(ValueError, match=r"alphabet repeats characters \['a'\]"):
        CharTokenizer("aba")


# ------------------------------------------------------------------ tasks and verifiers
@pytest.mark.parametrize("kind", list(TaskKind))
def test_generated_tasks_are_deterministic_and_correct(kind: TaskKind) -> None:
    a = generate_tasks(kind, 200, seed=3, difficulty=4, length=3)
    assert a == generate_tasks(kind.value, 200, seed=3, difficulty=4, length=3)
    assert a[:50] == generate_tasks(kind, 50, seed=3, difficulty=4, length=3)  # prefix-stable
    assert [r.prompt for r in a] != [
        r.prompt for r in generate_tasks(kind, 200, seed=4, difficulty=4, length=3)
    ]
    assert len({r.id for r in a}) == 200
    for r in a:
        digits = [int(c) for c in r.prompt if c.isdigit()]
        assert len(digits) == 3 and max(digits) <= 4  # difficulty 4: base 5
        want = {"copy": digits[-1], "max": max(digits), "add": sum(digits) % 5}[kind.value]
        assert r.answer == str(want)
        assert TOK.unknown(r.prompt) is None
    assert {r.answer for r in a} == {str(d) for d in range(5)}  # the whole answer space occurs


def test_task_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="task kind must be one of copy, max, add, got 'sub'"):
        generate_tasks("sub", 1)
    with pytest.raises(ValueError, match=r"difficulty must be in \[1, 9\]"):
        generate_tasks("add", 1, difficulty=10)
    with pytest.raises(ValueError, match=r"length must be in \[2, 16\]"):
        generate_tasks("add", 1, length=1)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        TaskRecord("", "1")


@pytest.mark.parametrize(
    ("response", "reward"),
    [("7", 1.0), ("7x", 0.5), ("77", 0.5), ("3", 0.1), ("3+", 0.1), ("-", 0.0), ("", 0.0), ("x7", 0.0)],
)
def test_exact_answer_gives_partial_credit(response: str, reward: float) -> None:
    assert exact_answer(response, "7") == reward
    assert exact_match(response, "7") == (1.0 if reward == 1.0 else 0.0)


def test_exact_answer_with_a_longer_answer() -> None:
    assert [exact_answer(r, "12") for r in ("12", "123", "13", "1", "-1", "1x")] == [
        1.0,
        0.5,
        0.1,
        0.0,
        0.1,
        0.0,
    ]


def test_verifier_registry_and_batch_scores() -> None:
    assert get_verifier("exact_answer") is exact_answer
    with pytest.raises(
        ConfigError,
        match=r"unknown verifier 'regex' \(allowed: answer_line, boxed, by_source, exact, exact_answer, "
        r"exact_match, gsm8k, gsm8k_flexible, math, math_verify, none\)",
    ):
        get_verifier("regex")
    got = score(exact_answer, ["1", "2", "1x", "?"], ["1", "1", "1", "1"])
    assert torch.equal(got, torch.tensor([1.0, 0.1, 0.5, 0.0]))


# ------------------------------------------------------------------ dataset files
def write(tmp_path: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = ['{"prompt": "1+2=", "answer": "3"}', '{"prompt": "copy 12=", "answer": "2", "id": "x"}']


@pytest.mark.parametrize(
    ("line", "field", "detail"),
    [
        ('{"answer": "3"}', "'prompt'", "missing field 'prompt' (required: prompt, answer)"),
        ('{"prompt": "1+2="}', "'answer'", "missing field 'answer'"),
        ('{"prompt": 12, "answer": "3"}', "'prompt'", "expected a string, got 12"),
        ('{"prompt": "1+2=", "answer": null}', "'answer'", "expected a string, got None"),
        ('{"prompt": "", "answer": "3"}', "'prompt'", "must not be empty"),
        (
            '{"prompt": "1+2=3+4+5+6=", "answer": "3"}',
            "'prompt'",
            "13 tokens (as encoded: template and special tokens) exceed max_prompt_len 12",
        ),
        (
            '{"prompt": "1+2=", "answer": "3", "extra": 1}',
            "'extra'",
            "unknown field 'extra' (allowed: prompt",
        ),
        ('{"prompt": "ÄÖ", "answer": "3"}', "'prompt'", "character 'Ä' is not in the tokenizer's alphabet"),
        (
            '{"prompt": "1+2=", "answer": "3", "id": true}',
            "'id'",
            "expected a string or an integer, got True",
        ),
        ('{"prompt": "1+2=", "answer": "3", "id": "x"}', "'id'", "'x' repeats the id of"),
        (
            '{"prompt": "1+\\ud800=", "answer": "3"}',
            "'prompt'",
            "not text (a lone surrogate \\ud800 at character 2)",
        ),
        ('{"prompt": "1+2=", "answer": "3", "id": "\\udfff"}', "'id'", "not text (a lone surrogate"),
        ('["1+2=", "3"]', "", "expected a JSON object with fields prompt, answer, id"),
        ('{"prompt": "1+2=", ', "", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "", "not valid JSON (nested too deeply)"),
        ('{"prompt": "1+2=", "prompt": "2+2=", "answer": "3"}', "", "(key 'prompt' given twice)"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path: Path, line: str, field: str, detail: str) -> None:
    path = write(tmp_path, [*GOOD, "", line])  # a blank line still counts: the bad record is line 4
    with pytest.raises(ConfigError) as err:
        PromptDataset.load(path, TOK, max_prompt_len=12)
    msg = str(err.value)
    assert msg.startswith(f"{path}:4: "), msg
    assert field in msg and detail in msg, msg
    assert "\n" not in msg


def test_bad_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ConfigError, match=r"unknown dataset format '\.csv' \(allowed: \.jsonl, \.json, \.parquet\)"
    ):
        PromptDataset.load(tmp_path / "d.csv", TOK, 64)
    with pytest.raises(ConfigError, match="dataset file does not exist"):
        PromptDataset.load(tmp_path / "none.jsonl", TOK, 64)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.jsonl: a folder, not a dataset file"):
        PromptDataset.load(tmp_path / "dir.jsonl", TOK, 64)
    nan = write(tmp_path, ['{"prompt": "1+2=", "answer": NaN}'], "nan.jsonl")
    with pytest.raises(
        ConfigError, match=r"nan\.jsonl:1: not valid JSON \(NaN is not a number a record may hold\)"
    ):
        PromptDataset.load(nan, TOK, 64)
    bom = tmp_path / "bom.jsonl"  # a byte-order mark, as Windows tools write one: read as UTF-8
    bom.write_bytes("\ufeff".encode() + "\n".join(GOOD).encode())
    assert len(PromptDataset.load(bom, TOK, 64).records) == 2
    with pytest.raises(ConfigError, match="no records"):
        PromptDataset.load(write(tmp_path, [""]), TOK, 64)
    parquet = tmp_path / "d.parquet"
    parquet.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as on a machine without pyarrow
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"d\.parquet: reading Parquet needs pyarrow"):
        PromptDataset.load(parquet, TOK, 64)


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    records = generate_tasks("max", 20, seed=1)
    pq.write_table(pa.Table.from_pylist([r.to_json() for r in records]), tmp_path / "d.parquet")
    assert PromptDataset.load(tmp_path / "d.parquet", TOK, 64).records == tuple(records)


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": "1+2=", "answer": float("nan")}, "answer"),
        ({"prompt": "1+2=", "answer": "3", "extra": {"score": [1.0, float("inf")]}}, "extra.score[1]"),
    ],
)
def test_parquet_nan_is_refused_naming_the_row_and_field(tmp_path: Path, row: dict, field: str) -> None:
    """As in JSONL: an answer of NaN would become the text "nan"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = {**row, "answer": 3.0} if field == "answer" else {**row, "extra": {"score": [1.0, 2.0]}}
    pq.write_table(pa.Table.from_pylist([good, row]), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match=rf"d\.parquet:row 2: field '{re.escape(field)}': NaN and Infinity"):
        PromptDataset.load(tmp_path / "d.parquet", TOK, 64)


def test_jsonl_round_trip_and_default_ids(tmp_path: Path) -> None:
    records = generate_tasks("add", 30, seed=2, difficulty=9, length=4)
    assert write_jsonl(records, tmp_path / "t.jsonl") == 30
    ds = PromptDataset.load(tmp_path / "t.jsonl", TOK, max_prompt_len=64)
    assert ds.records == tuple(records) and len(ds) == 30
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["id"] == records[0].id
    plain = PromptDataset.load(write(tmp_path, GOOD), TOK, 64)
    assert [r.id for r in plain.records] == ["1", "x"]  # the line number, unless given


def test_json_files_several_files_and_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    lines = write(tmp_path, GOOD, "lines.json")  # datasets' to_json writes JSON Lines under .json
    assert [r.id for r in PromptDataset.load(lines, TOK, 64).records] == ["1", "x"]
    array = tmp_path / "array.json"
    array.write_text("[" + ", ".join(GOOD) + "]")
    assert [r.answer for r in PromptDataset.load(array, TOK, 64).records] == ["3", "2"]
    array.write_text("[" + ", ".join(GOOD) + ",\n{]")
    with pytest.raises(ConfigError, match=r"array\.json:2: not valid JSON"):
        PromptDataset.load(array, TOK, 64)
    other = write(tmp_path, ['{"prompt": "2+2=", "answer": "4"}'], "other.jsonl")
    both = PromptDataset.load([lines, other], TOK, 64)  # a later file's line numbers are its own
    assert [r.id for r in both.records] == ["1", "x", f"{other}:1"] and both.source == f"{lines}, {other}"
    with pytest.raises(
        ConfigError, match=r"lines\.json:2: column 'id': 'x' repeats the id of .*lines\.json:2"
    ):
        PromptDataset.load([lines, lines], TOK, 64)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "1+2=", "answer": "3"}\n{"prompt": "\xff", "answer": "3"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not UTF-8 text \(byte 0xff\)"):
        PromptDataset.load(bad, TOK, 64)


# ------------------------------------------------------------------ global order and DP shards
def dataset(n: int = 10, seed: int = 0) -> PromptDataset:
    return PromptDataset("mem", tuple(generate_tasks("copy", n, seed=5)), seed)


def test_each_epoch_is_a_seeded_permutation() -> None:
    ds = dataset()
    orders = [ds.order(e) for e in range(4)]
    for o in orders:
        assert sorted(o) == list(range(10))
    assert len(set(orders)) == 4  # differs across epochs
    assert orders == [dataset().order(e) for e in range(4)]  # deterministic per seed
    assert orders[0] != dataset(seed=1).order(0)
    got = ds.samples(7, 16)  # crosses from epoch 0 into epoch 2
    assert [(s.index, s.epoch, s.position) for s in got[:4]] == [(7, 0, 7), (8, 0, 8), (9, 0, 9), (10, 1, 0)]
    assert [s.record for s in got] == [ds.records[orders[i // 10][i % 10]] for i in range(7, 23)]
    epoch1 = [s.record.id for s in ds.samples(10, 10)]
    assert sorted(epoch1) == sorted(r.id for r in ds.records)  # an epoch takes every record once


@pytest.mark.parametrize("minibatch", [0, 1, 3])
def test_every_dp_split_takes_the_same_samples(minibatch: int) -> None:
    ds, batch = dataset(), 8  # minibatch 1 straddles the end of epoch 0
    whole = ds.shard(batch, 1, 0, minibatch)
    assert [s.index for s in whole] == list(range(minibatch * batch, (minibatch + 1) * batch))
    for dp in (1, 2, 4):
        parts = [ds.shard(batch, dp, r, minibatch) for r in range(dp)]
        assert [len(p) for p in parts] == [batch // dp] * dp
        assert [s for p in parts for s in p] == whole  # none repeated, none skipped, same order
        ids = [collate(p, TOK, samples_per_prompt=4)[2] for p in parts]
        assert [i for part in ids for i in part] == collate(whole, TOK, samples_per_prompt=4)[2]
    r = sample_range(batch, 2, 1, minibatch)
    assert [s.index for s in ds.shard(batch, 2, 1, minibatch)] == list(r)


def test_collate_left_pads_and_repeats_each_prompt() -> None:
    ds = PromptDataset("mem", (TaskRecord("copy 1234=", "4"), TaskRecord("1+2=", "3")), 0)
    samples = ds.samples(12, 2)
    ids, valid, sample_ids = collate(samples, TOK, samples_per_prompt=3)
    lengths = [len(TOK.encode(s.record.prompt)) for s in samples]
    assert ids.shape == valid.shape == (6, max(lengths)) and ids.dtype == valid.dtype == torch.long
    assert sample_ids == [12 * 3, 12 * 3 + 1, 12 * 3 + 2, 13 * 3, 13 * 3 + 1, 13 * 3 + 2]
    for row in range(6):
        s = samples[row // 3]
        n = lengths[row // 3]
        assert valid[row].tolist() == [0] * (ids.shape[1] - n) + [1] * n  # left padding
        assert ids[row, : ids.shape[1] - n].eq(PAD_ID).all()
        assert ids[row, -n:].tolist() == TOK.encode(s.record.prompt)
    wide, wide_valid, _ = collate(samples, TOK, pad_to=16)
    assert wide.shape == (2, 16) and wide_valid.sum(1).tolist() == lengths
    with pytest.raises(ValueError, match="pad_to 4 is shorter than the longest prompt"):
        collate(samples, TOK, pad_to=4)
    with pytest.raises(ValueError, match="samples_per_prompt must be positive"):
        collate(samples, TOK, samples_per_prompt=0)
