"""``nereus run`` end to end with models of the roles' own (4 local worker processes, gloo): a
reward model loaded from Hugging Face weights scores each response's last token, and a critic of
another shape named under the workload's ``models:`` is built, trained, checkpointed and exported
in that shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.test_runtime_e2e import BASE, CONFIGS, _hf_checkpoint, cli_run, metrics

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_reward_model_stage_scores_from_hugging_face_weights(tmp_path: Path) -> None:
    """A workload with a reward model: reward.inf runs on its own GPU, loaded (like the actor)
    from Hugging Face checkpoints, and scores each response's last token; with no verifier the
    reward is the reward model's score."""
    actor = _hf_checkpoint(tmp_path / "actor", "lm", 11)
    rm = _hf_checkpoint(tmp_path / "rm", "value", 12, head_scale=50.0)
    exp = tmp_path / "rm.yaml"
    exp.write_text(
        BASE.format(name="rm", steps=2).replace("workload: ppo-tiny", "workload: ppo-tiny-rm")
        + f"verifier: none\ninit: {{actor: {actor}, reward: {rm}}}\n"
    )
    out = tmp_path / "out"
    proc = cli_run(exp, out, 240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert all("reward.inf" in r["plan"] for r in rows)  # type: ignore[operator]
    for r in rows:
        assert r["reward"] == pytest.approx(r["rm_score"], abs=1e-6)
        assert abs(r["rm_score"]) > 1e-3  # type: ignore[arg-type]
    bad = tmp_path / "bad.yaml"
    bad.write_text(exp.read_text().replace(str(rm), str(tmp_path / "missing")))
    proc = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(bad), "--out", str(tmp_path / "out2")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "init.reward" in proc.stderr, proc.stderr


@pytest.mark.timeout(300)
def test_a_critic_of_another_shape_named_under_models_runs_as_named(tmp_path: Path) -> None:
    """The workload's ``models:`` gives the critic a model of its own (head_dim 32: q/k/v and o
    shapes of their own), as ``nereus plan`` prices it; the run builds and trains that critic. The
    reference is named a Hugging Face folder there, and starts from its weights (not the actor's:
    the first step's KL is not 0)."""
    ref = _hf_checkpoint(tmp_path / "ref", "lm", 13)
    workload = tmp_path / "ppo-critic.yaml"
    workload.write_text(
        (CONFIGS / "workloads" / "ppo-tiny.yaml").read_text()
        + f"models: {{critic: tiny-llama-h32, ref: {ref}}}\n"
    )
    exp = tmp_path / "critic.yaml"
    exp.write_text(BASE.format(name="critic", steps=2).replace("workload: ppo-tiny", f"workload: {workload}"))
    out = tmp_path / "out"
    proc = cli_run(exp, out, 240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(r["critic_loss"] > 0 for r in metrics(out))  # type: ignore[operator]
    assert metrics(out)[0]["kl"] != 0.0  # the actor's own weights as the reference: exactly 0
    from torch.distributed.checkpoint import FileSystemReader

    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    saved = FileSystemReader(str(latest)).read_metadata().state_dict_metadata
    shape = {name: tuple(getattr(saved[name], "size", ())) for name in saved}
    assert shape["critic.train/param/model.layers.0.self_attn.q_proj.weight"] == (128, 64)  # 4 heads of 32
    assert shape["actor.train/param/model.layers.0.self_attn.q_proj.weight"] == (64, 64)  # 4 heads of 16
    critic = load_file(str(out / "hf" / "critic" / "model.safetensors"))  # exported in its own shape
    assert tuple(critic["model.layers.0.self_attn.q_proj.weight"].shape) == (128, 64)
    resumed = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out), "--resume", "--steps", "3"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(out)] == [0, 1, 2]
    workload.write_text((CONFIGS / "workloads" / "ppo-tiny.yaml").read_text())  # the critic: the actor's
    refused = subprocess.run(
        [sys.executable, "-m", "nereus.cli", "run", str(exp), "--out", str(out), "--resume", "--steps", "4"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (
        "written with the roles' models {critic: tiny-llama-h32, ref: ref}; this run's workload names {}"
        in (refused.stderr)
    ), refused.stderr
