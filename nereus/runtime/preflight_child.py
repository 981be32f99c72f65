"""The preflight's checks that import torch, in a child process (``nereus run`` never imports it):
the dataset's records, the verifier, the engines' installs, and each ``init:`` folder's
architecture, weight headers and tokenizer. The spec goes in on stdin, one JSON line comes back:
``ok``, or the ``ConfigError``'s line and exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nereus.errors import ConfigError, NereusError
from nereus.spec.files import brief

if TYPE_CHECKING:
    from nereus.rl.tasks import TaskRecord

T = TypeVar("T")


def keyed(key: str, load: Callable[[str], T], value: str) -> T:
    """``load(value)``, its error naming the experiment's ``key`` (``workload: unknown …``)."""
    try:
        return load(value)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _warn_unscorable(warnings: list[str], key: str, verifier: str, records: Sequence[TaskRecord]) -> None:
    """A warning where ``verifier`` can match no response to some of ``records`` (``unscorable``)."""
    from nereus.rl.verifiers import unscorable

    dead = unscorable(verifier, records)
    if dead:
        first = dead[0]
        warnings.append(
            f"{key}: {len(dead)} of {len(records)} rows have no one number after their answer's last "
            f"#### (row {first.id}: {brief(first.answer)}), so {verifier} scores every response to them 0"
        )


def torch_checks(spec: Any) -> list[str]:
    """The checks that import torch (run in a child process by ``preflight``): the dataset's
    records, the verifier, and each ``init:`` folder's architecture and weights. Returns the
    warnings (what runs, but likely not as meant)."""
    from nereus.backends import hf
    from nereus.plan.layout import Layout
    from nereus.rl.data import PromptDataset
    from nereus.rl.tokenizer import tokenizer_of
    from nereus.rl.verifiers import get_verifier
    from nereus.runtime.engines import check_importable, default_cache, engines_of, job_models
    from nereus.spec import load_model, load_workload
    from nereus.spec.model import Head
    from nereus.spec.workload import Role
    from nereus.state.geometry import shards

    warnings: list[str] = []
    workload, model = load_workload(spec.workload), load_model(spec.model)
    models = job_models(workload, model)  # each role's: the workload's models: entry, else model
    check_importable(engines_of(spec, workload, models), default_cache())
    tok = tokenizer_of(spec.tokenizer, *spec.tokenizer_folders(workload))
    if tok.vocab_size > model.vocab_size:
        raise ConfigError(
            f"tokenizer: {tok.vocab_size} ids do not fit {model.name}'s vocabulary of {model.vocab_size}"
        )
    keyed("verifier", get_verifier, spec.verifier)  # before the data's rows are judged by it
    train: tuple[str, int] | None = None  # the training prompts' key and rows
    if spec.data is not None:  # under by_source, every row's data_source names a verifier
        layout = spec.data.record_layout(by_source=spec.verifier == "by_source")
        for key, named in (("data.train", spec.data.files), ("data.val", spec.data.val_files)):
            try:
                if named:
                    rows = PromptDataset.load(
                        [Path(f) for f in named], tok, workload.max_prompt_len, 0, layout
                    )
                    train = train or (key, len(rows))
                    _warn_unscorable(warnings, key, spec.verifier, rows.records)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from None
    elif spec.dataset:
        rows = keyed(
            "dataset", lambda p: PromptDataset.load(Path(p), tok, workload.max_prompt_len), spec.dataset
        )
        train = ("dataset", len(rows))
        _warn_unscorable(warnings, "dataset", spec.verifier, rows.records)
    if train is not None and train[1] < workload.prompts_per_step:
        warnings.append(
            f"{train[0]}: {train[1]} row{'s' if train[1] != 1 else ''}, fewer than {workload.name}'s "
            f"prompts_per_step {workload.prompts_per_step}: every step trains on rows repeated "
            f"(each about {workload.prompts_per_step / train[1]:.3g} times)"
        )
    runs = {ms.role.value for ms in workload.workflow().model_stages}
    for role, head in (("actor", Head.LM), ("ref", Head.LM), ("reward", Head.VALUE), ("critic", Head.VALUE)):
        # where the user named these weights: an init: entry, a models: entry, or the model: folder
        path, label = spec.role_weights(role, workload)
        if not path or role not in runs or (role == "ref" and "ref" not in workload.models):
            continue  # a reference without an entry of its own starts as the actor: checked there
        folder, wanted = Path(path), models[Role(role)].with_head(head)
        try:
            hf.check_compatible(wanted, hf.read_config(folder), folder)
        except ConfigError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        try:
            reader = hf.SafetensorsReader(folder)
        except ConfigError as exc:
            raise ConfigError(f"{label}: {path} has no weights ({exc})") from None
        absent = sorted({f for f in reader.files.values() if not f.is_file()})
        if absent:
            what = "not a file" if absent[0].exists() else "missing"
            raise ConfigError(f"{label}: {path}: the weights index names {absent[0]}, which is {what}")
        shapes = {s.source: s.full_shape for s in shards(wanted, Layout(1, 1), 0, 0)}
        needed = set(shapes)
        if role == "reward" and "score.weight" not in reader.names():  # its head would be zeros
            headless = f"{label}: {path} has no reward head (no score.weight: a causal LM)"
            named = spec.init.path("reward") or workload.models.get(role)
            if named or spec.verifier == "none":  # named so, or the only reward
                raise ConfigError(
                    f"{headless}, so every response would score 0; a reward model is a Hugging Face "
                    "*ForSequenceClassification with one label (name it with init.reward, or set "
                    "reward_model: false in the workload and score with a verifier)"
                )
            warnings.append(
                f"{headless}: it scores every response 0 and the verifier ({spec.verifier}) alone "
                "rewards; set reward_model: false in the workload to free its GPUs, or name a reward "
                "model with init.reward"
            )
        if head is Head.VALUE:
            needed.discard("score.weight")  # a critic may start from an LM checkpoint (zeros, as verl)
        missing = sorted(needed - reader.names())
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise ConfigError(f"{label}: {path} has no weights for {missing[0]}{more}")
        for name in sorted(set(shapes) & reader.names()):  # from the headers: no tensor is read
            try:
                reader.check_header(name, shapes[name])
            except ConfigError as exc:
                raise ConfigError(f"{label}: {exc}") from None
        if role != "actor":  # the actor reads the job's tokenizer by definition
            _check_same_tokenizer(label, folder, tok)
        unused = sorted(n for n in reader.names() - needed if not hf.unused_is_harmless(n))
        if unused:
            more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
            raise ConfigError(
                f"{label}: {path} holds {unused[0]}{more}, which {wanted.name} does not have "
                "(another architecture: its config.json does not describe these weights)"
            )
        if head is Head.LM and hf.untied_head(reader, wanted):
            warnings.append(
                f"{label}: {path}: config.json ties the LM head to the embeddings (tie_word_embeddings: "
                "true) but the checkpoint's lm_head.weight differs from them; the run uses the "
                "embeddings as the head, as transformers and vLLM do (set tie_word_embeddings: false "
                "in config.json to train the checkpoint's own head)"
            )
    return warnings + _random_reference(spec, workload, runs) + _short_responses(spec, workload)


def _random_reference(spec: Any, workload: Any, runs: set[str]) -> list[str]:
    """A warning when the reference has a model of its own without weights (a model YAML: random
    weights) while the actor starts from a checkpoint: the KL penalty would pull the actor toward
    a random model."""
    own = workload.models.get("ref", "")  # a reference without one starts as the actor
    if "ref" not in runs or not own or spec.weights_of("ref", own) or spec.rl.kl_coef == 0:
        return []
    if not spec.role_weights("actor", workload)[0]:
        return []  # every role starts from seeded random weights: by design
    return [
        f"models.ref: {own} holds no weights, so the reference starts from random weights while the "
        f"actor starts from a checkpoint, and the KL penalty (kl_coef {spec.rl.kl_coef}) pulls the actor "
        "toward them; name a Hugging Face folder with safetensors weights under models.ref"
    ]


def _short_responses(spec: Any, workload: Any) -> list[str]:
    """A warning when the actor starts from a checkpoint and the first steps generate at the
    default ``max_new_tokens`` while the workload's responses run longer: every response would
    be cut (and the plans priced) at the default's few tokens."""
    from nereus.runtime.experiment import ExperimentSpec

    default = ExperimentSpec.__dataclass_fields__["max_new_tokens"].default
    first = spec.max_new_tokens_at(0)
    pretrained = bool(spec.role_weights("actor", workload)[0])
    if first != default or workload.max_response_len <= first or not pretrained:
        return []
    return [
        f"max_new_tokens is {first} (the default) at step 0: every response is cut at {first} tokens, "
        f"and the plans are priced for them, while {workload.name} allows responses of up to "
        f"{workload.max_response_len} tokens (max_response_len); set max_new_tokens (verl's "
        "data.max_response_length)"
    ]


def _check_same_tokenizer(label: str, folder: Path, tok: Any) -> None:
    """A critic or reward model reads the actor's token ids: a folder with a tokenizer of its own
    must map every token of the job's tokenizer to the same id (tokens of its own past them, a pad
    token say, are fine; the same vocabulary size is not enough: a different tokenizer of that
    size feeds the model ids it never saw). Beside the bundled character tokenizer, which no
    Hugging Face tokenizer reproduces, such a folder is refused."""
    from nereus.rl.hf_tokenizer import HfTokenizer, has_tokenizer

    if not has_tokenizer(folder):
        return
    if not isinstance(tok, HfTokenizer):  # the bundled characters: no Hugging Face tokenizer maps them
        raise ConfigError(
            f"{label}: {folder} has a tokenizer of its own, but the job reads text with the bundled "
            "character tokenizer (no tokenizer: key, and the model folder holds none); this model "
            "reads the actor's token ids, so name the tokenizer it was trained with (tokenizer: DIR) "
            "or give it a checkpoint trained with the job's"
        )
    if Path(tok.folder) == folder:
        return
    try:
        theirs, ours = HfTokenizer(str(folder), chat=False).vocabulary(), tok.vocabulary()
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    differ = sorted(t for t, i in ours.items() if theirs.get(t) != i)
    if differ:
        raise ConfigError(
            f"{label}: {folder}'s tokenizer is not the job's ({tok.folder}): {len(differ)} of the job's "
            f"tokens have other ids there (e.g. {differ[0]!r}); this model reads the actor's token ids, so "
            "give it a checkpoint trained with the actor's tokenizer"
        )


CHILD = "from nereus.runtime.preflight_child import _child_main; _child_main()"


def checks_in_a_child(spec: Any) -> None:
    """``torch_checks`` in a child process (the spec goes in on stdin, one JSON line comes back);
    its warnings are printed on stderr."""
    import pickle

    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        stdout, stderr = proc.communicate(pickle.dumps(spec))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else {}
    except ValueError:
        doc = {}
    if proc.returncode == 0 and doc.get("ok"):
        for line in doc.get("warnings", []):
            print(f"nereus run: warning: {line}", file=sys.stderr)
        return
    if "error" in doc:
        err = NereusError(doc["error"])
        err.exit_code = int(doc.get("code", 2))
        raise err
    last = (stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
    raise NereusError(f"the preflight's checks failed (exit code {proc.returncode}): {last}")


def _child_main() -> None:
    import pickle

    spec = pickle.loads(sys.stdin.buffer.read())  # from the parent process
    try:
        doc: dict[str, Any] = {"ok": True, "warnings": torch_checks(spec)}
    except NereusError as exc:
        doc = {"error": str(exc), "code": exc.exit_code}
    print(json.dumps(doc))
