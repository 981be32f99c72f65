"""The RL job: every worker's step loop, with the controller on rank 0.

Each step: generation, inference, rewards and advantages, training, weight sync (``Worker``);
then, at the step boundary, the scripted drift (workers leave or rejoin, the response limit
changes), the controller's decision on rank 0 from the step's telemetry, and every worker runs
the admitted transition and re-binds its engines. Rank 0 writes the metrics and the report.
Edge module (torch.distributed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus.backends.optim import AdamWConfig
from nereus.backends.sampling import SamplingParams
from nereus.control.admission import Verdict
from nereus.control.controller import Controller, policy_config
from nereus.control.telemetry import Telemetry
from nereus.errors import InfeasibleError
from nereus.plan.layout import Plan
from nereus.plan.problem import PlanningProblem, SeqStats
from nereus.plan.search import search
from nereus.rl.advantages import gae, grpo_advantages, remax_advantages, token_rewards
from nereus.rl.data import PromptDataset, collate
from nereus.rl.losses import PolicyLoss, ValueLoss, kl_penalty
from nereus.rl.tasks import generate_tasks, write_jsonl
from nereus.rl.tokenizer import CharTokenizer
from nereus.rl.verifiers import get_verifier, score
from nereus.runtime import checkpoint as ckpt
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.metrics import MetricsWriter, StepRecord, plan_summary
from nereus.runtime.rollout import Rollouts, responses
from nereus.runtime.worker import Worker
from nereus.spec import load_cluster, load_model, load_workload
from nereus.spec.model import Head, ModelSpec
from nereus.spec.workload import Algorithm, Role, WorkloadSpec
from nereus.transition.between import plan_transition


@dataclass(frozen=True, slots=True)
class JobSetup:
    """Everything every worker derives identically from the experiment."""

    spec: ExperimentSpec
    workload: WorkloadSpec
    models: dict[Role, ModelSpec]
    dataset: PromptDataset
    tokenizer: CharTokenizer

    @classmethod
    def build(cls, spec: ExperimentSpec, out: Path) -> JobSetup:
        workload = load_workload(spec.workload)
        actor = load_model(spec.model)
        models = {role: actor for role in Role}
        models[Role.CRITIC] = actor.with_head(Head.VALUE)
        models[Role.REWARD] = actor.with_head(Head.VALUE)
        tok = CharTokenizer()
        if tok.vocab_size > actor.vocab_size:
            raise ValueError(
                f"{actor.name}: vocabulary {actor.vocab_size} is smaller than the tokenizer's "
                f"{tok.vocab_size}"
            )
        if spec.dataset:
            path = Path(spec.dataset)
        else:
            path = out / "tasks.jsonl"
            t = spec.task
            write_jsonl(generate_tasks(t.kind, t.n, t.seed, t.difficulty, t.length), path)
        dataset = PromptDataset.load(path, tok, workload.max_prompt_len, spec.seed)
        return cls(spec, workload, models, dataset, tok)


def initial_plan(setup: JobSetup, pool: tuple[int, ...], max_new: int) -> Plan:
    spec, w = setup.spec, setup.workload
    seq = SeqStats.fixed(w.prompt_len, max_new)
    problem = PlanningProblem(w, setup.models, load_cluster(spec.cluster), pool, seq)
    return search(problem).plan


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _algorithm_step(
    worker: Worker, plan: Plan, setup: JobSetup, step: int, max_new: int
) -> tuple[Rollouts, Tensor, dict[str, float]]:
    """One RL step on every worker; returns rollouts, scores and the step's metrics."""
    spec, w, tok = setup.spec, setup.workload, setup.tokenizer
    rl = spec.rl
    g = w.samples_per_prompt
    samples = setup.dataset.samples(step * w.prompts_per_step, w.prompts_per_step)
    prompt_ids, prompt_valid, sample_ids = collate(samples, tok, g)
    params = SamplingParams(
        max_new, temperature=rl.temperature, top_p=rl.top_p, stop_token_ids=(tok.eos_id,),
        pad_token_id=tok.pad_id, seed=spec.seed,
    )  # fmt: skip
    r = worker.generate(plan, prompt_ids, prompt_valid, list(sample_ids), params)
    verifier = get_verifier(spec.verifier)
    answers = [s.record.answer for s in samples for _ in range(g)]
    texts = [tok.decode(x) for x in responses(r)]
    scores = score(verifier, texts, answers)
    mask = r.mask.float()
    old = worker.infer(plan, "actor.inf", r)
    ref = worker.infer(plan, "ref.inf", r)
    kl = kl_penalty(old, ref, "k1") * mask
    metrics: dict[str, float] = {}
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
        policy = lambda n: PolicyLoss(rl.clip_eps, n)  # noqa: E731
    else:
        if algo is Algorithm.GRPO:
            fields["advantages"] = grpo_advantages(scores, g, r.mask)
        else:  # ReMax: the greedy rollout of each prompt is the baseline
            greedy = SamplingParams(
                max_new, greedy=True, stop_token_ids=(tok.eos_id,), pad_token_id=tok.pad_id
            )
            gids, gvalid, gsid = collate(samples, tok, 1)
            base = worker.generate(plan, gids, gvalid, list(gsid), greedy)
            btexts = [tok.decode(x) for x in responses(base)]
            baseline = score(verifier, btexts, [s.record.answer for s in samples]).repeat_interleave(g)
            fields["advantages"] = remax_advantages(scores, baseline, r.mask)
        fields["ref_logprobs"] = ref
        policy = lambda n: PolicyLoss(rl.clip_eps, n, rl.kl_coef)  # noqa: E731
    metrics["actor_loss"] = worker.train(plan, "actor.train", r, fields, policy)
    metrics["reward"] = float(scores.mean())
    metrics["accuracy"] = float((scores >= 1.0).float().mean())
    metrics["kl"] = float(kl.sum() / mask.sum().clamp(min=1))
    return r, scores, metrics


def run_worker(
    rank: int, world: int, spec: ExperimentSpec, out: str, store: str, resume: bool = False
) -> None:
    """One worker process: the whole job, SPMD; rank 0 also decides and reports."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _loop(rank, spec, Path(out), resume)
    finally:
        dist.destroy_process_group()


def _loop(rank: int, spec: ExperimentSpec, out: Path, resume: bool) -> None:
    setup = JobSetup.build(spec, out) if rank == 0 else None
    setup = _broadcast(setup)
    assert setup is not None
    w, rl = setup.workload, spec.rl
    optim = {
        Role.ACTOR: AdamWConfig(lr=rl.lr, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm),
        Role.CRITIC: AdamWConfig(
            lr=rl.critic_lr, weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm
        ),
    }
    worker = Worker(rank, w, setup.models, spec.cluster, optim, spec.seed)
    folder = out / "checkpoints"
    start = 0
    resume_from = _broadcast(ckpt.latest(folder) if rank == 0 and resume else None)
    first = ckpt.step_of(resume_from) + 1 if resume_from is not None else 0  # the pool and limit then
    plan: Plan = _broadcast(
        initial_plan(setup, spec.pool_at(first), spec.max_new_tokens_at(first)) if rank == 0 else None
    )
    if resume_from is not None:
        start = ckpt.load(worker, plan, resume_from) + 1
        worker.bind(plan)
        worker.weight_sync(plan)
    else:
        worker.init_state(plan)
        worker.bind(plan)
    controller = metrics = None
    if rank == 0:
        controller = Controller(w, setup.models, load_cluster(spec.cluster), plan, policy_config(spec.policy))
        metrics = MetricsWriter(out, spec)
    started = time.perf_counter()
    step = start
    while step < spec.steps:
        t0 = time.perf_counter()
        worker.times.seconds.clear()
        r, _, m = _algorithm_step(worker, plan, setup, step, spec.max_new_tokens_at(step))
        sync_s = worker.weight_sync(plan)
        step_s = time.perf_counter() - t0
        t_ckpt = time.perf_counter()
        if (spec.checkpoint_every and (step + 1) % spec.checkpoint_every == 0) or step + 1 == spec.steps:
            ckpt.save(worker, plan, step, folder)
        t_monitor = time.perf_counter()
        # every rank's stage seconds and held bytes, in one gather
        reports: list[Any] = [None] * dist.get_world_size()
        mine = (dict(worker.times.seconds), {n: rs.nbytes for n, rs in worker.holder.units.items()})
        dist.all_gather_object(reports, mine)
        times: list[dict[str, float]] = [t for t, _ in reports]
        held: list[dict[str, int]] = [h for _, h in reports]
        # ---- the boundary: drift, the controller's decision on rank 0, the transition everywhere
        nxt = step + 1
        if rank in (spec.lost_at(nxt) if nxt < spec.steps else ()):
            worker.drop()  # this worker left the pool: its state is gone
        lengths = r.response_lengths().float()
        record, box = None, None
        if rank == 0:
            assert controller is not None
            stage_times = {n: max(t.get(n, 0.0) for t in times) for n in {k for t in times for k in t}}
            peaks = {n: float(max(h.get(n, 0) for h in held)) for n in {k for h in held for k in h}}
            mean = max(1.0, float(lengths.mean()))
            tel = Telemetry(
                step, time.perf_counter() - started, mean, max(mean, float(lengths.quantile(0.95))),
                spec.pool_at(nxt), stage_times, peaks,
            )  # fmt: skip
            record = StepRecord.of(step, m, step_s, float(lengths.mean()), plan, sync_s, stage_times)
            if nxt < spec.steps:
                box = _decide(controller, tel, plan, setup, spec.max_new_tokens_at(nxt))
            if controller.decisions and controller.decisions[-1].step == step:
                d = controller.decisions[-1].to_json()
                record = record.with_decision({k: d[k] for k in ("verdict", "triggers", "reason")})
        box = _broadcast(box)
        if record is not None:  # telemetry, the controller's decision and its broadcast
            record = record.with_overheads(time.perf_counter() - t_monitor, t_monitor - t_ckpt)
        moved: list[dict[str, Any]] = []
        if box is not None and box[0] == "admit":
            _, target, tr, reason = box
            seconds = _max(worker.transition(tr))
            worker.bind(target)
            kinds = sorted({n.primitive.value for n in tr.dag.nodes})
            moved.append({
                "kind": "+".join(kinds) or "regroup", "seconds": seconds, "reason": reason,
                "bytes": tr.moved_bytes, "before": plan_summary(plan), "after": plan_summary(target),
            })  # fmt: skip
            plan = target
            if controller is not None:
                controller.transition_done(seconds)
        elif box is not None and box[0] == "restart":
            _, target, _, reason = box
            began = time.perf_counter()
            path = ckpt.latest(folder)
            if path is None:
                raise RuntimeError(f"step {step}: {reason}, and there is no checkpoint to restart from")
            resumed = ckpt.load(worker, target, path)
            worker.bind(target)
            worker.weight_sync(target)
            seconds = _max(time.perf_counter() - began)
            moved.append({"kind": "restart", "seconds": seconds, "reason": reason, "from_step": resumed,
                          "before": plan_summary(plan), "after": plan_summary(target)})  # fmt: skip
            plan = target
            if controller is not None:
                controller.restarted(target)
            nxt = resumed + 1  # steps after the checkpoint run again, on the new plan
        if rank == 0:
            assert metrics is not None and record is not None
            metrics.write(record.with_transitions(moved), plan)
        step = nxt
    if "actor.train" in worker.engines:
        worker.engines["actor.train"].save_hf(out / "hf" / "actor")
    if rank == 0:
        assert metrics is not None
        metrics.close()


def _decide(controller: Controller, tel: Telemetry, plan: Plan, setup: JobSetup, max_new: int) -> Any:
    """Rank 0: the controller's verdict as what every worker needs to act on it."""
    decision = controller.observe(tel)
    if decision is None:
        return None
    if decision.verdict is Verdict.ADMIT and decision.target is not None:
        gone = frozenset(g for c in plan.candidates for g in c.gpus) - frozenset(tel.pool)
        problem = controller.problem(tel.pool, SeqStats.fixed(setup.workload.prompt_len, tel.seq_len_mean))
        return (
            "admit",
            decision.target,
            plan_transition(problem, plan, decision.target, gone),
            decision.reason,
        )
    if decision.verdict is Verdict.RESTART:
        # the policy's own search space (a static policy keeps its layouts) if anything fits there
        seq = SeqStats.fixed(setup.workload.prompt_len, max_new)
        try:
            target = search(controller.problem(tel.pool, seq)).plan
        except InfeasibleError:
            target = initial_plan(setup, tel.pool, max_new)
        return ("restart", target, None, decision.reason)
    return None


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
