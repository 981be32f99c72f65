"""Collectives between nodes over one rail per rank on each node (``Links.rails``).

NCCL runs a ring per NIC, so an all-reduce or all-gather whose group holds g ranks on each node
moves the bytes that leave a node over g rails. The cost model prices that where the search
knows g (a model-stage placed alone on the pool, no reserved GPUs: ``bestfit.rails_priced``) and
one rail elsewhere; the held-out check priced MPT-13B FSDP on 64 H100s at +517% with one rail
everywhere, where llm-foundry's table shows the step no slower than on 8."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from nereus.cli import main
from nereus.plan.bestfit import rails_priced
from nereus.plan.calibration import Efficiencies
from nereus.plan.cost import CostModel
from nereus.plan.costterms import collective
from nereus.plan.layout import Layout
from nereus.plan.links import Links
from nereus.plan.opclass import Collective, Link, OpClass
from nereus.runtime.optimes import train_times
from nereus.spec import load_cluster, load_model
from nereus.spec.domains import FailureDomains
from tests.helpers import make_problem

pytestmark = pytest.mark.pure

H100 = load_cluster("h100-ib")  # 8 GPUs a node, 450 GB/s inside, 50 GB/s a GPU between nodes
AR_INTER = OpClass.of(Collective.ALLREDUCE, Link.INTER)


def test_rails_are_one_per_rank_on_a_node_up_to_the_rate_inside_it() -> None:
    links = Links(H100, Efficiencies.unit())
    inter, intra = 50e9, 450e9
    assert float(links.rails(Collective.ALLREDUCE, 1.0)) == inter
    assert float(links.rails(Collective.ALLREDUCE, 4.0)) == 4 * inter
    assert float(links.rails(Collective.ALLGATHER, 8.0)) == 8 * inter
    assert float(links.rails(Collective.ALLREDUCE, 16.0)) == intra  # never faster than NVLink
    assert float(links.rails(Collective.BROADCAST, 8.0)) == inter  # one rail for the others
    assert float(links.rails(Collective.SENDRECV, 8.0)) == inter


def test_a_group_of_eight_ranks_a_node_moves_its_bytes_over_eight_rails() -> None:
    links = Links(H100, Efficiencies.unit())
    nbytes, ranks = 1e9, 64.0
    ring = 2 * 63 / 64 * nbytes
    hops = 2 * 63 * H100.inter_node_latency_us * 1e-6
    on_rails = collective(links, Collective.ALLREDUCE, 64.0, ranks, nbytes, rails=True)
    one_rail = collective(links, Collective.ALLREDUCE, 64.0, ranks, nbytes)
    assert float(on_rails.by_class[AR_INTER]) == pytest.approx(ring / 400e9 + hops)
    assert float(one_rail.by_class[AR_INTER]) == pytest.approx(ring / 50e9 + hops)
    spread = collective(links, Collective.ALLREDUCE, 512.0, ranks, nbytes, rails=True)  # 1 a node
    assert float(spread.by_class[AR_INTER]) == pytest.approx(ring / 50e9 + hops)
    # inside a node rails change nothing; rows choose rails one by one
    inside = collective(
        links, Collective.ALLREDUCE, np.array([8.0, 8.0]), 8.0, nbytes, rails=np.array([1, 0]) > 0
    )
    assert inside.by_class[OpClass.of(Collective.ALLREDUCE, Link.INTRA)][0] == pytest.approx(
        inside.by_class[OpClass.of(Collective.ALLREDUCE, Link.INTRA)][1]
    )


def test_the_tracked_path_prices_what_the_fast_path_does_and_groups_one_rail_as_one_rank_a_node() -> None:
    links = Links(H100, Efficiencies.unit())
    args = (links, Collective.ALLREDUCE, np.array([64.0, 64.0, 8.0]), 64.0, np.array([1e8, 1e8, 1e8]))
    rails = np.array([True, False, False])
    fast, tracked = collective(*args, rails=rails), collective(*args, track=True, rails=rails)
    for op, t in fast.by_class.items():
        assert tracked.by_class[op] == pytest.approx(t)
    assert tracked.feats is not None
    ln_g = tracked.feats[AR_INTER][1] / np.maximum(tracked.by_class[AR_INTER], 1e-30)
    assert ln_g[:2] == pytest.approx([np.log(8.0), 0.0])  # 8 ranks a node on rails; one rail: 1


def _dp_sync_s(problem: object, name: str, layout: Layout, dp: int) -> float:
    model = CostModel(problem)  # type: ignore[arg-type]
    stage = model.workflow.get(name)
    terms, _ = model.evaluate_rows(stage, [layout], np.array([0]), np.array([dp]), np.array([1]))
    return float(terms.parts["dp_sync"].by_class.get(AR_INTER, np.zeros(1))[0])


def test_a_trainer_placed_alone_is_priced_on_rails_and_stage_mates_on_one() -> None:
    grpo = make_problem("llama-3.1-8b", cluster="h100-ib", gpus=32, algo="grpo")  # one trainer
    ppo = make_problem("llama-3.1-8b", cluster="h100-ib", gpus=32, algo="ppo")  # two share the pool
    alone = _dp_sync_s(grpo, "actor.train", Layout(2, 1), 16)  # 4 ranks a node over 4 nodes
    shared = _dp_sync_s(ppo, "actor.train", Layout(2, 1), 16)
    assert alone > 0 and shared > 0
    assert shared / alone == pytest.approx(4.0, rel=0.1)  # 4 rails against 1 (bytes dominate)
    reserved = dataclasses.replace(grpo, domains=FailureDomains(frozenset(range(8)), 8, 0.0))
    assert _dp_sync_s(reserved, "actor.train", Layout(2, 1), 16) == pytest.approx(shared)
    assert rails_priced(None) and not rails_priced(FailureDomains(frozenset({0}), 8, 0.0))


def test_the_measured_all_reduce_is_held_to_the_ideal_it_is_priced_at() -> None:
    model = load_model("tiny-llama")
    dp_gpus = tuple(range(0, 32, 2))  # 4 ranks on each of 4 nodes
    args = ("actor.train", model, Layout(2, 1), 100, 2.0, 0.5, 1 << 28, dp_gpus, H100, H100.peak_flops)
    on_rails, one_rail = train_times(*args, rails=True)[1], train_times(*args)[1]
    links = Links(H100, Efficiencies.unit())
    assert on_rails.ideal_s == pytest.approx(
        links.ideal_ring_s(Collective.ALLREDUCE, 16, 1 << 28, Link.INTER, 4.0)
    )
    assert one_rail.ideal_s == pytest.approx(
        links.ideal_ring_s(Collective.ALLREDUCE, 16, 1 << 28, Link.INTER)
    )
    assert one_rail.ideal_s > 3 * on_rails.ideal_s


def test_fsdp_on_eight_nodes_is_no_slower_than_on_one(capsys: pytest.CaptureFixture[str]) -> None:
    """llm-foundry's H100 table (``scripts/train/benchmarking/README.md``): MPT-13B's step time
    does not grow from 8 to 64 GPUs; ``nereus price`` (one layout on GPUs of its own) agrees."""

    def step(gpus: int) -> float:
        argv = [
            "price", "--model", "llama-2-13b", "--cluster", "h100-ib", "--stage", "train", "--tp", "1",
            "--pp", "1", "--dp", str(gpus), "--sequences", str(8 * gpus), "--global-batch", str(8 * gpus),
            "--micro-batch", "4", "--recompute", "full", "--prompt-len", "1", "--seq-len", "2047",
            "--fsdp", "--json",
        ]  # fmt: skip
        assert main(argv) == 0
        return float(json.loads(capsys.readouterr().out)["latency_s"])

    assert step(64) <= 1.05 * step(8)
