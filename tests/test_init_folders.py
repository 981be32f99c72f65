"""The preflight's checks of the folders each role starts from (``preflight_child.torch_checks``,
in process): a reward model must have its one-label head (a causal LM's would be zeros and score
every response 0), and a critic or reward model with a tokenizer of its own must map tokens to
the actor's ids (the same vocabulary size is not enough); and a data set smaller than one step's
prompts is a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from nereus.errors import ConfigError
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.preflight_child import torch_checks
from tests.test_hf_tokenizer import build
from tests.test_runtime_e2e import _hf_checkpoint

pytestmark = pytest.mark.pure


def spec(tmp_path: Path, workload: str, init: str, extra: str = "max_new_tokens: 2\n") -> ExperimentSpec:
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"name: x\nworkload: {workload}\nmodel: tiny-llama\nverifier: none\n"
        f"task: {{kind: copy, n: 8, difficulty: 2, length: 2}}\ninit: {{{init}}}\n{extra}"
    )
    return ExperimentSpec.load(path)


def refusal(s: ExperimentSpec) -> str:
    with pytest.raises(ConfigError) as err:
        torch_checks(s)
    return str(err.value)


def test_a_reward_model_needs_its_head_with_one_label(tmp_path: Path) -> None:
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    rm = _hf_checkpoint(tmp_path / "rm", "value", 12)
    torch_checks(spec(tmp_path, "ppo-tiny-rm", f"actor: {actor}, reward: {rm}"))
    got = refusal(spec(tmp_path, "ppo-tiny-rm", f"actor: {actor}, reward: {actor}"))  # a causal LM
    assert got.startswith(f"init.reward: {actor} has no reward head (no score.weight: a causal LM)"), got
    assert "reward_model: false" in got and "\n" not in got
    tensors = safetensors.torch.load_file(rm / "model.safetensors")
    tensors["score.weight"] = torch.zeros(3, tensors["score.weight"].shape[1])  # three labels
    safetensors.torch.save_file(tensors, rm / "model.safetensors")
    got = refusal(spec(tmp_path, "ppo-tiny-rm", f"actor: {actor}, reward: {rm}"))
    shape = "tensor 'score.weight' has shape (3, 64), the model needs (1, 64)"
    assert got == f"init.reward: {rm}/model.safetensors: {shape}"
    torch_checks(spec(tmp_path, "ppo-tiny", f"actor: {actor}, critic: {actor}"))  # a critic may: zeros


def test_a_reward_model_falling_back_to_the_actors_folder_is_a_warning_beside_a_verifier(
    tmp_path: Path,
) -> None:
    """No ``init.reward``: the reward model starts from the ``model:`` folder, a causal LM, so it
    scores 0. Beside a verifier the run rewards by the verifier alone (a warning says so and how
    to free the GPUs); with ``verifier: none`` nothing would reward, so it is refused."""
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    path = tmp_path / "exp.yaml"
    base = f"name: x\nworkload: ppo-tiny-rm\nmodel: {actor}\ntokenizer: {build(tmp_path / 'tok')}\n"
    base += "task: {kind: copy, n: 8, difficulty: 2, length: 2}\nmax_new_tokens: 2\n"
    path.write_text(base + "verifier: exact_answer\n")
    [warning] = torch_checks(ExperimentSpec.load(path))
    assert warning.startswith(f"model (reward): {actor} has no reward head (no score.weight: a causal LM)")
    assert "verifier (exact_answer) alone rewards; set reward_model: false" in warning
    path.write_text(base + "verifier: none\n")
    assert refusal(ExperimentSpec.load(path)).startswith(f"model (reward): {actor} has no reward head")


def test_a_critic_with_another_tokenizer_of_the_same_size_is_refused(tmp_path: Path) -> None:
    actor = build(_hf_checkpoint(tmp_path / "actor", "lm", 11))
    critic = _hf_checkpoint(tmp_path / "critic", "value", 12)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (actor / name).is_file():
            shutil.copy(actor / name, critic / name)
    torch_checks(spec(tmp_path, "ppo-tiny", f"actor: {actor}, critic: {critic}"))  # the same tokenizer
    doc = json.loads((critic / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    a, b = "a", "b"
    extra = dict(doc)
    pad = {"id": max(vocab.values()) + 50, "content": "<|pad_of_its_own|>", "single_word": False,
           "lstrip": False, "rstrip": False, "normalized": False, "special": True}  # fmt: skip
    extra["added_tokens"] = [*doc.get("added_tokens", []), pad]
    (critic / "tokenizer.json").write_text(json.dumps(extra))  # a token past the actor's: fine
    torch_checks(spec(tmp_path, "ppo-tiny", f"actor: {actor}, critic: {critic}"))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, other ids
    (critic / "tokenizer.json").write_text(json.dumps(doc))
    got = refusal(spec(tmp_path, "ppo-tiny", f"actor: {actor}, critic: {critic}"))
    want = f"init.critic: {critic}'s tokenizer is not the job's ({actor}): "
    assert got.startswith(want + "2 of the job's tokens have other ids there"), got
    plain = _hf_checkpoint(tmp_path / "plain", "lm", 11)  # no tokenizer: the job reads characters
    got = refusal(spec(tmp_path, "ppo-tiny", f"actor: {plain}, critic: {critic}"))
    assert got.startswith(f"init.critic: {critic} has a tokenizer of its own, but the job reads text with "
                          "the bundled character tokenizer"), got  # fmt: skip


def test_an_init_entry_may_name_the_folders_config_json(tmp_path: Path) -> None:
    """As ``model:`` may: the folder is meant (it said "… is not a Hugging Face checkpoint folder
    (no config.json)" of a config.json that was there)."""
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    s = spec(tmp_path, "ppo-tiny", f"actor: {actor / 'config.json'}")
    assert s.weights_of("actor") == str(actor) and s.weights_of("critic") == ""
    torch_checks(s)


def _own_models(tmp_path: Path, models: str) -> str:
    """A copy of ppo-tiny whose ``models:`` names ``models`` (a flow mapping's body)."""
    workload = tmp_path / "own.yaml"
    text = (Path(__file__).parents[1] / "configs" / "workloads" / "ppo-tiny.yaml").read_text()
    workload.write_text(text + f"models: {{{models}}}\n")
    return str(workload)


def test_a_role_whose_models_entry_is_a_folder_starts_from_its_weights(tmp_path: Path) -> None:
    """A role named a Hugging Face folder under ``models:`` starts from that folder's weights (it
    started from random ones unless an ``init:`` entry named the folder again); a bad tensor there
    is named by its ``models:`` key. The reference's folder is checked as the actor's is."""
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    ref = _hf_checkpoint(tmp_path / "ref", "lm", 13)
    critic = _hf_checkpoint(tmp_path / "critic", "value", 12)
    s = spec(
        tmp_path, _own_models(tmp_path, f"ref: {ref}, critic: {critic / 'config.json'}"), f"actor: {actor}"
    )
    assert s.weights_of("ref", str(ref)) == str(ref) and s.weights_label("ref", str(ref)) == "models.ref"
    assert s.weights_of("critic", str(critic / "config.json")) == str(critic)
    assert (
        s.weights_of("ref") == str(actor) and s.weights_label("ref") == "init.actor"
    )  # no entry: the actor's
    assert torch_checks(s) == []
    tensors = safetensors.torch.load_file(ref / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(3)
    safetensors.torch.save_file(tensors, ref / "model.safetensors")
    got = refusal(s)
    assert got.startswith(
        f"models.ref: {ref}/model.safetensors: tensor 'model.norm.weight' has shape (3,)"
    ), got


def test_a_reference_on_random_weights_beside_a_trained_actor_is_a_warning(tmp_path: Path) -> None:
    """``models: {ref: <a model YAML>}`` has no weights to start from: the KL penalty would pull
    an actor that starts from a checkpoint toward a random model."""
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    s = spec(tmp_path, _own_models(tmp_path, "ref: tiny-llama"), f"actor: {actor}")
    assert s.weights_of("ref", "tiny-llama") == ""
    [warning] = torch_checks(s)
    assert warning.startswith("models.ref: tiny-llama holds no weights, so the reference starts from random")
    assert torch_checks(spec(tmp_path, _own_models(tmp_path, "ref: tiny-llama"), "")) == []  # all random


def test_a_critic_falling_back_to_the_reward_models_folder_is_named_so(tmp_path: Path) -> None:
    rm = _hf_checkpoint(tmp_path / "rm", "value", 12)
    s = spec(tmp_path, "ppo-tiny-rm", f"reward: {rm}")
    assert s.weights_of("critic") == str(rm) and s.weights_label("critic") == "init.reward"
    assert s.weights_label("reward") == "init.reward" and s.weights_label("actor") == "model"


def test_a_reference_without_an_entry_follows_the_actors(tmp_path: Path) -> None:
    """``models: {actor: DIR}`` alone: the reference is the initial actor (as in verl), its model
    and its weights DIR's, not the experiment's ``model:`` (a KL against another model)."""
    from nereus.runtime.engines import job_models
    from nereus.spec import Role, load_model, load_workload

    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    s = spec(tmp_path, _own_models(tmp_path, f"actor: {actor}"), "")
    workload = load_workload(s.workload)
    assert workload.model_of("ref") == workload.model_of("actor") == str(actor)
    models = job_models(workload, load_model(s.model))
    assert models[Role.REF] == models[Role.ACTOR] and models[Role.CRITIC].name == "tiny-llama"
    assert (
        s.role_weights("ref", workload) == s.role_weights("actor", workload) == (str(actor), "models.actor")
    )
    sft = _hf_checkpoint(
        tmp_path / "sft", "lm", 12
    )  # the actor starts from init.actor: so does the reference
    s = spec(tmp_path, _own_models(tmp_path, f"actor: {actor}"), f"actor: {sft}")
    assert s.role_weights("ref", workload) == (str(sft), "init.actor")
    named = load_workload(_own_models(tmp_path, f"actor: {actor}, ref: tiny-llama"))
    assert named.model_of("ref") == "tiny-llama"  # a reference of its own stays its own
    assert s.role_weights("ref", named) == ("", "models.ref")  # a model YAML: random weights


def data_warnings(tmp_path: Path, answers: list[str], verifier: str) -> list[str]:
    """The preflight's warnings on a grpo-tiny run (prompts_per_step 4) over a ``dataset:`` of one
    row per answer, scored by ``verifier``."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(f'{{"prompt": "q{i}=", "answer": "{a}", "id": {i}}}\n' for i, a in enumerate(answers))
    )
    path = tmp_path / "exp.yaml"
    path.write_text(
        f"name: x\nworkload: grpo-tiny\nmodel: tiny-llama\nverifier: {verifier}\ndataset: {rows}\n"
    )
    return torch_checks(ExperimentSpec.load(path))


def test_a_data_set_smaller_than_a_step_is_a_warning(tmp_path: Path) -> None:
    """One row and prompts_per_step 4 (grpo-tiny): every step trains on that row four times; it ran
    with no notice."""
    assert data_warnings(tmp_path, ["ab"], "exact") == [
        "dataset: 1 row, fewer than grpo-tiny's prompts_per_step 4: every step trains on rows repeated "
        "(each about 4 times)"
    ]
    assert data_warnings(tmp_path, ["ab"] * 4, "exact") == []


def test_ground_truths_gsm8k_can_never_match_are_a_warning(tmp_path: Path) -> None:
    """A ground truth with no one number after its last ``####`` (``12-15``): ``gsm8k`` scores every
    response to it 0 — a run on such data trains on nothing, so the preflight says so."""
    answers = ["72", "12-15", "the answer is: 5", "3:30"]  # (the bundled tokenizer's alphabet)
    assert data_warnings(tmp_path, answers, "gsm8k") == [
        "dataset: 2 of 4 rows have no one number after their answer's last #### (row 1: '12-15'), so "
        "gsm8k scores every response to them 0"
    ]
    assert data_warnings(tmp_path, answers, "math") == []


def test_responses_left_at_the_default_length_from_a_checkpoint_are_a_warning(tmp_path: Path) -> None:
    """A user's pretrained actor with ``max_new_tokens`` left at 8 would have every response cut
    (and planned) at 8 tokens; the shipped tiny experiments, on random weights, name theirs."""
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    [warning] = torch_checks(spec(tmp_path, "ppo-tiny", f"actor: {actor}", extra=""))
    assert warning.startswith("max_new_tokens is 8 (the default) at step 0: every response is cut at 8")
    assert "up to 16 tokens (max_response_len)" in warning, warning
    assert torch_checks(spec(tmp_path, "ppo-tiny", f"actor: {actor}", extra="max_new_tokens: 16\n")) == []
    assert torch_checks(spec(tmp_path, "ppo-tiny", "", extra="")) == []  # random weights: by design
