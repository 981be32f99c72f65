"""WorkloadSpec and Workflow: which model-stages an RL algorithm runs, on how much data.

A workflow is data: model-stages (a model role at a stage) and the dependency edges between them.
Defaults follow architecture.md §3:

* PPO:   actor.gen → {actor.inf, ref.inf, reward.inf, critic.inf} → {actor.train, critic.train}
* GRPO:  no critic; G samples per prompt, advantages normalised within each group
* ReMax: no critic; one extra greedy rollout per prompt whose reward is the baseline

and after training, weight syncs actor.train ⇒ actor.gen, actor.inf (and critic.train ⇒ critic.inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from nereus.errors import ConfigError
from nereus.spec.files import brief
from nereus.spec.model import Head
from nereus.spec.schema import (
    ALLOWED,
    build,
    coerce_enums,
    load_yaml,
    named,
    require_at_most,
    require_positive,
)

MAX_TOKENS = 1 << 24  # a prompt or response length beyond any context window
MAX_SEQUENCES = 1 << 24  # sequences per step, per batch
MAX_STALENESS = 16  # async: batches generated ahead of training, at most
ASYNC_ONLY = ("max_staleness", "in_flight")  # workload keys that act in mode: async only


class Algorithm(StrEnum):
    PPO = "ppo"
    GRPO = "grpo"
    REMAX = "remax"


class Stage(StrEnum):
    GEN = "gen"
    INF = "inf"
    TRAIN = "train"


STAGE_ORDER: tuple[Stage, ...] = (Stage.GEN, Stage.INF, Stage.TRAIN)


class Role(StrEnum):
    ACTOR = "actor"
    CRITIC = "critic"
    REF = "ref"
    REWARD = "reward"


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # recompute core attention (Korthikanti et al. 2022 §4)
    FULL = "full"  # keep only each layer's input


class Precision(StrEnum):
    BF16_MIXED = "bf16-mixed"  # bf16 params/activations, fp32 master weights, grads, Adam state
    FP32 = "fp32"


class ExecutionMode(StrEnum):
    SYNC = "sync"  # gen, inf, train one after another on a shared pool
    ASYNC = "async"  # gen on its own GPUs, overlapping inf+train; a step = one weight sync


class InFlight(StrEnum):
    """Async: what a transition or restart does with the batches generated ahead of training."""

    DRAIN = "drain"  # keep them: they are trained on under the versions that generated them
    DROP = "drop"  # drop them: they are generated again by the new plan's engines


@dataclass(frozen=True, slots=True)
class ModelStage:
    """One model at one stage, e.g. ``actor.gen``; processes ``rollouts_per_prompt`` per prompt."""

    name: str
    role: Role
    stage: Stage
    rollouts_per_prompt: int

    def __post_init__(self) -> None:
        if self.name != f"{self.role.value}.{self.stage.value}":
            raise ValueError(f"model-stage name must be '<role>.<stage>', got {self.name!r}")
        if self.rollouts_per_prompt <= 0:
            raise ValueError(f"{self.name}: rollouts_per_prompt must be positive")
        if self.stage is Stage.GEN and self.role is not Role.ACTOR:
            raise ValueError(f"{self.name}: only the actor generates")
        if self.stage is Stage.TRAIN and self.role not in (Role.ACTOR, Role.CRITIC):
            raise ValueError(f"{self.name}: only the actor and the critic train")

    @property
    def head(self) -> Head:
        return Head.VALUE if self.role in (Role.CRITIC, Role.REWARD) else Head.LM


@dataclass(frozen=True, slots=True)
class Workflow:
    """Model-stages, data-dependency edges, and end-of-step weight syncs (trainer ⇒ receiver)."""

    algorithm: Algorithm
    model_stages: tuple[ModelStage, ...]
    edges: tuple[tuple[str, str], ...]
    weight_syncs: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.model_stages]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model-stage names in {names}")
        known = {m.name: m for m in self.model_stages}
        order = {s: i for i, s in enumerate(STAGE_ORDER)}
        for src, dst in self.edges:
            for end in (src, dst):
                if end not in known:
                    raise ValueError(f"edge {src}→{dst}: unknown model-stage {end!r}")
            if order[known[src].stage] >= order[known[dst].stage]:
                raise ValueError(
                    f"edge {src}→{dst} must go to a later stage (model-stages of one stage run concurrently)"
                )
        for src, dst in self.weight_syncs:
            if src not in known or dst not in known:
                raise ValueError(f"weight sync {src}⇒{dst}: unknown model-stage")
            if known[src].stage is not Stage.TRAIN or known[dst].stage is Stage.TRAIN:
                raise ValueError(f"weight sync {src}⇒{dst} must go from a trainer to a non-trainer")
            if known[src].role is not known[dst].role:
                raise ValueError(f"weight sync {src}⇒{dst} must stay within one model")

    def get(self, name: str) -> ModelStage:
        for m in self.model_stages:
            if m.name == name:
                return m
        raise KeyError(name)

    def by_stage(self, stage: Stage) -> tuple[ModelStage, ...]:
        return tuple(m for m in self.model_stages if m.stage is stage)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in STAGE_ORDER if self.by_stage(s))

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(dict.fromkeys(m.role for m in self.model_stages))

    def sync_source(self, receiver: str) -> str | None:
        """The trainer whose weights ``receiver`` loads at the step boundary, if any."""
        for src, dst in self.weight_syncs:
            if dst == receiver:
                return src
        return None


def default_workflow(algorithm: Algorithm, samples_per_prompt: int, reward_model: bool) -> Workflow:
    """The model-stages and edges of ``algorithm`` (architecture.md §3)."""
    g = samples_per_prompt
    greedy = 1 if algorithm is Algorithm.REMAX else 0  # ReMax: one greedy rollout per prompt
    gen = [ModelStage("actor.gen", Role.ACTOR, Stage.GEN, g + greedy)]
    inf = [
        ModelStage("actor.inf", Role.ACTOR, Stage.INF, g),  # old log-probs
        ModelStage("ref.inf", Role.REF, Stage.INF, g),
    ]
    if reward_model:
        inf.append(ModelStage("reward.inf", Role.REWARD, Stage.INF, g + greedy))
    train = [ModelStage("actor.train", Role.ACTOR, Stage.TRAIN, g)]
    syncs = [("actor.train", "actor.gen"), ("actor.train", "actor.inf")]
    if algorithm is Algorithm.PPO:
        inf.append(ModelStage("critic.inf", Role.CRITIC, Stage.INF, g))
        train.append(ModelStage("critic.train", Role.CRITIC, Stage.TRAIN, g))
        syncs.append(("critic.train", "critic.inf"))
    edges = [(gen[0].name, m.name) for m in inf] + [(i.name, t.name) for i in inf for t in train]
    return Workflow(algorithm, tuple(gen + inf + train), tuple(edges), tuple(syncs))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadSpec:
    """How much an RL step processes and how the trainers are configured."""

    name: str
    algorithm: Algorithm
    mode: ExecutionMode = ExecutionMode.SYNC
    prompts_per_step: int = 512
    samples_per_prompt: int = 1
    prompt_len: int = 512  # mean prompt tokens
    max_prompt_len: int = 1024
    max_response_len: int = 8192
    global_batch: int = 128  # sequences per optimizer update, = dp × micro_batch × grad-accum
    micro_batch: int = 4  # largest per-replica micro-batch of a trainer
    inference_micro_batch: int = 16  # per-replica micro-batch of inf model-stages
    max_num_seqs: int = 256  # most concurrent sequences per generation replica (vLLM)
    epochs: int = 1  # passes over a step's samples (PPO epochs)
    precision: Precision = Precision.BF16_MIXED
    recompute: Recompute = Recompute.NONE
    sequence_parallel: bool = True
    flash_attention: bool = True
    reward_model: bool = True  # False: rule-based verifier, no reward.inf model-stage
    models: dict[str, str] = field(default_factory=dict)  # role → model; absent roles: the job's (model_of)
    # async: how many policy versions a trained batch may lag the trainer (0: generation waits for
    # every sync, as synchronous RL does), and the fate of batches generated ahead at a transition
    max_staleness: int = field(default=1, metadata={ALLOWED: f"a whole number 0…{MAX_STALENESS}"})
    in_flight: InFlight = InFlight.DRAIN

    def __post_init__(self) -> None:
        coerce_enums(
            self, algorithm=Algorithm, mode=ExecutionMode, precision=Precision, recompute=Recompute,
            in_flight=InFlight,
        )  # fmt: skip
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
            raise ValueError(
                f"max_staleness must be a whole number 0…{MAX_STALENESS}, got {brief(self.max_staleness)}"
            )
        if not 0 <= self.max_staleness <= MAX_STALENESS:
            raise ValueError(f"max_staleness must be 0…{MAX_STALENESS}, got {self.max_staleness}")
        require_positive(
            self,
            "prompts_per_step",
            "samples_per_prompt",
            "prompt_len",
            "max_prompt_len",
            "max_response_len",
            "global_batch",
            "micro_batch",
            "inference_micro_batch",
            "max_num_seqs",
            "epochs",
        )
        require_at_most(self, MAX_TOKENS, "prompt_len", "max_prompt_len", "max_response_len")
        require_at_most(self, MAX_SEQUENCES, "prompts_per_step", "global_batch", "max_num_seqs")
        require_at_most(self, 1 << 16, "samples_per_prompt", "micro_batch", "inference_micro_batch")
        require_at_most(self, 1000, "epochs")
        if self.sequences_per_step > MAX_SEQUENCES:
            raise ValueError(
                f"prompts_per_step × samples_per_prompt must be at most {MAX_SEQUENCES}, "
                f"got {self.sequences_per_step}"
            )
        if self.micro_batch > self.global_batch:
            raise ValueError(
                f"micro_batch {self.micro_batch} exceeds global_batch {self.global_batch} (a trainer "
                "replica's micro-batch is a part of one optimizer update's sequences)"
            )
        if self.prompt_len > self.max_prompt_len:
            raise ValueError(f"prompt_len {self.prompt_len} exceeds max_prompt_len {self.max_prompt_len}")
        if self.algorithm is Algorithm.GRPO and self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be at least 2 for grpo (group baseline)")
        if self.sequences_per_step % self.global_batch:
            raise ValueError(
                f"global_batch {self.global_batch} must divide the sequences per step "
                f"{self.sequences_per_step} (prompts_per_step × samples_per_prompt)"
            )
        roles = {r.value for r in Role}
        for role in self.models:
            if role not in roles:
                raise ValueError(f"models: unknown role {brief(role)} (allowed: {', '.join(sorted(roles))})")
        runs = sorted({ms.role.value for ms in self.workflow().model_stages})
        for role in self.models:  # a model for a role that does not run would do nothing
            if role not in runs:
                why = " (reward_model: false)" if role == "reward" and not self.reward_model else ""
                runs_no = f"models: {self.algorithm.value} runs no {role} model{why}"
                raise ValueError(f"{runs_no} (allowed roles: {', '.join(runs)})")

    @classmethod
    def from_yaml(cls, path: Path, mode: ExecutionMode | None = None) -> WorkloadSpec:
        """The workload in ``path``; its name defaults to the file's stem. The async-only keys in a
        synchronous workload are refused rather than ignored: a user who wrote them expects them to act.
        ``mode`` (a command's ``--mode``) overrides the file's: to async, its keys act; to sync, the
        user asked for the synchronous plan of an asynchronous workload, and they do not."""
        data = named(load_yaml(path), path)
        written_sync = data.get("mode", ExecutionMode.SYNC.value) == ExecutionMode.SYNC.value
        if written_sync and mode is not ExecutionMode.ASYNC:  # the file says sync, and so does --mode
            given = [k for k in ASYNC_ONLY if k in data]
            if given:
                raise ConfigError(
                    f"{path}: key '{given[0]}' applies to mode: async only; this workload's mode is sync "
                    "(set mode: async, or remove the key)"
                )
        if mode is not None:
            data["mode"] = mode.value
        return build(cls, data, str(path))

    def model_key(self, role: str) -> str:
        """The ``models:`` key ``role``'s model comes from: its own, or for a reference without
        one beside an actor with one, the actor's (it is the initial actor, as in verl)."""
        return "actor" if role == "ref" and role not in self.models and "actor" in self.models else role

    def model_of(self, role: str) -> str:
        """``role``'s ``models:`` entry (``model_key``'s; "" when it has none: the job's model)."""
        return self.models.get(self.model_key(role), "")

    @property
    def sequences_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step: mini-batches of ``global_batch`` × epochs."""
        return math.ceil(self.sequences_per_step / self.global_batch) * self.epochs

    def workflow(self) -> Workflow:
        return default_workflow(self.algorithm, self.samples_per_prompt, self.reward_model)

    def sequences(self, model_stage: ModelStage) -> int:
        """Sequences ``model_stage`` processes per step."""
        return self.prompts_per_step * model_stage.rollouts_per_prompt
