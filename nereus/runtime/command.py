"""``nereus run EXP.yaml``: an RL job as local worker processes (torch is imported only here)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from nereus.errors import ConfigError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("run", help="run an RL experiment on local worker processes")
    p.add_argument("experiment", type=Path, help="configs/experiments/<name>.yaml")
    p.add_argument("--out", type=Path, default=None, help="results folder (default runs/<name>)")
    p.add_argument("--steps", type=int, default=None, help="override the experiment's step count")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in the results folder"
    )


def add_node_parser(sub: Any) -> None:
    p = sub.add_parser(
        "node", help="one worker process of a launched job (what nereus-launch runs on compute nodes)"
    )
    p.add_argument("job_dir", type=Path, help="the job folder nereus-launch wrote")
    p.add_argument("--join", action="store_true", help="join the running job (a grow)")


def node(args: argparse.Namespace, out: Console) -> int:
    from nereus.runtime.node import JobFolder, main

    folder = JobFolder(args.job_dir)  # a clear error (exit 2) before anything starts
    preflight(folder.spec(), folder.run, resume=False)
    from nereus.runtime.membership import JoinRefusedError

    try:
        status = main(str(args.job_dir), join=args.join)
    except JoinRefusedError as exc:
        raise ConfigError(str(exc)) from None
    out.print(f"{args.job_dir}: {status}")
    return 0


def preflight(spec: Any, folder: Path, resume: bool) -> None:
    """Everything a worker would reject, checked before any process starts or file is written:
    one ``ConfigError`` (exit 2) naming the cause."""
    from nereus.control.controller import policy_config
    from nereus.rl.data import PromptDataset
    from nereus.rl.tokenizer import CharTokenizer
    from nereus.rl.verifiers import get_verifier
    from nereus.spec import load_cluster, load_model, load_workload

    workload = load_workload(spec.workload)
    stages = [ms.name for ms in workload.workflow().model_stages]
    for name in spec.engines:
        if name not in stages:
            raise ConfigError(
                f"engines.{name}: not a model-stage of {workload.name} (allowed: {', '.join(stages)})"
            )
    model = load_model(spec.model)
    cluster = load_cluster(spec.cluster)
    if spec.workers > cluster.total_gpus:
        raise ConfigError(
            f"workers: {spec.workers} exceeds the {cluster.total_gpus} GPUs of cluster {cluster.name}"
        )
    tok = CharTokenizer()
    if tok.vocab_size > model.vocab_size:
        raise ConfigError(
            f"model: {model.name}'s vocabulary ({model.vocab_size}) is smaller than the tokenizer's"
        )
    if spec.dataset:
        PromptDataset.load(Path(spec.dataset), tok, workload.max_prompt_len)
    policy_config(spec.policy)
    get_verifier(spec.verifier)
    from nereus.backends import hf
    from nereus.spec.model import Head

    for role, head in (("actor", Head.LM), ("reward", Head.VALUE), ("critic", Head.VALUE)):
        path = spec.init.path(role)
        if path:
            if not (Path(path) / "config.json").is_file():
                raise ConfigError(
                    f"init.{role}: {path} is not a Hugging Face checkpoint folder (no config.json)"
                )
            hf.check_compatible(model.with_head(head), hf.read_config(Path(path)), Path(path))
    if resume:
        from nereus.runtime.checkpoint import latest, step_of

        path = latest(folder / "checkpoints")
        if path is None:
            raise ConfigError(f"--resume: no checkpoint under {folder / 'checkpoints'}")
        step_of(path)


def run(args: argparse.Namespace, out: Console) -> int:
    from nereus.runtime.experiment import ExperimentSpec

    spec = ExperimentSpec.load(args.experiment)
    if args.steps is not None:
        if args.steps <= 0:
            raise ConfigError(f"--steps: expected a positive integer, got {args.steps}")
        import dataclasses

        spec = dataclasses.replace(spec, steps=args.steps)
    folder = args.out or Path("runs") / spec.name
    preflight(spec, folder, args.resume)
    from nereus.runtime.local import launch_local

    out.print(
        f"[bold]{spec.name}[/]: {spec.workload} on {spec.model}, "
        f"{spec.workers} local workers, {spec.steps} steps"
    )
    launch_local(spec, folder, resume=args.resume)
    out.print(f"wrote {folder / 'metrics.jsonl'} and {folder / 'report.png'}")
    return 0
