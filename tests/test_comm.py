"""The runtime's control collectives (``nereus.runtime.comm``) in a spawned 3-rank gloo world: a
message that fits its slot is one collective, a larger one arrives whole in two, ``gather``
brings every rank's message to one rank only, and a bad length is refused; the boundary's
``Notice`` round-trips and is exactly one of a stop, a pool change or an action."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from nereus.control.action import Keep
from nereus.runtime import comm
from nereus.runtime.codec import MAX_BYTES, MessageError, decode, encode
from nereus.runtime.monitor import Notice
from nereus.runtime.pool import Change
from tests.helpers import spawned

pytestmark = pytest.mark.dist

WORLD = 3


def _big(rank: int) -> str:
    return f"r{rank}:" + "x" * (comm.ROOM + 1000 * rank)  # longer than a slot from rank 1 on


def _rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    calls: list[str] = []
    for name in ("broadcast", "all_gather", "gather", "send", "recv"):
        real = getattr(dist, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls.append(_name)
            return _real(*a, **k)

        setattr(dist, name, counted)
    out: dict[str, Any] = {}
    calls.clear()
    out["small"] = comm.broadcast(Keep("quiet") if rank == 0 else None, Keep).reason
    out["small_calls"] = list(calls)
    calls.clear()
    out["large"] = comm.broadcast(_big(0) if rank == 0 else None, str) == _big(0)
    out["large_calls"] = list(calls)
    calls.clear()
    out["gathered_small"] = comm.all_gather(rank * 10, int)
    out["gathered_small_calls"] = list(calls)
    mixed = _big(rank) if rank == 2 else f"r{rank}"
    out["gathered_mixed"] = comm.all_gather(mixed, str) == ["r0", "r1", _big(2)]
    calls.clear()
    got = comm.gather(_big(rank) if rank else "r0", str, dst=0)
    out["gather_calls"] = list(calls)
    out["gather"] = None if got is None else got == ["r0", _big(1), _big(2)]
    calls.clear()
    notice = comm.broadcast(Notice(action=Keep("x")) if rank == 0 else None, Notice)
    out["notice"] = notice.action.reason if notice.action is not None else None
    out["notice_calls"] = list(calls)
    Path(folder, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_small_messages_take_one_collective_and_large_ones_arrive_whole(tmp_path: Path) -> None:
    assert spawned(_rank, WORLD, tmp_path, timeout_s=100) == [0] * WORLD
    got = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    for r, g in enumerate(got):
        assert g["small"] == "quiet" and g["small_calls"] == ["broadcast"], (r, g)
        assert g["large"] and g["large_calls"] == ["broadcast", "broadcast"], r
        assert g["gathered_small"] == [0, 10, 20] and g["gathered_small_calls"] == ["all_gather"], r
        assert g["gathered_mixed"], r
        assert g["notice"] == "x" and g["notice_calls"] == ["broadcast"], r
    assert got[0]["gather"] is True and got[0]["gather_calls"] == ["gather", "recv", "recv"]
    for r in (1, 2):
        assert got[r]["gather"] is None and got[r]["gather_calls"] == ["gather", "send"], r


def test_a_slot_announcing_a_bad_length_is_refused() -> None:
    slot = comm._slot(b"{}")
    assert comm._length(slot, "rank 1") == 2 and comm._first(slot, 2) == b"{}"
    for n in (0, -1, MAX_BYTES + 1):
        slot[: comm.HEAD] = comm._bytes(n.to_bytes(comm.HEAD, "little", signed=True))
        with pytest.raises(MessageError, match="rank 1 announced"):
            comm._length(slot, "rank 1")


def test_a_notice_is_exactly_one_of_stop_change_action() -> None:
    change = Change(4, (0, 1, 2), 3, leaving=(3,))
    for notice in (Notice(preempted=True), Notice(change=change), Notice(action=Keep("quiet"))):
        assert decode(encode(notice), Notice) == notice
    for bad in ({}, {"preempted": True, "action": Keep()}, {"change": change, "action": Keep()}):
        with pytest.raises(ValueError, match="exactly one"):
            Notice(**bad)  # type: ignore[arg-type]
