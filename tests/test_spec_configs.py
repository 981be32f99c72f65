"""Strict config loading (unknown keys, wrong types) and the shipped clusters and workloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.errors import ConfigError
from nereus.spec import (
    Algorithm,
    ClusterSpec,
    ExecutionMode,
    ModelSpec,
    Stage,
    WorkloadSpec,
    load_cluster,
    load_workload,
    names,
)

pytestmark = pytest.mark.pure


def test_shipped_clusters_are_the_papers_testbeds() -> None:
    assert set(names("clusters")) == {
        "mi250x-slingshot",
        "a100-64gb-hdr100",
        "h200-ib",
        "h100-ib",
        "local-cpu",
        "local-slurm",
        "a100-80gb-dgx",  # published-measurement hardware of benchmarks/fidelity.py
        "h100-96gb-gt",
    }
    frontier = load_cluster("mi250x-slingshot")
    assert (frontier.total_gpus, frontier.vendor.value, frontier.collective_library.value) == (
        1024,
        "amd",
        "rccl",
    )
    assert load_cluster("a100-64gb-hdr100").total_gpus == 256
    h200 = load_cluster("h200-ib")
    assert (h200.total_gpus, h200.gpus_per_node) == (64, 8)
    assert load_cluster("local-cpu").collective_library.value == "gloo"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "thing.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_file_key_and_allowed(tmp_path: Path) -> None:
    p = _write(tmp_path, "family: llama\nhidden_size: 64\nnum_layers: 2\n")
    with pytest.raises(ConfigError) as err:
        ModelSpec.from_yaml(p)
    msg = str(err.value)
    assert str(p) in msg and "unknown key 'num_layers'" in msg and "num_hidden_layers" in msg


def test_wrong_type_names_key_and_expected_type(tmp_path: Path) -> None:
    base = (
        "vendor: nvidia\ncollective_library: nccl\nnodes: 2\ngpus_per_node: 8\ngpu_model: x\n"
        "gpu_memory_gib: 80\npeak_bf16_tflops: 989\nhbm_bandwidth_gbs: 3350\n"
        "intra_node_bandwidth_gbs: 450\ninter_node_bandwidth_gbs: 50\n"
    )
    with pytest.raises(ConfigError, match=r"key 'nodes': expected int, got True"):
        ClusterSpec.from_yaml(_write(tmp_path, base.replace("nodes: 2", "nodes: true")))
    with pytest.raises(ConfigError, match=r"key 'vendor': expected one of nvidia\|amd\|cpu"):
        ClusterSpec.from_yaml(_write(tmp_path, base.replace("vendor: nvidia", "vendor: intel")))
    with pytest.raises(ConfigError, match="does not match vendor"):
        ClusterSpec.from_yaml(_write(tmp_path, base.replace("library: nccl", "library: rccl")))
    with pytest.raises(ConfigError, match="missing key 'gpu_model'"):
        ClusterSpec.from_yaml(_write(tmp_path, base.replace("gpu_model: x\n", "")))
    assert ClusterSpec.from_yaml(_write(tmp_path, base)).total_gpus == 16


def test_bad_yaml_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: [ppo\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        WorkloadSpec.from_yaml(_write(tmp_path, "- 1\n- 2\n"))


def test_workload_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="global_batch 100 must divide"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: ppo\nglobal_batch: 100\n"))
    with pytest.raises(ConfigError, match="samples_per_prompt must be at least 2 for grpo"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: grpo\nsamples_per_prompt: 1\n"))
    with pytest.raises(ConfigError, match="micro_batch 256 exceeds global_batch 128"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: ppo\nmicro_batch: 256\n"))
    with pytest.raises(ConfigError, match="models: unknown role 'judge'"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: ppo\nmodels: {judge: x}\n"))
    with pytest.raises(
        ConfigError, match=r"models: grpo runs no critic model \(allowed roles: actor, ref, reward\)"
    ):
        WorkloadSpec.from_yaml(
            _write(tmp_path, "algorithm: grpo\nsamples_per_prompt: 4\nmodels: {critic: x}\n")
        )
    with pytest.raises(ConfigError, match=r"models: ppo runs no reward model \(reward_model: false\)"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: ppo\nreward_model: false\nmodels: {reward: x}\n"))
    with pytest.raises(ConfigError, match=r"key 'mode': expected one of sync\|async, got 'eager'"):
        WorkloadSpec.from_yaml(_write(tmp_path, "algorithm: ppo\nmode: eager\n"))
    with pytest.raises(ConfigError, match=r"unknown algorithm 'dpo' \(choices: ppo, grpo, remax"):
        load_workload("dpo")


def test_default_workflows() -> None:
    ppo = load_workload("ppo").workflow()
    assert [m.name for m in ppo.model_stages] == [
        "actor.gen",
        "actor.inf",
        "ref.inf",
        "reward.inf",
        "critic.inf",
        "actor.train",
        "critic.train",
    ]
    assert ("actor.gen", "critic.inf") in ppo.edges and ("ref.inf", "critic.train") in ppo.edges
    assert set(ppo.weight_syncs) == {
        ("actor.train", "actor.gen"),
        ("actor.train", "actor.inf"),
        ("critic.train", "critic.inf"),
    }
    grpo = load_workload("grpo")
    assert "critic.train" not in [m.name for m in grpo.workflow().model_stages]
    assert grpo.sequences(grpo.workflow().get("actor.gen")) == 64 * 8
    remax = load_workload("remax")
    wf = remax.workflow()
    assert remax.algorithm is Algorithm.REMAX
    # the greedy baseline: one more rollout per prompt for generation and the reward model
    assert remax.sequences(wf.get("actor.gen")) == 2 * remax.sequences(wf.get("ref.inf"))
    assert remax.sequences(wf.get("reward.inf")) == remax.sequences(wf.get("actor.gen"))
    assert [s for s in wf.stages] == [Stage.GEN, Stage.INF, Stage.TRAIN]
    assert load_workload("ppo").mode is ExecutionMode.SYNC


def test_workflow_rejects_bad_edges() -> None:
    from nereus.spec.workload import ModelStage, Role, Workflow

    gen = ModelStage("actor.gen", Role.ACTOR, Stage.GEN, 1)
    inf = ModelStage("ref.inf", Role.REF, Stage.INF, 1)
    with pytest.raises(ValueError, match="must go to a later stage"):
        Workflow(Algorithm.PPO, (gen, inf), (("ref.inf", "actor.gen"),), ())
    with pytest.raises(ValueError, match="unknown model-stage"):
        Workflow(Algorithm.PPO, (gen, inf), (("actor.gen", "critic.inf"),), ())
    with pytest.raises(ValueError, match="only the actor generates"):
        ModelStage("ref.gen", Role.REF, Stage.GEN, 1)
