"""What a transition sends, checked without processes: on random plan pairs (lost GPUs included,
so restores from the trainer and from storage occur), every planned receive has exactly one
matching send of the same size, every message reads a unit that is there when its wave runs, and
the walk ends with exactly the target units."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter, defaultdict

import pytest
import torch

from nereus.plan.calibration import Efficiencies
from nereus.plan.layout import Layout
from nereus.spec import load_cluster, load_model
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import BufferKind, StatePolicy, rank_buffers
from nereus.state.holder import RankState, StateHolder
from nereus.transition import LinkModel, StageMove, Transition, build_dag, plan_transition
from nereus.transition.dag import Primitive
from nereus.transition.execute import Executor, TransitionError
from nereus.transition.wire import Carry, Message, WirePlan, takes_part, waves
from tests.helpers import make_problem, random_plan

pytestmark = pytest.mark.pure


def walk(tr: Transition) -> dict[str, set[tuple[object, tuple[int, ...]]]]:
    """Replay the executor's walk symbolically; assert the wire invariants; return the units alive
    at the end per model-stage as (layout, GPUs)."""
    plan = WirePlan(tr.dag, tr.moves)
    held: dict[int, set[str]] = defaultdict(set)  # GPU → unit ids it holds a rank of
    for m in tr.moves:
        for u in m.current:
            for g in u.gpus:
                held[g].add(u.id)
    gpus = sorted({g for n in tr.dag.nodes for g in (*n.gpus, *n.sends, *(x for x, _ in n.release))})
    order = tr.schedule.order() if tr.schedule else None
    for wave in waves(tr.dag, order):
        sent: Counter[Message] = Counter()
        expected: Counter[Message] = Counter()
        installs: list[tuple[int, str]] = []
        for i in wave:
            node = tr.dag.nodes[i]
            for g in gpus:
                if not takes_part(node, g):
                    continue
                part = plan.part(node, g)
                for x in part.sends:
                    assert x.src == g and x.src_unit in held[g], (
                        f"{node.describe()}: GPU {g} lacks {x.src_unit}"
                    )
                    sent.update(plan.sent(x))
                if part.receive is None:
                    continue
                r = part.receive
                need = rank_buffers(
                    plan.moves[node.model_stage].model,
                    r.layout,
                    r.t,
                    r.p,
                    plan.moves[node.model_stage].policy,
                )
                if r.whole is None:
                    assert sum(pc.numel for x in r.transfers for pc in x.pieces) == need.payload_numel
                for x in r.transfers:
                    assert x.dst == g
                    assert takes_part(node, x.src), (
                        f"{node.describe()}: provider GPU {x.src} is not in the node"
                    )
                    if x.carry is Carry.LOCAL:
                        assert x.src_unit in held[g]
                    expected.update(plan.expected(x))
                installs.append((g, r.unit))
        assert sent == expected, (
            f"wave {wave}: sends {sent - expected} / receives {expected - sent} unmatched"
        )
        pairs = Counter((msg.src, msg.dst, msg.tag) for msg in sent)
        assert max(pairs.values(), default=1) == 1, "two messages share (source, destination, tag) in a wave"
        for i in wave:  # what each node's finish does on every GPU that takes part
            node = tr.dag.nodes[i]
            for g in gpus:
                if takes_part(node, g):
                    if node.primitive is Primitive.DESTROY:
                        held[g].discard(node.inputs[0])
                    held[g].difference_update(node.frees)
            if node.source == "storage":
                unit = plan.units[node.outputs[0]]
                installs += [(g, unit.id) for g in unit.gpus]
        for g, uid in installs:
            held[g].add(uid)
    alive: dict[str, set[tuple[object, tuple[int, ...]]]] = defaultdict(set)
    for uid in {u for us in held.values() for u in us}:
        unit = plan.units[uid]
        assert all(uid in held[g] for g in unit.gpus), f"{uid} is incomplete at the end"
        alive[unit.model_stage].add((unit.layout, unit.gpus))
    return alive


@pytest.mark.parametrize(
    ("model", "precision", "lose"),
    [
        ("tiny-llama", Precision.FP32, 0),
        ("tiny-qwen3", Precision.BF16_MIXED, 0),
        ("tiny-llama", Precision.BF16_MIXED, 1),
        ("tiny-qwen3", Precision.FP32, 2),
    ],
)
def test_every_receive_has_exactly_one_matching_send(model: str, precision: Precision, lose: int) -> None:
    rng = random.Random(f"{model}/{precision}/{lose}")
    problem = make_problem(model=model, cluster="local-cpu", gpus=8, response=32, precision=precision)
    checked = restores = 0
    for _ in range(400):
        a = random_plan(rng, problem, (1, 2, 4))
        lost = frozenset(rng.sample(sorted({g for c in a.candidates for g in c.gpus}), lose))
        left = dataclasses.replace(problem, pool=tuple(g for g in problem.pool if g not in lost))
        b = random_plan(rng, left, (1, 2, 4))
        try:
            tr = plan_transition(problem, a, b, lost)
        except ValueError:  # NoSourceError: a trainer lost its last replica
            continue
        if not tr.feasible or not tr.dag.nodes:
            continue
        alive = walk(tr)
        for m in tr.moves:
            if not m.unchanged:
                assert alive[m.name] == {(v.layout, v.gpus) for v in m.target}
        checked += 1
        restores += any(n.source for n in tr.dag.nodes)
        if checked == 30:
            break
    assert checked == 30
    assert restores or not lose


def test_bad_buffers_and_positions_are_refused_before_anything_moves() -> None:
    m = load_model("tiny-llama")
    policy = StatePolicy.of(Stage.TRAIN, Precision.FP32)
    good = RankState.empty("actor.train", m, Layout(2, 1), 0, 0, policy)
    with pytest.raises(ValueError, match=r"exp_avg: expected a flat torch\.float32 buffer"):
        bufs = dict(good.buffers)
        bufs[BufferKind.EXP_AVG] = bufs[BufferKind.EXP_AVG][:-1]
        RankState("actor.train", m, Layout(2, 1), 0, 0, policy, bufs)
    with pytest.raises(ValueError, match="float32"):
        bufs = dict(good.buffers)
        bufs[BufferKind.PARAM] = bufs[BufferKind.PARAM].to(torch.bfloat16)
        RankState("actor.train", m, Layout(2, 1), 0, 0, policy, bufs)
    # the holder says (2, 1) rank 0, the plan puts a (1, 1) unit on this GPU
    move = StageMove.between("actor.train", m, policy, Layout(1, 1), ((0,),), Layout(1, 1), ((0,),))
    dag = build_dag([move], {"actor.train": 2}, LinkModel(load_cluster("local-cpu"), Efficiencies()), 2**40)
    holder = StateHolder(0)
    holder.units["actor.train"] = good
    with pytest.raises(TransitionError, match=r"rank 0: holds actor\.train tp2·pp1"):
        Executor(dag, [move], holder, {0: 0}).run()
    assert holder.units == {"actor.train": good}  # untouched


def test_waves_group_ready_nodes_and_never_split_an_edge() -> None:
    problem = make_problem(model="tiny-llama", cluster="local-cpu", gpus=4, response=32)
    rng = random.Random(5)
    concurrent = 0
    for _ in range(20):
        a, b = random_plan(rng, problem, (1, 2, 4)), random_plan(rng, problem, (1, 2, 4))
        tr = plan_transition(problem, a, b)
        if not tr.feasible:
            continue
        grouped = waves(tr.dag)
        where = {i: w for w, wave in enumerate(grouped) for i in wave}
        assert sorted(where) == list(range(len(tr.dag.nodes)))
        assert all(where[e.src] < where[e.dst] for e in tr.dag.edges)
        concurrent += any(len(w) > 1 for w in grouped)
    assert concurrent  # independent primitives do share waves
