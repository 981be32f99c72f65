"""A sweep: a grid of ``nereus`` CLI runs submitted as one job array (``configs/sweeps/*.yaml``).

```yaml
name: plan-scaling
command: plan                      # a torch-free nereus command with --json output
args: {model: llama-3.1-8b, algo: ppo, cluster: h200-ib, seq-len: 4096}
grid: {gpus: [8, 16, 32, 64]}      # the product of every key's values; one array task each
```
``args`` and ``grid`` keys are the command's long options without ``--``; ``true`` is a bare flag.
Every task's command line is checked with the ``nereus`` parser before anything is submitted.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

from launch.inputs import read_yaml
from launch.render import job_name_error
from nereus.errors import ConfigError
from nereus.spec.schema import build

COMMANDS = ("plan",)  # torch-free commands whose --json output a task keeps
MAX_TASKS = 1000  # SLURM's default MaxArraySize is 1001
_OPTION = re.compile(r"[a-z][a-z0-9-]*")

Value = str | int | float | bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Sweep:
    """The fixed arguments and the grid of one sweep; ``name`` is the file's stem by default."""

    name: str
    description: str = ""
    command: str
    args: dict[str, Value] = field(default_factory=dict)
    grid: dict[str, tuple[Value, ...]]

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {self.command!r}")
        if not self.grid:
            raise ValueError("grid must name at least one option")
        for key in (*self.args, *self.grid):
            if not _OPTION.fullmatch(key) or key == "json":
                raise ValueError(f"{key!r} is not an option a sweep may set (json is always on)")
        both = sorted(set(self.args) & set(self.grid))
        if both:
            raise ValueError(f"{both[0]!r} is both in args and in grid")
        for key, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{key} has no values")
        if self.size > MAX_TASKS:
            raise ValueError(f"grid has {self.size} points (at most {MAX_TASKS} tasks per array)")

    @property
    def size(self) -> int:
        n = 1
        for values in self.grid.values():
            n *= len(values)
        return n

    def points(self) -> list[dict[str, Value]]:
        """Every grid point, the last grid key varying fastest."""
        keys = list(self.grid)
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*self.grid.values())]

    def argv(self, point: dict[str, Value]) -> list[str]:
        """The ``nereus`` command line of one grid point."""
        argv = [self.command]
        for key, value in {**self.args, **point}.items():
            if value is True:
                argv.append(f"--{key}")
            elif value is not False:
                argv += [f"--{key}", str(value)]
        return [*argv, "--json"]


def load_sweep(path: Path) -> Sweep:
    data = read_yaml(path, "SWEEP")
    stem = "name" not in data
    data.setdefault("name", path.stem)
    sweep = build(Sweep, data, str(path))
    if why := job_name_error(sweep.name):
        raise ConfigError(f"{path}: key 'name'{' (the file name)' if stem else ''}: {why}")
    return sweep


def check_argv(sweep: Sweep, path: Path) -> None:
    """Parse every task's command line with the ``nereus`` parser: one line naming the first bad one."""
    from nereus.cli import _parser, _problem  # the planner CLI's own parser and checks: no torch

    parser = _parser()
    for index, point in enumerate(sweep.points()):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                args = parser.parse_args(sweep.argv(point))
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            why = lines[-1] if lines else "rejected by the nereus parser"
            raise ConfigError(f"{path}: task {index} {point}: {why}") from None
        if args.command == "plan":  # the names and sizes it would refuse on a compute node
            try:
                _problem(args)
            except ConfigError as exc:
                raise ConfigError(f"{path}: task {index} {point}: {exc}") from None
