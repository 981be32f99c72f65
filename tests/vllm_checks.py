"""The vllm engine's checks on any device: the GPU runner (``tests/gpu/test_vllm_gpu.py``) calls
them with a GPU (bf16, sleep mode on), their CPU twins (``tests/test_device_twins_dist.py``) with
the CPU (fp32), each in a spawned process of its own (vLLM's state is process-wide).

- generation: vLLM's greedy tokens, and its log-probs against the torch-native engine's scores
  of the same sequences (on the CPU in fp32 the tokens equal the torch-native engine's greedy
  ones);
- a weight sync: new weights into the state, ``rebind``, and generation follows them;
- sleep and wake: on a GPU shared with a trainer the engine frees its memory after generating
  and takes it back for the next sync (vLLM's sleep mode; a no-op on the CPU);
- a sliding window: vLLM's windowed attention kernel against the torch-native engine's mask;
- beside the others: a replica of one rank in a world of two (rank 1 holds no part of it), built
  on a GPU that already holds a trainer's state, generating, syncing while asleep and generating
  again. On GPUs the world binds its device, and a new group would be split off the world's
  communicator, a collective rank 1 never joins; and vLLM starts only when its share of the GPU
  is free (``nereus.backends.vllm.setup.memory_utilization``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.protocol import EngineOptions, TokenBatch
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import TorchNativeEngine
from nereus.devices import Devices, abort_world, init_world
from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState

MODEL = "tiny-llama-h32"
NEW = 8
FP32_LOGPROB = 1e-3  # vLLM's CPU kernels against ours, fp32
BF16_LOGPROB = 0.25  # bf16 weights and activations, different kernels: nats per token
TRAINER_SHARE = 0.3  # of a GPU, held as a colocated trainer's state while vLLM builds and syncs


def run_isolated(check: Callable[..., None], *args: Any, timeout: float = 300) -> None:
    """``check(*args)`` in a spawned process; its failure fails the caller."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=check, args=args)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"{check.__name__} did not finish within {timeout:.0f} s")
    assert proc.exitcode == 0, f"{check.__name__} failed (exit code {proc.exitcode}); see its output above"


def _weights(seed: int) -> Callable[[BufferKind, str], torch.Tensor]:
    model = load_model(MODEL)
    shapes = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}

    def full(kind: BufferKind, name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name])
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        return torch.randn(shapes[name], generator=g) * 0.3

    return full


def _prompts() -> TokenBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 6), generator=g)
    valid = torch.ones_like(ids)
    valid[1, :3] = 0  # a left-padded prompt
    return TokenBatch(ids, valid)


def _scored(native: TorchNativeEngine, prompts: TokenBatch, tokens: torch.Tensor) -> torch.Tensor:
    """The torch-native engine's log-probs of ``tokens`` after ``prompts`` (rows, NEW)."""
    batch = TokenBatch(
        torch.cat([prompts.ids, tokens], 1), torch.cat([prompts.valid, torch.ones_like(tokens)], 1)
    )
    return native.forward(batch)[:, prompts.ids.shape[1] :].float().cpu()


def check_vllm_engine(device: str, tmp: str) -> None:
    """Generation, a weight sync and sleep/wake of one vllm engine in a world of one."""
    from nereus.backends.vllm import VllmEngine

    devices = Devices(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    if devices.accelerated:
        torch.cuda.set_device(devices.device)
    init_world(devices, dist.FileStore(str(Path(tmp) / "store"), 1), 0, 1, timedelta(seconds=120))
    try:
        model, one = load_model(MODEL), Layout(1, 1)
        precision = Precision.BF16_MIXED if devices.accelerated else Precision.FP32
        policy = StatePolicy.of(Stage.GEN, precision)
        state = RankState.from_full("actor.gen", model, one, 0, 0, policy, _weights(0), None, devices.device)
        groups = Groups.build(Grid(one, (0,)), model, 0)
        options = EngineOptions(max_num_seqs=4, max_model_len=32, workdir=Path(tmp), sleep=True)
        held = _a_trainers_state(devices)
        engine = VllmEngine(state, groups, options=options)
        native = TorchNativeEngine(state, groups, device=devices.device)
        prompts, greedy = _prompts(), SamplingParams(NEW, greedy=True)
        tolerance = BF16_LOGPROB if devices.accelerated else FP32_LOGPROB

        def agrees(tag: str) -> torch.Tensor:
            out = engine.generate(prompts, [0, 1, 2, 3], greedy)
            assert out.tokens.shape == (4, NEW) and bool(out.valid.all()), tag
            err = float((out.logprobs - _scored(native, prompts, out.tokens)).abs().max())
            assert err <= tolerance, (
                f"{tag}: vLLM's log-probs differ from the torch-native scores by {err:.3g}"
            )
            if not devices.accelerated:
                want = native.generate(prompts, [0, 1, 2, 3], greedy).tokens
                assert torch.equal(out.tokens, want), f"{tag}: greedy tokens differ from torch-native's"
            return out.tokens

        before = agrees("built")
        if devices.accelerated:  # after generating, the engine sleeps: its memory is back
            assert engine._sleeping
            free_asleep = torch.cuda.mem_get_info(devices.device)[0]
            engine.wake()
            assert torch.cuda.mem_get_info(devices.device)[0] < free_asleep, "waking took no memory back"
        else:
            assert not engine._sleeping  # vLLM's sleep mode is CUDA/ROCm only
        new = RankState.from_full("actor.gen", model, one, 0, 0, policy, _weights(1), None, devices.device)
        state.buffers[BufferKind.PARAM].copy_(new.buffers[BufferKind.PARAM])  # a trainer's update
        engine.rebind(state)
        assert engine.sync_s > 0
        after = agrees("synced")
        assert not torch.equal(before, after), "the weight sync changed nothing"
        engine.close()
        groups.destroy()
        del held
    finally:
        abort_world()


def _a_trainers_state(devices: Devices) -> torch.Tensor:
    """On a GPU, ``TRAINER_SHARE`` of it taken, as a colocated trainer's state is; none on a CPU."""
    if not devices.accelerated:
        return torch.empty(0)
    total = torch.cuda.get_device_properties(devices.device).total_memory
    return torch.empty(int(total * TRAINER_SHARE), dtype=torch.uint8, device=devices.device)


def check_vllm_in_part_of_the_world(device: str, tmp: str, timeout: float = 300) -> None:
    """Two ranks (two GPUs, or two CPU processes); rank 0 alone is a generation replica."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_part_of_the_world, args=(r, device, tmp)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        p.kill()
    assert not alive, f"ranks {alive} did not finish within {timeout:.0f} s (a replica's groups hung?)"
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}; see the output above"


def _part_of_the_world(rank: int, device: str, tmp: str) -> None:
    devices = Devices(torch.device(device, rank) if device == "cuda" else torch.device("cpu"))
    if devices.accelerated:
        torch.cuda.set_device(devices.device)
    init_world(devices, dist.FileStore(str(Path(tmp) / "part-store"), 2), rank, 2, timedelta(seconds=120))
    try:
        held = _a_trainers_state(devices)
        model, one = load_model(MODEL), Layout(1, 1)
        groups = Groups.build(Grid(one, (0,)), model, rank)  # collective: rank 1 is outside the grid
        if rank == 0:
            _generate_sync_generate(devices, model, groups, Path(tmp) / "part")
        dist.barrier()  # the world: rank 1 waited outside the replica all along
        groups.destroy()
        del held
    finally:
        abort_world()


def check_vllm_window(device: str, tmp: str) -> None:
    """A Mistral-style model whose 4-token sliding window is shorter than its 14-token sequences:
    vLLM's log-probs (its windowed attention kernel on the device) equal the torch-native engine's
    windowed scores, and are far from what full attention would give."""
    import dataclasses

    from nereus.backends.vllm import VllmEngine
    from nereus.spec.model import ModelFamily

    devices = Devices(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    if devices.accelerated:
        torch.cuda.set_device(devices.device)
    init_world(devices, dist.FileStore(str(Path(tmp) / "store"), 1), 0, 1, timedelta(seconds=120))
    try:
        model = dataclasses.replace(load_model(MODEL), family=ModelFamily.MISTRAL, sliding_window=4)
        one = Layout(1, 1)
        precision = Precision.BF16_MIXED if devices.accelerated else Precision.FP32
        policy = StatePolicy.of(Stage.GEN, precision)
        state = RankState.from_full("actor.gen", model, one, 0, 0, policy, _weights(0), None, devices.device)
        groups = Groups.build(Grid(one, (0,)), model, 0)
        options = EngineOptions(max_num_seqs=4, max_model_len=32, workdir=Path(tmp))
        engine = VllmEngine(state, groups, options=options)
        native = TorchNativeEngine(state, groups, device=devices.device)
        prompts = _prompts()
        out = engine.generate(prompts, [0, 1, 2, 3], SamplingParams(NEW, greedy=True))
        tolerance = BF16_LOGPROB if devices.accelerated else FP32_LOGPROB
        err = float((out.logprobs - _scored(native, prompts, out.tokens)).abs().max())
        assert err <= tolerance, f"vLLM's windowed log-probs differ from the torch-native scores by {err:.3g}"
        full_state = RankState.from_full(
            "actor.gen", dataclasses.replace(model, sliding_window=0), one, 0, 0, policy, _weights(0), None,
            devices.device,
        )  # fmt: skip
        full = TorchNativeEngine(full_state, groups, device=devices.device)
        apart = float((out.logprobs - _scored(full, prompts, out.tokens)).abs().max())
        assert apart > 4 * tolerance, f"the window changes the scores by {apart:.3g} only"
        engine.close()
        groups.destroy()
    finally:
        abort_world()


def _generate_sync_generate(devices: Devices, model: ModelSpec, groups: Groups, workdir: Path) -> None:
    from nereus.backends.vllm import VllmEngine

    one = Layout(1, 1)
    policy = StatePolicy.of(Stage.GEN, Precision.BF16_MIXED if devices.accelerated else Precision.FP32)

    def weights(seed: int) -> RankState:
        full = _weights(seed)
        return RankState.from_full("actor.gen", model, one, 0, 0, policy, full, None, devices.device)

    state = weights(0)
    options = EngineOptions(max_num_seqs=4, max_model_len=32, workdir=workdir, sleep=True)
    engine = VllmEngine(state, groups, options=options)
    greedy = SamplingParams(NEW, greedy=True)
    before = engine.generate(_prompts(), [0, 1, 2, 3], greedy).tokens
    assert engine._sleeping == devices.accelerated  # beside a trainer, it sleeps on a GPU
    state.buffers[BufferKind.PARAM].copy_(weights(1).buffers[BufferKind.PARAM])
    engine.rebind(state)  # asleep: the weights' memory back, the load, then the KV cache's
    assert not engine._sleeping
    after = engine.generate(_prompts(), [0, 1, 2, 3], greedy).tokens
    assert after.shape == (4, NEW) and not torch.equal(before, after), "the sync changed nothing"
    engine.close()
