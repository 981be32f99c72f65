"""Bad calibration files (``nereus plan --calibration``): malformed JSON, keys and samples out of
range are one line naming the key, exit 2; a missing file and a good one behave (issue 15)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus.plan.calibration import CalibrationStore, Measurement
from nereus.plan.opclass import OpClass
from tests.bad_input import (  # noqa: F401 - _in_tmp: the autouse fixture
    E_PLAN,
    OPS,
    PLAN,
    _in_tmp,
    cli,
    refused,
    write,
)

pytestmark = pytest.mark.pure


# ------------------------------------------------------------------ calibration and anchor
CAL = '{"format": 1, "clusters": {"local-cpu": %s}}'
ENTRY = '{"window": 8, "samples": %s, "memory": %s}'


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("{", "line 1: not valid JSON (Expecting property name enclosed in double quotes)"),
        ('{"format": 3, "clusters": {}}', "key 'format': expected 1 or 2 (this Nereus reads both), got 3"),
        (
            '{"format": true, "clusters": {}}',
            "key 'format': expected 1 or 2 (this Nereus reads both), got True",
        ),
        ("[]", "expected a JSON object with keys format and clusters, got []"),
        ('{"format": 1, "clusters": []}', "key 'clusters': expected a mapping"),
        (
            '{"format": 1, "clusters": {"h200-ib": {}}}',
            "no calibration for cluster local-cpu (clusters in it: h200-ib)",
        ),
        (
            CAL % "[1]",
            "key 'clusters.local-cpu': malformed calibration "
            "(expected a mapping of window, samples, memory[, shaped])",
        ),
        (
            CAL % '{"window": 1e20, "samples": {}, "memory": {}}',
            "key 'clusters.local-cpu.window': expected an integer in [1, 65536], got 1e+20",
        ),
        (
            CAL % (ENTRY % ("[]", "{}")),
            f"key 'clusters.local-cpu.samples': expected a mapping of {OPS}, got []",
        ),
        (
            CAL % (ENTRY % ('{"gemm": [[1, 0]]}', "{}")),
            "key 'clusters.local-cpu.samples.gemm': expected a list of [ideal_s, measured_s] pairs "
            "(numbers in [1e-12, 1e+12])",
        ),
        (
            CAL % (ENTRY % ('{"tpu": []}', "{}")),
            f"key 'clusters.local-cpu.samples.tpu': malformed calibration (allowed: {OPS})",
        ),
        (
            CAL % '{"window": 8, "samples": {}, "memory": {}, "shaped": {"gemm": [[1, 2, 3]]}}',
            "key 'clusters.local-cpu.shaped.gemm': expected a list of [ideal_s, measured_s, size, group] "
            "lists (numbers in [1e-12, 1e+12]; size and group 0 or up to 1e+21)",
        ),
        (
            '{"format": 2.0, "clusters": {}}',
            "key 'format': expected 1 or 2 (this Nereus reads both), got 2.0",
        ),
        (
            '{"format": 2, "clusters": {}, "extra": 1}',
            "unknown key 'extra' (allowed: format, clusters)",
        ),
        (
            CAL % (ENTRY % ("{}", '{"train": [-1]}')),
            "key 'clusters.local-cpu.memory.train': expected a list of ratios (numbers in [1e-12, 1e+12])",
        ),
    ],
)
def test_malformed_calibration(text: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    write("cal.json", text)
    assert refused([*PLAN, "--calibration", "cal.json"], capsys) == f"{E_PLAN}--calibration cal.json: {line}"


def test_missing_calibration_and_a_good_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*PLAN, "--calibration", "cal.json"]
    assert refused(argv, capsys) == f"{E_PLAN}--calibration cal.json: no such file"
    store = CalibrationStore("local-cpu")
    store.update(Measurement(op, 1.0, 1.1) for op in OpClass)
    store.save(Path("cal.json"))
    assert cli(argv, capsys)[0] == 0
