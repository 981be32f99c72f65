"""Peers coming and going, the pure rules: which errors the runtime's loop takes for a peer that
is gone (the survivors regroup) and which it lets through (a bug here), in gloo's own words as
these machines' torch prints them; and which GPU ids a grown node's newcomers get."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from nereus.runtime.comm import is_peer_failure
from nereus.runtime.pool import joiner_gpu, node_blocks

pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    "text",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4711",
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer",
        # a peer died while a new group (weight sync's, a transition's) connected to it: found by
        # the SLURM node-down test, where it killed a survivor on another node
        "Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "pair.h:311] Connect timeout [127.0.0.1]:63180",
        "Gloo connectFullMesh failed with [pair.cc:1020] Connection refused [127.0.0.1]:1234",
    ],
)
def test_a_peer_gone_is_a_peer_failure(text: str) -> None:
    assert is_peer_failure(RuntimeError(text))
    assert is_peer_failure(dist.DistError(text))  # NCCL's backend errors, whatever they say


def test_a_bug_here_is_not_a_peer_failure() -> None:
    assert not is_peer_failure(RuntimeError("The size of tensor a (33) must match the size of tensor b (34)"))
    assert not is_peer_failure(ValueError("Connection closed"))  # only the backends' RuntimeErrors


def test_a_nodes_newcomers_get_its_block_of_gpu_ids_whatever_order_they_ask_in() -> None:
    """SLURM starts a grown node's processes in any order (n3's and n4's interleave): each node's
    GPUs must still be one node to the planner and the failure domains (ids k·per_node …)."""
    hosts = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}
    taken, blocks = set(hosts), node_blocks(hosts, 2)
    assert blocks == {"n1": 0, "n2": 1}
    got = {}
    for node in ("n4", "n3", "n3", "n4"):
        gpu = joiner_gpu(node, taken, blocks, 2, 8)
        taken.add(gpu)
        got.setdefault(node, []).append(gpu)
    assert got == {"n4": [4, 5], "n3": [6, 7]}
    assert joiner_gpu("n5", taken, blocks, 2, 8) == 8  # no block left: the lowest free id
    taken = {0, 1, 2, 3, 5}  # a gap: GPU 4 left, its node's GPU 5 stayed
    assert joiner_gpu("n2", taken, {"n1": 0, "n2": 1, "n3": 2}, 2, 8) == 4  # n2's block is full
    assert joiner_gpu("n9", taken, {"n1": 0, "n2": 1, "n3": 2}, 2, 8) == 6  # the first free block
