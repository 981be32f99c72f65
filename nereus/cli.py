"""``nereus``: the command line (plan, price, transition, simulate, run, describe, list).

Bad input exits 2, no feasible plan exits 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape

from nereus import __version__
from nereus import describe as describe_command
from nereus.errors import ConfigError, InfeasibleError, NereusError
from nereus.plan import price_command
from nereus.plan.calibration import CalibrationStore
from nereus.plan.exhaustive import ExhaustiveTooLargeError, all_plans, exhaustive
from nereus.plan.fixes import held_space
from nereus.plan.layout import is_power_of_two
from nereus.plan.problem import DEFAULT_HEADROOM, PlanningProblem, SearchSpace, SeqStats
from nereus.plan.report import plan_json
from nereus.plan.solvers import Solver, solve
from nereus.plan.tables import print_explain, print_plan
from nereus.runtime import command as run_command
from nereus.sim import command as simulate_command
from nereus.spec import (
    Algorithm,
    ExecutionMode,
    load_cluster,
    load_model,
    load_workload,
    names,
)
from nereus.spec.files import ascii_float, ascii_int, brief, one_line, shorten
from nereus.spec.model import check_context
from nereus.spec.registry import lasting_name, load_role_models
from nereus.spec.workload import MAX_TOKENS, Recompute
from nereus.telemetry import read_node
from nereus.transition import command as transition_command
from nereus.transition.command import MAX_GPUS, MAX_TP

MAX_LISTED_PLANS = 100_000
MAX_LINE = 1000  # characters of an error line (values in it are cut to ~60 already)


# ------------------------------------------------------------------ parser
class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``nereus <cmd>: error: <message> (see nereus <cmd> --help)``
    on stderr, exit 2, instead of the usage block (and ``{"error": <message>}`` on stdout when the
    command line asks for ``--json``). Subparsers are of this class too."""

    json_out = False  # the command line holds --json (set by ``_parse``)

    def error(self, message: str) -> NoReturn:
        # argparse quotes user values with %r: cut long ones so the line stays short
        message = shorten(_LONG_QUOTED.sub(lambda m: brief(m.group(1) or m.group(2)), message), MAX_LINE)
        if Parser.json_out:
            print(json.dumps({"error": message}))
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_LONG_QUOTED = re.compile(r"'([^']{61,})'|\"([^\"]{61,})\"")


# ------------------------------------------------------------------ argument types
def _positive_int(text: str, most: int) -> int:
    try:
        value = ascii_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {brief(text)}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most}, got {brief(value)}")
    return value


def _count(most: int) -> Callable[[str], int]:
    """An argparse type: an integer in [1, most]."""

    def parse(text: str) -> int:
        return _positive_int(text, most)

    return parse


def _power_of_two(text: str) -> int:
    value = _positive_int(text, MAX_TP)
    if not is_power_of_two(value):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {brief(text)}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {value}")
    return value + 0.0  # -0.0 is 0 (printed "-0%" otherwise)


def _parser() -> Parser:
    p = Parser(prog="nereus", description=__doc__)
    p.add_argument("--version", action="version", version=f"nereus {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="best DP/TP/PP layout and GPUs for every model-stage")
    plan.add_argument("--model", required=True, help="shipped name, our YAML, or HF config.json/dir")
    plan.add_argument("--algo", required=True, help="ppo, grpo, remax, or a workload YAML")
    plan.add_argument("--cluster", required=True, help="shipped name or a cluster YAML")
    plan.add_argument("--gpus", required=True, type=_count(MAX_GPUS), help="GPUs in the pool")
    plan.add_argument("--seq-len", required=True, type=_count(MAX_TOKENS), help="mean response tokens")
    plan.add_argument("--seq-len-p95", type=_count(MAX_TOKENS), help="p95 response tokens (memory)")
    plan.add_argument("--prompt-len", type=_count(MAX_TOKENS), help="mean prompt tokens (workload's)")
    plan.add_argument("--mode", choices=[m.value for m in ExecutionMode], help="sync or async")
    plan.add_argument("--max-tp", type=_power_of_two, help="largest TP degree (default: node size)")
    plan.add_argument("--headroom", type=_fraction, default=DEFAULT_HEADROOM, help="memory kept free")
    plan.add_argument("--urgent", action="store_true", help="also try recomputation, smaller batches")
    plan.add_argument(
        "--pipelined-gen", action="store_true",
        help="let generation span pipeline stages (the torch-native engine; vLLM, the default, does not)",
    )  # fmt: skip
    plan.add_argument("--calibration", type=Path, help="calibration JSON (efficiencies per op class)")
    plan.add_argument("--solver", choices=[s.value for s in Solver], default=Solver.DP.value)
    plan.add_argument("--exhaustive", action="store_true", help="also count every valid plan")
    plan.add_argument("--all", action="store_true", help="with --exhaustive: list every valid plan")
    plan.add_argument("--json", action="store_true", help="one JSON object on stdout")
    plan.add_argument("--explain", action="store_true", help="latency and memory breakdown")
    plan.add_argument(
        "--anchor", type=Path, help="running plan (nereus plan --json): keep its unchanged replicas in place"
    )
    plan.add_argument(
        "--fix", action="append", default=[], metavar="MODEL_STAGE=tpT,ppP,dpD[,mbB]",
        help="hold a model-stage's layout (e.g. your verl setup's) and search the rest, on Nereus's "
        "engines (trainers ZeRO-0; `nereus price --fsdp` prices an FSDP trainer); repeatable",
    )  # fmt: skip

    desc = sub.add_parser("describe", help="derived facts of a model or a cluster; this node's GPUs")
    desc.add_argument("kind", choices=["model", "cluster", "node"])
    desc.add_argument("name", nargs="?", help="the model or cluster (describe node takes none)")
    desc.add_argument("--seq-len", type=_count(MAX_TOKENS), help="count attention FLOPs at this length")
    desc.add_argument("--json", action="store_true")

    price_command.add_parser(sub)
    transition_command.add_parser(sub)
    simulate_command.add_parser(sub)
    run_command.add_parser(sub)
    run_command.add_node_parser(sub)

    lst = sub.add_parser("list", help="shipped models, clusters, algorithms or traces")
    lst.add_argument("kind", choices=["models", "clusters", "algos", "algorithms", "traces"])
    return p


# ------------------------------------------------------------------ plan
def _flag(args: argparse.Namespace, name: str) -> str:
    """How an error names an input: ``--seq-len`` for a flag, or, for the problem of a plan read
    back from a file (``args.origin``), ``a.json: key 'problem.seq_len'``."""
    origin = getattr(args, "origin", None)
    return f"{origin}: key 'problem.{name}':" if origin else f"--{name.replace('_', '-')}"


def _problem(args: argparse.Namespace) -> PlanningProblem:
    model = load_model(args.model)
    cluster = load_cluster(args.cluster)
    workload = load_workload(args.algo, ExecutionMode(args.mode) if args.mode else None)
    if args.gpus > cluster.total_gpus:
        raise ConfigError(
            f"{_flag(args, 'gpus')} {args.gpus} exceeds cluster {cluster.name} ({cluster.total_gpus} GPUs)"
        )
    p95 = args.seq_len_p95 or args.seq_len
    if p95 < args.seq_len:
        raise ConfigError(f"{_flag(args, 'seq_len_p95')} {p95} must be at least --seq-len {args.seq_len}")
    models = load_role_models(workload, model)
    calibration = None
    if args.calibration:
        path = Path(args.calibration)
        try:
            calibration = CalibrationStore.load(path, cluster.name, strict=True)
        except ConfigError as exc:
            reason = str(exc).removeprefix("calibration file ")
            raise ConfigError(f"{_flag(args, 'calibration')} {reason}") from None
        for what in calibration.clipped():
            warning = f"{_flag(args, 'calibration')} {path}: {what}"
            print(f"nereus {getattr(args, 'command', 'plan')}: warning: {warning}", file=sys.stderr)
    space = SearchSpace.urgent() if args.urgent else SearchSpace()
    if args.max_tp:
        space = dataclasses.replace(space, max_tp=args.max_tp)
    # generation on vLLM, which does not pipeline (as `nereus run` plans it)
    flat = SearchSpace.engines(workload, getattr(args, "pipelined_gen", False)).flat
    space = dataclasses.replace(space, flat=flat)
    fixes = tuple(getattr(args, "fix", None) or ())
    space = held_space(space, fixes, workload, models, cluster, args.gpus) if fixes else space
    prompt = args.prompt_len or workload.prompt_len
    if prompt > workload.max_prompt_len:
        raise ConfigError(
            f"{_flag(args, 'prompt_len')} {prompt} exceeds {workload.name}'s max_prompt_len "
            f"{workload.max_prompt_len}"
        )
    longest = _flag(args, "seq_len_p95" if args.seq_len_p95 else "seq_len")
    if p95 > workload.max_response_len:
        raise ConfigError(
            f"{longest} {p95} exceeds {workload.name}'s max_response_len {workload.max_response_len}"
        )
    for m in {m.name: m for m in models.values()}.values():
        check_context(m, prompt, p95, f"{_flag(args, 'prompt_len')} + {longest}")
    kwargs: dict[str, Any] = {}
    if calibration is not None:
        kwargs["efficiencies"] = calibration.efficiencies()
    # reserved and revocable nodes, as the job's controller places with them
    kwargs["domains"] = cluster.failure_domains()
    try:
        return PlanningProblem(
            workload,
            models,
            cluster,
            tuple(range(args.gpus)),
            SeqStats(prompt, args.seq_len, p95),
            space=space,
            headroom=args.headroom,
            **kwargs,
        )
    except ValueError as exc:
        origin = getattr(args, "origin", None)
        raise ConfigError(f"{origin}: {exc}" if origin else str(exc)) from None


def _fits_in(problem: PlanningProblem, **space: Any) -> float | None:
    """The step latency of ``problem``'s plan once its search space has ``space``'s fields
    (None: still no plan)."""
    try:
        wider = dataclasses.replace(problem, space=dataclasses.replace(problem.space, **space))
        return solve(wider, Solver.DP).step_latency_s
    except InfeasibleError:
        return None


def _why_not(problem: PlanningProblem, urgent: bool) -> str:
    """What would give ``problem`` a plan: --urgent (recomputation, smaller micro-batches), then
    --pipelined-gen (generation across pipeline stages); "" when neither does."""
    hints = []
    if not urgent and (step := _fits_in(problem, recompute=tuple(Recompute), shrink_micro_batch=True)):
        hints.append(
            "with --urgent, which also tries activation recomputation and smaller micro-batches, it "
            f"has a plan ({step:.1f} s per step)"
        )
    if problem.space.flat and _fits_in(problem, flat=()) is not None:  # what the default engine costs
        hints.append(
            "generation at pp 1, as vLLM runs it; --pipelined-gen, the torch-native engine's "
            "pipelined generation, has a plan"
        )
    return f" ({'; '.join(hints)})" if hints else ""


def _plan(args: argparse.Namespace, out: Console) -> int:
    if args.all and not args.exhaustive:
        raise ConfigError("--all lists the plans of --exhaustive; add --exhaustive")
    problem = _problem(args)
    if args.anchor:
        expect = {
            "model": args.model,
            "algo": args.algo,
            "cluster": args.cluster,
            "mode": problem.workload.mode.value,
        }
        anchor = transition_command.load_plan(args.anchor, _problem, expect)
        problem = dataclasses.replace(problem, anchor=anchor)
    try:
        result = solve(problem, Solver(args.solver))
    except ExhaustiveTooLargeError as exc:
        raise ConfigError(f"--solver {args.solver}: {exc} (allowed: fewer --gpus, or --solver dp)") from None
    except InfeasibleError as exc:
        # with --json, main prints {"fits": false, "error"}
        raise InfeasibleError(str(exc) + _why_not(problem, args.urgent)) from None
    doc = plan_json(problem, result)
    doc["problem"] = {k: getattr(args, k) for k in transition_command.PROBLEM_KEYS}
    doc["problem"]["mode"] = problem.workload.mode.value
    for key in ("model", "algo", "cluster"):  # files named as paths: readable from any folder
        doc["problem"][key] = lasting_name(doc["problem"][key])
    if doc["problem"]["calibration"] is not None:
        doc["problem"]["calibration"] = str(Path(doc["problem"]["calibration"]).resolve())
    ex = None
    if args.exhaustive:
        try:
            ex = exhaustive(problem)
        except ExhaustiveTooLargeError as exc:
            if args.all:
                raise ConfigError(
                    f"--all: the plan space is too large to list ({exc}); lower --gpus"
                ) from None
            doc["exhaustive"] = {"error": f"not tractable: {exc}"}
    if ex is not None:
        doc["exhaustive"] = {
            "count": ex.count,
            "best_step_latency_s": ex.best_step_latency_s,
            "seconds": ex.seconds,
        }
        if args.all:
            if ex.count > MAX_LISTED_PLANS:
                raise ConfigError(
                    f"--all would list {ex.count} plans (limit {MAX_LISTED_PLANS}); lower --gpus"
                )
            doc["plans"] = [
                {
                    "step_latency_s": latency,
                    "stages": {name: str(shape) for name, shape in shapes.items()},
                }
                for shapes, latency in all_plans(problem)
            ]
    if args.json:
        out.print_json(data=doc) if out.is_terminal else print(json.dumps(doc))
        return 0
    print_plan(problem, result, out)
    if args.explain:
        print_explain(problem, result, out)
    if "error" in doc.get("exhaustive", {}):
        out.print(escape(f"exhaustive: {doc['exhaustive']['error']}"))
    if ex is not None and ex.best_step_latency_s is not None:
        gap = result.step_latency_s / ex.best_step_latency_s - 1.0
        out.print(
            f"exhaustive: {ex.count:,} valid plans, best {ex.best_step_latency_s:.3f} s "
            f"(gap {gap:.2%}) in {ex.seconds:.2f} s"
        )
    if args.all:
        for shapes, latency in sorted(all_plans(problem), key=lambda t: t[1]):
            out.print(f"{latency:10.3f} s  " + "  ".join(f"{n}={s}" for n, s in shapes.items()))
    return 0


# ------------------------------------------------------------------ list
def _list(args: argparse.Namespace, out: Console) -> int:
    items = [a.value for a in Algorithm] if args.kind in ("algos", "algorithms") else names(args.kind)
    for item in items:
        out.print(escape(item))
    return 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; arguments no subcommand knows are that subcommand's error (one line)."""
    parser = _parser()
    words = list(sys.argv[1:] if argv is None else argv)
    Parser.json_out = "--json" in words and bool(words) and words[0] in JSON_COMMANDS
    args, extra = parser.parse_known_args(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    owner = sub.choices.get(args.command, parser)
    if extra:
        owner.error(f"unrecognized arguments: {shorten(' '.join(extra))}")
    if args.command == "plan" and args.json and args.explain:
        owner.error("--explain prints a breakdown table; it does not combine with --json (choose one)")
    if args.command == "describe" and args.kind != "node" and args.name is None:
        owner.error("the following arguments are required: name")
    if args.command == "describe" and args.kind == "node" and args.name is not None:
        owner.error(f"describe node takes no name (it reads the node it runs on), got {brief(args.name)}")
    if args.command == "describe" and args.kind != "model" and args.seq_len is not None:
        owner.error(f"describe {args.kind} takes no --seq-len (it sets a model's attention FLOPs)")
    return args


JSON_COMMANDS = ("plan", "describe", "price", "simulate", "transition")  # those with --json
PIPED_WIDTH = 400  # columns of tables written to a pipe or file (rich's default there is 80)


class _Out(Console):
    """Rich's console, but a reader that leaves raises BrokenPipeError (``main`` exits 141, as
    with ``--json``) where rich would exit 1."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError


def _dispatch(args: argparse.Namespace, out: Console) -> int:
    """Run the subcommand ``args`` names (``list`` where none of the others)."""
    commands: dict[str, Callable[[], int]] = {
        "plan": lambda: _plan(args, out),
        "describe": lambda: describe_command.run(args, out, read_node),
        "price": lambda: price_command.run(args, out),
        "simulate": lambda: simulate_command.run(args, out),
        "transition": lambda: transition_command.run(args, out, _problem),
        "run": lambda: run_command.run(args, out),
        "node": lambda: run_command.node(args, out),
    }
    return commands.get(args.command, lambda: _list(args, out))()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    out = _Out(highlight=False, emoji=False)  # ":fire:" in a name is text too
    if not out.is_terminal and "COLUMNS" not in os.environ:  # piped or redirected: never cut a cell
        out = _Out(highlight=False, emoji=False, width=PIPED_WIDTH)
    try:
        code = _dispatch(args, out)
        sys.stdout.flush()  # a full disk shows here, not as a traceback at exit
        return code
    except NereusError as exc:
        line = shorten(one_line(str(exc)), MAX_LINE)
        if getattr(args, "json", False):  # a script reading stdout gets an object on every exit
            fits = {"fits": False} if isinstance(exc, InfeasibleError) and args.command == "plan" else {}
            print(json.dumps({**fits, "error": line}))
        print(f"nereus {args.command}: error: {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C in a long search or simulation (each file is written whole or not)
        if getattr(args, "json", False):
            print(json.dumps({"error": "stopped by SIGINT"}))
        print(f"nereus {args.command}: stopped by SIGINT", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (nereus plan --json | head): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # stdout on a full disk (> /dev/full): no file named; a file's is its own
        if exc.filename is not None or exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG):
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush there
        print(f"nereus {args.command}: error: cannot write its output ({exc.strerror})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
