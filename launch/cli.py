"""``nereus-launch``: submit Nereus jobs to SLURM through submitit (or run them locally), follow,
grow, shrink and cancel them. Runs on login nodes: it never imports torch.

Bad input is one line on stderr naming the field or cause, exit code 2, and nothing written:
``nereus-launch <command>: error: <message>`` (usage errors end with ``(see --help)``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from launch import monitor, resume, submit
from launch.inputs import shown
from launch.jobdir import find_job, read_record
from launch.render import DEFAULT_RESTARTS, LAUNCHERS, MAX_RESTARTS
from nereus.errors import NereusError
from nereus.spec.files import one_line

DEFAULT_ROOT = Path("jobs")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the caller prints them and exits 2.
    The subcommands' parsers are of this class too (``add_subparsers(parser_class=...)``)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {one_line(message)} (see --help)")


def _nodes(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", text.strip()):  # ASCII digits: int() takes "١", "1_0", "+1"
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {shown(text)}")
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _restarts(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,9}", text.strip()) or int(text) > MAX_RESTARTS:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {MAX_RESTARTS}, got {shown(text)}")
    return int(text)


def _parser() -> _Parser:
    p = _Parser(prog="nereus-launch", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def scheduling(q: argparse.ArgumentParser, what: str) -> None:
        q.add_argument("--local", action="store_true", help="run as local processes (submitit LocalExecutor)")
        q.add_argument(
            "--site",
            default=None,
            help="frontier, nvidia, local or a site YAML (default: $NEREUS_SITE, else local)",
        )
        q.add_argument("--partition", help="SLURM partition (default: the site's; '' for the cluster's)")
        q.add_argument("--account", help="SLURM account (default: the site's)")
        q.add_argument("--time", help="time limit: MM, HH:MM:SS or D-HH:MM:SS (default: the site's)")
        q.add_argument("--jobs-root", type=Path, default=DEFAULT_ROOT, help=f"where {what} folders go")
        q.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")

    s = sub.add_parser("submit", help="submit an RL experiment")
    s.add_argument("experiment", type=Path, help="configs/experiments/<name>.yaml")
    s.add_argument("--nodes", type=_nodes, help="nodes (default: enough for the experiment's workers)")
    s.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="srun",
        help="srun: one task per GPU (default); torchrun: one agent per node, which restarts its workers",
    )
    s.add_argument(
        "--max-restarts",
        type=_restarts,
        metavar="N",
        help=f"torchrun: restarts of a node's workers, 0-{MAX_RESTARTS} (default {DEFAULT_RESTARTS})",
    )
    scheduling(s, "job")

    a = sub.add_parser("array", help="submit a sweep of planner runs as one job array")
    a.add_argument("sweep", type=Path, help="configs/sweeps/<name>.yaml")
    scheduling(a, "job")

    def job(name: str, help: str) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help)
        q.add_argument("job", help="a job folder, or a SLURM job id under --jobs-root")
        q.add_argument("--jobs-root", type=Path, default=DEFAULT_ROOT, help="where to look up job ids")
        return q

    job("status", "scheduler state and progress").add_argument("--json", action="store_true")
    job("logs", "print the job's logs").add_argument("--follow", "-f", action="store_true")
    job("cancel", "cancel the job and its grow jobs")
    job("grow", "add nodes to the running job").add_argument("--nodes", type=_nodes, required=True)
    job("shrink", "drain nodes from the running job").add_argument("--nodes", type=_nodes, required=True)
    job("resume", "submit an ended job again: it resumes from its latest checkpoint").add_argument(
        "--time", help="time limit: MM, HH:MM:SS or D-HH:MM:SS (default: the job's)"
    )
    return p


def _options(args: argparse.Namespace) -> submit.Options:
    env = os.environ.get("NEREUS_SITE")  # the site when --site is not given (errors then name it)
    site, flag = (
        (args.site, "--site")
        if args.site is not None
        else (env or "local", "$NEREUS_SITE" if env else "--site")
    )
    return submit.Options(
        site=site, site_flag=flag, local=args.local, nodes=getattr(args, "nodes", None),
        partition=args.partition, account=args.account, time=args.time, jobs_root=args.jobs_root,
        launcher=getattr(args, "launcher", "srun"), max_restarts=getattr(args, "max_restarts", None),
    )  # fmt: skip


def _submit(args: argparse.Namespace, factory: submit.ExecutorFactory) -> int:
    opts = _options(args)
    if args.command == "submit":
        prep = submit.prepare_experiment(args.experiment, opts)
    else:
        prep = submit.prepare_array(args.sweep, opts)
    if args.dry_run:
        _warn(prep.warnings)
        sys.stdout.write(prep.script(opts.local))
        return 0
    folder, record = submit.commit(prep, factory)
    _warn(prep.warnings)  # once submitted: an error stays the one line
    ids = ", ".join(record.job_ids)
    where = "local processes" if opts.local else f"site {record.site}"
    shape = (f"{len(record.tasks)} tasks" if record.kind == "array"
             else f"{record.nodes} node(s) × {record.tasks_per_node} task(s)")  # fmt: skip
    if record.launcher == "torchrun":
        shape += f", torchrun, {record.max_restarts} restart(s)"
    print(f"submitted {record.name}: job {ids} ({shape}, {where}) → {folder}")
    return 0


def _warn(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        print(f"nereus-launch: warning: {warning}", file=sys.stderr)


def _is_number(value: Any) -> bool:
    """What the status line formats as a number (the files it comes from may be anything)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _print_status(doc: dict[str, Any], out: Console) -> None:
    """The status lines; every value from the job folder is escaped (a path or a site named
    ``a[/]b`` is text, not Rich markup)."""
    e = _text
    out.print(
        f"[bold]{e(doc['name'])}[/] ({e(doc['kind'])}, {e(doc['executor'])}, site {e(doc['site'])}) "
        f"[bold]{e(doc['state'])}[/] · {e(doc['nodes'])} node(s) × {e(doc['tasks_per_node'])} task(s) "
        f"{'(torchrun) ' if doc.get('launcher') == 'torchrun' else ''}· {e(doc['folder'])}"
    )
    grown = {g["job_id"] for g in doc["grows"]}
    if doc["kind"] != "array":
        for job_id, state in doc["jobs"].items():
            out.print(f"  {'grow' if job_id in grown else 'job'} {e(job_id)}: {e(state)}")
    for s in doc["shrinks"]:
        out.print(f"  shrink request: {e(s['nodes'])} node(s) ({e(s['file'])})")
    for s in doc.get("refused_shrinks", ()):
        out.print(f"  shrink refused by the job ({e(s['file'])}): {e(s['reason'])}")
    if doc["kind"] == "array":
        table = Table("task", "args", "state", "result", title_justify="left")
        for t in doc["tasks"]:
            args = " ".join(f"{k}={v}" for k, v in t["args"].items())
            if t["exit_code"] is None:
                result = "-"
            elif t["exit_code"] == 0:
                latency = t.get("step_latency_s")
                result = f"ok, step {latency:.3f} s" if _is_number(latency) else "ok"
            else:
                result = f"exit {t['exit_code']}: {t.get('error', '')}"
            table.add_row(e(t["index"]), e(args), e(t["state"]), e(result))
        out.print(table)
        return
    if doc.get("error"):
        out.print(f"  [red]error[/] (job {e(doc.get('error_job', ''))}): {e(doc['error'])}")
    p = doc.get("progress")
    if p is None:
        out.print("  progress: no step yet (run/metrics.jsonl)")
        return
    plan = ", ".join(f"{k} {v}" for k, v in p["plan"].items()) if isinstance(p.get("plan"), dict) else ""
    parts = [f"step {p.get('step')}"]
    if _is_number(p.get("reward")):
        parts.append(f"reward {p['reward']:.3f}")
    if "gpus" in p:
        parts.append(f"{p['gpus']} GPUs")
    out.print(f"  progress: {e(' · '.join(parts))}" + (f"\n  plan: {e(plan)}" if plan else ""))


def _text(value: Any) -> str:
    """``value`` as literal text in a Rich line."""
    return escape(str(value))


def _job_command(args: argparse.Namespace, factory: submit.ExecutorFactory, runner: monitor.Runner) -> int:
    folder = find_job(args.job, args.jobs_root)
    if args.command == "status":
        doc = monitor.status(folder, runner)
        if args.json:
            print(json.dumps(doc))
        else:
            _print_status(doc, Console(highlight=False, emoji=False, soft_wrap=True))
    elif args.command == "logs":
        record = read_record(folder)
        if args.follow:
            monitor.follow(  # the record read again each time: a grow meanwhile adds its logs
                lambda: monitor.log_files(folder, read_record(folder)),
                lambda: monitor.ended_state(folder, read_record(folder), runner),
                sys.stdout,
            )
        else:
            files = monitor.log_files(folder, record)
            if not files:
                print(f"no logs yet in {folder / 'logs'}")
            monitor.Follower(sys.stdout).poll(files)
    elif args.command == "cancel":
        ids = monitor.cancel(folder, runner)
        print(f"cancelled {', '.join(ids) or 'nothing (the job had already ended)'}")
    elif args.command == "resume":
        record = resume.resume(folder, args.time, factory, runner)
        print(
            f"resume: job {record.job_ids[0]} continues {record.name} from its latest checkpoint "
            f"({record.nodes} node(s) × {record.tasks_per_node} task(s)) → {folder}"
        )
    elif args.command == "grow":
        added, record = submit.grow(folder, args.nodes, factory, runner)
        print(f"grow: job {added.job_id} adds {added.nodes} node(s); {record.current_nodes} in all")
    else:
        path, record = submit.shrink(folder, args.nodes, runner)
        print(f"shrink: asked the job to drain {args.nodes} node(s) ({path}); {record.current_nodes} left")
    return 0


def main(
    argv: Sequence[str] | None = None,
    *,
    factory: submit.ExecutorFactory = submit.submitit_executor,
    runner: monitor.Runner = monitor.run_command,
) -> int:
    """The console script. ``factory`` and ``runner`` are seams: submitit executors and SLURM's
    client commands by default."""
    try:
        args, extra = _parser().parse_known_args(argv)
        if extra:  # the subcommand's error, not the top parser's
            raise _UsageError(
                f"nereus-launch {args.command}: error: unrecognized arguments: "
                f"{one_line(' '.join(extra))} (see --help)"
            )
    except _UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    prefix = f"nereus-launch {args.command}: error:"
    try:
        if args.command in ("submit", "array"):
            return _submit(args, factory)
        return _job_command(args, factory, runner)
    except NereusError as exc:
        print(f"{prefix} {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `nereus-launch logs JOB | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except UnicodeDecodeError as exc:  # a config file another one names (a cluster, a model)
        print(f"{prefix} a config file is not UTF-8 text ({exc.reason} at byte {exc.start})", file=sys.stderr)
        return 2
    except OSError as exc:  # a job folder this user cannot write (shrink, cancel, grow)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prefix} {one_line(where + (exc.strerror or str(exc)))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
