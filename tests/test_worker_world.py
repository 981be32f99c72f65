"""A worker's world is its generation's GPU ids in rank order, which need not be 0…n − 1."""

from __future__ import annotations

import pytest

from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.plan.layout import Layout
from nereus.runtime.worker import Worker
from nereus.spec import Role, load_cluster, load_model, load_workload

pytestmark = pytest.mark.pure


def test_a_newcomer_whose_gpu_id_is_past_the_world_size_gets_its_rank() -> None:
    """Two newcomers accepted in one round as GPUs 4 and 6 (the first worker of each grown node,
    GPU ids node-aligned) form a world of six with 0–3: GPU 6 is rank 5. The worker took its first
    world as ranks 0…5 and failed (KeyError 6) before the generation's GPU ids reached it."""
    model = load_model("tiny-llama")
    members = (0, 1, 2, 3, 4, 6)
    worker = Worker(
        6, load_workload("ppo-tiny"), dict.fromkeys(Role, model), load_cluster("local-cpu"), {}, 0,
        lambda name: "torch", members=members,
    )  # fmt: skip
    assert worker.rank_of == {g: r for r, g in enumerate(members)} and worker.holder.rank == 5


@pytest.mark.parametrize(
    ("layout", "ranks", "kind"), [(Layout(2, 1), (1, 0), "tp"), (Layout(1, 2), (3, 2), "pp")]
)
def test_a_tp_or_pp_group_whose_ranks_descend_is_refused(
    layout: Layout, ranks: tuple[int, ...], kind: str
) -> None:
    """Torch orders a group by rank: a TP rank's vocabulary shard and mesh coordinate, a pipeline
    stage's peers are its group rank, so a grid that would give them in another order is refused
    before any group is made (a DP group may come in any order: it only sums)."""
    model = load_model("tiny-llama")
    with pytest.raises(ValueError, match=rf"{kind} group \[{ranks[0]}, {ranks[1]}\]: ranks must ascend"):
        Groups.build(Grid(layout, ranks), model, ranks[0])
