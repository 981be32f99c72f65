"""A Hugging Face tokenizer from a local folder, as a user brings it with their model.

``HfTokenizer(folder)`` reads ``tokenizer.json`` / ``tokenizer_config.json`` (with its
``chat_template``) through ``transformers.AutoTokenizer``, offline: nothing is fetched from the
hub at run time, and a folder without a tokenizer is a one-line ``ConfigError``. Prompts go through
the chat template (a user turn, then the generation prompt) when the tokenizer has one and
``chat`` is on; else they are encoded as plain text with the tokenizer's special tokens. A
response ends at the tokenizer's eos or at any ``eos_token_id`` of the model's
``generation_config.json`` (its folder's, ``generation``, else the tokenizer folder's: an
instruct model's end of turn, e.g. Llama 3.1's ``<|eot_id|>`` and ``<|eom_id|>``, Qwen's
``<|im_end|>`` and ``<|endoftext|>``), as transformers' ``generate`` and vLLM stop. Decoding
stops at the first of them and drops special tokens, so a verifier sees the response's text. The
value is a frozen dataclass of its folders and ``chat`` only: the runtime sends it to every
worker as such and each loads the files itself. Edge module (files; imports transformers when
built).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.spec.files import brief

FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# what a model folder carries beside its weights for transformers and vLLM to serve it
COMPANIONS = (
    *FILES, "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)  # fmt: skip


def has_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a Hugging Face tokenizer's files."""
    return any((Path(folder) / name).is_file() for name in FILES)


def check_folder(folder: str | Path) -> None:
    """A one-line ``ConfigError`` unless ``folder`` holds a tokenizer (no transformers import)."""
    if not has_tokenizer(folder):
        raise ConfigError(
            f"tokenizer: {folder} holds no Hugging Face tokenizer (expected {' or '.join(FILES)})"
        )


GENERATION = "generation_config.json"


def _generation_eos(folder: Path, vocab: int) -> tuple[int, ...]:
    """``eos_token_id`` (an id or a list of them) of ``folder/generation_config.json``, if any."""
    path = folder / GENERATION
    if not path.is_file():
        return ()
    from nereus.spec.files import load_json

    doc = load_json(path, "generation config")
    raw = doc.get("eos_token_id") if isinstance(doc, dict) else None
    if raw is None:
        return ()
    ids = raw if isinstance(raw, list) else [raw]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
        raise ConfigError(
            f"{path}: key 'eos_token_id': expected a token id or a list of ids in [0, {vocab}), "
            f"got {brief(raw)}"
        )
    return tuple(ids)


@dataclass(frozen=True, slots=True)
class HfTokenizer:
    folder: str
    chat: bool = True  # prompts through the chat template, when the tokenizer has one
    # the model's folder, whose generation_config.json gives the stop ids and goes with an export
    # when it has one ("" or a folder without one: the tokenizer's folder's)
    generation: str = ""
    _tok: Any = field(init=False, repr=False, compare=False)
    _stop: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_folder(self.folder)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub at run time
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"tokenizer: {self.folder} cannot be loaded: {first}") from None
        if tok.eos_token_id is None:
            raise ConfigError(f"tokenizer: {self.folder} has no eos token (tokenizer_config.json: eos_token)")
        object.__setattr__(self, "_tok", tok)
        if self.templated:  # a template that does not render fails here, not in the workers
            self.encode_messages([{"role": "user", "content": "1 + 1 = ?"}])
        eos = int(tok.eos_token_id)
        more = _generation_eos(self._generation_folder(), len(tok))
        object.__setattr__(self, "_stop", (eos, *sorted(set(more) - {eos})))

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_token_id)

    def _generation_folder(self) -> Path:
        """Where the generation config is: the model's folder when it has one, else the tokenizer's."""
        model = Path(self.generation) if self.generation else None
        if model is not None and (model / GENERATION).is_file():
            return model
        return Path(self.folder)

    def companions(self) -> tuple[Path, ...]:
        """This tokenizer's files and the model's generation config, for an exported model."""
        folder = Path(self.folder)
        files = [folder / name for name in COMPANIONS if name != GENERATION and (folder / name).is_file()]
        config = self._generation_folder() / GENERATION
        return (*files, config) if config.is_file() else tuple(files)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a response: the eos first, then the generation config's others."""
        return self._stop

    @property
    def pad_id(self) -> int:
        """The pad token's id; the eos id when the tokenizer has no pad token (as is usual)."""
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else self.eos_id

    @property
    def bos_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    def vocabulary(self) -> dict[str, int]:
        """Every token and its id (added tokens included): two tokenizers agree on ids if these do."""
        vocab: dict[str, int] = self._tok.get_vocab()
        return vocab

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included."""
        return len(self._tok)

    @property
    def templated(self) -> bool:
        """Whether prompts go through a chat template."""
        return self.chat and bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """A prompt's ids: a user turn of the chat template and the generation prompt, or the plain
        text with the tokenizer's own special tokens (``bos``); ``eos`` appends the eos id."""
        if self.templated:
            ids = self.encode_messages([{"role": "user", "content": text}])
        else:
            ids = list(self._tok.encode(text, add_special_tokens=bos))
        return [*ids, self.eos_id] if eos else ids

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """A conversation's ids through the chat template, ending with the generation prompt."""
        if not getattr(self._tok, "chat_template", None):
            raise ConfigError(f"tokenizer: {self.folder} has no chat_template for chat-message prompts")
        try:
            out = self._tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # jinja2's errors: a broken template, or its raise_exception()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"tokenizer: {self.folder}: its chat_template does not render: {type(exc).__name__}: {first}"
            ) from None
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(i) for i in ids]

    def unknown(self, text: str) -> str | None:
        """Nothing: a Hugging Face tokenizer encodes any text (bytes or its unknown token)."""
        return None

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first eos, special tokens dropped."""
        kept: list[int] = []
        for raw in ids:
            i = int(raw)
            if i < 0:
                raise ValueError(f"token id {i} is negative")
            if i in self._stop:
                break
            kept.append(i)
        return str(self._tok.decode(kept, skip_special_tokens=True))
