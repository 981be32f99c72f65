"""A SLURM site: what a cluster's sbatch scripts need that the job itself does not decide.

A site file (``slurm/templates/<name>.yaml``) has a fixed set of keys: the node shape (GPUs per
node, CPUs per task), scheduling defaults (partition, account, time limit, the partitions that
exist), the ``srun --mpi`` plugin under which mpi4py finds its ranks, extra ``#SBATCH`` flags,
shell setup lines (``module load ...``) and the environment exported before ``srun``
(NCCL/RCCL, libfabric). Unknown keys and bad values are one-line ``ConfigError``s naming the key.
Every value that reaches the sbatch script is free of control characters (a newline would start a
shell line of its own); ``setup`` lines are shell, run as written, while ``env`` values are data:
exported through ``shlex.quote``, so ``$VAR``, ``$(...)`` and backticks stay literal.
Time limits are SLURM's formats (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
``D-HH:MM:SS``), kept as whole minutes: submitit passes them in minutes and times requeues by them.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from launch.inputs import check_text, control_error, has_control, read_yaml, shown
from nereus.errors import ConfigError
from nereus.spec.cluster import Vendor
from nereus.spec.schema import build, coerce_enums

MPI_PLUGINS = ("pmi2", "pmix", "cray_shasta", "none")
# Flags the launcher sets itself from the request; a site may not override them through ``sbatch``.
RESERVED_SBATCH = frozenset(
    {
        "account", "array", "cpus-per-task", "error", "gpus-per-node", "job-name", "nodes",
        "ntasks-per-node", "open-mode", "output", "partition", "signal", "time",
        # the script and its launch: a wrapped command replaces it, the others move or hold it
        "wrap", "ntasks", "chdir", "export", "dependency", "hold", "wait", "test-only", "parsable",
        "requeue", "no-requeue",  # always --requeue: a preempted or timed-out job resumes
    }
)  # fmt: skip
# ``wckey`` is not reserved: submitit's default ("submitit") is dropped, a site may set its own.
# sbatch and srun read a long flag's unambiguous abbreviation as the flag (getopt_long): a site's
# ``part`` would be ``--partition``. These are options of their own despite being a reserved
# flag's prefix (an exact name wins over an abbreviation).
OWN_OPTIONS = frozenset({"gpus"})
# srun flags the launcher sets (-o, -e, -c: their short forms): srun reads no SLURM_CPUS_PER_TASK since
# Slurm 22.05, so the launcher passes --cpus-per-task to srun itself
SRUN_RESERVED = ("mpi", "output", "error", "cpus-per-task")


def reserved_sbatch(key: str) -> bool:
    """Whether ``--key`` is, or abbreviates, a flag the launcher sets itself."""
    return key in RESERVED_SBATCH or (
        key not in OWN_OPTIONS and any(r.startswith(key) for r in RESERVED_SBATCH)
    )


def reserved_srun(arg: str) -> bool:
    """Whether an srun argument sets (or abbreviates) ``--mpi``, ``--output``, ``--error`` or
    ``--cpus-per-task``."""
    if not arg.startswith("--"):
        return arg.startswith(("-o", "-e", "-c"))
    name = arg[2:].split("=", 1)[0]
    return bool(name) and any(r.startswith(name) or name.startswith(r) for r in SRUN_RESERVED)


GPU_BINDING = ("gpus-per-task", "gpu-bind", "ntasks-per-gpu")  # srun flags that give a task its GPUs


def gpu_binding(arg: str) -> bool:
    """Whether an srun argument binds GPUs to tasks (``--gpus-per-task``, ``--gpu-bind``,
    ``--ntasks-per-gpu``): for srun's task per GPU, not a torchrun agent's or an array's task."""
    return arg.startswith("--") and arg[2:].split("=", 1)[0] in GPU_BINDING


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SBATCH_NAME = re.compile(r"[a-z][a-z0-9-]*")

TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
# ASCII digits only, at most 9 each: int() would take other scripts' digits, and fail past 4300.
_DAYS = re.compile(r"([0-9]{1,9})-([0-9]{1,9})(?::([0-9]{1,9}))?(?::([0-9]{1,9}))?")
_CLOCK = re.compile(r"([0-9]{1,9})(?::([0-9]{1,9}))?(?::([0-9]{1,9}))?")


MAX_SIGNAL_DELAY_S = 65535  # sbatch --signal=SIG@TIME takes at most this many seconds
MAX_TIME_DAYS = 365


def parse_time(text: str, flag: str = "--time") -> int:
    """Minutes in a SLURM time limit (rounded up, as sbatch's ``--time`` takes minutes); a
    ``ConfigError`` naming ``flag`` when it is not one."""
    return math.ceil(parse_seconds(text, flag) / 60)


def parse_seconds(text: str, flag: str = "--time") -> int:
    """Seconds in a SLURM time limit; a ``ConfigError`` naming ``flag`` when it is not one."""
    check_text(flag, str(text))
    text = str(text).strip()
    seconds: int | None = None
    if m := _DAYS.fullmatch(text):
        d, h, mi, s = (int(g) if g else 0 for g in m.groups())
        if h < 24 and mi < 60 and s < 60:
            seconds = ((d * 24 + h) * 60 + mi) * 60 + s
    elif m := _CLOCK.fullmatch(text):
        parts = [int(g) for g in m.groups() if g is not None]
        if len(parts) == 1:
            seconds = parts[0] * 60
        elif len(parts) == 2 and parts[1] < 60:
            seconds = parts[0] * 60 + parts[1]
        elif len(parts) == 3 and parts[1] < 60 and parts[2] < 60:
            seconds = (parts[0] * 60 + parts[1]) * 60 + parts[2]
    if not seconds:
        raise ConfigError(f"{flag}: expected a positive time limit as {TIME_FORMATS}, got {shown(text)}")
    if seconds > MAX_TIME_DAYS * 86400:
        raise ConfigError(f"{flag}: {shown(text)} is more than {MAX_TIME_DAYS} days")
    return seconds


def time_limit(text: str, flag: str, signal_delay_s: int, site: str) -> int:
    """The minutes of a time limit that is longer than the site's checkpoint-and-requeue warning
    (``signal_delay_s``, compared before the limit is rounded up to whole minutes)."""
    seconds = parse_seconds(text, flag)
    if seconds <= signal_delay_s:  # USR2 (checkpoint, requeue) would come as the job starts
        raise ConfigError(
            f"{flag}: {f'{seconds // 60} min' if seconds % 60 == 0 else f'{seconds} s'} is not longer "
            f"than site {site}'s signal_delay_s "
            f"{signal_delay_s} s (the checkpoint-and-requeue warning)"
        )
    return math.ceil(seconds / 60)


def sites_dir() -> Path:
    """``$NEREUS_SITES`` if set, else the repository's ``slurm/templates/``."""
    env = os.environ.get("NEREUS_SITES")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "slurm" / "templates"


def site_names() -> list[str]:
    """The shipped site names, sorted."""
    return sorted(p.stem for p in sites_dir().glob("*.yaml"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """One cluster's scheduling conventions; ``name`` is the file's stem."""

    name: str
    description: str = ""
    vendor: Vendor
    gpus_per_node: int = 0  # 0: CPU workers, no GPU request (the local test cluster)
    cpus_per_task: int = 1
    partition: str = ""  # default partition; "": the cluster's default
    partitions: tuple[str, ...] = ()  # the partitions that exist; empty: any name is accepted
    account: str = ""  # default account; "": none (or $SBATCH_ACCOUNT, read by sbatch itself)
    time: str = "01:00:00"  # default time limit (SLURM format)
    max_nodes: int = 0  # 0: no limit
    mpi: str = "pmi2"  # srun --mpi plugin; "none" leaves srun's default
    srun_args: tuple[str, ...] = ()  # more srun flags (e.g. --gpu-bind=closest)
    sbatch: dict[str, str | int | bool] = field(default_factory=dict)  # more #SBATCH flags
    setup: tuple[str, ...] = ()  # shell lines run before srun (module loads)
    env: dict[str, str] = field(default_factory=dict)  # exported before srun
    signal_delay_s: int = 120  # USR2 this long before the time limit: checkpoint and requeue
    # folders the compute nodes cannot write ("$HOME" on Frontier): a job folder under one is refused
    read_only_roots: tuple[str, ...] = ()
    jobs_root_hint: str = ""  # where job folders should go instead (shown in that refusal)

    def __post_init__(self) -> None:
        self._check_text()
        coerce_enums(self, vendor=Vendor)
        if self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be non-negative, got {self.gpus_per_node}")
        if (self.vendor is Vendor.CPU) != (self.gpus_per_node == 0):
            raise ValueError(
                f"gpus_per_node must be 0 exactly when vendor is cpu (vendor {self.vendor.value}, "
                f"gpus_per_node {self.gpus_per_node})"
            )
        for name in ("cpus_per_task", "signal_delay_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.signal_delay_s > MAX_SIGNAL_DELAY_S:
            raise ValueError(
                f"signal_delay_s must be at most {MAX_SIGNAL_DELAY_S} (sbatch --signal), "
                f"got {self.signal_delay_s}"
            )
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be non-negative, got {self.max_nodes}")
        if self.partitions and self.partition and self.partition not in self.partitions:
            raise ValueError(
                f"partition {self.partition!r} is not in partitions ({', '.join(self.partitions)})"
            )
        if self.mpi not in MPI_PLUGINS:
            raise ValueError(f"mpi must be one of {', '.join(MPI_PLUGINS)}, got {self.mpi!r}")
        try:
            parse_time(self.time, "time")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        for arg in self.srun_args:
            if not arg.startswith("-") or reserved_srun(arg):
                raise ValueError(
                    f"srun_args: {arg!r} is not an srun flag the site may set (--output and --error are "
                    "submitit's, --mpi is the site's mpi key; a flag's value goes in the same item, "
                    "as --flag=value)"
                )
        for i, root in enumerate(self.read_only_roots):
            if not root.startswith(("/", "~", "$")):
                raise ValueError(
                    f"read_only_roots[{i}]: expected an absolute path, ~ or $VARIABLE/..., got {root!r}"
                )
        for key, value in self.sbatch.items():
            if value is False:
                raise ValueError(f"sbatch: {key}: false is not a value (leave the flag out)")

    def _check_text(self) -> None:
        """Flag and variable names, then every value the sbatch script gets: no control characters."""
        for key in self.sbatch:
            if not _SBATCH_NAME.fullmatch(key) or reserved_sbatch(key):
                raise ValueError(f"sbatch: {key!r} is not a flag the site may set")
        for key in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(
                    f"key 'env': {key!r} is not an environment variable name (allowed: {_ENV_NAME.pattern})"
                )
        values = [("name", self.name), ("partition", self.partition), ("account", self.account),
                  ("time", self.time), ("jobs_root_hint", self.jobs_root_hint)]  # fmt: skip
        for key, items in (("partitions", self.partitions), ("srun_args", self.srun_args),
                           ("setup", self.setup), ("read_only_roots", self.read_only_roots)):  # fmt: skip
            values += [(f"{key}[{i}]", item) for i, item in enumerate(items)]
        values += [(f"sbatch.{k}", v) for k, v in self.sbatch.items() if isinstance(v, str)]
        values += [(f"env.{k}", v) for k, v in self.env.items()]
        for key, value in values:
            if has_control(value):
                raise ValueError(control_error(f"key {key!r}", value))

    @property
    def mpi_flag(self) -> list[str]:
        """srun's MPI plugin flag (none for ``mpi: none``: srun's default)."""
        return [] if self.mpi == "none" else [f"--mpi={self.mpi}"]

    def env_lines(self) -> list[str]:
        """``export`` lines for the environment, each value ``shlex.quote``d: taken literally by the
        shell (``$VAR``, ``$(...)``, backticks, ``;`` expand to nothing; shell belongs in ``setup``)."""
        return [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]

    def read_only_root(self, folder: Path) -> str | None:
        """The entry of ``read_only_roots`` that ``folder`` is under (as given, or with symbolic
        links resolved), or None. Entries expand ``~`` and ``$VARIABLE`` here, on the login node;
        one whose variable is unset here is skipped."""
        paths = {folder.absolute(), folder.resolve()}
        for entry in self.read_only_roots:
            expanded = os.path.expanduser(os.path.expandvars(entry))
            if not expanded.startswith("/"):
                continue  # an unset variable: nothing to compare with
            roots = {Path(expanded), Path(expanded).resolve()}
            if any(p == r or r in p.parents for p in paths for r in roots):
                return entry
        return None

    def check_jobs_folder(self, folder: Path, flag: str = "--jobs-root") -> None:
        """Refuse a job folder that the compute nodes cannot write (under ``read_only_roots``)."""
        root = self.read_only_root(folder)
        if root is None:
            return
        where = (
            root
            if root == os.path.expanduser(os.path.expandvars(root))
            else (f"{root} ({os.path.expanduser(os.path.expandvars(root))})")
        )
        hint = f" such as {self.jobs_root_hint}" if self.jobs_root_hint else ""
        raise ConfigError(
            f"{flag}: the job folder {shown(str(folder))} is under {where}, which site {self.name}'s "
            f"compute nodes cannot write: pass {flag} on a file system they write{hint}"
        )

    def check_partition(self, partition: str) -> None:
        if self.partitions and partition not in self.partitions:
            raise ConfigError(
                f"--partition: {partition!r} is not a partition of site {self.name} "
                f"(allowed: {', '.join(self.partitions)})"
            )


def _is_name(name_or_path: str) -> bool:
    return Path(name_or_path).suffix not in (".yaml", ".yml") and os.sep not in name_or_path


def site_ref(name_or_path: str) -> str:
    """How a job record names its site: the shipped name, or the site file's absolute path."""
    return name_or_path if _is_name(name_or_path) else str(Path(name_or_path).resolve())


def load_site(name_or_path: str, flag: str = "--site") -> Site:
    """A shipped site by name, or a site YAML by path. Errors name ``flag``: ``--site``, or
    ``$NEREUS_SITE`` where the name came from it."""
    if has_control(name_or_path):
        raise ConfigError(control_error(flag, name_or_path))
    path = Path(name_or_path)
    if _is_name(name_or_path):
        folder = sites_dir()
        if os.environ.get("NEREUS_SITES") and not folder.is_dir():
            raise ConfigError(f"$NEREUS_SITES: {shown(str(folder))} is not a folder (of site YAMLs)")
        path = folder / f"{name_or_path}.yaml"
        try:
            found = path.is_file()
        except OSError:  # a name too long for a file
            found = False
        if not found:
            where = f" in $NEREUS_SITES ({shown(str(folder))})" if os.environ.get("NEREUS_SITES") else ""
            raise ConfigError(
                f"{flag}: unknown site {shown(name_or_path)}{where} "
                f"(allowed: {', '.join(site_names()) or 'none there'}, or a path to a site YAML)"
            )
    data = read_yaml(path, flag)
    data.setdefault("name", path.stem)
    return build(Site, data, str(path))
