"""``nereus simulate``: replay a trace under several policies and compare them (edge: files, PNG)."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nereus.control.policy import MAX_PERIOD, POLICIES, policy_config
from nereus.errors import ConfigError
from nereus.sim.engine import STATIC_BEST, Scenario, Summary, simulate
from nereus.sim.records import IN_FLIGHT
from nereus.sim.seqcurve import SeqCurve
from nereus.sim.trace import GpuSupply, SpotTrace
from nereus.sim.truth import Episode
from nereus.spec import Role, load_cluster, load_model, load_workload
from nereus.spec.files import OutputFolder, ascii_float, ascii_int, brief, nonempty_path
from nereus.spec.model import check_context
from nereus.spec.registry import load_role_models, trace_path
from nereus.spec.workload import MAX_STALENESS, ExecutionMode, Precision

DEFAULT_POLICIES = "nereus,static,always,periodic:3"
COMMAND = "simulate"
MAX_STEPS = 100_000
MAX_GPUS = 1 << 20
MAX_SPEEDUP = 1e6
MIN_SPEEDUP = 1e-3  # a trace played 1,000× slower than it was recorded
MAX_NOISE = 1.0
MAX_RUNS = 16


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (the message names the range)."""

    def parse(text: str) -> int:
        try:
            value = ascii_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{lo}, {hi}], got {brief(text)}"
            ) from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {brief(value)}")
        return value

    return parse


def float_in(lo: float, hi: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [lo, hi] (or (lo, hi] with ``low_open``)."""
    span = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        try:
            value = ascii_float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {brief(text)}") from None
        if not math.isfinite(value) or not lo <= value <= hi or (low_open and value == lo):
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {brief(text)}")
        return value

    return parse


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="replay a GPU-availability trace under several policies")
    p.add_argument(
        "--trace", required=True, help="shipped trace name or a JSON file (metadata.gap_seconds, data)"
    )
    p.add_argument(
        "--seq-curve",
        default=None,
        help="CSV step,mean_len,p95_len; 'growth' (500→8000 tokens over 1000 steps, the default: "
        "cut at the workload's max_response_len) or growth:A:B:N",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--algo", required=True)
    p.add_argument(
        "--mode",
        choices=[m.value for m in ExecutionMode],
        help="sync or async (generation on GPUs of its own, a batch ahead); default: the workload's",
    )
    p.add_argument(
        "--max-staleness",
        type=int_in(0, MAX_STALENESS),
        default=None,
        help="async: batches generation may run ahead of training (0: none, as sync); "
        "default: the workload's",
    )
    p.add_argument(
        "--in-flight",
        choices=IN_FLIGHT,
        default=None,
        help="async: at a transition or restart keep (drain) or drop the rollouts generated ahead; "
        "default: the workload's",
    )
    p.add_argument("--cluster", required=True)
    p.add_argument(
        "--pipelined-gen", action="store_true",
        help="let generation span pipeline stages (the torch-native engine; vLLM, the default, does not)",
    )  # fmt: skip
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma list: nereus, static, always, periodic:K; references: static-best, oracle",
    )
    p.add_argument("--gamma", help="γ for nereus (default 0.5); a comma list sweeps it")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=200)
    p.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    p.add_argument("--gpus-per-instance", type=int_in(1, 1024), default=1)
    p.add_argument(
        "--max-gpus", type=int_in(1, MAX_GPUS), help="cap on the pool (default: the cluster's GPUs)"
    )
    p.add_argument(
        "--min-gpus", type=int_in(0, MAX_GPUS), default=0, help="floor of the pool (a reserved allocation)"
    )
    p.add_argument("--offset", type=int_in(0, 2**31), default=0, help="trace tick the run starts at")
    p.add_argument(
        "--speedup",
        type=float_in(MIN_SPEEDUP, MAX_SPEEDUP),
        default=1.0,
        help="trace seconds per simulated second",
    )
    p.add_argument("--episode", action="append", default=[], help="START-END:SCOPE:FACTOR, repeatable")
    p.add_argument(
        "--noise", type=float_in(0.0, MAX_NOISE), default=0.03, help="per-step timing noise (lognormal σ)"
    )
    p.add_argument(
        "--out",
        type=nonempty_path,
        help="output folder (default runs/sim/<trace>-<model>-<algo>): new, empty, or one simulate wrote",
    )
    p.add_argument("--force", action="store_true", help="write into an --out folder holding other files")
    p.add_argument("--json", action="store_true", help="print the summary JSON")


def _curve(text: str) -> SeqCurve:
    if text == "growth":
        return SeqCurve.growth()
    if text.startswith("growth:"):
        try:
            a, b, n = text.split(":")[1:]
            start, end, steps = ascii_float(a), ascii_float(b), ascii_int(n)
        except ValueError:
            raise ConfigError(f"--seq-curve {brief(text)}: expected growth:START:END:STEPS") from None
        try:
            return SeqCurve.growth(start, end, steps)
        except ValueError as exc:
            raise ConfigError(f"--seq-curve {brief(text)}: {exc}") from None
    if not text.lower().endswith(".csv") and not Path(text).is_file():
        raise ConfigError(
            f"--seq-curve {brief(text)}: expected growth, growth:START:END:STEPS or a CSV file "
            "(step,mean_len,p95_len)"
        )
    return SeqCurve.load_csv(Path(text))


def _gammas(text: str) -> list[float]:
    try:
        values = [ascii_float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--gamma {brief(text)}: expected numbers in [0, 1], comma-separated") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise ConfigError(f"--gamma {brief(text)}: expected numbers in [0, 1], comma-separated")
    if len(values) > MAX_RUNS:
        raise ConfigError(f"--gamma: at most {MAX_RUNS} values, got {len(values)}")
    return [v + 0.0 for v in values]  # -0 is 0


def _gamma_label(g: float) -> str:
    """γ as a run's label shows it: ``:g`` where that reads back as ``g``, else every digit (two
    values ``:g`` would show alike are two runs)."""
    short = f"{g:g}"
    return short if float(short) == g else repr(g)


def scenario_from(args: argparse.Namespace) -> Scenario:
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    workload = load_workload(args.algo, ExecutionMode(args.mode) if args.mode is not None else None)
    if workload.precision is not Precision.BF16_MIXED:
        raise ConfigError(
            f"--algo {brief(args.algo)}: precision {workload.precision.value}; the simulator's hardware "
            "truth models bf16-mixed training only (allowed: bf16-mixed)"
        )
    if workload.mode is not ExecutionMode.ASYNC:
        for flag, value in (("--max-staleness", args.max_staleness), ("--in-flight", args.in_flight)):
            if value is not None:
                raise ConfigError(
                    f"{flag} sets asynchronous RL; {workload.name} runs sync here (add --mode async)"
                )
    trace = SpotTrace.load(trace_path(args.trace))
    for flag, value in (("--steps", args.steps), ("--gpus-per-instance", args.gpus_per_instance)):
        if value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if args.max_gpus is None and cluster.total_gpus > MAX_GPUS:  # a cluster file may name more
        raise ConfigError(
            f"{cluster.name} has {cluster.total_gpus} GPUs, more than a simulation holds: "
            f"cap the pool with --max-gpus (at most {MAX_GPUS})"
        )
    max_gpus = cluster.total_gpus if args.max_gpus is None else args.max_gpus
    if not 0 < max_gpus <= cluster.total_gpus:
        raise ConfigError(
            f"--max-gpus must be in [1, {cluster.total_gpus}] for {cluster.name}, got {max_gpus}"
        )
    if not 0 <= args.min_gpus <= max_gpus:
        raise ConfigError(f"--min-gpus must be in [0, --max-gpus {max_gpus}], got {args.min_gpus}")
    if args.gpus_per_instance > max_gpus:
        raise ConfigError(
            f"--gpus-per-instance must be in [1, --max-gpus {max_gpus}], got {args.gpus_per_instance}"
        )
    g = args.gpus_per_instance
    # whole instances: a GPU over --max-gpus would never be used; --min-gpus's are reserved whole
    named = (
        f"--max-gpus {max_gpus} is" if args.max_gpus is not None else f"{cluster.name}'s {max_gpus} GPUs are"
    )
    _whole_instances(named, "--max-gpus", max_gpus, g, cluster.total_gpus)
    _whole_instances(f"--min-gpus {args.min_gpus} is", "--min-gpus", args.min_gpus, g, max_gpus)
    if not 0 <= args.offset < len(trace.counts):
        raise ConfigError(f"--offset must be in [0, {len(trace.counts)}) ticks, got {args.offset}")
    if not (MIN_SPEEDUP <= args.speedup <= MAX_SPEEDUP and 0 <= args.noise <= MAX_NOISE):
        raise ConfigError(
            f"--speedup must be in [{MIN_SPEEDUP:g}, {MAX_SPEEDUP:g}] and --noise in [0, {MAX_NOISE:g}]"
        )
    curve = _curve("growth" if args.seq_curve is None else args.seq_curve)
    points = {0, args.steps - 1} | {k for k in curve.steps if k < args.steps}
    models = load_role_models(workload, model)  # the workload's ``models:``, as ``nereus plan`` reads them
    asked = max(curve.at(k)[1] for k in points)
    cap = workload.max_response_len
    if asked > cap and args.seq_curve is not None:  # the run cuts responses there, as the engine's
        # max_tokens would (Scenario.lengths); the default curve is cut without a word
        print(
            f"nereus simulate: warning: --seq-curve reaches a p95 of {asked:.0f} tokens, above "
            f"{workload.name}'s max_response_len {cap}: responses are cut at {cap}",
            file=sys.stderr,
        )
    for m in {m.name: m for m in models.values()}.values():
        check_context(m, workload.prompt_len, min(asked, cap), "--seq-curve (its p95)")
    try:
        supply = GpuSupply(
            trace, args.gpus_per_instance, max_gpus, args.min_gpus, args.offset, args.speedup, args.seed
        )
        episodes = tuple(Episode.parse(e) for e in args.episode)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Scenario(
        workload,
        models,
        cluster,
        supply,
        curve,
        args.steps,
        args.seed,
        args.noise,
        episodes,
        max_staleness=workload.max_staleness if args.max_staleness is None else args.max_staleness,
        in_flight=workload.in_flight.value if args.in_flight is None else args.in_flight,
        pipelined_gen=args.pipelined_gen,
    )


def _whole_instances(named: str, flag: str, gpus: int, g: int, most: int) -> None:
    """``gpus`` (``named``, passed as ``flag``) is whole instances of ``g`` GPUs, or a one-line
    ``ConfigError`` naming the nearest that are (the larger only where it is at most ``most``)."""
    if gpus % g:
        down, up = gpus // g * g, -(-gpus // g) * g
        raise ConfigError(
            f"{named} not a whole number of instances of {g} GPUs (--gpus-per-instance): pass "
            f"{flag} {down}" + (f" or {up}" if up <= most else "")
        )


def runs(policies: str, gammas: list[float]) -> list[tuple[str, str, float]]:
    """(label, policy, γ) for every run; nereus once per γ."""
    out: list[tuple[str, str, float]] = []
    if len(set(gammas)) != len(gammas):
        raise ConfigError(f"--gamma names a value twice: {','.join(_gamma_label(g) for g in gammas)}")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if len(names) > MAX_RUNS:
        raise ConfigError(f"--policies: at most {MAX_RUNS} policies, got {len(names)}")
    for name in names:
        period = re.fullmatch(r"periodic:([0-9]{1,8})", name)
        if name.startswith("periodic:") and (period is None or not 0 < int(period.group(1)) <= MAX_PERIOD):
            raise ConfigError(
                f"--policies: {brief(name)}: periodic:K needs a whole number K in [1, {MAX_PERIOD:,}]"
            )
        if name != STATIC_BEST:
            try:
                policy_config(name)  # refuses unknown names before anything runs
            except ConfigError:  # the simulator also runs the reference static-best
                choices = ", ".join((*POLICIES, STATIC_BEST))
                raise ConfigError(f"--policies: unknown policy {brief(name)} (choices: {choices})") from None
        if name == "nereus" and len(gammas) > 1:
            out.extend((f"nereus(γ={_gamma_label(g)})", name, g) for g in gammas)
        else:
            out.append((name, name, gammas[0]))
    if not out:
        raise ConfigError("--policies is empty")
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--policies names a run twice: {brief(policies)}")
    return out


def _past_the_trace(supply: GpuSupply, summaries: list[Summary]) -> str:
    """A note where a run went on past the trace's last tick (the pool then holds its last value,
    a calm the revocation rate estimated from the trace does not know); empty otherwise."""
    trace = supply.trace
    end_s = (len(trace.counts) - supply.offset_ticks) * trace.gap_seconds / supply.speedup
    past = [(s.policy, s.total_s) for s in summaries if s.total_s > end_s]
    if not past:
        return ""
    runs = ", ".join(f"{name} {1.0 - end_s / total:.0%}" for name, total in past)
    return (
        f"nereus simulate: warning: the trace ends {end_s:.0f} simulated s into the run "
        f"(tick {len(trace.counts)}); past it the pool held its last value for this share of a run: "
        f"{runs}. The policies price revocations at the rate the trace shows, which knows nothing of "
        "that calm: give a longer trace, a later --offset or fewer --steps"
    )


def _file_name(label: str) -> str:
    safe = label.replace(":", "-").replace("(", "-").replace(")", "").replace("γ=", "g")
    return f"steps-{safe}.jsonl"


def _writers(summaries: list[Summary], doc: dict[str, Any], title: str) -> dict[str, Callable[[Path], None]]:
    """What ``simulate`` writes: a JSONL of steps per policy, summary.json and timeline.png."""
    from nereus.sim.plot import timeline

    def steps(s: Summary) -> Callable[[Path], None]:
        def write(path: Path) -> None:
            with path.open("w") as fh:
                for r in s.records:
                    fh.write(json.dumps(r.to_json()) + "\n")

        return write

    def summary(path: Path) -> None:
        path.write_text(json.dumps(doc, indent=1) + "\n")

    files = {_file_name(s.policy): steps(s) for s in summaries}
    files["summary.json"] = summary
    files["timeline.png"] = lambda path: timeline(summaries, path, title)
    return files


def run(args: argparse.Namespace, out: Console) -> int:
    scenario = scenario_from(args)
    plan = runs(args.policies, _gammas("0.5" if args.gamma is None else args.gamma))
    if args.gamma is not None and all(policy != "nereus" for _, policy, _ in plan):
        policies = brief(args.policies)
        raise ConfigError(f"--gamma sets nereus's payback bar; --policies {policies} has no nereus")
    stem = scenario.supply.trace.name
    actor = scenario.models[Role.ACTOR].name
    # names come from files a user wrote (``name: meta-llama/Llama-3.1-8B``): one folder under runs/sim
    default = re.sub(r"\.{2,}|[^A-Za-z0-9._-]+", "_", f"{stem}-{actor}-{scenario.workload.name}").lstrip(".-")
    folder = args.out or Path("runs") / "sim" / (default or "sim")
    names = [_file_name(label) for label, _, _ in plan] + ["summary.json", "timeline.png"]
    target = OutputFolder.check(folder, COMMAND, names, force=args.force)  # before anything runs
    summaries = []
    for label, policy, gamma in plan:
        summaries.append(replace(simulate(scenario, policy, gamma), policy=label))
    doc = {s.policy: s.to_json() for s in summaries}
    supply, g = scenario.supply, scenario.supply.gpus_per_instance
    title = (  # the pool's bounds in whole instances, as the run holds them
        f"{scenario.workload.algorithm.value} {actor} on {scenario.cluster.name}, trace {stem} "
        f"(×{g} GPUs, {supply.reserved_instances * g}–{supply.max_gpus // g * g})"
    )
    target.write(_writers(summaries, doc, title))
    outlasted = _past_the_trace(supply, summaries)
    if outlasted:
        print(outlasted, file=sys.stderr)
    if args.json:
        print(json.dumps(doc))
        return 0
    table = Table(title=escape(title), title_justify="left")
    pipelined = scenario.workload.mode is ExecutionMode.ASYNC
    cols = ["policy", "mean step s", "total s", "transitions", "TP/PP", "restarts", "OOM", "preempted"]
    for col in cols + (["overlap s", "gen wait s", "train wait s", "dropped"] if pipelined else []):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for s in summaries:
        steps = s.pipelined or ()
        extra = [
            f"{sum(a.overlap_s for a in steps) / max(1, len(steps)):.1f}",
            f"{sum(a.gen_wait_s for a in steps) / max(1, len(steps)):.1f}",
            f"{sum(a.train_wait_s for a in steps) / max(1, len(steps)):.1f}",
            str(s.dropped_rollouts),
        ]
        table.add_row(
            escape(s.policy),
            f"{s.mean_step_s:.1f}",
            f"{s.total_s:.0f}",
            str(s.transitions),
            str(s.tp_pp_transitions),
            str(s.restarts),
            str(s.oom_steps),
            str(s.preempted_steps),
            *(extra if pipelined else []),
        )
    out.print(table)
    out.print(escape(f"wrote {folder}/summary.json, steps-*.jsonl, timeline.png"))
    return 0
