"""Pool changes and shrink requests: the format nereus-launch writes and the runtime reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.jobdir import write_shrink
from nereus.runtime.leader import Leader
from nereus.runtime.pool import (
    Change,
    ShrinkRequest,
    drain_gpus,
    read_shrink_requests,
    refuse_shrinks,
    refused_shrinks,
    retake_shrinks,
)
from tests.test_inventory import leader

pytestmark = pytest.mark.pure


def test_what_the_launcher_writes_the_runtime_reads(tmp_path: Path) -> None:
    first = write_shrink(tmp_path, ShrinkRequest(1, unix_ms=1_700_000_000_000))
    write_shrink(tmp_path, ShrinkRequest(2, unix_ms=1_700_000_000_001))
    assert first.parent == tmp_path / "control" and oct(first.parent.stat().st_mode & 0o777) == "0o700"
    assert ShrinkRequest.parse(first) == ShrinkRequest(1, 1_700_000_000_000)
    log: list[str] = []
    nodes, done = read_shrink_requests(tmp_path / "control", log.append)
    assert nodes == 3
    assert (
        [p.name for p in done]
        == sorted(p.name for p in (tmp_path / "control").iterdir())
        == [
            ".done-shrink-1700000000000.json",
            ".done-shrink-1700000000001.json",
        ]
    )
    assert read_shrink_requests(tmp_path / "control", log.append) == (0, ()) and not log  # read once
    refuse_shrinks(done, "the job does not fit on GPUs [0, 1]")
    assert refused_shrinks(tmp_path / "control") == {
        "shrink-1700000000000.json": "the job does not fit on GPUs [0, 1]",
        "shrink-1700000000001.json": "the job does not fit on GPUs [0, 1]",
    }
    assert read_shrink_requests(tmp_path / "control", log.append) == (0, ())  # not read as pending


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("{nope", "unreadable"),
        ('{"nodes": 0}', "positive integer"),
        ('{"nodes": -2}', "positive integer"),
        ('{"nodes": "2"}', "positive integer"),
        ('{"nodes": true}', "positive integer"),
        ('{"nodes": 1, "extra": 1}', 'expected {"nodes": K}'),
        ("[1]", 'expected {"nodes": K}'),
    ],
)
def test_a_bad_request_is_set_aside_and_logged(tmp_path: Path, body: str, why: str) -> None:
    control = tmp_path / "control"
    control.mkdir()
    (control / "shrink-5.json").write_text(body)
    (control / "shrink-6.json").write_text('{"nodes": 1}')
    log: list[str] = []
    assert read_shrink_requests(control, log.append)[0] == 1  # the good one still counts
    assert (control / ".bad-shrink-5.json").read_text() == body  # kept for the user, not parsed again
    assert len(log) == 1 and "shrink-5.json" in log[0] and why in log[0]


def test_no_control_folder_means_no_request(tmp_path: Path) -> None:
    assert read_shrink_requests(None, print) == (0, ())
    assert read_shrink_requests(tmp_path / "missing", print) == (0, ())
    assert refused_shrinks(tmp_path / "missing") == {}


def test_drains_take_whole_nodes_newest_first_never_the_leaders() -> None:
    members = (0, 1, 2, 3, 4, 5)
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    assert drain_gpus(1, members, hosts, leader=0) == ((4, 5), "")
    assert drain_gpus(2, members, hosts, leader=0) == ((2, 3, 4, 5), "")
    gpus, why = drain_gpus(3, members, hosts, leader=0)  # the leader's node never leaves
    assert gpus == () and "only 2 can leave" in why
    assert drain_gpus(0, members, hosts, leader=0) == ((), "")
    assert drain_gpus(1, members, {}, leader=0) == ((5,), "")  # unknown hosts: a GPU is a node


def test_a_change_knows_whether_the_world_re_forms() -> None:
    drain = Change(4, (0, 1, 2, 3), 2, draining=(2, 3))
    assert not drain.reforms and drain.after_drain == (0, 1)
    assert Change(4, (0, 1, 2), 3, leaving=(3,)).reforms
    assert Change(4, (0, 1, 2, 3), 3, joining=(3,)).reforms
    with pytest.raises(ValueError, match="leavers must not be members"):
        Change(4, (0, 1, 3), 3, leaving=(3,))
    with pytest.raises(ValueError, match="positive integer"):
        ShrinkRequest(0)


def _draining_leader(tmp_path: Path, survivors: tuple[int, ...]) -> Leader:
    """A leader that read one shrink request and is moving off GPUs 2 and 3, after a failed step
    left ``survivors`` (a real leader needs a running job: only what the bookkeeping reads)."""
    tmp_path.mkdir(exist_ok=True)
    write_shrink(tmp_path, ShrinkRequest(1, unix_ms=1_700_000_000_000))
    lead = leader(members=survivors)  # with the membership these hooks read
    _, lead.shrinks = read_shrink_requests(tmp_path / "control", lead.m.log)
    lead.draining = (2, 3)
    return lead


def test_a_drain_whose_move_failed_is_asked_again_at_the_next_boundary(tmp_path: Path) -> None:
    """The move off the drained node failed (another peer lost in it): the node still holds its
    state and stays in the job, so its request is pending again, not counted as carried out."""
    lead = _draining_leader(tmp_path, (0, 2, 3))
    lead.unfinished_drain()
    assert read_shrink_requests(tmp_path / "control", list[str]().append)[0] == 1
    assert lead.draining == () and "their shrink is taken again" in lead.m.lines[-1]  # type: ignore[attr-defined]
    lead.unfinished_drain()  # a later failure: nothing draining, nothing touched
    assert refused_shrinks(tmp_path / "control") == {}


def test_a_drain_that_lost_part_of_its_node_is_refused_and_one_that_lost_all_is_done(
    tmp_path: Path,
) -> None:
    lead = _draining_leader(tmp_path / "part", (0, 1, 2))
    lead.unfinished_drain()
    why = refused_shrinks(tmp_path / "part" / "control")["shrink-1700000000000.json"]
    assert "failed and GPUs [3] were lost" in why
    lead = _draining_leader(tmp_path / "all", (0, 1))
    lead.unfinished_drain()
    assert [p.name for p in (tmp_path / "all" / "control").iterdir()] == [".done-shrink-1700000000000.json"]


def test_a_request_written_again_meanwhile_is_kept_over_the_one_taken_back(tmp_path: Path) -> None:
    request = write_shrink(tmp_path, ShrinkRequest(1, unix_ms=1_700_000_000_000))
    _, done = read_shrink_requests(tmp_path / "control", list[str]().append)
    request.write_text('{"nodes": 2}')
    retake_shrinks(done)
    assert [p.name for p in (tmp_path / "control").iterdir()] == [request.name]
    assert ShrinkRequest.parse(request).nodes == 2


def test_a_pool_change_is_one_line_of_the_membership_log() -> None:
    from nereus.runtime.poolkeeping import describe_change

    lost = Change(5, (0, 1, 2), 3, leaving=(3,))
    assert describe_change(lost) == "before step 5: GPUs 3 leave (scripted); generation 3 has GPUs 0-2"
    both = Change(7, (0, 2, 4), 4, leaving=(1, 3), joining=(4,))
    assert describe_change(both, condemned=(3,)) == (
        "before step 7: GPUs 1 leave (scripted); GPUs 3 leave (unhealthy); GPUs 4 join; "
        "generation 4 has GPUs 0,2,4"
    )
    drain = Change(9, (0, 1, 2, 3), 4, draining=(2, 3))
    assert describe_change(drain) == (
        "before step 9: GPUs 2-3 drain (shrink), leaving GPUs 0-1; generation 4 has GPUs 0-3"
    )
    big = Change(3, tuple(g for g in range(1024) if g != 700), 2, leaving=(700,))
    assert describe_change(big).endswith("has GPUs 0-699,701-1023")  # within the log's line limit
