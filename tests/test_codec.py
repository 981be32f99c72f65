"""Control messages are JSON checked against the expected type: every message the runtime sends
round-trips exactly, and anything else is refused without constructing or running anything."""

from __future__ import annotations

import json
import pickle
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from nereus.backends.protocol import GenerationStats
from nereus.control.action import Action, Keep, Move, Restart
from nereus.control.controller import Controller, policy_config
from nereus.control.telemetry import Telemetry
from nereus.plan.layout import Plan
from nereus.plan.opclass import OpClass
from nereus.runtime.codec import MAX_BYTES, MessageError, decode, encode
from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.job import JobSetup, initial_plan
from nereus.runtime.monitor import RankReport
from nereus.runtime.optimes import OpTime
from nereus.runtime.pool import Change
from nereus.spec import load_cluster

pytestmark = pytest.mark.pure

EXPERIMENT = Path(__file__).resolve().parents[1] / "configs/experiments/ppo-tiny.yaml"


@pytest.fixture(scope="module")
def setup() -> JobSetup:
    return JobSetup.build(ExperimentSpec.load(EXPERIMENT), Path(tempfile.mkdtemp()))


def test_every_runtime_message_round_trips(setup: JobSetup) -> None:
    back = decode(encode(setup), JobSetup)
    assert (back.spec, back.workload, back.models, back.tokenizer) == (
        setup.spec, setup.workload, setup.models, setup.tokenizer,
    )  # fmt: skip
    assert back.dataset.records == setup.dataset.records and back.dataset.seed == setup.dataset.seed
    plan = initial_plan(setup, (0, 1, 2, 3), 2)
    assert decode(encode(plan), Plan) == plan
    ctl = Controller(setup.workload, setup.models, load_cluster("local-cpu"), plan, policy_config("always"))
    ctl.observe(Telemetry(0, 1.0, 2.0, 2.0, (0, 1, 2, 3)))
    decision = ctl.observe(Telemetry(1, 2.0, 2.0, 2.0, (0, 1, 2, 3, 4, 5)))
    assert decision is not None
    move = decision.action
    assert isinstance(move, Move) and move.transition.dag.nodes
    smaller = replace(move, transition=replace(move.transition, staging_budget=16 << 20))  # with_staging's
    for action in (move, smaller, Keep("nothing to do"), Restart(plan, "urgent"), Restart(None)):
        assert decode(encode(action), Action) == action
    assert decode(encode(smaller), Action).transition.staging_budget == 16 << 20
    bad = json.loads(encode(smaller))
    bad["transition"]["staging_budget"] = 0  # every rank's executor would stage without bound
    with pytest.raises(MessageError, match="staging_budget"):
        decode(json.dumps(bad).encode(), Action)
    change = Change(4, (0, 1, 2), 3, leaving=(3,))
    assert decode(encode(change), Change | None) == change and decode(encode(None), Change | None) is None
    welcome = (setup, plan, change)
    got = decode(encode(welcome), tuple[JobSetup, Plan, Change])
    assert got[1:] == (plan, change)
    report = RankReport(
        {"actor.gen": 0.25}, {"actor.gen": 1 << 40}, False, (OpTime("actor.gen", OpClass.DECODE, 0.1, 0.2),),
        '{"node": "gpu-a07"}', {"actor.gen": 1 << 41}, {"actor.gen": GenerationStats(64, 9, 0.5, 1)},
    )  # fmt: skip
    assert decode(encode(report), RankReport) == report
    assert got[0].engines == setup.engines and got[0].space == setup.space
    assert decode(encode({"a": {"updates": 3}}), dict[str, dict[str, int]]) == {"a": {"updates": 3}}


@pytest.mark.parametrize(
    ("raw", "tp", "why"),
    [
        (pickle.dumps(Keep("x")), Action, "not JSON"),
        (b"\xff\xfe", Action, "not JSON"),
        (json.dumps({"__type__": "Keep", "reason": "x", "extra": 1}).encode(), Action, "unknown fields"),
        (json.dumps({"__type__": "Change", "step": 1}).encode(), Change, "missing field"),
        (json.dumps({"__type__": "Change", "step": "1", "members": [0], "generation": 1}).encode(), Change,
         "expected an integer"),
        (json.dumps({"__type__": "Plan"}).encode(), Change, "expected a Change object"),
        (json.dumps({"__type__": "Change", "step": 1, "members": [0, 1], "generation": 1,
                     "leaving": [1]}).encode(), Change, "leavers must not be members"),
        (json.dumps({"__type__": "os.system", "args": ["id"]}).encode(), Action, "matches none"),
        (json.dumps([["x", True]]).encode(), dict[str, int], "expected an integer"),
    ],
)  # fmt: skip
def test_messages_of_the_wrong_shape_are_refused(raw: bytes, tp: object, why: str) -> None:
    with pytest.raises(MessageError, match=why):
        decode(raw, tp)


def test_oversized_and_unsendable_messages_are_refused() -> None:
    with pytest.raises(MessageError, match="at most"):
        decode(b" " * (MAX_BYTES + 1), Keep)
    with pytest.raises(MessageError, match="cannot send a"):
        encode(object())
