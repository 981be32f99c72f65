"""Hugging Face checkpoints: ``config.json`` and safetensors in, the same out.

Reading is lazy (``safe_open``): a rank reads only the slices its shards need, from a single
``model.safetensors`` or a sharded ``model.safetensors.index.json``. Writing goes to a temporary
directory that is renamed into place, so a reader never sees half a checkpoint. Names are the
model's state-dict names; a value head is ``score.weight`` (``*ForSequenceClassification``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nereus.errors import ConfigError
from nereus.spec.files import parse_json
from nereus.spec.model import Head, ModelFamily, ModelSpec
from nereus.state.geometry import EMBEDDING

T = TypeVar("T")

ARCHITECTURE = {
    ModelFamily.LLAMA: "Llama",
    ModelFamily.MISTRAL: "Mistral",
    ModelFamily.QWEN2: "Qwen2",
    ModelFamily.QWEN3: "Qwen3",
}
SHARD_BYTES = 4 << 30  # safetensors files are split above this size, as save_pretrained does
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the weights ``get`` takes (bf16, fp16, fp32), as a safetensors header names them
HEADER_FLOATS = frozenset({"BF16", "F16", "F32"})


def read_config(directory: Path) -> ModelSpec:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (expected a Hugging Face model directory)")
    return ModelSpec.from_hf_config(path, name=Path(directory).name)


def hf_config(model: ModelSpec, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``model`` in the form transformers writes (and reads back)."""
    arch = ARCHITECTURE[model.family] + (
        "ForSequenceClassification" if model.head is Head.VALUE else "ForCausalLM"
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        s = model.rope_scaling
        rope = {
            "rope_type": "llama3", "rope_theta": model.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }  # fmt: skip
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model.family.value,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_key_value_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.intermediate_size,
        "vocab_size": model.vocab_size,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": model.attention_bias,
        "rms_norm_eps": model.rms_norm_eps,
        "max_position_embeddings": model.max_position_embeddings,
        "rope_parameters": rope,  # transformers 5
        "rope_theta": model.rope_theta,  # transformers 4 reads these two
        "rope_scaling": None if model.rope_scaling is None else rope,
        "hidden_act": "silu",
        # stated even when there is none: transformers gives a Mistral config without the key a
        # 4096-token window, which vLLM would then apply
        "sliding_window": model.sliding_window or None,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if model.family in (ModelFamily.QWEN2, ModelFamily.QWEN3):
        cfg["use_sliding_window"] = model.sliding_window > 0
        cfg["max_window_layers"] = model.max_window_layers
    if model.head is Head.VALUE:
        cfg["num_labels"] = 1
    return cfg


class SafetensorsReader:
    """Lazy access to the tensors of a Hugging Face model directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        single = self.directory / SINGLE
        if index.is_file():
            source = index
        elif single.is_file():
            source = single
        else:
            raise ConfigError(f"{directory}: no {SINGLE} or {INDEX}")
        try:
            if source == index:
                doc = parse_json(index.read_text(), str(index))
                weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
                if not isinstance(weight_map, dict) or not all(
                    isinstance(n, str) and isinstance(f, str) for n, f in weight_map.items()
                ):
                    raise ConfigError(f"{index}: key 'weight_map' must map tensor names to file names")
                self.files = {name: self.directory / f for name, f in weight_map.items()}
            else:
                with safe_open(str(single), "pt") as f:
                    self.files = {name: single for name in f.keys()}  # noqa: SIM118
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError, SafetensorError) as exc:
            raise ConfigError(f"{source}: cannot read the tensor index ({exc})") from None
        self._open: dict[Path, Any] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def _file(self, path: Path) -> Any:
        if path not in self._open:
            self._open[path] = safe_open(str(path), "pt")
        return self._open[path]

    def _read(self, name: str, what: Callable[[Any], T]) -> T:
        """``what`` of ``name``'s slice view (its header, or rows without the rest of the data)."""
        path = self.files[name]
        try:
            return what(self._file(path).get_slice(name))
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ConfigError(f"{path}: cannot read tensor '{name}' ({exc})") from None

    def check_header(self, name: str, shape: tuple[int, ...] | None = None) -> None:
        """``name``'s dtype and (given) shape from its file's header alone, no tensor data read:
        what preflight checks before any worker starts, and ``get`` before it reads."""
        path = self.files[name]
        dtype, found = self._read(name, lambda v: (str(v.get_dtype()), tuple(int(d) for d in v.get_shape())))
        if dtype not in HEADER_FLOATS:
            raise ConfigError(
                f"{path}: tensor '{name}' is {dtype}; expected bf16, fp16 or fp32 weights (a quantized "
                "checkpoint must be dequantized first)"
            )
        if shape is not None and found != shape:
            raise ConfigError(f"{path}: tensor '{name}' has shape {found}, the model needs {shape}")

    def shape(self, name: str) -> tuple[int, ...]:
        """``name``'s shape from its file's header."""
        return self._read(name, lambda v: tuple(int(d) for d in v.get_shape()))

    def rows(self, name: str, picks: Sequence[int]) -> torch.Tensor:
        """Rows ``picks`` of a tensor, read from its file without the rest of it."""
        return self._read(name, lambda v: torch.cat([v[i : i + 1] for i in picks]))

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.files:
            raise ConfigError(f"{self.directory}: tensor '{name}' is missing from the checkpoint")
        self.check_header(name, shape)
        path = self.files[name]
        try:
            t: torch.Tensor = self._file(path).get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ConfigError(f"{path}: cannot read tensor '{name}' ({exc})") from None
        if not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{path}: tensor '{name}' holds NaN or Infinity")
        return t


def unused_is_harmless(name: str) -> bool:
    """A checkpoint tensor a model-stage may leave unread: an LM head (a critic or reward model
    from a causal LM; a tied model's copy), a value head (an actor from a reward model), RoPE's
    inverse frequencies (older transformers saved them)."""
    return name in ("lm_head.weight", "score.weight") or name.endswith("rotary_emb.inv_freq")


def untied_head(reader: SafetensorsReader, model: ModelSpec, samples: int = 16) -> bool:
    """Whether a tied model's checkpoint holds an LM head of its own that is not the embedding
    (compared on ``samples`` rows spread over the vocabulary): transformers and vLLM drop it and use
    the embedding, as the engines do, so a head trained apart would not be the one that runs."""
    names = reader.names()
    if not model.tie_word_embeddings or "lm_head.weight" not in names or EMBEDDING not in names:
        return False
    shape = reader.shape(EMBEDDING)
    if reader.shape("lm_head.weight") != shape or not shape:
        return True  # not a copy of the embedding, whatever it holds
    picks = sorted({round(k * (shape[0] - 1) / max(samples - 1, 1)) for k in range(samples)})
    return not torch.equal(reader.rows("lm_head.weight", picks), reader.rows(EMBEDDING, picks))


def check_compatible(model: ModelSpec, found: ModelSpec, directory: Path) -> None:
    """The checkpoint's architecture must be the model's (a value head may be added): shapes, and
    everything that changes the function (RoPE, norm epsilon, a tied LM head)."""
    keys = [
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "qk_norm", "attention_bias", "rope_theta", "rope_type",
        "rope_scaling", "rms_norm_eps", "sliding_window", "max_window_layers",
    ]  # fmt: skip
    if model.head is Head.LM:
        keys.append("tie_word_embeddings")
    for key in keys:
        a, b = getattr(model, key), getattr(found, key)
        if a != b:
            raise ConfigError(f"{directory}/config.json: key '{key}' is {b}, the model-stage needs {a}")


def full_reader(
    reader: SafetensorsReader, model: ModelSpec
) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    """``full(name, shape)``: a whole tensor; a value head missing from an LM checkpoint is zeros
    (a critic initialised from an actor, as verl does), anything else missing is an error."""

    def full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name == "score.weight" and model.head is Head.VALUE and name not in reader.names():
            return torch.zeros(shape)
        return reader.get(name, shape)

    return full


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _token_ids(companions: Sequence[Path]) -> dict[str, Any]:
    """The special token ids of the companions' folder's ``config.json`` (the tokenizer's model,
    usually the one trained from), so the export's config names them as its source did; none
    when there is no such file or it does not parse."""
    for folder in dict.fromkeys(p.parent for p in companions):
        try:
            source = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(source, dict):
            return {k: source[k] for k in TOKEN_IDS if _token_id(source.get(k))}
    return {}


def _token_id(value: Any) -> bool:
    """An id or a list of ids (Llama 3.1's several eos ids), as transformers writes them."""
    ids = value if isinstance(value, list) else [value]
    return bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)


def save(
    directory: Path, model: ModelSpec, tensors: Mapping[str, torch.Tensor], companions: Sequence[Path] = ()
) -> None:
    """Write ``config.json`` and safetensors (sharded above ``SHARD_BYTES``), atomically, with
    copies of the ``companions`` files (a tokenizer's; never a config or a weights file); the
    config names the special token ids of the companions' folder's config (``_token_ids``)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        for path in companions:
            if path.name == "config.json" or path.suffix == ".safetensors" or path.name == INDEX:
                raise ValueError(f"{path}: a companion file may not replace the checkpoint's own")
            shutil.copyfile(path, tmp / path.name)
        dtype = next(iter(tensors.values())).dtype if tensors else torch.float32
        config = {**hf_config(model, dtype), **_token_ids(companions)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        files: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if files[-1] and size + nbytes > SHARD_BYTES:
                files.append({})
                size = 0
            files[-1][name] = t.detach().contiguous().cpu()
            size += nbytes
        if len(files) == 1:
            save_file(files[0], str(tmp / SINGLE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, part in enumerate(files):
                fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                save_file(part, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in part})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
            )
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
