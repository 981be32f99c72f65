"""Error types shared by the library and the CLI; each carries the exit code the CLI uses."""

from __future__ import annotations


class NereusError(Exception):
    """Base class for errors that the CLI turns into a one-line message."""

    exit_code = 1


class ConfigError(NereusError):
    """Bad input: a config file, a CLI flag, a name that does not exist (exit 2)."""

    exit_code = 2


class InfeasibleError(NereusError):
    """No plan satisfies memory and the GPU pool (exit 3). The message names the binding constraint."""

    exit_code = 3


class TooFewGpusError(NereusError):
    """The GPUs a loss left cannot run the job: no plan fits them (the leader's; exit 1). Its
    latest checkpoint stays; under SLURM the job is requeued to resume from it."""
