"""Property-based fuzz of the ``nereus`` CLI (issue 15): random flags for every subcommand that
starts no process (plan, describe, list, transition, simulate) and mutated config, trace, curve,
plan and calibration files (bytes flipped, truncated, NaN/inf/negative/huge numbers, wrong
types, non-UTF-8, alias bombs).

Whatever the input: the exit code is 0, 2 or 3; stderr holds no traceback; a refusal (2 or 3) is
exactly one line; and nothing outside the output folder changes (each case runs with cwd and
HOME in a fresh folder, which is compared before and after, as is the repository's configs/).
Sized to run in a few seconds in the ``pure`` layer; ``NEREUS_FUZZ_SCALE=50`` runs 50 times as
many cases, ``FUZZ_DEBUG=1`` prints each case's exit code, argv and error line.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nereus.cli import main
from nereus.spec import names
from nereus.spec.registry import config_root, trace_path

pytestmark = pytest.mark.pure

CONFIGS = config_root()
EXAMPLE_S = 10  # a case running longer is a hang
SCALE = int(os.environ.get("NEREUS_FUZZ_SCALE", "1"))  # more examples: NEREUS_FUZZ_SCALE=50 pytest …
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ------------------------------------------------------------------ the files a case may use
HF_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}
_FITTED = {"window": 8, "samples": {"gemm": [[1.0, 1.3], [2.0, 2.5]]}, "memory": {"train": [1.1]}}
CALIBRATION = {"format": 1, "clusters": {"local-cpu": _FITTED, "cluster": _FITTED}}  # cluster.yaml's name
TINY_PLAN = ["plan", "--model", "tiny-llama", "--algo", "ppo", "--cluster", "local-cpu", "--json"]


def _quiet(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@cache
def base_files() -> dict[str, bytes]:
    """name → bytes of every file a case starts from (valid inputs, before any mutation)."""
    a = _quiet([*TINY_PLAN, "--gpus", "4", "--seq-len", "32"])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a.json").write_text(a)
        b = _quiet([*TINY_PLAN, "--gpus", "8", "--seq-len", "64", "--anchor", str(Path(tmp) / "a.json")])
    return {
        "model.yaml": (CONFIGS / "models" / "tiny-llama.yaml").read_bytes(),
        "cluster.yaml": (CONFIGS / "clusters" / "local-cpu.yaml").read_bytes(),
        "work.yaml": (CONFIGS / "workloads" / "ppo.yaml").read_bytes(),
        "hf/config.json": json.dumps(HF_CONFIG).encode(),
        "trace.json": json.dumps({"metadata": {"gap_seconds": 300}, "data": [8, 8, 6, 4, 8]}).encode(),
        "curve.csv": b"step,mean_len,p95_len\n0,100,120\n10,200,260\n",
        "cal.json": json.dumps(CALIBRATION).encode(),
        "a.json": a.encode(),
        "b.json": b.encode(),
    }


# ------------------------------------------------------------------ mutations
WEIRD: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    -1,
    0,
    -0.5,
    3,
    4.5,
    10**30,
    2**53 + 1,
    1e300,
    1e-300,
    "",
    "x" * 100,
    "é\n\x00",
    True,
    None,
    [],
    {},
    [1, "a"],
    {"k": 1},
    "sync",
    "ppo",
    "gemm",
]
INSERTS = [
    b"\xff",
    b"\xc3(",
    b"\x00",
    b"\n",
    b"*a",
    b"&a ",
    b"[",
    b"{",
    b"NaN",
    b"-",
    b"1e999",
    b"\t",
    b": ",
    b'"',
    b"9" * 40,
    b"!!python/object:os.system ",
    b"<<: *a\n",
]
BOMB = b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
    b"%c: &%c [*%c, *%c, *%c, *%c]\n" % (98 + i, 98 + i, 97 + i, 97 + i, 97 + i, 97 + i) for i in range(8)
)


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """(container, key) of every value in a parsed document."""
    found: list[tuple[Any, Any]] = []
    stack = [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            found.append((node, key))
            stack.append(value)
    return found


@st.composite
def mutated(draw: st.DrawFn, name: str) -> bytes:
    data = base_files()[name]
    how = draw(st.sampled_from(["keep", "value", "value", "drop", "extra", "flip", "cut", "insert", "bomb"]))
    if how in ("value", "drop", "extra") and not name.endswith(".csv"):
        doc = json.loads(data) if name.endswith(".json") else yaml.safe_load(data)
        slots = _slots(doc)
        container, key = draw(st.sampled_from(slots)) if slots else (doc, None)
        if how == "value" and key is not None:
            container[key] = draw(st.sampled_from(WEIRD))
        elif how == "drop" and key is not None:
            container.pop(key)
        elif isinstance(container, dict):
            container[draw(st.sampled_from(["zzz", "name", "1", ""]))] = draw(st.sampled_from(WEIRD))
        if name.endswith(".json"):
            return json.dumps(doc).encode()
        return yaml.safe_dump(doc, allow_unicode=True).encode()
    if how == "value":  # a CSV cell
        cells = [b"nan", b"inf", b"-1", b"0", b"1e30", b"x", b"", b"9" * 40, b"2.5"]
        return data.replace(b"100", draw(st.sampled_from(cells)), 1)
    pos = draw(st.integers(0, max(0, len(data) - 1)))
    if how == "flip":
        return data[:pos] + bytes([data[pos] ^ draw(st.integers(1, 255))]) + data[pos + 1 :]
    if how == "cut":
        return data[:pos]
    if how == "insert":
        return data[:pos] + draw(st.sampled_from(INSERTS)) + data[pos:]
    if how == "bomb":
        return BOMB if not name.endswith(".json") else b"[" * 5000 + b"]" * 5000
    return data


# ------------------------------------------------------------------ flag values
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
NUMBERS = st.one_of(
    st.sampled_from(
        ["0", "-1", "-3", "2.5", "1e12", "nan", "inf", "-inf", "1e-300", "9" * 40, "", "x", " 4", "0x10",
         "1_0", "٣", "--json", "100000000"]
    ),
    st.integers(-5, 40).map(str),
    TEXT,
)  # fmt: skip


class Flag(NamedTuple):
    """A flag: valid values (None: a switch), invalid ones (besides ``NUMBERS``), how often present."""

    name: str
    good: tuple[str, ...] | None
    bad: tuple[str, ...] = ()
    p: float = 0.2


@st.composite
def flags(draw: st.DrawFn, spec: list[Flag]) -> list[str]:
    """Flags of ``spec`` (each with its probability); each value is invalid with a rate drawn per
    case (mostly none or one bad value: most cases reach the command's logic, not argparse)."""
    bad_rate = draw(st.sampled_from([0.0, 0.0, 0.0, 0.05, 0.1, 0.3]))
    argv: list[str] = []
    for f in spec:
        if draw(st.floats(0, 1, exclude_max=True)) >= f.p:  # p 1: always (1.0 itself is drawn often)
            continue
        if f.good is None:
            argv.append(f.name)
        elif draw(st.floats(0, 1)) < bad_rate:
            argv += [f.name, draw(st.one_of(st.sampled_from(f.bad), NUMBERS) if f.bad else NUMBERS)]
        else:
            argv += [f.name, draw(st.sampled_from(f.good))]
    if bad_rate and draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(NUMBERS))  # a stray token
    return argv


MODELS = ("model.yaml", "hf/config.json", "hf", "tiny-llama", "tiny-qwen3")
BAD_MODELS = ("gpt-5", "missing.yaml", "/dev/null", "cluster.yaml", "a.json", "curve.csv")
CLUSTERS = ("cluster.yaml", "local-cpu")
BAD_CLUSTERS = ("tpu", "model.yaml", "a.json", "hf")
ALGOS = ("work.yaml", "ppo", "grpo", "remax")
BAD_ALGOS = ("dpo", "model.yaml", "missing.yaml")
PLANS = ("a.json", "b.json")
BAD_PLANS = ("cal.json", "missing.json", "trace.json", "hf", "model.yaml")
OUTS = ("out", "out/sub", "full/deeper")
BAD_OUTS = ("model.yaml", "full", ".", "hf/config.json", "hf")

PLAN_FLAGS = [
    Flag("--model", MODELS, BAD_MODELS, 0.97), Flag("--algo", ALGOS, BAD_ALGOS, 0.97),
    Flag("--cluster", CLUSTERS, BAD_CLUSTERS, 0.97), Flag("--gpus", ("1", "2", "4", "8"), ("16",), 0.97),
    Flag("--seq-len", ("16", "32", "64", "128"), (), 0.97), Flag("--seq-len-p95", ("64", "128"), ("8",)),
    Flag("--prompt-len", ("16", "32")), Flag("--mode", ("sync", "async"), ("eager",)),
    Flag("--max-tp", ("1", "2", "4"), ("3", "2048")), Flag("--headroom", ("0.1", "0", "0.5"), ("1",)),
    Flag("--urgent", None), Flag("--calibration", ("cal.json",), ("missing.json", "a.json"), 0.25),
    Flag("--solver", ("dp", "exhaustive", "scip"), ("greedy",)), Flag("--exhaustive", None, p=0.15),
    Flag("--all", None, p=0.05), Flag("--json", None, p=0.5), Flag("--explain", None),
    Flag("--anchor", PLANS, BAD_PLANS, 0.15),
]  # fmt: skip
SIM_FLAGS = [
    Flag("--trace", ("trace.json", names("traces")[0]), ("a.json", "curve.csv", "none"), 0.97),
    Flag("--seq-curve", ("curve.csv", "growth", "growth:9:99:9"), ("growth:1:2:0", "growth:nan:1:5"), 0.5),
    Flag("--model", MODELS, BAD_MODELS, 0.97), Flag("--algo", ALGOS, BAD_ALGOS, 0.97),
    Flag("--cluster", CLUSTERS, BAD_CLUSTERS, 0.97), Flag("--steps", ("1", "2", "3"), ("100000000",), 1.0),
    Flag("--policies", ("static", "nereus", "always", "periodic:2"),
         ("greedy", "periodic:0", "static,static", "", "periodic:x"), 1.0),
    Flag("--gamma", ("0.5", "0,1"), ("2", "")), Flag("--seed", ("0", "1", "7")),
    Flag("--gpus-per-instance", ("1", "2"), ("9", "2048")), Flag("--max-gpus", ("4", "8"), ("9",)),
    Flag("--min-gpus", ("0", "2", "4"), ("9",)), Flag("--offset", ("0", "1", "3"), ("5",)),
    Flag("--speedup", ("1", "5", "0.5")), Flag("--noise", ("0", "0.03", "0.5")),
    Flag("--episode", ("0-2:all:0.5", "1-3:inter:0.2"), ("2-1:all:0.5", "0-5:wifi:0.5", "0-5:all:nan")),
    Flag("--out", OUTS, BAD_OUTS, 0.9), Flag("--force", None, p=0.3), Flag("--json", None, p=0.5),
]  # fmt: skip
TRANSITION_FLAGS = [
    Flag("--from", PLANS, BAD_PLANS, 0.97), Flag("--to", PLANS, BAD_PLANS, 0.97),
    Flag("--lost", ("", "3", "0-1", "1,2"), ("999", "0-100000000000", "3-1", "-3", "x"), 0.4),
    Flag("--json", None, p=0.5),
]  # fmt: skip


# ------------------------------------------------------------------ running one case
def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def _configs() -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in CONFIGS.rglob("*") if p.is_file()}


@contextlib.contextmanager
def _sandbox(files: dict[str, bytes]) -> Iterator[Path]:
    """A fresh folder as cwd and HOME, holding ``files``, a non-empty folder ``full`` and an
    empty folder ``home``; cwd, HOME and the alarm are restored afterwards."""
    cwd, home = os.getcwd(), os.environ.get("HOME")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, data in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
        (root / "full").mkdir()
        (root / "full" / "notes.txt").write_text("the user's")
        (root / "home").mkdir()
        os.chdir(root)
        os.environ["HOME"] = str(root / "home")

        def hang(signum: int, frame: object) -> None:
            raise TimeoutError(f"a case ran longer than {EXAMPLE_S} s")

        old = signal.signal(signal.SIGALRM, hang)
        signal.alarm(EXAMPLE_S)
        try:
            yield root
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
            os.chdir(cwd)
            if home is None:
                os.environ.pop("HOME", None)
            else:
                os.environ["HOME"] = home


def _out_folder(argv: list[str]) -> str | None:
    """The folder a command may write into (relative to the case's folder), or None."""
    if not argv or argv[0] != "simulate":
        return None
    if "--out" in argv[:-1]:
        return os.path.normpath(argv[argv.index("--out") + 1])
    return os.path.join("runs", "sim")


def check(argv: list[str], files: dict[str, bytes]) -> None:
    """Run ``nereus argv`` in a sandbox holding ``files`` and check the promises."""
    configs = _configs()
    with _sandbox(files) as root:
        before = _snapshot(root)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # numpy overflow: a silently wrong answer
            try:
                code: object = main(argv)
            except SystemExit as exc:
                code = exc.code
        after = _snapshot(root)
    text = err.getvalue()
    event(f"exit {code}")
    if os.environ.get("FUZZ_DEBUG"):
        print(
            code, argv, text.strip()[:150], file=sys.__stderr__
        )  # --hypothesis-show-statistics: how often each outcome was reached
    assert code in (0, 2, 3), (argv, code, text)
    assert "Traceback" not in text, text
    if code != 0:
        assert text.endswith("\n") and text.count("\n") == 1 and text.startswith("nereus"), text
    elif argv[:1] != ["--help"] and "-h" not in argv and "--help" not in argv:
        # a success prints nothing on stderr but its warnings, one line each
        assert all(line.startswith(f"nereus {argv[0]}: warning: ") for line in text.splitlines()), text
    assert {k: after.get(k) for k in before} == before, f"{argv}: a file that was there changed"
    folder = _out_folder(argv) if code == 0 else None
    new = sorted(set(after) - set(before))
    outside = [n for n in new if folder is None or not (folder == "." or n.startswith(folder + os.sep))]
    assert not outside, f"{argv}: wrote {outside} outside its output folder {folder}"
    assert _configs() == configs, "configs/ changed"


def _files(draw: st.DrawFn, mutate: list[str]) -> dict[str, bytes]:
    """The base files, one of ``mutate`` (sometimes) mutated."""
    files = dict(base_files())
    target = draw(st.sampled_from([None, None, None, *mutate]))
    if target is not None:
        files[target] = draw(mutated(target))
    return files


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    """Build the base files and import matplotlib once, outside the sandboxes (its font cache)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    base_files()


# ------------------------------------------------------------------ the properties
@settings(FUZZ, max_examples=80 * SCALE)
@given(st.data())
def test_fuzz_plan(data: st.DataObject) -> None:
    files = _files(
        data.draw, ["model.yaml", "cluster.yaml", "work.yaml", "hf/config.json", "cal.json", "a.json"]
    )
    argv = ["plan", *data.draw(flags(PLAN_FLAGS))]
    if "--exhaustive" in argv or "--solver" in argv:  # the oracle is exponential: keep the pool tiny
        argv += ["--gpus", data.draw(st.sampled_from(["1", "4", "8", "0", "x"]))]
    check(argv, files)


@settings(FUZZ, max_examples=60 * SCALE)
@given(st.data())
def test_fuzz_describe_and_list(data: st.DataObject) -> None:
    files = _files(data.draw, ["model.yaml", "cluster.yaml", "hf/config.json"])
    kind = data.draw(st.sampled_from(["describe", "list"]))
    if kind == "list":
        argv = [
            "list",
            *data.draw(st.lists(st.sampled_from(["models", "clusters", "algos", "traces", "x"]), max_size=2)),
        ]
    else:
        what = data.draw(st.sampled_from(["model", "cluster", "gpu"]))
        name = data.draw(st.one_of(st.sampled_from([*MODELS, *CLUSTERS, *BAD_MODELS]), TEXT))
        extra = data.draw(flags([Flag("--seq-len", ("32", "1024"), p=0.3), Flag("--json", None, p=0.5)]))
        argv = ["describe", what, name, *extra]
    check(argv, files)


@settings(FUZZ, max_examples=60 * SCALE)
@given(st.data())
def test_fuzz_transition(data: st.DataObject) -> None:
    files = _files(data.draw, ["a.json", "b.json", "model.yaml"])
    check(["transition", *data.draw(flags(TRANSITION_FLAGS))], files)


@settings(FUZZ, max_examples=12 * SCALE)
@given(st.data())
def test_fuzz_simulate(data: st.DataObject) -> None:
    files = _files(data.draw, ["trace.json", "curve.csv", "model.yaml", "cluster.yaml", "work.yaml"])
    argv = ["simulate", *data.draw(flags(SIM_FLAGS))]
    check(argv, files)


@settings(FUZZ, max_examples=30 * SCALE)
@given(
    st.lists(NUMBERS, max_size=6),
    st.sampled_from(["plan", "describe", "list", "transition", "simulate", "", "x"]),
)
def test_fuzz_any_tokens(tokens: list[str], command: str) -> None:
    check([command, *tokens] if command else tokens, dict(base_files()))


def test_console_script_one_line_and_no_traceback(tmp_path: Path) -> None:
    """The installed ``nereus`` in a subprocess: a bad file is one line, exit 2 (a smoke test)."""
    import subprocess
    import sys

    bad = tmp_path / "m.yaml"
    bad.write_bytes(b"hidden_size: \xff\n")
    exe = Path(sys.executable).with_name("nereus")
    argv = [str(exe), "plan", "--model", str(bad), "--algo", "ppo", "--cluster", "local-cpu"]
    proc = subprocess.run(
        [*argv, "--gpus", "4", "--seq-len", "32"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"nereus plan: error: {bad}: not UTF-8 text (byte 0xff at offset 13)\n"
    assert trace_path(names("traces")[0]).exists()
