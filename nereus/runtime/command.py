"""``nereus run EXP.yaml``: an RL job as local worker processes.

Before anything is written or started, ``preflight`` checks everything a worker would reject —
the experiment and its names, that a plan exists for the workers, the output folder
(``nereus.runtime.outdir``), a ``--resume``'s checkpoint (signed by this run's key, written for
this model and workload), the dataset, the verifier and ``init:`` weights — and a bad one is one
``ConfigError`` line, exit 2. This process never imports torch: the checks that need the
runtime's torch-importing modules (the dataset, the verifier, Hugging Face weights) run in a
short child process, and the workers import the runtime themselves.

Exit codes: 0 done; 1 a worker failed; 2 bad input (nothing written), or a checkpoint a running
job refused; 130, 143, 144: stopped by SIGINT, SIGTERM, SIGUSR2 after a checkpoint
(``nereus.runtime.signals``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from nereus.errors import ConfigError, InfeasibleError, NereusError
from nereus.runtime import outdir, signing
from nereus.runtime.export import exported
from nereus.runtime.preflight_child import checks_in_a_child
from nereus.runtime.preflight_child import keyed as _keyed
from nereus.runtime.resume import check_checkpoint, check_task, missing_rows
from nereus.runtime.signals import exit_code
from nereus.runtime.signals import name as signal_name
from nereus.spec.files import int_flag, nonempty_path, shorten

FEASIBLE_LISTED_UP_TO = 64  # worker counts tried for the message of an infeasible one


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run an RL experiment on local worker processes")
    p.add_argument("experiment", type=Path, help="configs/experiments/<name>.yaml")
    p.add_argument("--out", type=nonempty_path, default=None, help="results folder (default runs/<name>)")
    p.add_argument("--steps", type=int_flag, default=None, help="override the experiment's step count")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in the results folder"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="write into a results folder that is not empty, replacing a previous run's files there",
    )


def add_node_parser(sub: Any) -> None:
    p = sub.add_parser(
        "node", help="one worker process of a launched job (what nereus-launch runs on compute nodes)"
    )
    p.add_argument("job_dir", type=Path, help="the job folder nereus-launch wrote")
    p.add_argument("--join", action="store_true", help="join the running job (a grow)")


def quiet_torch_warnings() -> None:
    """Workers start torch with its C++ log at ERROR (unless the user set ``TORCH_CPP_LOG_LEVEL``):
    a peer that leaves makes c10d print a warning with pages of C++ stack frames from every
    survivor's store client, for a loss the job handles and reports in one line."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def node(args: argparse.Namespace, out: Console) -> int:
    quiet_torch_warnings()  # before torch is imported here
    from nereus.runtime.node import JobFolder, main

    folder = JobFolder(args.job_dir)  # a clear error (exit 2) before anything starts
    from nereus.runtime import joberror
    from nereus.runtime.membership import JoinRefusedError

    try:
        preflight(folder.spec(), folder.run, resume=False, local=False)
        status = main(str(args.job_dir), join=args.join)
    except (NereusError, JoinRefusedError) as exc:  # one line, for nereus-launch status too
        joberror.record_failure(folder.path, exc, newcomer=args.join)
        if isinstance(exc, NereusError):
            raise
        raise ConfigError(str(exc)) from None
    out.print(escape(f"{args.job_dir}: {status}"))
    return 0


# ------------------------------------------------------------------ the preflight
def preflight(
    spec: Any, folder: Path, resume: bool, force: bool = False, local: bool = True, child: bool = True
) -> int:
    """Everything a worker would reject, checked before any process starts or file is written:
    one ``ConfigError`` (exit 2) naming the cause. Returns the first step to run (after a
    ``resume``'s checkpoint; 0 otherwise). ``local``: ``nereus run``'s checks of the
    output folder and of a plan for ``spec.workers`` (a launched job's world is SLURM's).
    ``child``: also the checks that import torch, in a child process (the login node's launcher
    runs the rest: names, folders, the verifier)."""
    from nereus.control.controller import policy_config
    from nereus.rl.hf_tokenizer import check_folder
    from nereus.rl.tokenizer import CharTokenizer
    from nereus.runtime.engines import engines_of, job_models
    from nereus.spec import load_cluster, load_model, load_workload
    from nereus.spec.model import check_context, check_runnable
    from nereus.spec.workload import Role

    workload = _keyed("workload", load_workload, spec.workload)
    stages = [ms.name for ms in workload.workflow().model_stages]
    for name in spec.engines:
        if name not in stages:
            raise ConfigError(
                f"engines.{name}: not a model-stage of {workload.name} (allowed: {', '.join(stages)})"
            )
    for event in spec.drift:
        if event.oom and event.oom_stage not in stages:
            raise ConfigError(
                f"drift (step {event.step}): oom_stage {event.oom_stage!r} is not a model-stage of "
                f"{workload.name} (allowed: {', '.join(stages)})"
            )
    model = _keyed("model", load_model, spec.model)
    check_runnable(model)
    # a generation engine holds the longest prompt and the longest response the run asks for
    # (max_new_tokens; vLLM refuses past the context): the workload's max_response_len is what
    # the planner prices, not a length this run generates
    longest = spec.longest_response()
    check_context(
        model, workload.max_prompt_len, longest, f"{workload.name}'s max_prompt_len + max_new_tokens"
    )
    models = job_models(workload, model)
    for role in sorted(workload.models):  # a model the workload names for a role runs too
        try:
            check_runnable(models[Role(role)])
            check_context(models[Role(role)], workload.max_prompt_len, longest, "the longest sequence")
        except ConfigError as exc:
            raise ConfigError(f"{workload.name}: key 'models.{role}': {exc}") from None
    engines = engines_of(spec, workload, models)
    cluster = _keyed("cluster", load_cluster, spec.cluster)
    if spec.workers > cluster.total_gpus:
        raise ConfigError(
            f"workers: {spec.workers} exceeds the {cluster.total_gpus} GPUs of cluster {cluster.name}"
        )
    if not spec.tokenizer and not spec.weights_of("actor") and CharTokenizer().vocab_size > model.vocab_size:
        raise ConfigError(
            f"model: {model.name}'s vocabulary ({model.vocab_size}) is smaller than the tokenizer's"
        )
    if spec.tokenizer:
        check_folder(spec.tokenizer)
    _keyed("policy", policy_config, spec.policy)
    check_weights(spec)
    check_tokenizer(spec, workload)
    check_data_files(spec)
    roles = {ms.role.value for ms in workload.workflow().model_stages}
    if spec.verifier == "none" and ("reward" not in roles or spec.reward_coef == 0):  # nothing rewards
        why = (
            f"workload {workload.name} has reward_model: false" if "reward" not in roles else "reward_coef: 0"
        )
        raise ConfigError(
            f"verifier: none leaves no reward: {why} (allowed: a verifier such as exact_answer, gsm8k, "
            "math, or a reward model with a non-zero reward_coef)"
        )
    if "reward" not in roles and spec.reward_coef != 1.0:  # a weight of nothing
        raise ConfigError(
            f"reward_coef: weighs the reward model's score; workload {workload.name} has reward_model: false "
            "(leave reward_coef out, or use a workload with reward_model: true)"
        )
    for role in ("critic", "reward"):  # weights for a model the workload does not run would do nothing
        if getattr(spec.init, role) and role not in roles:
            raise ConfigError(
                f"init.{role}: {workload.name} has no {role} model (its models: {', '.join(sorted(roles))})"
            )
    for role in ("actor", "ref", "reward", "critic"):
        path, label = spec.role_weights(role, workload)
        if path and not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{label}: {path} is not a Hugging Face checkpoint folder (no config.json)")
    if local:
        outdir.recover(folder)  # a replacement a killed run left: settled before anything reads it
        outdir.check(folder, resume, force)
    first = 0
    if resume:
        first = check_checkpoint(folder, signing.run_identity(models, workload, spec.seed)) + 1
        check_task(spec, folder)
    if local:
        check_plan(spec, spec.workers, spec.max_new_tokens_at(first))
    if not child:
        from nereus.rl.verifiers import get_verifier

        _keyed("verifier", get_verifier, spec.verifier)
    elif _child_has_work(spec, engines, workload.models):
        checks_in_a_child(spec)
    return first


def check_weights(spec: Any) -> None:
    """A ``model:`` folder the actor starts from holds safetensors weights: a folder without them
    (``pytorch_model.bin`` only, or a config alone) would silently start every role from random
    weights. A shipped model or a model YAML starts from random weights by design."""
    folder = spec.model_folder()
    if folder is None or spec.weights_of("actor"):  # a shipped model or YAML, or weights found
        return
    found = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    what = f"found {', '.join(found[:3])}" if found else "no weight files"
    raise ConfigError(
        f"model: {shorten(str(folder), 200)} holds no *.safetensors weights ({what}); every role would "
        "start from random weights (allowed: a folder with *.safetensors, as transformers' "
        "save_pretrained writes by default; init.actor naming one; or a shipped model or a model "
        "YAML for random weights)"
    )


def check_data_files(spec: Any) -> None:
    """Every prompt file the experiment names exists (its records are read in the preflight's
    child, or for a launched job on the compute nodes, which would find a missing one only there)."""
    named = [("dataset", spec.dataset)] if spec.dataset else []
    if spec.data is not None:
        named += [("data.train", f) for f in spec.data.files] + [("data.val", f) for f in spec.data.val_files]
    for key, path in named:
        if not Path(path).exists():
            raise ConfigError(f"{key}: {shorten(str(path), 200)}: dataset file does not exist")


def check_tokenizer(spec: Any, workload: Any = None) -> None:
    """A ``model:`` folder (a user's Hugging Face model) comes with its tokenizer: its own, the
    actor's ``init:`` folder's, or ``tokenizer:``'s. Without one the job would fall back to the
    bundled tasks' character tokenizer and train the user's weights on ids they never saw."""
    from nereus.rl.hf_tokenizer import FILES, has_tokenizer

    folder = spec.model_folder()
    if (
        folder is None
        or spec.tokenizer
        or any(f and has_tokenizer(f) for f in spec.tokenizer_folders(workload))
    ):
        return
    raise ConfigError(
        f"model: {shorten(str(folder), 200)} holds no Hugging Face tokenizer (expected "
        f"{' or '.join(FILES)}); name the folder that holds the model's with tokenizer: DIR"
    )


def _child_has_work(spec: Any, engines: dict[str, str], models: Mapping[str, str]) -> bool:
    """Whether ``torch_checks`` has anything to check that this process has not: a tokenizer
    folder, a data set, ``init:`` weights, or an engine install not known to import. Else (a
    bundled task, the character tokenizer, known installs) the child, which would import torch
    only to find nothing wrong, is not started; the verifier's name is checked here."""
    from nereus.rl.verifiers import get_verifier
    from nereus.runtime.engines import default_cache, imports_known

    if spec.tokenizer or spec.data is not None or spec.dataset:
        return True
    if any(spec.weights_of(role, models.get(role, "")) for role in ("actor", "ref", "reward", "critic")):
        return True
    _keyed("verifier", get_verifier, spec.verifier)
    return not imports_known(engines, default_cache())


def check_plan(spec: Any, workers: int, max_new: int) -> None:
    """A plan exists for ``workers`` (as the leader's first plan: ``nereus.runtime.job``'s
    ``initial_plan``, without torch); else a ``ConfigError`` naming the worker counts that fit."""
    from nereus.plan.problem import PlanningProblem, SeqStats
    from nereus.plan.search import search
    from nereus.runtime.engines import engines_of, job_models, space_of
    from nereus.spec import load_cluster, load_model, load_workload

    workload, actor = load_workload(spec.workload), load_model(spec.model)
    cluster = load_cluster(spec.cluster)
    models = job_models(workload, actor)
    seq = SeqStats.fixed(workload.prompt_len, max_new)
    space = space_of(engines_of(spec, workload, models))

    def why_not(n: int) -> str | None:
        try:
            search(PlanningProblem(workload, models, cluster, tuple(range(n)), seq, space=space))
        except (InfeasibleError, ValueError) as exc:
            return str(exc)
        return None

    reason = why_not(workers)
    if reason is None:
        return
    top = min(cluster.total_gpus, FEASIBLE_LISTED_UP_TO)
    fits = [n for n in range(1, top + 1) if n != workers and why_not(n) is None]
    allowed = f"allowed on {cluster.name}: {_ranges(fits)}" if fits else f"no count up to {top} fits"
    raise ConfigError(
        f"workers: no plan of {workload.name} for {actor.name} fits {workers} workers ({reason}); {allowed}"
    )


def _ranges(values: list[int]) -> str:
    """``[1, 2, 3, 5]`` → ``1-3, 5``."""
    parts: list[str] = []
    for v in values:
        if parts and v == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{v}"
        else:
            parts.append(str(v))
    return ", ".join(parts)


# ------------------------------------------------------------------ the run
def run(args: argparse.Namespace, out: Console) -> int:
    try:
        return _run(args, out)
    except KeyboardInterrupt:  # before the job's own handling of signals is in place
        print("nereus run: stopped by SIGINT before the job started", file=sys.stderr)
        return exit_code(signal.SIGINT)


def _run(args: argparse.Namespace, out: Console) -> int:
    from nereus.runtime.experiment import ExperimentSpec

    spec = ExperimentSpec.load(args.experiment)
    if args.steps is not None:
        if args.steps <= 0:
            raise ConfigError(f"--steps: expected a positive integer, got {args.steps}")
        import dataclasses

        try:
            spec = dataclasses.replace(spec, steps=args.steps)
        except ValueError as exc:
            raise ConfigError(f"--steps: {exc}") from None
    folder = args.out or Path("runs") / spec.name
    created = not folder.exists()  # the run makes it: a refused fresh run removes it again
    first = preflight(spec, folder, args.resume, args.force)
    if first > spec.steps or (first == spec.steps and exported(folder, first)):
        out.print(  # --resume of a run that trained and exported every step: no worker to start
            escape(
                f"{spec.name}: nothing to resume; {folder} holds a checkpoint after step {first - 1}, and "
                f"the experiment has {spec.steps} steps (a larger --steps trains further)"
            ),
            soft_wrap=True,
        )
        return 0
    if first == spec.steps:  # trained, but ended before its export: the workers write it, no step
        out.print(
            escape(
                f"{spec.name}: every step is trained; writing the Hugging Face export from the checkpoint"
            ),
            soft_wrap=True,
        )
    from nereus.runtime.local import launch_local

    gaps = missing_rows(folder / "metrics.jsonl", first) if args.resume else []
    if gaps:
        print(
            f"nereus run: warning: {folder / 'metrics.jsonl'} has no rows for steps {_ranges(gaps)} (cut or "
            f"removed); they are not written again: this run writes rows from step {first} on",
            file=sys.stderr,
        )
    from nereus.runtime.engines import describe_engines, job_engines

    out.print(
        f"[bold]{escape(str(spec.name))}[/]: {escape(str(spec.workload))} on {escape(str(spec.model))}, "
        f"{spec.workers} local workers, {spec.steps} steps; {describe_engines(job_engines(spec))}",
        soft_wrap=True,
    )
    quiet_torch_warnings()  # the workers' environment
    end = launch_local(spec, folder, resume=args.resume, force=args.force)
    if outdir.settle(folder):  # --force, and the new run ended before its first step
        print(f"nereus run: the previous run's files in {folder} are back as they were", file=sys.stderr)
    if end.signum is not None:
        print(f"nereus run: {_stopped(end.signum, end.forced, end.checkpoint)}", file=sys.stderr)
        return end.code
    if end.code == ConfigError.exit_code:  # the supervisor printed the worker's one line
        if not args.resume:  # bad input the workers found (NaN init weights): nothing half-written
            outdir.discard(folder, created)
        return end.code
    if end.code != 0:
        raise NereusError(f"the job's leader (GPU 0) failed with exit code {end.code}; see above")
    from nereus.runtime.report import read_metrics, summary

    for line in summary(read_metrics(folder / "metrics.jsonl")):
        out.print(escape(line), soft_wrap=True)
    out.print(escape(f"wrote {folder / 'metrics.jsonl'} and {folder / 'report.png'}"))
    return 0


def _stopped(signum: int, forced: bool, checkpoint: int | None) -> str:
    """The one line of a run a signal stopped."""
    by = "a second SIGINT" if forced else signal_name(signum)
    if checkpoint is None:
        return f"stopped by {by} before the first checkpoint; run again with --force to start over"
    if forced:
        return (
            f"stopped by {by} without waiting for a checkpoint; resume with --resume "
            f"(from the checkpoint after step {checkpoint})"
        )
    return f"stopped by {by} after step {checkpoint}, with a checkpoint; resume with --resume"
