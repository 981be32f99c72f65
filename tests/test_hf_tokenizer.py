"""Hugging Face tokenizers from a local folder (``nereus.rl.hf_tokenizer``).

The test trains a small byte-level BPE with the ``tokenizers`` library, wraps it as
``transformers``' fast tokenizer with special tokens and a chat template, and saves it as a user
would bring it. Checked: it loads offline; prompts go through the chat template (a user turn and
the generation prompt) or as plain text; decoding stops at eos and drops special tokens; which
tokenizer a job takes (named, the actor's init folder, else the character tokenizer); bad folders
are one-line errors; the value crosses the control channel as its folder; a prompt dataset reads
text the character tokenizer refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.rl.assets import CHAT_TEMPLATE
from nereus.rl.data import PromptDataset, collate
from nereus.rl.hf_tokenizer import HfTokenizer, has_tokenizer
from nereus.rl.tokenizer import CharTokenizer, tokenizer_of
from nereus.runtime.codec import decode, encode

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.pure

TEMPLATE = CHAT_TEMPLATE  # ChatML, as the main job's tokenizer has
TEXT = [
    "What is 12 plus 30? The answer is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "Compute \\frac{1}{2} + \\frac{1}{3}. The answer is \\boxed{\\frac{5}{6}}.",
] * 8


def build(folder: Path, template: str | None = TEMPLATE, eos: bool = True) -> Path:
    """A byte-level BPE of about 300 ids with <|endoftext|>, <|im_start|>, <|im_end|>."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>" if eos else None, pad_token="<|endoftext|>"
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("tok"))


def test_loads_offline_with_its_special_ids(folder: Path) -> None:
    tok = HfTokenizer(str(folder))
    raw = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.vocab_size == len(raw) <= 303
    assert tok.eos_id == raw.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_id == raw.convert_tokens_to_ids("<|endoftext|>") != tok.eos_id
    assert tok.templated


def test_prompts_go_through_the_chat_template(folder: Path) -> None:
    tok = HfTokenizer(str(folder))
    ids = tok.encode("What is 12 plus 30?")
    text = transformers.AutoTokenizer.from_pretrained(folder).decode(ids)
    assert text == "<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.encode_messages(messages)[-len(ids) :] != ids
    plain = HfTokenizer(str(folder), chat=False)
    assert not plain.templated
    assert plain.decode(plain.encode("What is 12 plus 30?")) == "What is 12 plus 30?"
    assert plain.encode("x", eos=True)[-1] == plain.eos_id


def test_decoding_stops_at_eos_and_drops_special_tokens(folder: Path) -> None:
    tok = HfTokenizer(str(folder), chat=False)
    answer = tok.encode(" The answer is 42.")
    tail = tok.encode(" and more")
    assert tok.decode([*answer, tok.eos_id, *tail]) == " The answer is 42."
    assert tok.decode([tok.pad_id, *answer]) == " The answer is 42."
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_a_generation_configs_eos_ids_also_end_a_response(folder: Path, tmp_path: Path) -> None:
    """An instruct model's folder lists its end-of-turn ids in generation_config.json (Llama 3.1:
    [128001, 128008, 128009]); generation stops at any of them, as transformers and vLLM do."""
    import shutil

    tok = HfTokenizer(str(folder), chat=False)
    assert tok.stop_ids == (tok.eos_id,)
    instruct = tmp_path / "instruct"
    shutil.copytree(folder, instruct)
    (instruct / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.pad_id, tok.eos_id]}))
    both = HfTokenizer(str(instruct), chat=False)
    assert both.stop_ids == (tok.eos_id, tok.pad_id)  # the tokenizer's eos first
    answer = both.encode(" The answer is 42.")
    assert both.decode([*answer, tok.pad_id, *both.encode(" and more")]) == " The answer is 42."
    (instruct / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.eos_id, "top_p": 0.9}))
    assert HfTokenizer(str(instruct)).stop_ids == (tok.eos_id,)
    for bad in ('{"eos_token_id": "2"}', '{"eos_token_id": [1, 100000]}', '{"eos_token_id": [true]}'):
        (instruct / "generation_config.json").write_text(bad)
        with pytest.raises(
            ConfigError, match=r"generation_config.json: key 'eos_token_id': expected a token id"
        ):
            HfTokenizer(str(instruct))
    assert CharTokenizer().stop_ids == (CharTokenizer().eos_id,)
    names = {p.name for p in both.companions()}  # what an exported model carries
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert all(p.parent == instruct for p in both.companions()) and CharTokenizer().companions() == ()


def test_which_tokenizer_a_job_takes(folder: Path, tmp_path: Path) -> None:
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    assert isinstance(tokenizer_of("", ""), CharTokenizer)
    assert isinstance(tokenizer_of("", str(weights_only)), CharTokenizer)  # an init folder without one
    assert tokenizer_of("", str(folder)) == HfTokenizer(str(folder))  # the actor's folder brings one
    assert tokenizer_of(str(folder), str(weights_only)).folder == str(folder)  # named wins
    assert has_tokenizer(folder) and not has_tokenizer(weights_only)
    # an init folder without one, then the model folder with one: the model folder's
    assert tokenizer_of("", str(weights_only), str(folder)).folder == str(folder)


def test_bad_folders_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"^tokenizer: .* holds no Hugging Face tokenizer \(expected tokenizer"
    ):
        HfTokenizer(str(tmp_path))
    no_eos = build(tmp_path / "no-eos", eos=False)
    with pytest.raises(ConfigError, match=r"^tokenizer: .* has no eos token"):
        HfTokenizer(str(no_eos))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"^tokenizer: .* cannot be loaded") as info:
        HfTokenizer(str(broken))
    assert "\n" not in str(info.value)
    untemplated = HfTokenizer(str(build(tmp_path / "plain", template=None)))
    assert not untemplated.templated
    with pytest.raises(ConfigError, match="no chat_template"):
        untemplated.encode_messages([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% for m in messages %}", "TemplateSyntaxError"),
        ('{{ raise_exception("no system turn") }}', "TemplateError"),
    ],
)
def test_a_chat_template_that_does_not_render_is_one_line(tmp_path: Path, template: str, error: str) -> None:
    """Found when the tokenizer is built (preflight builds it), not in the workers' first step;
    a template that refuses a later conversation is one line too."""
    refused = rf"^tokenizer: .*: its chat_template does not render: {error}: "
    with pytest.raises(ConfigError, match=refused) as info:
        HfTokenizer(str(build(tmp_path / "bad", template=template)))
    assert "\n" not in str(info.value)
    picky = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    tok = HfTokenizer(str(build(tmp_path / "picky", template=picky)))
    with pytest.raises(ConfigError, match=r"does not render: TemplateError: user first$"):
        tok.encode_messages([{"role": "system", "content": "hi"}])
    assert HfTokenizer(str(build(tmp_path / "plain", template=picky)), chat=False).encode("hi")


def test_crosses_the_control_channel_as_its_folder(folder: Path) -> None:
    tok = HfTokenizer(str(folder))
    doc = json.loads(encode(tok))
    assert doc["folder"] == str(folder) and "_tok" not in doc
    back = decode(encode(tok), CharTokenizer | HfTokenizer)
    assert back == tok and back.encode("Hi") == tok.encode("Hi")


def test_a_dataset_reads_text_the_character_tokenizer_refuses(folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "Natalia sold 48 clips in April — how many in May?", "answer": "24"}] * 4
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match="not in the tokenizer's alphabet"):
        PromptDataset.load(path, CharTokenizer(), 64)
    tok = HfTokenizer(str(folder))
    data = PromptDataset.load(path, tok, 64)
    ids, valid, _ = collate(data.samples(0, 2), tok, 2)
    assert ids.shape[0] == 4 and int(valid[0].sum()) == len(tok.encode(rows[0]["prompt"]))
    assert int(ids[0, -1]) == tok.encode(rows[0]["prompt"])[-1]  # left-padded: the prompt ends the row


def test_the_models_generation_config_rules_wherever_the_tokenizer_is(folder: Path, tmp_path: Path) -> None:
    """``tokenizer:`` names another folder: the stop ids and the exported generation config are
    still the model folder's (Llama 3.1's end-of-turn ids live there, not with the tokenizer)."""
    model = tmp_path / "model"
    model.mkdir()
    tok = HfTokenizer(str(folder), chat=False)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, tok.pad_id]}))
    named = tokenizer_of(str(folder), str(model))
    assert isinstance(named, HfTokenizer) and named.generation == str(model)
    assert named.stop_ids == (tok.eos_id, tok.pad_id)
    assert model / "generation_config.json" in named.companions()
    assert not any(p.parent == model and p.name != "generation_config.json" for p in named.companions())
    assert tokenizer_of(str(folder), "").stop_ids == (tok.eos_id,)  # no model folder: the tokenizer's
