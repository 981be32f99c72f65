"""A rank's boundary report travels as float64s (``monitor.pack_report``): every value comes back
exactly, in a fraction of the JSON codec's bytes, and a malformed report is refused."""

from __future__ import annotations

import math
import struct

import pytest

from nereus.backends.protocol import GenerationStats
from nereus.plan.opclass import OpClass
from nereus.runtime.codec import MessageError, encode
from nereus.runtime.monitor import RankReport, pack_report, unpack_report
from nereus.runtime.optimes import OpTime

pytestmark = pytest.mark.pure

NAMES = ("actor.gen", "ref.inf", "critic.inf", "actor.train", "critic.train")


def report(health: str = "") -> RankReport:
    return RankReport(
        {"actor.gen": 0.1 + 0.2, "actor.train": 1e-300, "critic.train": 3.0},
        {"actor.train": 2**52 + 1, "actor.gen": 0},
        True,
        (
            OpTime("actor.train", OpClass.GEMM, 1 / 3, 0.25),
            OpTime("actor.train", OpClass.ALLREDUCE_INTER, 5e-7, math.pi),
            OpTime("ref.inf", OpClass.MEMORY, 0.0, 0.0),
            OpTime("actor.gen", OpClass.DECODE, 2.5, 3.0),
        ),
        health,
        {"actor.train": 3 << 40},
        {"actor.gen": GenerationStats(64, 9, 0.5, 1)},
        0.1 + 0.7,
    )


def test_a_report_round_trips_exactly_in_a_fraction_of_the_json() -> None:
    for r in (report(), report('{"node": "gpu-a07", "xid": [79]}'), RankReport({}, {}, False, ())):
        data = pack_report(r, NAMES)
        assert unpack_report(data, NAMES) == r
    assert len(pack_report(report(), NAMES)) < len(encode(report())) / 2


def _floats(*xs: float) -> bytes:
    return struct.pack(f"<{len(xs)}d", *xs)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "not a rank report"),
        (b"\x00" * 7, "whole number"),
        (_floats(1, 0, 0, 0, 0, 0, 0, 0, 0), "not a rank report"),  # another format (the one before ready_s)
        (_floats(2, 0.5, 0, 0, 0, 0, 0, 0, 0), "not a rank report"),
        (_floats(2, 0, -1, 0, 0, 0, 0, 0, 0), "not a rank report"),  # a negative ready_s
        (_floats(2, 0, 0, 1, 0, 0, 0, 0, 0), "header announces"),  # a stage time missing
        (_floats(2, 0, 0, -1, 0, 0, 0, 0, 0), "not a count"),
        (_floats(2, 0, 0, 1, 0, 0, 0, 0, 0, 5, 0.1), "not a count below 5"),  # no such model-stage
        (_floats(2, 0, 0, 1, 0, 0, 0, 0, 0, 0.5, 0.1), "not a count"),
        (_floats(2, 0, 0, 1, 0, 0, 0, 0, 0, 0, math.nan), "not finite"),
        (_floats(2, 0, 0, 0, 0, 0, 1, 0, 0, 0, 99, 0.1, 0.1), "not a count below"),  # no such op class
        (_floats(2, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1.5, 0), "kv_usage"),
        (_floats(2, 0, 0, 0, 0, 0, 0, 0, 2) + b"\xff\xfe", "codec can't decode"),
    ],
)
def test_a_malformed_report_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(MessageError, match=why):
        unpack_report(data, NAMES)


def test_a_count_a_float64_cannot_carry_is_not_sent() -> None:
    with pytest.raises(ValueError, match="out of range"):
        pack_report(RankReport({}, {"actor.gen": 2**53}, False, ()), NAMES)
    with pytest.raises(KeyError):
        pack_report(RankReport({"reward.inf": 1.0}, {}, False, ()), NAMES)
