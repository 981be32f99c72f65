"""The main job's inputs, made by the project in the formats a user brings (``make run``).

``build(out)`` writes, under ``out``:

* ``model/``: a Hugging Face folder as on the hub. ``config.json`` and ``model.safetensors`` of a
  randomly initialised ``transformers`` causal LM (the shape of a shipped model YAML, its
  vocabulary the tokenizer's), next to a tokenizer: a byte-level BPE trained here with the
  ``tokenizers`` library on shipped text (``configs/data/corpus.txt``) and the data set's prompts,
  digits split one per token as Qwen2's and Llama 3's pre-tokenizers do, saved as ``transformers``'
  fast tokenizer with ChatML special tokens and chat template (``<|im_end|>`` ends a turn).
* ``train.parquet``: the prompts in verl's layout (``prompt`` chat messages,
  ``reward_model.ground_truth``, ``data_source``, ``extra_info.index``), from a generated task
  (``nereus.rl.tasks``) whose answers a rule-based verifier checks.

The job then reads them through the same code a user's folder and data set go through
(``model:``, ``data: {layout: verl}``). Every file is written into a temporary folder that
replaces ``out`` only when complete. Edge module (files; imports tokenizers, transformers and
pyarrow when building). ``python -m nereus.rl.assets OUT`` builds with the defaults.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nereus.errors import ConfigError
from nereus.rl.tasks import TaskRecord, generate_tasks
from nereus.spec.model import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "configs" / "data" / "corpus.txt"
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # pad, turn start, turn end (eos)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split: words, single digits, punctuation runs, whitespace.
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SOURCE = "nereus/copy"


@dataclass(frozen=True, slots=True)
class Assets:
    """What ``build`` wrote: the model folder (with its tokenizer) and the data set."""

    model: Path
    train: Path


@dataclass(frozen=True, slots=True)
class AssetSpec:
    """What to build: the task of the data set, the model shape, the tokenizer's vocabulary."""

    model: str = "tiny-llama-h32"  # a shipped model name or YAML: the shape (its vocab is replaced)
    kind: str = "copy"
    n: int = 4096
    difficulty: int = 2
    length: int = 2
    seed: int = 0
    vocab_size: int = 512

    def __post_init__(self) -> None:
        generate_tasks(self.kind, 0, self.seed, self.difficulty, self.length)  # validates the task
        if self.n < 1:
            raise ValueError(f"n must be positive, got {self.n}")
        if not len(SPECIAL) + 256 <= self.vocab_size <= 1 << 20:
            low = len(SPECIAL) + 256  # the byte alphabet and the special tokens
            raise ValueError(f"vocab_size must be in [{low}, {1 << 20}], got {self.vocab_size}")


def corpus_lines(path: Path = CORPUS) -> list[str]:
    """The shipped text, without comment and blank lines."""
    lines = [s.strip() for s in path.read_text(encoding="utf-8").splitlines()]
    return [s for s in lines if s and not s.startswith("#")]


def build_tokenizer(folder: Path, texts: Iterable[str], vocab_size: int) -> int:
    """Train a byte-level BPE on ``texts`` and save it into ``folder`` as ``transformers``' fast
    tokenizer with ChatML special tokens and chat template; returns its vocabulary size."""
    tokenizers: Any = importlib.import_module("tokenizers")
    transformers: Any = importlib.import_module("transformers")
    decoders, pre_tokenizers = tokenizers.decoders, tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL[2], pad_token=SPECIAL[0], bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return len(fast)


def build_model(folder: Path, shape: ModelSpec, vocab_size: int, seed: int) -> None:
    """A randomly initialised ``transformers`` causal LM of ``shape`` with the vocabulary and
    special ids of the tokenizer saved in ``folder``, saved next to it (``config.json``,
    ``model.safetensors``)."""
    import torch

    from nereus.backends.hf import hf_config

    transformers: Any = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = hf_config(replace(shape, vocab_size=vocab_size), torch.float32)
    cfg.update(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(folder)


def verl_rows(records: Sequence[TaskRecord], source: str = SOURCE) -> list[dict[str, object]]:
    """``records`` as rows of verl's layout (one user turn each)."""
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": r.prompt}],
            "ability": "copy",
            "reward_model": {"style": "rule", "ground_truth": r.answer},
            "extra_info": {"split": "train", "index": i},
        }
        for i, r in enumerate(records)
    ]


def write_parquet(rows: Sequence[dict[str, object]], path: Path) -> Path:
    """``rows`` as a Parquet file at ``path`` (pyarrow infers the schema); returns ``path``."""
    pa = importlib.import_module("pyarrow")
    pq = importlib.import_module("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def build(out: Path, spec: AssetSpec = AssetSpec()) -> Assets:
    """Build the model folder (weights and tokenizer) and the verl data set under ``out``,
    replacing what was there only once everything is written."""
    from nereus.spec.registry import load_model

    out = Path(out)
    shape = load_model(spec.model)
    records = generate_tasks(spec.kind, spec.n, spec.seed, spec.difficulty, spec.length)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        texts = [*corpus_lines(), *(f"{r.prompt} {r.answer}" for r in records)]
        vocab = build_tokenizer(tmp / "model", texts, spec.vocab_size)
        build_model(tmp / "model", shape, vocab, spec.seed)
        write_parquet(verl_rows(records), tmp / "train.parquet")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Assets(out / "model", out / "train.parquet")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nereus.rl.assets",
        description="Build the main job's model folder (BPE tokenizer, random weights) and verl data set.",
    )
    default = AssetSpec()
    parser.add_argument("out", type=Path, help="folder to write (replaced)")
    parser.add_argument("--model", default=default.model, help="shipped model name or YAML (the shape)")
    parser.add_argument("--n", type=int, default=default.n, help="prompts in the data set")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--vocab-size", type=int, default=default.vocab_size)
    args = parser.parse_args(argv)
    try:
        spec = AssetSpec(model=args.model, n=args.n, seed=args.seed, vocab_size=args.vocab_size)
        assets = build(args.out, spec)
    except (ConfigError, ValueError) as exc:
        print(f"nereus assets: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:  # a trimmed install: the builders need the Hugging Face stack
        print(
            f"nereus assets: error: building needs transformers, tokenizers and pyarrow "
            f"(pip install transformers tokenizers pyarrow): {exc}",
            file=sys.stderr,
        )
        return 2
    print(f"model and tokenizer: {assets.model}\ndata set: {assets.train}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
