"""How long a collective waits for a peer (``collective_timeout_s``): the experiment's number,
or, from the first step on (``JobLoop.run``), 600 s growing to 5 × the slowest step; a slower step
stretches it on the world and every group already formed, so a long but healthy step never trips
it, and a frozen peer surfaces after it."""

from __future__ import annotations

import subprocess
import sys
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
def test_a_slower_step_stretches_the_timeout_on_the_world_and_the_groups() -> None:
    seen: list[tuple[str, float]] = []
    loop = SimpleNamespace(
        slowest=0.0, spec=spec(), _apply_timeout=lambda s: JobLoop._apply_timeout(loop, s),  # type: ignore[arg-type]
        m=SimpleNamespace(time_collectives_out=lambda t: seen.append(("world", t.total_seconds()))),
        worker=SimpleNamespace(time_collectives_out=lambda t: seen.append(("groups", t.total_seconds()))),
    )  # fmt: skip
    for seconds in (0.5, 90.0, 200.0, 150.0, 200.0, 250.0):
        JobLoop._stretch_timeout(loop, seconds)  # type: ignore[arg-type]
    assert seen == [("world", 1000.0), ("groups", 1000.0), ("world", 1250.0), ("groups", 1250.0)]
    assert loop.slowest == 250.0
    fixed = SimpleNamespace(slowest=0.0, spec=spec(collective_timeout_s=30.0), m=None, worker=None)
    JobLoop._stretch_timeout(fixed, 1e4)  # type: ignore[arg-type]  # nothing to stretch: fixed


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
