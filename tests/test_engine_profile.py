"""Engine properties the cost model prices (``SearchSpace.overlap_dp_sync``, ``paged_kv``).

Checked: by default (our runtime) the DP gradient all-reduce is serial and the KV cache is
reserved at full length, unchanged; an overlapping trainer exposes only what backward compute
cannot hide, never less than the last bucket and never more than the serial all-reduce; a paged
KV pool holds more sequences in the same memory than full-length reservation, prices its
recompute preemption, and still refuses a p95 sequence that cannot fit; the plan cache keys on
these properties and the job keeps them across replans.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nereus.plan.cache import PlanCache
from nereus.plan.calibration import Efficiencies
from nereus.plan.cost import CostModel
from nereus.plan.layout import Layout
from nereus.plan.memory import KV_BLOCK_TOKENS, kv_pool_tokens, preempted_tokens
from nereus.plan.opclass import OpClass
from nereus.plan.price import PriceQuery, price
from nereus.plan.problem import SearchSpace
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import Stage
from tests.helpers import make_problem

pytestmark = pytest.mark.pure


def _train_terms(
    space: SearchSpace, dp: int, micro: int, eff: Efficiencies | None = None
) -> dict[str, float]:
    p = make_problem(gpus=64, space=space)
    if eff is not None:
        p = dataclasses.replace(p, efficiencies=eff)
    cost = CostModel(p)
    terms, _ = cost.evaluate(p.workflow.get("actor.train"), Layout(1, 1), np.array([dp]), np.array([micro]))
    return {k: float(np.ravel(v)[0]) for k, v in terms.terms.items()}


def _scaled(op: OpClass, factor: float) -> Efficiencies:
    eta = dict(Efficiencies().eta)
    eta[op] = eta[op] * factor
    return Efficiencies(eta=eta)


def test_overlap_hides_the_all_reduce_up_to_backward_compute() -> None:
    serial = _train_terms(SearchSpace(), 32, 1)
    over = _train_terms(SearchSpace(overlap_dp_sync=("actor.train",)), 32, 1)
    assert {k: v for k, v in over.items() if k != "dp_sync"} == {
        k: v for k, v in serial.items() if k != "dp_sync"
    }
    assert 0 < over["dp_sync"] < serial["dp_sync"]
    # the hidden part is bounded by one micro-batch's backward (2/3 of its compute without recompute)
    p = make_problem(gpus=64)
    accum = p.workload.global_batch / 32
    backward = serial["compute"] / (p.workload.updates_per_step * accum) * 2 / 3
    assert serial["dp_sync"] - over["dp_sync"] <= backward * p.workload.updates_per_step * 1.05
    # slower compute hides more; with compute far slower than the network only the last bucket
    # shows: 8B fp32 gradients in buckets of 4e7 parameters are ~200 buckets
    slow = _scaled(OpClass.GEMM, 0.02)
    hidden = _train_terms(SearchSpace(overlap_dp_sync=("actor.train",)), 32, 1, slow)
    assert 0 < hidden["dp_sync"] < over["dp_sync"]
    assert hidden["dp_sync"] < serial["dp_sync"] * 2 / 100


def test_serial_is_the_default_and_a_single_replica_syncs_nothing() -> None:
    assert SearchSpace().overlap_dp_sync == () and SearchSpace().paged_kv == ()
    assert _train_terms(SearchSpace(overlap_dp_sync=("actor.train",)), 1, 4)["dp_sync"] == 0.0


def test_paged_pool_is_mean_occupancy_in_blocks_never_below_one_p95_sequence() -> None:
    conc = np.array([1.0, 8.0, 64.0])
    full = kv_pool_tokens(conc, 128 + 2048 / 2, 128 + 4096, paged=False)
    paged = kv_pool_tokens(conc, 128 + 2048 / 2, 128 + 4096, paged=True)
    assert np.allclose(full, conc * (128 + 4096))
    blocks = np.ceil((128 + 1024) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    assert paged[0] == np.ceil((128 + 4096) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS  # one p95 sequence
    assert np.allclose(paged[1:], conc[1:] * blocks)
    assert np.all(paged <= full)


def test_lockstep_preemption_by_hand() -> None:
    # c sequences start together in a pool of c·a tokens and grow to b: c·a·ln(b/a) tokens redone
    tokens, mean_len = preempted_tokens(np.array([10.0]), np.array([10.0 * 1000]), 200 + 1800)
    assert float(tokens[0]) == pytest.approx(10 * 1000 * np.log(2.0))
    assert float(mean_len[0]) == pytest.approx(1000 * 2000 * np.log(2.0) / 1000)
    none, _ = preempted_tokens(np.array([10.0]), np.array([10.0 * 2000]), 200 + 1800)
    assert float(none[0]) == 0.0


def _gen(conc: int, paged: bool, model: str = "llama-3.3-70b", tp: int = 2, resp: int = 2048, p95: int = 0):  # type: ignore[no-untyped-def]
    q = PriceQuery(Stage.GEN, tp, 1, 1, 4096, 128, resp, seq_len_p95=p95, concurrency=conc, paged_kv=paged)
    return price(load_model(model), load_cluster("a100-80gb-dgx"), q)


def _largest_fitting(paged: bool) -> int:
    conc = 1
    while _gen(conc * 2, paged).fits and conc < 4096:
        conc *= 2
    return conc


def test_paged_kv_raises_concurrency_over_full_length_reservation() -> None:
    reserved, paged = _largest_fitting(False), _largest_fitting(True)
    assert paged > reserved
    same = _gen(reserved, False), _gen(reserved, True)
    assert same[1].peak_bytes < same[0].peak_bytes
    assert same[1].by_term["preemption"] > 0 and "preemption" not in same[0].by_term
    # more sequences at once beat the recomputation: the paged engine finishes sooner
    assert _gen(paged, True).latency_s < _gen(reserved, False).latency_s


def test_feasibility_still_refuses_a_p95_sequence_that_cannot_fit() -> None:
    # one sequence whose p95 response does not fit next to the weights: refused, paged or not
    huge = 600_000
    assert not _gen(1, True, resp=1024, p95=huge).fits
    assert not _gen(1, False, resp=1024, p95=huge).fits
    assert _gen(1, True, resp=1024, p95=4096).fits


def test_flags_belong_to_their_stage() -> None:
    from nereus.errors import ConfigError

    with pytest.raises(ConfigError, match="--paged-kv prices generation"):
        PriceQuery(Stage.TRAIN, 1, 1, 1, 8, 8, 8, paged_kv=True)
    with pytest.raises(ConfigError, match="--overlap-dp-sync prices training"):
        PriceQuery(Stage.GEN, 1, 1, 1, 8, 8, 8, overlap_dp_sync=True)


def test_cache_keys_on_engine_properties_and_the_job_keeps_them() -> None:
    a = make_problem(space=SearchSpace())
    b = dataclasses.replace(a, space=SearchSpace(overlap_dp_sync=("actor.train",), paged_kv=("actor.gen",)))
    cache = PlanCache()
    assert cache.price_key(a) != cache.price_key(b)
    kept = SearchSpace.urgent().keeping(b.space)
    assert kept.overlap_dp_sync == ("actor.train",) and kept.paged_kv == ("actor.gen",)
