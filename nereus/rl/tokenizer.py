"""Tokenizers: the ``Tokenizer`` protocol the runtime and the data speak, a deterministic
character-level tokenizer for the bundled tasks (``nereus.rl.tasks``), and ``tokenizer_of``, which
picks a job's (a Hugging Face tokenizer, ``nereus.rl.hf_tokenizer``, when the experiment names or
brings one).

Ids 0, 1, 2 are pad, bos and eos; character ``c`` of the alphabet has id ``3 + alphabet.index(c)``.
The whole vocabulary (53 ids) fits the tiny models' 512, so a randomly initialised model trains on
it directly. A model with a larger vocabulary can emit ids outside the alphabet; they decode to
U+FFFD so that a verifier sees a malformed answer instead of the loop failing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from nereus.rl.hf_tokenizer import HfTokenizer

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL = 3  # ids below this are special tokens
ALPHABET = "0123456789+-*= abcdefghijklmnopqrstuvwxyz.,:;?!()'"
UNKNOWN = "\ufffd"  # what an id beyond the alphabet decodes to


class Tokenizer(Protocol):
    """What a job needs of a tokenizer: prompt ids, response text up to eos, the special ids."""

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a response (the eos first)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def unknown(self, text: str) -> str | None:
        """The first character ``encode`` would refuse, or None."""
        ...

    def companions(self) -> tuple[Path, ...]:
        """Files an exported model carries so that transformers and vLLM read it with this
        tokenizer (none for the character tokenizer)."""
        ...


def tokenizer_of(named: str, *folders: str) -> CharTokenizer | HfTokenizer:
    """A job's tokenizer: the Hugging Face tokenizer in folder ``named`` (the experiment's
    ``tokenizer:``), else the one in the first of ``folders`` (the actor's ``init:`` folder, the
    ``model:`` folder) that has one, else the character-level tokenizer of the bundled tasks
    (``nereus run`` refuses a ``model:`` folder left without one, ``command.check_tokenizer``)."""
    from nereus.rl.hf_tokenizer import HfTokenizer, has_tokenizer

    # the model's generation config (its stop ids) is its own folder's, wherever the tokenizer is
    model = next((f for f in folders if f and (Path(f) / "generation_config.json").is_file()), "")
    if named:
        return HfTokenizer(named, generation=model)
    for folder in folders:
        if folder and has_tokenizer(folder):
            return HfTokenizer(folder, generation=model)
    return CharTokenizer()


@dataclass(frozen=True, slots=True)
class CharTokenizer:
    """Characters of ``alphabet`` ↔ ids; ``encode`` refuses any other character."""

    alphabet: str = ALPHABET
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.alphabet:
            raise ValueError("alphabet must not be empty")
        repeated = sorted({c for c in self.alphabet if self.alphabet.count(c) > 1})
        if repeated:
            raise ValueError(f"alphabet repeats characters {repeated}")
        object.__setattr__(self, "_ids", {c: SPECIAL + i for i, c in enumerate(self.alphabet)})

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    stop_ids = (EOS_ID,)

    @property
    def vocab_size(self) -> int:
        """Ids in use: the three special tokens and the alphabet."""
        return SPECIAL + len(self.alphabet)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Ids of ``text``, after bos (and followed by eos) when asked."""
        ids = [BOS_ID] if bos else []
        for pos, c in enumerate(text):
            i = self._ids.get(c)
            if i is None:
                raise ValueError(
                    f"character {c!r} at position {pos} is not in the tokenizer's alphabet {self.alphabet!r}"
                )
            ids.append(i)
        if eos:
            ids.append(EOS_ID)
        return ids

    def companions(self) -> tuple[Path, ...]:
        return ()

    def unknown(self, text: str) -> str | None:
        """The first character of ``text`` that ``encode`` refuses, or None."""
        return next((c for c in text if c not in self._ids), None)

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first eos; pad and bos are skipped, ids beyond the alphabet become U+FFFD."""
        out: list[str] = []
        for raw in ids:
            i = int(raw)
            if i < 0:
                raise ValueError(f"token id {i} is negative")
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            k = i - SPECIAL
            out.append(self.alphabet[k] if k < len(self.alphabet) else UNKNOWN)
        return "".join(out)
