"""``VllmEngine``: actor generation on vLLM, behind the Backend protocol.

One ``vllm.LLM`` per rank of a generation replica, built in this process on the replica's ranks
(``world.py``: TP inside the replica through vLLM's external launcher; DP replicas are separate
engines), from the plan's options: ``max_num_seqs`` its concurrency, the KV room of its memory
budget, ``max_model_len`` the workload's longest sequence. vLLM starts from dummy weights and
the rank's state is loaded in place (``reload_weights``): at build, and at every weight sync
(``rebind`` with the same placement). A new layout, replica or option set rebuilds the engine;
``build_s`` and ``sync_s`` are the measured seconds of the last of each.

Sampling follows the experiment: greedy, or temperature and top-p with one seed per request from
(seed, sample id), so a sequence's draws do not depend on its batch or replica. The log-probs
returned are those of the sampled tokens under the processed (temperature, top-p) distribution.
On a GPU shared with a trainer the engine sleeps after generating (KV cache and weights freed,
``sleep`` level 2: the next weight sync brings the weights) and wakes before the sync.
Edge module (vLLM, torch.distributed).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.gather import assemble, gather_flats, stream_whole, whole_names
from nereus.backends.grid import Coord
from nereus.backends.groups import Groups
from nereus.backends.optim import AdamWConfig
from nereus.backends.protocol import (
    Capabilities,
    EngineOptions,
    Generation,
    GenerationStats,
    LossFn,
    TokenBatch,
    TrainStats,
)
from nereus.backends.sampling import MASK64, SamplingParams, _splitmix64
from nereus.backends.vllm import setup, support, world
from nereus.state.buffers import BufferKind
from nereus.state.holder import RankState

HEAD = "lm_head.weight"
_live: list[VllmEngine] = []  # the process's engine (vLLM's groups are process-wide: one at a time)


def close_all() -> None:
    """Shut every engine of this process down (the world they were built in has failed)."""
    for engine in list(_live):
        engine.close()


def request_seed(seed: int, sample_id: int) -> int:
    """A request's sampling seed from the job's seed and the sample's id (63 bits)."""
    return _splitmix64(_splitmix64(seed & MASK64) ^ (sample_id & MASK64)) >> 1


def _with_tied_head(state: RankState, tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``tensors``, and after the embedding the head it ties to, where the state has no head of
    its own (vLLM's dummy-initialised head is its own tensor until a load names it)."""
    names = set(whole_names(state))
    for name, tensor in tensors:
        yield name, tensor
        if name == "model.embed_tokens.weight" and state.model.tie_word_embeddings and HEAD not in names:
            yield HEAD, tensor


def _agreed_ident(groups: Groups, device: torch.device) -> str:
    """A fresh name the replica's ranks share (its first rank draws it)."""
    value = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=device)
    if groups.unit is not None:
        root = groups.grid.unit_groups()[groups.coord.dp][0]
        dist.broadcast(value, src=root, group=groups.unit)
    return f"{int(value.item()):x}"


class VllmEngine:
    capabilities = Capabilities(
        train=False, generate=True, value_head=False, devices=("cpu", "cuda"),
        tensor_parallel="vLLM external launcher over the replica's ranks", pipeline_parallel="none",
    )  # fmt: skip

    def __init__(
        self, state: RankState, groups: Groups, optim: AdamWConfig | None = None, *,
        options: EngineOptions | None = None,
    ) -> None:  # fmt: skip
        # ``optim`` (the role's AdamW settings) does not apply: the engine never trains.
        self.options = options or EngineOptions()
        self.llm: Any = None
        self.build_s = 0.0
        self.sync_s = 0.0
        self._sleeping = False
        self._can_sleep = False  # built with vLLM's sleep mode (CUDA/ROCm, shared with a trainer)
        self._build(state, groups)

    # ------------------------------------------------------------------ building
    def _placement(self, state: RankState, groups: Groups) -> tuple[Any, ...]:
        replica = groups.grid.unit_groups()[groups.coord.dp]
        return (state.layout, state.t, state.p, tuple(replica), self.options)

    def _build(self, state: RankState, groups: Groups) -> None:
        why = support.unservable(state.model, state.layout.tp, state.layout.pp)
        if why:
            raise ValueError(f"{state.model_stage}: {why}")
        for old in list(_live):
            old.close()
        self.state, self.groups = state, groups
        replica = groups.grid.unit_groups()[groups.coord.dp]
        root = self._workdir()
        folder = setup.model_folder(root, state)
        os.environ.update(setup.environment(root))
        setup.quiet_known_noise()
        opts = self.options
        max_len = opts.max_model_len or state.model.max_position_embeddings
        device = state.buffers[BufferKind.PARAM].device
        here = replica.index(groups.rank)
        local = device.index if device.type == "cuda" and device.index is not None else here
        started = time.perf_counter()
        from vllm import LLM

        ident = _agreed_ident(groups, device)
        with setup.launcher_env(here, local, len(replica)), world.replica_world(replica, ident):
            self.llm = LLM(
                model=str(folder), skip_tokenizer_init=True, load_format="dummy",
                dtype="bfloat16" if setup.dtype_of(state) is torch.bfloat16 else "float32", seed=0,
                tensor_parallel_size=state.layout.tp, distributed_executor_backend="external_launcher",
                enforce_eager=device.type == "cpu", max_model_len=max_len,
                max_num_seqs=opts.max_num_seqs or 256,
                kv_cache_memory_bytes=setup.kv_cache_bytes(state, opts, max_len),
                gpu_memory_utilization=setup.memory_utilization(device),
                logprobs_mode="processed_logprobs", disable_log_stats=False,
                enable_sleep_mode=opts.sleep and device.type == "cuda", enable_prefix_caching=False,
                max_num_batched_tokens=setup.max_batched_tokens(state.model),
            )  # fmt: skip
        _live.append(self)
        self._can_sleep, self._sleeping = opts.sleep and device.type == "cuda", False
        self.build_s = time.perf_counter() - started
        self._load(state)

    def _workdir(self) -> Path:
        if self.options.workdir is not None:
            return Path(self.options.workdir) / "vllm"
        return Path(tempfile.gettempdir()) / f"nereus-vllm-{os.getuid()}"

    def _load(self, state: RankState) -> None:
        """The replica's whole tensors (gathered from its ranks' shards, a bucket at a time, on
        the device: ``stream_whole``) into vLLM, in place."""
        started = time.perf_counter()
        if self._sleeping:  # the weights' memory first; the KV cache's once the buckets are gone
            self.llm.wake_up(tags=["weights"])
        tensors = _with_tied_head(state, stream_whole(state, self.groups, BufferKind.PARAM))
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        for _ in tensors:  # a loader that stopped early: the rest of the stream's collectives
            pass
        del tensors
        if self._sleeping:
            if state.device.type == "cuda":  # the buckets' blocks back to the GPU, for the KV cache
                torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self._sleeping = False
        self.state = state
        self.sync_s = time.perf_counter() - started

    # ------------------------------------------------------------------ Backend
    @property
    def coord(self) -> Coord:
        return self.groups.coord

    def rebind(
        self, state: RankState, groups: Groups | None = None, options: EngineOptions | None = None
    ) -> None:
        """Reload the weights (a weight sync, or a kept placement); rebuild on a new one."""
        if options is not None and options != self.options:
            self.options = options
            self._build(state, groups or self.groups)
            return
        if groups is not None and self._placement(state, groups) != self._placement(self.state, self.groups):
            self._build(state, groups)
            return
        if groups is not None:
            self.groups = groups
        self._load(state)

    def generate(self, prompts: TokenBatch, sample_ids: Sequence[int], params: SamplingParams) -> Generation:
        from vllm import SamplingParams as VSampling
        from vllm.inputs import TokensPrompt

        rows = prompts.rows
        if len(sample_ids) != rows:
            raise ValueError(f"{len(sample_ids)} sample ids for {rows} prompts")
        requests = [
            TokensPrompt(prompt_token_ids=ids[v.bool()].tolist())
            for ids, v in zip(prompts.ids, prompts.valid, strict=True)
        ]
        if any(not r["prompt_token_ids"] for r in requests):
            raise ValueError("every prompt needs at least one valid token")
        common: dict[str, Any] = {
            "max_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True, "logprobs": 0, "detokenize": False, "skip_special_tokens": False,
        }  # fmt: skip
        if params.greedy:
            sampling = [VSampling(temperature=0.0, **common) for _ in sample_ids]
        else:
            t, p = params.temperature, params.top_p
            sampling = [
                VSampling(temperature=t, top_p=p, seed=request_seed(params.seed, s), **common)
                for s in sample_ids
            ]
        if self._sleeping:  # asleep since its last call (level 2 dropped the weights): reload them
            self._load(self.state)
        before = self._counters()
        outs = self.llm.generate(requests, sampling, use_tqdm=False)
        after = self._counters()
        width = max((len(o.outputs[0].token_ids) for o in outs), default=0) or 1
        tokens = torch.full((rows, width), params.pad_token_id, dtype=torch.long)
        valid = torch.zeros((rows, width), dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        for i, o in enumerate(outs):
            ids = list(o.outputs[0].token_ids)
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            valid[i, : len(ids)] = 1
            for j, (tok, lp) in enumerate(zip(ids, o.outputs[0].logprobs or [], strict=False)):
                logprobs[i, j] = lp[tok].logprob
        stats = GenerationStats(
            int(after["tokens"] - before["tokens"]), int(after["steps"] - before["steps"]),
            self._kv_usage([len(r["prompt_token_ids"]) for r in requests], valid.sum(1).tolist()),
            int(after["preemptions"] - before["preemptions"]),
        )  # fmt: skip
        self.sleep()
        return Generation(prompts.ids, prompts.valid, tokens, valid, logprobs, stats)

    def _counters(self) -> dict[str, float]:
        """vLLM's cumulative counters: generated tokens, engine steps, preemptions."""
        out = {"tokens": 0.0, "steps": 0.0, "preemptions": 0.0}
        for m in self.llm.get_metrics():
            if m.name == "vllm:generation_tokens":
                out["tokens"] += float(m.value)
            elif m.name == "vllm:iteration_tokens_total":
                out["steps"] += float(m.count)
            elif m.name == "vllm:num_preemptions":
                out["preemptions"] += float(m.value)
        return out

    def _kv_usage(self, prompt_lens: list[int], response_lens: list[int]) -> float:
        """The largest share of the KV blocks the running batch held: the ``max_num_seqs``
        longest sequences, each in whole blocks of vLLM's size."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        blocks, size = int(cache.num_gpu_blocks or 0), int(cache.block_size)
        if not blocks:
            return 0.0
        need = sorted(
            (-(-(p + r) // size) for p, r in zip(prompt_lens, response_lens, strict=True)), reverse=True
        )
        running = self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        return min(1.0, sum(need[:running]) / blocks)

    def sleep(self) -> None:
        """Free the GPU for a trainer (CUDA/ROCm; vLLM's sleep is a no-op on a CPU)."""
        if self._can_sleep and not self._sleeping and self.llm is not None:
            self.llm.sleep(level=2)
            self._sleeping = True

    def wake(self) -> None:
        """All of the engine's memory back (a weight sync wakes it in two parts: ``_load``)."""
        if self._sleeping and self.llm is not None:
            self.llm.wake_up()
            self._sleeping = False

    def forward(self, batch: TokenBatch, micro_batches: int = 1, temperature: float = 1.0) -> Tensor:
        raise NotImplementedError(
            f"{self.state.model_stage}: the vllm engine generates only (scoring runs on an inf stage)"
        )

    def train_step(
        self, batch: TokenBatch, loss_fn: LossFn, micro_batches: int = 1, temperature: float = 1.0
    ) -> TrainStats:
        raise NotImplementedError(f"{self.state.model_stage}: the vllm engine does not train")

    def load_hf(self, directory: Path) -> None:
        """Read this rank's shards of a checkpoint into the state (as the torch-native engine
        does), then into vLLM."""
        self.read_hf(directory)
        self.reload()

    def read_hf(self, directory: Path) -> None:
        from nereus.backends.torch_native import weights
        from nereus.backends.torch_native.stage import BoundStage

        weights.load_hf(
            BoundStage(self.state, self.groups, self.state.buffers[BufferKind.PARAM].device), directory
        )

    def reload(self) -> None:
        """The state's weights into vLLM (gathered from the replica's ranks: collective)."""
        self._load(self.state)

    def save_hf(self, directory: Path, companions: Sequence[Path] = ()) -> None:
        from nereus.backends import hf

        if self.coord.dp != 0:
            return
        flats = gather_flats(self.state, self.groups, BufferKind.PARAM, everywhere=False)
        if flats is not None:
            hf.save(directory, self.state.model, assemble(self.state, flats), companions)

    def close(self) -> None:
        """Shut the engine down and drop vLLM's groups (the state buffers stay the holder's)."""
        if self in _live:
            _live.remove(self)
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        with suppress(Exception), world.keeping_ours():  # a half-built or stopped engine
            llm.llm_engine.engine_core.shutdown()
        del llm
        world.release()
