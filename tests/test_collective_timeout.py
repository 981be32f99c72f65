"""How long a collective of a step waits for a peer (``collective_timeout_s``): the experiment's
number, or 600 s growing to 5 × the slowest step, so a long but healthy step never trips it and a
frozen peer surfaces after it; set on the world and every group already formed at each step's
start, and the formation's 30 minutes back for the boundary's work."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from nereus.runtime.experiment import ExperimentSpec
from nereus.runtime.loop import JobLoop


def spec(**extra: object) -> ExperimentSpec:
    return ExperimentSpec(name="x", workload="ppo-tiny", model="tiny-llama", **extra)  # type: ignore[arg-type]


@pytest.mark.pure
def test_the_timeout_is_the_experiments_or_grows_with_the_slowest_step() -> None:
    auto = spec()
    assert auto.collective_timeout() == auto.collective_timeout(100.0) == 600.0  # NCCL's, Megatron's
    assert auto.collective_timeout(300.0) == 1500.0  # five slowest steps
    assert auto.collective_timeout(1e9) == 86_400.0  # a day at most
    assert spec(collective_timeout_s=5.0).collective_timeout(300.0) == 5.0  # fixed: never stretched


@pytest.mark.pure
def test_a_step_waits_its_timeout_and_the_boundary_the_formations() -> None:
    """Around each step the world and the worker's groups get the step's timeout (600 s, or 5 ×
    the slowest step so far), then the formation's 30 minutes back for the boundary's work (a
    checkpoint, a move's engine builds, a join)."""
    import nereus.runtime.loop as loop_module

    seen: list[tuple[str, float]] = []
    loop = SimpleNamespace(
        step=0, slowest=0.0, spec=spec(), m=SimpleNamespace(timeout=timedelta(minutes=30)),
        worker=SimpleNamespace(time_collectives_out=lambda t: seen.append(("groups", t.total_seconds()))),
        _rl_step=lambda step: SimpleNamespace(seconds=[300.0, 20.0][step]),
    )  # fmt: skip
    loop._time_collectives = lambda s: JobLoop._time_collectives(loop, s)  # type: ignore[arg-type]
    original = loop_module.set_world_timeout
    loop_module.set_world_timeout = lambda t: seen.append(("world", t.total_seconds()))
    try:
        for k in range(2):
            loop.step = k
            with pytest.raises(AttributeError):  # stops at the checkpoint, past what is checked
                JobLoop._step(loop)  # type: ignore[arg-type]
    finally:
        loop_module.set_world_timeout = original
    assert seen == [
        ("world", 600.0), ("groups", 600.0), ("world", 1800.0), ("groups", 1800.0),  # step 0
        ("world", 1500.0), ("groups", 1500.0), ("world", 1800.0), ("groups", 1800.0),  # after 300 s
    ]  # fmt: skip
    assert loop.slowest == 300.0
    assert loop.worker.p2p_timeout == timedelta(seconds=1500)  # the groups formed from now on


GROUPS = """
import datetime, sys, torch, torch.distributed as dist
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.devices import set_world_timeout
from nereus.plan.layout import Layout
from nereus.spec import load_model
rank = int(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=rank, world_size=2)
g = Groups.build(Grid(Layout(2, 1), (0, 1)), load_model("tiny-llama"), rank, datetime.timedelta(seconds=30))
before = {pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in g.created}
g.time_out(datetime.timedelta(seconds=4))
set_world_timeout(datetime.timedelta(seconds=5))
after = {pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in g.created}
world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
print(len(g.created), sorted(before), sorted(after), world)
dist.barrier()
"""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_groups_already_formed_take_a_new_timeout(tmp_path: Path) -> None:
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", GROUPS, str(tmp_path / "store"), str(r)], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    for p in ranks:
        out = p.communicate(timeout=100)[0].split()
        assert p.returncode == 0 and int(out[0]) > 0 and out[1:] == ["[30.0]", "[4.0]", "5.0"], out


P2P = """
import datetime, sys, time, torch, torch.distributed as dist
from nereus.backends.grid import Grid
from nereus.backends.groups import Groups
from nereus.plan.layout import Layout
from nereus.spec import load_model
rank = int(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=rank, world_size=2)
g = Groups.build(Grid(Layout(2, 1), (0, 1)), load_model("tiny-llama"), rank, datetime.timedelta(seconds=2))
g.time_out(datetime.timedelta(seconds=60))  # the boundary's, for collectives
dist.barrier(group=g.tp)
if rank == 0:
    t = time.monotonic()
    try:
        dist.send(torch.ones(4), 1, group=g.tp)  # rank 1 never receives
        print("sent")
    except RuntimeError:
        print(f"{time.monotonic() - t:.1f}")
else:
    time.sleep(20)
"""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_pipeline_send_to_a_silent_peer_fails_after_the_groups_creation_timeout(tmp_path: Path) -> None:
    """gloo fixes how long a send or receive waits when its group is created (``set_timeout``
    reaches collectives only): groups formed with the step's timeout bound a pipeline's sends to
    a frozen peer by it, even while their collectives have the boundary's longer one."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", P2P, str(tmp_path / "store"), str(r)], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    out = ranks[0].communicate(timeout=100)[0].split()
    ranks[1].kill()
    assert ranks[0].returncode == 0 and out != ["sent"] and 1.5 <= float(out[0]) < 15, out
