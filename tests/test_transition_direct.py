"""Re-layouts straight from one replica (``local._direct``): the planner assembles each target
unit from one current unit, each GPU acquiring only its target shard, where that is shorter than
Split → Extend → Merge or where every commit order of that runs out of memory (its Extends copy
whole T_sub shards onto GPUs that keep only a slice of them); on gloo (4 spawned ranks) that
leaves every buffer byte for byte as the Split → Extend → Merge path does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.transition import LinkModel, StageMove, build_dag, plan_transition
from nereus.transition.build import CommitOrder, _Locals, initial_bytes
from nereus.transition.choose import plan_dag
from nereus.transition.dag import Primitive
from nereus.transition.local import applies_direct
from tests.helpers_spawn import world
from tests.test_execute_zero_copy import STAGE, TIMEOUT_S, WORLD, _run, _same, reshards, start
from tests.transition_cases import GOLDEN, plan_of, problem_of

LINKS = LinkModel(load_cluster("local-cpu"), Efficiencies())


def _deeper() -> StageMove:
    """Two whole replicas on GPUs 0 and 1 re-laid out as one pp2 unit on GPUs 2 and 3."""
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    return StageMove.between(
        STAGE, load_model("tiny-llama"), policy, Layout(1, 1), ((0,), (1,)), Layout(1, 2), ((2, 3),)
    )


@pytest.mark.pure
def test_where_extends_of_whole_shards_do_not_fit_the_target_unit_is_assembled_straight() -> None:
    move = _deeper()
    whole = initial_bytes([move])[0]  # a whole replica's state
    # GPUs 2 and 3: more than a pp2 shard, less than the whole copy an Extend lands first
    cap = {0: whole, 1: whole, 2: whole * 3 // 4, 3: whole * 3 // 4}
    assert not build_dag([move], {STAGE: 2}, LINKS, cap).feasible
    dag, sched = plan_dag([move], {STAGE: 2}, LINKS, cap)
    assert dag.feasible and sched is not None, dag.reason
    assert all(dag.peak[g] <= cap[g] for g in dag.peak)
    merges = [n for n in dag.nodes if n.primitive is Primitive.MERGE]
    assert len(merges) == 1 and set(merges[0].gpus) == {2, 3}
    (src,) = merges[0].inputs
    assert set(dag.units[src].gpus) <= {0, 1}  # from a replica on other GPUs
    destroyed = {n.inputs[0] for n in dag.nodes if n.primitive is Primitive.DESTROY}
    assert destroyed == {u.id for u in move.current}  # both replicas freed, the source after it
    # with room for the whole copies both fit, as fast: the planner keeps Split → Extend → Merge
    roomy, _ = plan_dag([move], {STAGE: 2}, LINKS, 2**40)
    assert roomy.feasible and any(n.primitive is Primitive.EXTEND for n in roomy.nodes)


@pytest.mark.pure
@pytest.mark.parametrize("name", ["random pair 8 (8 GPUs)", "random pair 38 (16 GPUs)"])
def test_where_the_direct_re_layout_is_shorter_it_is_kept(name: str) -> None:
    """Both fit; assembling each target unit straight from one replica takes half as long here
    (each GPU receives only its shard), so it is the plan (it was planned only for memory)."""
    case = next(c for c in json.loads(GOLDEN.read_text()) if c["name"] == name)
    problem = problem_of(case)
    current, target = plan_of(case["current"], problem), plan_of(case["target"], problem)
    kept = plan_transition(problem, current, target)
    plain = plan_transition(problem, current, target, direct=False)
    assert plain.feasible and kept.l_tran_s < 0.75 * plain.l_tran_s
    assert sum(n.primitive is Primitive.EXTEND for n in kept.dag.nodes) < sum(
        n.primitive is Primitive.EXTEND for n in plain.dag.nodes
    )


@pytest.mark.pure
def test_a_move_onto_its_own_gpus_or_with_its_layout_kept_is_not_direct() -> None:
    move = _deeper()
    kept = StageMove.between(STAGE, move.model, move.policy, Layout(1, 1), ((0,),), Layout(1, 1), ((2,),))
    own = StageMove.between(STAGE, move.model, move.policy, Layout(1, 2), ((0, 1),), Layout(2, 1), ((0, 1),))
    assert applies_direct(move) and not applies_direct(kept) and not applies_direct(own)


def _direct_worker(rank: int, store: str, seed: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        moves = [m for _, _, m in reshards(24, seed) if applies_direct(m)][:8]
        assert len(moves) >= 4
        for k, move in enumerate([_deeper(), *moves]):
            via_sub = build_dag([move], {STAGE: 2}, LINKS, 2**40)
            direct = _Locals([move], LINKS, 2**40, direct=True).commit({STAGE: 2}, CommitOrder.SPLITS_FIRST)
            assert direct.feasible and not any(n.primitive is Primitive.EXTEND for n in direct.nodes)
            _, want = _run(via_sub, [move], start(move, rank), rank, True)
            for zero_copy in (True, False):
                _, got = _run(direct, [move], start(move, rank), rank, zero_copy)
                _same(got, want, f"move {k} rank {rank} zero_copy={zero_copy}")
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(TIMEOUT_S)
def test_a_direct_re_layout_leaves_the_state_of_split_extend_merge(tmp_path: Path) -> None:
    """Random re-layouts onto other GPUs (both precisions, random DP and GPU order) and the
    deeper-pipeline move above: every buffer and logical state as Split → Extend → Merge leaves
    them, zero-copy and packed."""
    world(_direct_worker, (str(tmp_path / "store"), 5, str(tmp_path)), WORLD)
    assert all((tmp_path / f"ok{r}").exists() for r in range(WORLD))
