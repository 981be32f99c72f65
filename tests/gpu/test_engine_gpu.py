"""The engine on a GPU (CUDA or ROCm): skipped cleanly elsewhere; run by ``tests/gpu/run.sh``.

- bf16 mixed precision: bf16 parameters and activations, fp32 master weights and Adam moments;
  log-probs close to the fp32 CPU engine's, and the update lands in the master copy;
- fp32 on the GPU decodes the same greedy tokens as fp32 on the CPU;
- with two or more GPUs, a tp2 replica over NCCL/RCCL equals the single-GPU one.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.backends.optim import AdamWConfig
from nereus.backends.protocol import TokenBatch
from nereus.backends.sampling import SamplingParams
from nereus.backends.torch_native import TorchNativeEngine
from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy
from nereus.state.geometry import shards
from nereus.state.holder import RankState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]


def full_tensor(model: ModelSpec, kind: BufferKind, name: str) -> torch.Tensor:
    shape = {s.source: s.full_shape for s in shards(model, Layout(1, 1), 0, 0)}[name]
    if kind not in (BufferKind.PARAM, BufferKind.MASTER):
        return torch.zeros(shape)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1
    return 1 + x if name.endswith("norm.weight") else x


def engine(
    model: ModelSpec, layout: Layout, t: int, p: int, policy: StatePolicy, device: str, groups: Groups
) -> TorchNativeEngine:
    rs = RankState.from_full("actor", model, layout, t, p, policy, lambda k, n: full_tensor(model, k, n))
    rs.buffers = {k: b.to(device) for k, b in rs.buffers.items()}
    return TorchNativeEngine(rs, groups, AdamWConfig(lr=1e-3), device=device)


NEAR_TIE = 1e-3  # nats: fp32 kernels on two devices may order logits this close either way


def data(model: ModelSpec) -> TokenBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (4, 32), generator=g)
    valid = torch.ones_like(ids)
    valid[1, :5] = 0
    return TokenBatch(ids, valid, {"mask": valid.float()})


def single(model: ModelSpec, policy: StatePolicy, device: str) -> TorchNativeEngine:
    lay = Layout(1, 1)
    return engine(model, lay, 0, 0, policy, device, Groups.build(Grid.single(lay), model, 0))


def test_bf16_mixed_precision_on_gpu() -> None:
    model = load_model("tiny-qwen3")
    cpu = single(model, StatePolicy.of(Stage.TRAIN, Precision.FP32), "cpu")
    gpu = single(model, StatePolicy.of(Stage.TRAIN, Precision.BF16_MIXED), "cuda")
    b = data(model)
    ref, got = cpu.forward(b), gpu.forward(b).cpu()
    assert (ref - got)[b.valid.bool()].abs().max().item() < 0.25  # bf16 rounding (0.07 seen on CPU)
    before = gpu.state.buffers[BufferKind.MASTER].clone()
    stats = gpu.train_step(b, lambda s, f: -(s * f["mask"]).sum() / f["mask"].numel(), micro_batches=2)
    assert stats.grad_norm > 0 and gpu.state.state.updates == 1
    master = gpu.state.buffers[BufferKind.MASTER]
    assert master.dtype == torch.float32 and not torch.equal(master, before)
    assert torch.equal(gpu.state.buffers[BufferKind.PARAM], master.to(torch.bfloat16))
    assert torch.cuda.max_memory_allocated() > 0


def test_fp32_gpu_decodes_the_cpu_tokens() -> None:
    model = load_model("tiny-llama")
    policy = StatePolicy.of(Stage.GEN, Precision.FP32)
    prompts = TokenBatch(data(model).ids[:, :8], data(model).valid[:, :8])
    params = SamplingParams(16, greedy=True)
    cpu = single(model, policy, "cpu")
    a = cpu.generate(prompts, range(4), params)
    b = single(model, policy, "cuda").generate(prompts, range(4), params)
    if torch.equal(a.tokens, b.tokens.cpu()):
        return
    # other kernels may break a near-tie the other way: the first token the GPU chose otherwise must
    # be one the CPU scores within NEAR_TIE of its own choice (the prefixes agree up to it)
    differs = (a.tokens != b.tokens.cpu()).int()
    row = int(differs.any(1).int().argmax())
    col = int(differs[row].argmax())
    ids = torch.cat([prompts.ids, b.tokens.cpu()], 1)
    valid = torch.cat([prompts.valid, torch.ones_like(b.tokens.cpu())], 1)
    theirs = cpu.forward(TokenBatch(ids, valid))[:, prompts.ids.shape[1] :]
    gap = float(a.logprobs[row, col] - theirs[row, col])
    assert gap < NEAR_TIE, f"row {row}, token {col}: the GPU chose a token {gap:.3g} nats below the CPU's"


def _nccl_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        model = load_model("tiny-qwen3")
        policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
        result: dict[str, Any] = {}
        for tp in (1, 2):
            grid = Grid.single(Layout(tp, 1))
            groups = Groups.build(grid, model, rank)
            if rank in grid.ranks:
                eng = engine(model, grid.layout, grid.coord(rank).t, 0, policy, f"cuda:{rank}", groups)
                b = data(model)
                result[f"lp{tp}"] = eng.forward(b).cpu()
                result[f"loss{tp}"] = eng.train_step(b, lambda s, f: -(s * f["mask"]).sum() / 128).loss
                result[f"w{tp}"] = eng.full_state()
            dist.barrier()
            groups.destroy()
        if rank == 0:
            torch.save(result, Path(out) / "nccl.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.timeout(300)
def test_tp2_over_nccl_equals_one_gpu(tmp_path: Path) -> None:
    mp.spawn(_nccl_worker, args=(2, 29750, str(tmp_path)), nprocs=2)
    r = torch.load(tmp_path / "nccl.pt", weights_only=False)
    assert (r["lp1"] - r["lp2"]).abs().max().item() < 1e-4
    assert r["loss1"] == pytest.approx(r["loss2"], rel=1e-4)
    for name, w in r["w1"].items():
        assert (w - r["w2"][name]).abs().max().item() < 1e-3, name
