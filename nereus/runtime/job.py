"""The RL job: its setup, its workers, and one RL step on every worker.

``JobSetup`` is what every worker derives identically from the experiment; ``make_worker`` builds
a process's worker from it; ``algorithm_step`` runs one PPO/GRPO/ReMax step (generation,
inference, rewards and advantages, training) on the plan. The loop around them, with the
controller, membership and failures, is ``nereus.runtime.loop``. Edge module (torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from nereus.backends.protocol import AdamWConfig, SamplingParams
from nereus.devices import Devices
from nereus.errors import ConfigError, InfeasibleError
from nereus.plan.calibration import CalibrationStore
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SearchSpace, SeqStats
from nereus.plan.search import SearchResult, search
from nereus.rl.advantages import gae, grpo_advantages, remax_advantages, token_rewards
from nereus.rl.data import PromptDataset, Sample, collate
from nereus.rl.hf_tokenizer import HfTokenizer
from nereus.rl.losses import PolicyLoss, ValueLoss, kl_penalty
from nereus.rl.tasks import TaskRecord, generate_tasks, write_jsonl
from nereus.rl.tokenizer import CharTokenizer, tokenizer_of
from nereus.rl.verifiers import by_source, get_verifier, score, score_by_source
from nereus.runtime import checkpoint as ckpt
from nereus.runtime.comm import all_gather
from nereus.runtime.engines import engines_of, job_models, space_of
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.rollout import Batch, Rollouts, probs_diff, responses
from nereus.runtime.worker import Worker
from nereus.spec import ClusterSpec, load_cluster, load_model, load_workload
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Algorithm, Role, WorkloadSpec


@dataclass(frozen=True, slots=True)
class JobSetup:
    """Everything every worker derives identically from the experiment."""

    spec: ExperimentSpec
    workload: WorkloadSpec
    models: dict[Role, ModelSpec]
    dataset: PromptDataset
    tokenizer: CharTokenizer | HfTokenizer
    cluster: ClusterSpec  # the spec's, with what the leader's node measured where they differ
    engines: dict[str, str] = dataclasses.field(default_factory=dict)  # model-stage → engine
    validation: PromptDataset | None = None  # data.val's held-out prompts, if any

    def engine_of(self, model_stage: str) -> str:
        return self.engines[model_stage]

    @property
    def space(self) -> SearchSpace:
        """The job's search space (an engine without pipelining keeps its model-stage at pp = 1)."""
        return space_of(self.engines)

    @classmethod
    def build(cls, spec: ExperimentSpec, out: Path) -> JobSetup:
        workload = load_workload(spec.workload)
        actor = load_model(spec.model)
        models = job_models(workload, actor)
        tok = tokenizer_of(spec.tokenizer, *spec.tokenizer_folders(workload))
        if tok.vocab_size > actor.vocab_size:
            raise ValueError(
                f"{actor.name}: vocabulary {actor.vocab_size} is smaller than the tokenizer's "
                f"{tok.vocab_size}"
            )
        layout = spec.data.record_layout(spec.verifier == "by_source") if spec.data is not None else None
        if spec.data is not None:
            paths = [Path(f) for f in spec.data.files]
        elif spec.dataset:
            paths = [Path(spec.dataset)]
        else:
            paths = [out / "tasks.jsonl"]
            t = spec.task
            write_jsonl(generate_tasks(t.kind, t.n, t.seed, t.difficulty, t.length), paths[0])
        dataset = PromptDataset.load(paths, tok, workload.max_prompt_len, spec.seed, layout)
        val = None
        if spec.data is not None and spec.data.val_files:
            val_paths = [Path(f) for f in spec.data.val_files]
            val = PromptDataset.load(val_paths, tok, workload.max_prompt_len, spec.seed, layout)
        engines = engines_of(spec, workload, models)
        return cls(spec, workload, models, dataset, tok, load_cluster(spec.cluster), engines, val)


def initial_plan(
    setup: JobSetup, pool: tuple[int, ...], max_new: int, calibration: CalibrationStore | None = None
) -> Plan:
    """The first plan, priced with ``calibration`` (the start-up sweep's) or the priors."""
    w = setup.workload
    seq = SeqStats.fixed(w.prompt_len, max_new)
    problem = PlanningProblem(w, setup.models, setup.cluster, pool, seq, space=setup.space)
    if calibration is not None:
        problem = dataclasses.replace(problem, efficiencies=calibration.efficiencies())
    return search(problem).plan


Part = tuple[int, list[Tensor]] | None  # a replica's first row and its tokens and valid mask
Parts = tuple[Part, Part]  # a batch's rollouts and ReMax's greedy ones: this rank's share
Prompts = tuple[Tensor, Tensor, list[int]]  # prompt ids, their valid mask, one sample id per row
BatchPrompts = tuple[Prompts, Prompts | None]  # the sampled rows' and (ReMax) the greedy rows'


def make_worker(
    gpu: int,
    setup: JobSetup,
    devices: Devices,
    workdir: Path | None = None,
    members: tuple[int, ...] | None = None,
) -> Worker:
    """This process's worker: the setup's models, AdamW per trainer role, engines per model-stage;
    ``members``: the world's GPU ids in rank order (default: the default world's ranks)."""
    spec = setup.spec
    rl = spec.rl
    optim = {
        Role.ACTOR: AdamWConfig(lr=rl.lr, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm),
        Role.CRITIC: AdamWConfig(
            lr=rl.critic_lr, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm
        ),
    }
    worker = Worker(
        gpu, setup.workload, setup.models, setup.cluster, optim, spec.seed, setup.engine_of, devices, workdir,
        spec.longest_response(), members,
    )  # fmt: skip
    worker.weights_of = lambda role: spec.role_weights(role, setup.workload)[0]
    worker.temperature = rl.temperature  # log-probs of the policy that sampled (verl's, too)
    return worker


def restart_plan(
    setup: JobSetup, problem: PlanningProblem, max_new: int,
    planner: Callable[[PlanningProblem], SearchResult] = search,
) -> Plan:  # fmt: skip
    """Where a restart from the checkpoint goes: the policy's own search space (a static policy
    keeps its layouts) if anything fits there, else anything that fits the pool. ``planner``: the
    search (the controller's, which reuses what its replans priced)."""
    seq = SeqStats.fixed(setup.workload.prompt_len, max_new)
    try:
        return planner(dataclasses.replace(problem, seq=seq)).plan
    except InfeasibleError:
        return initial_plan(setup, problem.pool, max_new)


def sampling(setup: JobSetup, max_new: int, greedy: bool = False) -> SamplingParams:
    """The experiment's sampling of a step's responses (``greedy``: ReMax's baseline)."""
    rl, tok = setup.spec.rl, setup.tokenizer
    if greedy:
        return SamplingParams(max_new, greedy=True, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    return SamplingParams(
        max_new, temperature=rl.temperature, top_p=rl.top_p, stop_token_ids=tok.stop_ids,
        pad_token_id=tok.pad_id, seed=setup.spec.seed,
    )  # fmt: skip


def step_samples(setup: JobSetup, step: int) -> list[Sample]:
    """The prompts step ``step`` trains on (the data set's order: a resume neither repeats nor skips)."""
    w = setup.workload
    return setup.dataset.samples(step * w.prompts_per_step, w.prompts_per_step)


def prompts_of(setup: JobSetup, step: int, per_prompt: int) -> Prompts:
    """Step ``step``'s prompts, each ``per_prompt`` times: ids, valid mask, sample ids."""
    ids, valid, sample_ids = collate(step_samples(setup, step), setup.tokenizer, per_prompt)
    return ids, valid, list(sample_ids)


def generate_batch(
    worker: Worker, plan: Plan, setup: JobSetup, step: int, max_new: int
) -> tuple[Rollouts, Rollouts | None]:
    """Step ``step``'s rollouts (and ReMax's greedy baseline rollouts), on every worker."""
    prompts = batch_prompts(setup, step)
    return collect_batch(worker, setup, prompts, generate_parts(worker, plan, setup, prompts, max_new))


def batch_prompts(setup: JobSetup, step: int) -> BatchPrompts:
    """Step ``step``'s prompts, tokenised once: each ``samples_per_prompt`` times, and (ReMax)
    once each for the greedy baseline."""
    w = setup.workload
    greedy = prompts_of(setup, step, 1) if w.algorithm is Algorithm.REMAX else None
    return prompts_of(setup, step, w.samples_per_prompt), greedy


def generate_parts(worker: Worker, plan: Plan, setup: JobSetup, prompts: BatchPrompts, max_new: int) -> Parts:
    """This rank's share of a batch's rollouts (and ReMax's greedy ones), not yet gathered."""
    sampled, greedy = prompts
    part = worker.generate_part(plan, *sampled, sampling(setup, max_new))
    if greedy is None:
        return part, None
    return part, worker.generate_part(plan, *greedy, sampling(setup, max_new, greedy=True))


def collect_batch(
    worker: Worker, setup: JobSetup, prompts: BatchPrompts, parts: Parts | None
) -> tuple[Rollouts, Rollouts | None]:
    """A batch's rollouts from the generation replicas' parts, on every worker (collective)."""
    pad = setup.tokenizer.pad_id
    (sampled, greedy), (part, greedy_part) = prompts, parts if parts is not None else (None, None)
    r = worker.collect(part, *sampled, pad)
    return r, (worker.collect(greedy_part, *greedy, pad) if greedy is not None else None)


def behaviour(
    worker: Worker, plan: Plan, step: int, version: int, r: Rollouts, base: Rollouts | None
) -> Batch:
    """The batch of ``r`` with the generating policy's log-probs, from actor.inf while it still
    holds version ``version`` (the weights that generated ``r``), and how far the engine's
    probabilities of the sampled tokens are from them (``probs_diff``)."""
    logprobs = worker.infer(plan, "actor.inf", r)
    return Batch(step, version, r, logprobs, base, probs_diff(r, logprobs))


def algorithm_step(
    worker: Worker, plan: Plan, setup: JobSetup, step: int, max_new: int,
    after_generate: Callable[[Rollouts], None] | None = None,
) -> tuple[Rollouts, Tensor, dict[str, float]]:  # fmt: skip
    """One synchronous RL step on every worker; returns rollouts, scores and the step's metrics.
    ``after_generate``: a hook on the step's rollouts (the leader's boundary work that needs only
    them, started early; a scripted kill in the middle of the step)."""
    r, base = generate_batch(worker, plan, setup, step, max_new)
    if after_generate is not None:
        after_generate(r)
    scores, metrics = learn(worker, plan, setup, behaviour(worker, plan, step, step, r, base))
    return r, scores, metrics


def learn(worker: Worker, plan: Plan, setup: JobSetup, batch: Batch) -> tuple[Tensor, dict[str, float]]:
    """Rewards, inference and training on ``batch`` (on the workers that hold its model-stages,
    exchanging over ``worker.exchange``); returns the scores and the step's metrics. The
    behaviour policy's log-probs are PPO's old log-probs and the KL penalty's policy side."""
    spec, w = setup.spec, setup.workload
    rl, g, r = spec.rl, w.samples_per_prompt, batch.rollouts
    samples = step_samples(setup, batch.step)
    scores, rm, verifier = sequence_rewards(
        worker, plan, setup, r, [s.record for s in samples for _ in range(g)]
    )
    mask = r.mask.float()
    metrics: dict[str, float] = {}
    if rm is not None:
        metrics["rm_score"] = float(rm.mean())
    old = batch.behaviour
    ref = worker.infer(plan, "ref.inf", r)
    kl = kl_penalty(old, ref, "k1") * mask
    fields: dict[str, Tensor] = {"old_logprobs": old, "mask": mask}
    algo = w.algorithm
    if algo is Algorithm.PPO:
        values = worker.infer(plan, "critic.inf", r)
        rewards = token_rewards(scores, r.mask, kl, rl.kl_coef)
        adv, returns = gae(rewards, values, r.mask, rl.gamma, rl.lam)
        fields["advantages"] = adv
        metrics["critic_loss"] = worker.train(
            plan, "critic.train", r, {"old_values": values, "returns": returns, "mask": mask},
            lambda n: ValueLoss(rl.vf_clip, n),
        )  # fmt: skip
        policy = lambda n: PolicyLoss(rl.clip_eps, n, dual_clip=rl.dual_clip)  # noqa: E731
    else:
        if algo is Algorithm.GRPO:
            fields["advantages"] = grpo_advantages(scores, g, r.mask)
        else:  # ReMax: the greedy rollout of each prompt is the baseline
            if batch.baseline is None:
                raise ValueError(f"step {batch.step}: a ReMax batch without its greedy baseline rollouts")
            baseline, _, _ = sequence_rewards(
                worker, plan, setup, batch.baseline, [s.record for s in samples]
            )
            baseline = baseline.repeat_interleave(g)  # scored exactly as the samples are
            fields["advantages"] = remax_advantages(scores, baseline, r.mask)
        fields["ref_logprobs"] = ref
        policy = lambda n: PolicyLoss(rl.clip_eps, n, rl.kl_coef, dual_clip=rl.dual_clip)  # noqa: E731
    metrics["actor_loss"] = worker.train(plan, "actor.train", r, fields, policy)
    metrics["reward"] = float(scores.mean())
    if spec.verifier != "none":  # the verifier's alone, as validation's
        metrics["accuracy"] = float((verifier >= 1.0).float().mean())
    metrics["truncated"] = truncated(r, setup.tokenizer.stop_ids)
    metrics["kl"] = float(kl.sum() / mask.sum().clamp(min=1))
    metrics.update(batch.probs_diff)
    return scores, metrics


def sequence_rewards(
    worker: Worker, plan: Plan, setup: JobSetup, r: Rollouts, records: list[TaskRecord]
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Each rollout's reward (row i answers ``records[i]``): the verifier's score of its decoded
    response (``by_source``: the verifier of the record's data source) and, in a workload with a
    reward model, ``reward_coef`` × the model's score of its last token; then the model's score
    (else None) and the verifier's. Every rollout a step scores (ReMax's greedy baseline too) is
    scored by this."""
    scores = verified(setup, r, records)
    if not any(ms.name == "reward.inf" for ms in worker.workflow.model_stages):
        return scores, None, scores
    # the reward model's head at the last token itself (as verl and sequence-classification models
    # read it): entry i + 1 of the scores aligned with the tokens, one padding column further
    values = worker.infer(plan, "reward.inf", r.widened())
    rm = values.gather(1, (last_tokens(r) + 1).unsqueeze(1)).squeeze(1)
    return scores + setup.spec.reward_coef * rm, rm, scores


def verified(setup: JobSetup, r: Rollouts, records: list[TaskRecord]) -> Tensor:
    """The verifier's score of each rollout's decoded response (row i answers ``records[i]``;
    ``by_source``: the verifier of the record's data source)."""
    verifier = get_verifier(setup.spec.verifier)
    texts, answers = [setup.tokenizer.decode(x) for x in responses(r)], [x.answer for x in records]
    if verifier is by_source:
        return score_by_source(texts, answers, [x.source for x in records])
    return score(verifier, texts, answers)


def truncated(r: Rollouts, stop_ids: Sequence[int]) -> float:
    """The share of responses cut at the length limit: those that end without a stop token
    (verl's ``response_length/clip_ratio``)."""
    last = r.ids.gather(1, last_tokens(r).unsqueeze(1)).squeeze(1)
    stopped = torch.isin(last, torch.tensor(list(stop_ids), dtype=last.dtype)) & (r.mask.sum(1) > 0)
    return float((~stopped).float().mean())


def last_tokens(r: Rollouts) -> Tensor:
    """Each row's last response token (its last prompt token when the response is empty)."""
    positions = torch.arange(r.ids.shape[1]).expand_as(r.mask)
    last = torch.where(r.mask.bool(), positions, torch.zeros_like(positions)).amax(1)
    return torch.where(r.mask.sum(1) == 0, torch.full_like(last, r.prompt_len - 1), last)


def first_state(worker: Worker, plan: Plan, resume_from: Path | None, spec: ExperimentSpec) -> ckpt.Loaded:
    """The checkpoint's state (then the weight copies from their trainers), or fresh weights and
    the Hugging Face checkpoints the experiment starts from; engines bound. Returns the step
    before the first one to run (−1 on a fresh start) and the checkpoint's batches dropped."""
    if resume_from is not None:
        loaded = ckpt.load(worker, plan, resume_from)
        worker.bind(plan)
        worker.weight_sync(plan)
        return loaded
    worker.init_state(plan)
    worker.bind(plan)
    read, error = [], None
    for name, engine in worker.engines.items():
        path, label = spec.role_weights(worker.workflow.get(name).role.value, worker.workload)
        if path:
            try:
                engine.read_hf(Path(path))
            except ConfigError as exc:  # what only reading the tensors finds (NaN): where it was named
                error = f"{label}: {exc}"
                break
            read.append(engine)
    # A rank reads its own shards only: one whose shards are bad is every rank's error, before
    # any collective (vLLM's reload) could leave the others waiting on it.
    first = next((e for e in all_gather(error, str | None) if e is not None), None)
    if first is not None:
        raise ConfigError(first)
    for engine in read:
        engine.reload()
    return ckpt.Loaded(-1, 0)
