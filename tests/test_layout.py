"""Layout, Candidate and Plan validate themselves on construction."""

from __future__ import annotations

import pytest

from nereus.plan.layout import Candidate, Layout, Plan, split_layers
from nereus.spec import ExecutionMode, load_workload

pytestmark = pytest.mark.pure


def test_layout_powers_of_two() -> None:
    assert Layout(4, 2).size == 8 and str(Layout(4, 2)) == "tp4·pp2"
    for bad in ((3, 1), (2, 0), (1, 6)):
        with pytest.raises(ValueError, match="power of two"):
            Layout(*bad)


def test_split_layers_uneven() -> None:
    assert split_layers(32, 4) == (8, 8, 8, 8)
    assert split_layers(10, 4) == (3, 3, 2, 2)
    with pytest.raises(ValueError):
        split_layers(4, 8)


def test_candidate_gpu_count_and_groups() -> None:
    c = Candidate("actor.train", Layout(2, 2), 2, tuple(range(8)))
    assert c.replica_gpus(1) == (4, 5, 6, 7)
    assert c.tp_groups() == ((0, 1), (2, 3), (4, 5), (6, 7))
    with pytest.raises(ValueError, match="needs 8 GPUs, got 7"):
        Candidate("actor.train", Layout(2, 2), 2, tuple(range(7)))
    with pytest.raises(ValueError, match="repeat"):
        Candidate("actor.train", Layout(1, 1), 2, (3, 3))


def _plan(ref_gpus: tuple[int, ...], mode: ExecutionMode = ExecutionMode.SYNC, gen_gpus=(0, 1)) -> Plan:  # type: ignore[no-untyped-def]
    wf = load_workload("grpo").workflow()
    cands = (
        Candidate("actor.gen", Layout(1, 1), len(gen_gpus), gen_gpus),
        Candidate("actor.inf", Layout(1, 1), 1, (0,)),
        Candidate("ref.inf", Layout(1, 1), len(ref_gpus), ref_gpus),
        Candidate("reward.inf", Layout(1, 1), 1, (2,)),
        Candidate("actor.train", Layout(2, 1), 1, (0, 1)),
    )
    return Plan(wf, cands, (0, 1, 2, 3), mode)


def test_plan_rejects_overlapping_concurrent_gpus() -> None:
    assert _plan((1,)).resident_on(0) == ("actor.gen", "actor.inf", "actor.train")
    with pytest.raises(ValueError, match=r"actor\.inf and ref\.inf run concurrently but share GPU 0"):
        _plan((0,))


def test_async_generation_may_not_share() -> None:
    with pytest.raises(ValueError, match="share GPU"):
        _plan((1,), ExecutionMode.ASYNC)
    plan = _plan((1,), ExecutionMode.ASYNC, gen_gpus=(3,))  # inference 0-2, training 0-1
    assert plan.resident_on(3) == ("actor.gen",)


def test_plan_needs_every_model_stage_and_pool_membership() -> None:
    wf = load_workload("grpo").workflow()
    with pytest.raises(ValueError, match="one candidate per model-stage"):
        Plan(wf, (Candidate("actor.gen", Layout(1, 1), 1, (0,)),), (0,))
    with pytest.raises(ValueError, match="outside the pool"):
        _plan((9,))
