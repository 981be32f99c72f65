"""An experiment: one RL job as data (``configs/experiments/<name>.yaml``).

What runs (workload, models, cluster, workers, steps, policy), what it learns from (a bundled task
or a JSONL/Parquet dataset), the RL hyper-parameters, and a scripted drift for local runs: GPU
pool changes (workers lost and regained) and a response-length schedule at given steps, so
adaptation is visible on one machine. Pure and strict: unknown keys and bad values are one-line
``ConfigError``s naming the file and key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from nereus.backends.registry import check_engine, default_engine
from nereus.errors import ConfigError
from nereus.rl.layouts import RecordLayout
from nereus.runtime.drift import MAX_STEPS, DriftEvent
from nereus.spec.files import brief
from nereus.spec.model import ModelSpec
from nereus.spec.registry import hf_folder, weights_folder
from nereus.spec.schema import load_spec, require_at_most, require_finite, require_positive
from nereus.spec.workload import MAX_TOKENS, WorkloadSpec

# An experiment's name becomes a folder (runs/<name>), a Slurm job name and part of shell lines.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME = 64
MAX_WORKERS = 1 << 16
# how long a collective waits for a peer before the job counts it lost, unless the experiment
# fixes it: NCCL's and Megatron's default (10 min), or this many times the slowest step so far
# when that is longer (a rank may wait a whole stage for another; a long step must not trip it)
COLLECTIVE_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_STEPS = 5.0
COLLECTIVE_TIMEOUT_RANGE_S = (1.0, 86_400.0)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A generated task set (``nereus.rl.tasks``)."""

    kind: str = "add"
    n: int = 4096
    difficulty: int = 4
    length: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        from nereus.rl.tasks import generate_tasks

        require_positive(self, "n")
        require_at_most(self, 10_000_000, "n")
        generate_tasks(self.kind, 0, self.seed, self.difficulty, self.length)  # validates the rest


MAX_DATA_FILES = 1024


@dataclass(frozen=True, slots=True)
class DataSpec:
    """A prompt data set as users bring it (``nereus.rl.layouts``): ``train`` a JSONL, JSON or
    Parquet file, or a list of them (one data set, in order, as verl's ``train_files``);
    ``layout`` verl (chat messages, ``reward_model.ground_truth``, ``data_source``), qa
    (``{question, answer}`` through ``template``) or nereus (``{prompt, answer, id}``); and the
    column names where they differ from the layout's. ``val``: held-out prompts in the same layout
    (verl's ``val_files``), scored greedily every ``val_every`` steps (``nereus.runtime.validation``)."""

    train: str | tuple[str, ...]
    layout: str = "verl"
    template: str = "{question}"
    prompt_key: str = "prompt"
    question_key: str = "question"
    answer_key: str = ""
    source_key: str = "data_source"
    val: str | tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key, files in (("train", self.files), ("val", self.val_files)):
            if (key == "train" and not files) or not all(f.strip() for f in files):
                raise ValueError(
                    f"{key} must name a JSONL, JSON or Parquet file or a list of them, got "
                    f"{getattr(self, key)!r}"
                )
            if len(files) > MAX_DATA_FILES:
                raise ValueError(f"{key} names {len(files)} files, more than {MAX_DATA_FILES}")
            twice = sorted({f for f in files if files.count(f) > 1})
            if twice:
                raise ValueError(f"{key} names {twice[0]!r} twice")
        self.record_layout()  # validates layout and template
        for key in COLUMN_KEYS:  # a key the layout does not read would do nothing
            value = getattr(self, key)
            if key != "answer_key" and not value.strip():
                raise ValueError(f"{key} must not be empty")
            if value != DATA_DEFAULTS[key] and key not in LAYOUT_KEYS.get(self.layout, ()):
                reads = ", ".join(LAYOUT_KEYS[self.layout]) or "none: its columns are prompt, answer and id"
                raise ValueError(
                    f"{key}: layout {self.layout} does not read it (the keys it reads: {reads}; "
                    "layout qa takes any question and answer columns through question_key, answer_key "
                    "and template)"
                )

    @property
    def files(self) -> tuple[str, ...]:
        return (self.train,) if isinstance(self.train, str) else self.train

    @property
    def val_files(self) -> tuple[str, ...]:
        return (self.val,) if isinstance(self.val, str) else self.val

    def record_layout(self, by_source: bool = False) -> RecordLayout:
        return RecordLayout(
            self.layout, self.prompt_key, self.question_key, self.answer_key, self.source_key, self.template,
            by_source,
        )  # fmt: skip


COLUMN_KEYS = ("template", "prompt_key", "question_key", "answer_key", "source_key")
LAYOUT_KEYS: dict[str, tuple[str, ...]] = {  # the column keys each layout reads
    "verl": ("prompt_key", "answer_key", "source_key"),
    "qa": ("question_key", "answer_key", "template"),
    "nereus": (),
}
DATA_DEFAULTS = {f.name: f.default for f in fields(DataSpec)}


MIN_TEMPERATURE = 0.01  # vLLM raises a lower one to 0.01 (its _MAX_TEMP), which the trainer would not


@dataclass(frozen=True, slots=True)
class RlSpec:
    # verl's defaults (actor 1e-6, critic 1e-5): pretrained weights. The shipped experiments,
    # which learn a toy task from random weights, name much larger ones
    lr: float = 1e-6
    critic_lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2  # the losses' ratio clip: in (0, 1)
    vf_clip: float | None = 0.2  # the critic's value clip; null: off
    kl_coef: float = 0.01  # PPO: KL (k1) in the reward; GRPO and ReMax: KL (k3) in the loss
    gamma: float = 1.0
    lam: float = 0.95
    temperature: float = 1.0  # sampling's; log-probs (behaviour, reference, trained) are at it too
    top_p: float = 1.0
    dual_clip: float | None = 3.0  # verl's clip_ratio_c: a token with A < 0 costs at most −A·3; null: off

    def __post_init__(self) -> None:
        names = ("lr", "critic_lr", "weight_decay", "max_grad_norm", "clip_eps", "kl_coef")
        require_finite(self, *names, "gamma", "lam", "temperature", "top_p")
        require_positive(self, "lr", "critic_lr", "clip_eps", "temperature")
        require_at_most(self, 1e6, *names, "temperature")
        if self.temperature < MIN_TEMPERATURE:  # logits / T overflow: every log-prob NaN
            raise ValueError(
                f"temperature must be in [{MIN_TEMPERATURE:g}, 1e6], got {brief(self.temperature)}"
            )
        if self.clip_eps >= 1:  # 1 - clip_eps bounds the ratio from below: it must stay positive
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        vf = self.vf_clip
        if vf is not None and (isinstance(vf, bool) or not isinstance(vf, int | float) or not 0 < vf <= 1e6):
            raise ValueError(f"vf_clip must be in (0, 1e6] or null (off), got {brief(vf)}")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:  # the nucleus keeps at least the likeliest token
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("weight_decay", "max_grad_norm", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.dual_clip is not None and not (math.isfinite(self.dual_clip) and 1 < self.dual_clip <= 1e6):
            raise ValueError(f"dual_clip must be in (1, 1e6] or null (off), got {brief(self.dual_clip)}")


@dataclass(frozen=True, slots=True)
class InitSpec:
    """Hugging Face checkpoint folders the job starts from (empty: seeded random weights). The
    actor's also initialises the reference; the reward model's is a ``*ForSequenceClassification``
    with one label (a value head); the critic's likewise (default: the reward model's)."""

    actor: str = ""
    critic: str = ""
    reward: str = ""

    def __post_init__(self) -> None:
        for role in ("actor", "critic", "reward"):  # a folder's config.json names the folder, as model: does
            named = Path(getattr(self, role))
            if named.name == "config.json" and named.is_file():
                object.__setattr__(self, role, str(named.parent))

    def own(self, role: str) -> str:
        """The folder named for ``role`` itself (the reference and a critic named by the reward
        model's entry have none)."""
        return getattr(self, role) if role in ("actor", "critic", "reward") else ""

    def path(self, role: str) -> str:
        if role in ("actor", "ref"):
            return self.actor
        if role == "critic":
            return self.critic or self.reward
        return self.reward if role == "reward" else ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperimentSpec:
    name: str
    workload: str  # a name in configs/workloads (or a path)
    model: str  # the actor's (and reference's) model, unless models: names another; critics add a value head
    cluster: str = "local-cpu"
    workers: int = 4
    steps: int = 20
    seed: int = 0
    policy: str = "nereus"
    task: TaskSpec = field(default_factory=TaskSpec)
    dataset: str = ""  # a JSONL/Parquet prompt file instead of the generated task
    data: DataSpec | None = None  # a data set in a user's layout (verl, qa) instead
    verifier: str = "exact_answer"  # or "none": the reward model alone scores
    reward_coef: float = 1.0  # the reward model's score's weight (workloads with reward_model: true)
    init: InitSpec = field(default_factory=InitSpec)
    # A Hugging Face tokenizer's folder (tokenizer.json / tokenizer_config.json with its chat
    # template); default: the actor's init folder when it has one, else the bundled tasks'
    # character-level tokenizer.
    tokenizer: str = ""
    max_new_tokens: int = 8
    rl: RlSpec = field(default_factory=RlSpec)
    drift: tuple[DriftEvent, ...] = ()
    checkpoint_every: int = 0  # steps; 0: only at the end
    checkpoint_keep: int = 2  # the newest checkpoints kept (verl's max_actor_ckpt_to_keep); older ones go
    val_every: int = 0  # steps between validations of data.val (verl's test_freq); 0: after the last only
    # Time the world's collectives before the first plan (``nereus.runtime.sweep``) and feed the
    # measured op-class efficiencies to the controller's calibration. Off in the tiny CPU
    # experiments: DTensor's tensor-parallel collectives are not timed apart, so a fitted GEMM
    # efficiency alone steers the planner to TP layouts that gloo makes slower.
    calibrate: bool = False
    # Seconds a collective of a step waits for a peer before the job counts the peer lost (a
    # frozen node, a stuck kernel) and recovers without it; the longest wait a healthy step has
    # (a rank idle while another generates) must fit in it. The boundary's work (checkpoints,
    # moves, joins) keeps the 30 minutes of forming a generation. None: 600 s, or 5 × the
    # slowest step so far once that is longer (``collective_timeout``).
    collective_timeout_s: float | None = None
    # The engine of each model-stage (``actor.gen: <engine>``), from ``nereus.backends.registry``;
    # a model-stage not named runs on the default engine (vLLM for generation when it is
    # installed and serves the model, torch-native otherwise).
    engines: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.name) > MAX_NAME or not NAME.fullmatch(self.name):
            raise ValueError(
                f"key 'name': expected a letter or digit, then letters, digits, '.', '_' or '-', at most "
                f"{MAX_NAME} characters (it names the results folder and the job), got {brief(self.name)}"
            )
        require_positive(self, "workers", "steps", "max_new_tokens", "checkpoint_keep")
        require_at_most(self, MAX_WORKERS, "workers")
        require_at_most(self, MAX_STEPS, "steps", "checkpoint_every", "checkpoint_keep", "val_every")
        require_at_most(self, MAX_TOKENS, "max_new_tokens")
        require_finite(self, "reward_coef")
        low, high = COLLECTIVE_TIMEOUT_RANGE_S
        if (timeout := self.collective_timeout_s) is not None and not low <= timeout <= high:
            bounds = f"[{low:g}, {high:g}] seconds"
            raise ValueError(f"collective_timeout_s must be in {bounds}, got {brief(timeout)}")
        for name, engine in self.engines.items():
            if name.count(".") != 1:
                raise ValueError(f"engines: {name!r} is not a model-stage (<model>.<stage>, e.g. actor.gen)")
            try:
                check_engine(engine, name.split(".")[1])
            except ConfigError as exc:
                raise ValueError(f"engines.{name}: {exc}") from None
        if self.dataset and self.data is not None:
            raise ValueError(
                "dataset and data: name one prompt file (data: in verl or qa layout, or dataset:)"
            )
        if (self.dataset or self.data is not None) and self.task != TaskSpec():
            raise ValueError(
                f"task and {'dataset' if self.dataset else 'data'}: the generated task's settings do "
                "nothing when a prompt file is named (allowed: one of task:, data:, dataset:)"
            )
        for name in ("seed", "checkpoint_every", "val_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if self.verifier == "by_source" and (self.data is None or self.data.layout != "verl"):
            raise ValueError(
                "verifier: by_source scores each row by its data_source column, which only data in the "
                "verl layout has (data: {layout: verl}); name another verifier (exact_answer, gsm8k, math, …)"
            )
        validated = self.data is not None and bool(self.data.val_files)
        if self.val_every and not validated:
            raise ValueError(
                "val_every: validates the prompts of data.val, which this experiment does not name"
            )
        if validated and self.verifier == "none":
            raise ValueError(
                "data.val: validation scores greedy responses with the verifier; verifier: none has none "
                "(name one, e.g. by_source or exact_answer)"
            )
        steps = [e.step for e in self.drift]
        twice = sorted({s for s in steps if steps.count(s) > 1})
        if twice:
            raise ValueError(
                f"drift: two events at step {twice[0]}; put one step's changes in one event (their "
                "order within a step is the runtime's: losses, then gains)"
            )
        pool = set(range(self.workers))
        for e in sorted(self.drift, key=lambda e: e.step):
            dies_joining = set(e.kill) & set(e.gain)
            gone = (set(e.lose) | set(e.kill) | set(e.unhealthy)) - dies_joining
            if 0 in gone | set(e.hang) | set(e.freeze):
                raise ValueError(
                    f"drift at step {e.step}: worker 0 hosts the controller and cannot leave or hang"
                )
            for w in (*e.lose, *e.kill, *e.unhealthy, *e.gain, *e.oom, *e.hang, *e.freeze):
                if not 0 <= w < self.workers:
                    raise ValueError(f"drift at step {e.step}: worker {w} outside 0…{self.workers - 1}")
            staying = set(e.oom) | set(e.hang) | set(e.freeze)
            if not (gone | staying) <= pool:
                missing = sorted((gone | staying) - pool)
                raise ValueError(f"drift at step {e.step}: workers {missing} are not in the pool")
            if set(e.gain) & pool:
                raise ValueError(
                    f"drift at step {e.step}: workers {sorted(set(e.gain) & pool)} are already in"
                )
            pool = (pool - gone) | (set(e.gain) - dies_joining)
            if not pool:
                raise ValueError(f"drift at step {e.step} leaves no worker")

    @classmethod
    def load(cls, path: Path) -> ExperimentSpec:
        try:
            return load_spec(cls, Path(path), check_name=False)  # its name names the results folder
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def collective_timeout(self, slowest_step_s: float = 0.0) -> float:
        """Seconds each collective waits for a peer: the experiment's, else 600 s or
        ``COLLECTIVE_TIMEOUT_STEPS`` × the slowest step so far, whichever is longer (at most a day)."""
        if self.collective_timeout_s is not None:
            return self.collective_timeout_s
        auto = max(COLLECTIVE_TIMEOUT_S, COLLECTIVE_TIMEOUT_STEPS * slowest_step_s)
        return min(auto, COLLECTIVE_TIMEOUT_RANGE_S[1])

    def model_folder(self) -> Path | None:
        """The Hugging Face folder ``model:`` names: the folder itself, or the folder of a
        ``config.json`` named directly; None for a shipped model or a model YAML."""
        return hf_folder(self.model)

    def tokenizer_folders(self, workload: WorkloadSpec | None = None) -> tuple[str, str]:
        """Where the job's tokenizer may be, first first (after ``tokenizer:``): the folder the
        actor starts from (its ``init:`` folder, else its ``models:`` entry's in ``workload``),
        then the ``model:`` folder ("" where there is none)."""
        folder = self.model_folder()
        actor = self.role_weights("actor", workload)[0] if workload is not None else self.weights_of("actor")
        return actor, str(folder) if folder is not None else ""

    def role_weights(self, role: str, workload: WorkloadSpec) -> tuple[str, str]:
        """(``weights_of``, ``weights_label``) of ``role`` with its ``models:`` entry in
        ``workload``. A reference without an entry of its own beside an actor with one is the
        initial actor: the actor's folder and name (``WorkloadSpec.model_key``)."""
        key = workload.model_key(role)
        return self.weights_of(key, workload.model_of(key)), self.weights_label(key, workload.model_of(key))

    def weights_of(self, role: str, model_of: str = "") -> str:
        """The Hugging Face folder ``role`` starts from: its ``init:`` folder, else the ``model:``
        folder when it holds weights (a value head then starts at zero), else none (random
        weights: a shipped model or a model YAML; ``nereus run`` refuses a model folder without
        weights, ``command.check_weights``). ``model_of``: the role's own model, the workload's
        ``models:`` entry (empty: the experiment's ``model``). A role with a model of its own
        starts from its own ``init:`` entry, else from that entry's folder when it is a Hugging
        Face folder with weights, else from random weights (a model YAML); never from another
        role's folder or ``model:``'s."""
        if model_of:
            return self.init.own(role) or weights_folder(hf_folder(model_of))
        named = self.init.path(role)
        return named or weights_folder(self.model_folder())

    def weights_label(self, role: str, model_of: str = "") -> str:
        """Where ``role``'s weights were named, for an error about them: ``init.<role>``, else the
        role's ``models:`` entry, else the ``model:`` folder (``model (critic)`` for another role
        starting from it)."""
        if model_of:
            return f"init.{role}" if self.init.own(role) else f"models.{role}"
        named = self.init.path(role)
        if named:
            owner = "reward" if role == "critic" and not self.init.critic else role
            return f"init.{'actor' if role == 'ref' else owner}"  # a critic may start as the reward model
        return "model" if role == "actor" else f"model ({role})"

    def engine_of(self, model_stage: str, model: ModelSpec | None = None) -> str:
        """The engine that runs ``model_stage`` (of ``model``): the one named, else the default."""
        named = self.engines.get(model_stage)
        return named if named is not None else default_engine(model_stage.split(".")[1], model)

    def pool_at(self, step: int) -> tuple[int, ...]:
        """The workers in the pool during ``step``."""
        pool = set(range(self.workers))
        for e in sorted(self.drift, key=lambda e: e.step):
            if e.step <= step:
                pool = (pool - set(e.lose) - set(e.kill) - set(e.unhealthy)) | (set(e.gain) - set(e.kill))
        return tuple(sorted(pool))

    def max_new_tokens_at(self, step: int) -> int:
        limit = self.max_new_tokens
        for e in sorted(self.drift, key=lambda e: e.step):
            if e.step <= step and e.max_new_tokens:
                limit = e.max_new_tokens
        return limit

    def validates_at(self, step: int) -> bool:
        """Whether ``step`` ends with a validation (every ``val_every`` steps, and after the last)."""
        if self.data is None or not self.data.val_files:
            return False
        return step + 1 == self.steps or bool(self.val_every and (step + 1) % self.val_every == 0)

    def longest_response(self) -> int:
        """The largest ``max_new_tokens`` the job will ask for (drift included, up to its last step)."""
        return max([self.max_new_tokens, *(e.max_new_tokens for e in self.drift if e.step < self.steps)])

    def lost_at(self, step: int) -> tuple[int, ...]:
        """Workers that leave at the boundary before ``step``."""
        return tuple(sorted(w for e in self.drift if e.step == step for w in e.lose))

    def oom_at(self, step: int) -> dict[int, str]:
        """Workers whose model-stage (the value) runs out of memory once in ``step``."""
        return {w: e.oom_stage for e in self.drift if e.step == step for w in e.oom}

    def unhealthy_at(self, step: int) -> tuple[int, ...]:
        """Workers whose GPU reports a fatal XID at the boundary before ``step``."""
        return tuple(sorted(w for e in self.drift if e.step == step for w in e.unhealthy))

    def hung_at(self, step: int) -> dict[int, float]:
        """Workers that freeze when ``step`` fails, and for how many seconds."""
        return {w: e.hang_s for e in self.drift if e.step == step for w in e.hang}

    def frozen_at(self, step: int) -> dict[int, float]:
        """Workers that freeze in the middle of ``step``, and for how many seconds."""
        return {w: e.hang_s for e in self.drift if e.step == step for w in e.freeze}

    def killed_at(self, step: int) -> tuple[int, ...]:
        """Workers killed in the middle of ``step``."""
        return tuple(sorted(w for e in self.drift if e.step == step for w in e.kill if w not in e.gain))

    def killed_joining(self, step: int) -> tuple[int, ...]:
        """Workers gained at the boundary before ``step`` that die once accepted, before forming."""
        return tuple(sorted(w for e in self.drift if e.step == step for w in e.kill if w in e.gain))

    def gained_at(self, step: int) -> tuple[int, ...]:
        """Workers started at the boundary before ``step``."""
        return tuple(sorted(w for e in self.drift if e.step == step for w in e.gain))
