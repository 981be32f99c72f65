"""Which errors the runtime's loop takes for a peer that is gone (the survivors regroup) and
which it lets through (a bug here): gloo's own words, as these machines' torch prints them."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from nereus.runtime.comm import is_peer_failure

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
