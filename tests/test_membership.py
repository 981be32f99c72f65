"""Membership: signed joins (a stranger is refused and logged), and a world re-formed in place
after a member dies (survivors keep their tensors; the dead one is detected within seconds)."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nereus.runtime import rendezvous
from nereus.runtime.membership import (
    JOIN_QUEUE,
    FormationError,
    JoinRefusedError,
    LeftBehindError,
    Membership,
    Rendezvous,
)
from nereus.runtime.signed import BoundedLog, SignedStore
from tests.helpers import spawned

pytestmark = pytest.mark.dist

SECRET = bytes(range(32))


def _ask(m: Membership, out: dict[str, object], gpu: int | None = None, timeout_s: float = 30) -> None:
    try:
        out["answer"] = m.request_join(gpu, timeout_s=timeout_s)
    except JoinRefusedError as exc:
        out["refused"] = str(exc)


def _pending(leader: Membership, n: int) -> list[object]:
    deadline = time.monotonic() + 10
    got: list[object] = []
    while len(got) < n and time.monotonic() < deadline:
        got += leader.pending_joins()
        time.sleep(0.02)
    return got


def test_a_join_without_the_secret_is_refused_and_logged(tmp_path: Path) -> None:
    log = tmp_path / "membership.log"
    leader = Membership.host(SECRET, log=log)
    leader.members = (0, 1)
    stranger = Membership.connect(leader.rendezvous, b"not the secret" * 3, -1)
    friend = Membership.connect(leader.rendezvous, SECRET, -1)
    s_out: dict[str, object] = {}
    f_out: dict[str, object] = {}
    threads = [
        threading.Thread(target=_ask, args=(stranger, s_out, None, 8)),
        threading.Thread(target=_ask, args=(friend, f_out, 5)),
    ]
    for t in threads:
        t.start()
    (req,) = _pending(leader, 1)  # the stranger's request is refused inside pending_joins
    leader.answer(req, 5, 1, (0, 1, 5))  # type: ignore[arg-type]
    for t in threads:
        t.join(15)
    assert "could not verify this request" in str(s_out["refused"])  # a note, never an answer
    assert f_out["answer"] == (5, 1, (0, 1, 5))
    text = log.read_text()
    assert "refused join request" in text and "bad secret" in text and "accepted join request" in text


def _host_and_wait(ports: Any) -> None:
    m = Membership.host(SECRET, address="127.0.0.1")
    ports.put(m.rendezvous.port)
    time.sleep(120)  # until killed


@pytest.mark.timeout(120)
def test_a_join_whose_leader_goes_away_before_answering_is_refused() -> None:
    """The job ended (its leader and store gone) while a newcomer, or a worker left behind asking
    to rejoin, waited for an answer: one line, not the store's error (a traceback)."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    leader = ctx.Process(target=_host_and_wait, args=(ports,))
    leader.start()
    try:
        newcomer = Membership.connect(Rendezvous("127.0.0.1", ports.get(timeout=60)), SECRET, -1)
        out: dict[str, object] = {}
        asking = threading.Thread(target=_ask, args=(newcomer, out, 3, 60))
        asking.start()
        time.sleep(1.0)  # the request is queued, no answer yet
    finally:
        leader.kill()
        leader.join()
    asking.join(30)
    assert "the job's rendezvous closed before answering" in str(out.get("refused")), out


def test_replayed_forged_and_malformed_requests_are_refused_never_fatal(tmp_path: Path) -> None:
    leader = Membership.host(SECRET, log=tmp_path / "m.log")
    signed = SignedStore(leader.store, SECRET)
    body = {"ticket": "ab" * 16, "time": time.time(), "host": "h", "pid": 1, "gpu": None}
    good = signed.envelope(JOIN_QUEUE, body)
    stale = signed.envelope(JOIN_QUEUE, {**body, "ticket": "cd" * 16, "time": time.time() - 3600})
    moved = signed.envelope(
        "join/answer/" + "ab" * 16, {**body, "ticket": "ef" * 16}
    )  # signed for another key
    hostile = [
        good,
        good,
        stale,
        moved,
        "{not json",
        b"\xff\xfe",
        json.dumps({"value": body, "mac": "\u00e9" * 64}),
        json.dumps({"value": body, "mac": 5}),
        json.dumps([1, 2]),
        "x" * 10_000,
        SignedStore(leader.store, b"not the secret" * 3).envelope(JOIN_QUEUE, {**body, "ticket": "12" * 16}),
    ]
    for raw in hostile:
        leader.store.queue_push(JOIN_QUEUE, raw)
    accepted = leader.pending_joins()
    assert [r.ticket for r in accepted] == ["ab" * 16]
    stale_answer = signed.read("join/answer/" + "cd" * 16)
    assert "replayed or stale" in stale_answer["refused"]
    for ticket in ("12" * 16, "ef" * 16):  # another secret, or signed for another key: no answer at all,
        assert not leader.store.check(["join/answer/" + ticket])  # so a stranger cannot make one
    text = (tmp_path / "m.log").read_text()
    assert "malformed" in text or "bad secret" in text


def test_forged_store_entries_are_ignored_and_the_log_stays_bounded(tmp_path: Path) -> None:
    log = tmp_path / "m.log"
    leader = Membership.host(SECRET, log=log)
    leader.members = (0, 1)
    assert leader._silent(1, True, {}, 0.0, 0.0)  # a member that never beat: gone at once
    leader.signed.put("hb/1", {"t": time.time() - 10})
    beats: dict[int, Any] = {}
    assert not leader._silent(1, True, beats, 0.0, 0.0)  # a beat the leader sees for the first time
    assert leader._silent(1, True, beats, 0.0, 4.0)  # unchanged 4 s of the leader's clock: gone
    for garbage in (
        "not a number",
        json.dumps({"value": {"t": 1e18}, "mac": "0" * 64}),
        "\x00",
        leader.signed.envelope("hb/1", {"t": 1.0, "hold": 1e9}),  # a hold no member of ours says
        leader.signed.envelope("hb/1", [1.0]),
    ):
        leader.store.set("hb/1", garbage)  # a stranger's heartbeat for GPU 1: says nothing either way
        assert leader._silent(1, True, {}, 0.0, 1e6) is False
        leader.store.set("host/1", garbage)
        assert leader.hosts()[1] == "gpu1"
    assert "ignored the heartbeat of GPU 1" in log.read_text()
    for _ in range(5000):  # a flood of bad join requests over many boundaries
        leader.store.queue_push(JOIN_QUEUE, "{garbage")
    while leader.store.queue_len(JOIN_QUEUE):
        assert leader.pending_joins() == []
    assert log.stat().st_size < 64 * 1024  # rate-limited: a burst per minute, not a line per request
    bounded = BoundedLog(tmp_path / "small.log", max_bytes=2000)
    for i in range(1000):
        bounded.write(f"line {i}")
    assert (tmp_path / "small.log").stat().st_size <= 2100
    assert "the log is full" in (tmp_path / "small.log").read_text()


def test_a_short_secret_is_refused_and_the_store_listens_only_where_asked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        Membership.host(b"short")
    leader = Membership.host(SECRET, address="127.0.0.1")
    import socket

    other = [a for a in {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
             if not a.startswith("127.")]  # fmt: skip
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", leader.rendezvous.port)) == 0
    for address in other:  # another interface of this host: nothing listens there
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, leader.rendezvous.port)) != 0


def test_rendezvous_file_is_private_and_waits_for_its_launch(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous.json"
    Rendezvous("127.0.0.1", 1234, "old").write(path)
    assert (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(TimeoutError):
        Rendezvous.read(path, timeout_s=0.3, launch_id="new")
    assert Rendezvous.read(path, launch_id="old").port == 1234
    with pytest.raises(ValueError, match="bad address"):
        Rendezvous("", 0)


def test_rendezvous_polls_back_off_to_their_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiting ranks poll the file less and less often (a parallel file system's metadata server
    sees thousands of them), never past ``POLL_MAX_S``; the file is read as soon as it appears."""
    path, slept = tmp_path / "rendezvous.json", []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 12:
            Rendezvous("127.0.0.1", 4321).write(path)

    monkeypatch.setattr(rendezvous.time, "sleep", sleep)
    assert Rendezvous.read(path, timeout_s=600).port == 4321
    assert len(slept) == 12 and max(slept) <= rendezvous.POLL_MAX_S
    assert slept[0] <= rendezvous.POLL_MIN_S and slept[-1] >= rendezvous.POLL_MAX_S / 2


def joined(gpu: int, port: int, out: str, members: tuple[int, ...]) -> Membership:
    """GPU ``gpu`` in generation 0 of ``members`` (GPU 0 the leader, hosting the store on
    ``port`` and logging to ``out/m.log``), in a spawned process of a test."""
    torch.set_num_threads(1)
    m = (
        Membership.host(SECRET, 0, "127.0.0.1", port, log=Path(out) / "m.log")
        if gpu == 0
        else Membership.connect(Rendezvous("127.0.0.1", port), SECRET, gpu)
    )
    m.form(members, 0)
    return m


def _member(gpu: int, port: int, out: str) -> None:
    m = joined(gpu, port, out, (0, 1, 2))
    kept = torch.full((4,), float(gpu))
    sub = dist.new_group([0, 1])
    dist.barrier()
    if gpu == 2:
        time.sleep(0.3)
        os._exit(0)  # dies without a word
    started = time.monotonic()
    failed = False
    try:  # the same collectives in the same order on every rank, as the runtime's steps are
        dist.all_reduce(torch.ones(1), group=sub)
        dist.all_reduce(torch.ones(1))  # with the dead one: fails on both survivors
    except RuntimeError:
        failed = True
    del sub
    assert failed
    survivors = m.recover(grace_s=20)
    detected = time.monotonic() - started
    m.form(survivors, 1)
    t = torch.ones(1)
    dist.all_reduce(t)
    Path(out, f"{gpu}.json").write_text(
        json.dumps({"survivors": survivors, "sum": float(t), "kept": kept.tolist(), "s": detected})
    )
    m.close()


@pytest.mark.timeout(120)
def test_survivors_re_form_the_world_in_place_after_a_member_dies(tmp_path: Path) -> None:

    assert spawned(_member, 3, tmp_path) == [0, 0, 0]
    for g in (0, 1):
        got = json.loads((tmp_path / f"{g}.json").read_text())
        assert got["survivors"] == [0, 1] and got["sum"] == 2.0 and got["kept"] == [float(g)] * 4
        assert got["s"] < 10.0  # detected within seconds (the heartbeat goes stale after 4 s)
    assert "lost GPUs [2]" in (tmp_path / "m.log").read_text()


def _left_behind(gpu: int, port: int, out: str) -> None:
    """GPU 0 (the leader, the store's host) finishes and goes while GPU 1 still recovers."""
    m = joined(gpu, port, out, (0, 1))
    dist.barrier()
    if gpu == 0:
        os._exit(0)  # the job ended without this member: its store goes with it
    time.sleep(1.0)
    try:
        m.recover(grace_s=2)
    except LeftBehindError as exc:
        Path(out, "left.txt").write_text(str(exc))
    os._exit(0)


@pytest.mark.timeout(120)
def test_a_member_that_loses_the_store_while_recovering_leaves_the_job(tmp_path: Path) -> None:
    """Not a crash (a SLURM job whose training finished was marked FAILED by one such rank): the
    member learns it is left behind and leaves (``Outcome.LEFT``, exit 0)."""
    assert spawned(_left_behind, 2, tmp_path) == [0, 0]
    assert "GPU 1 found the job's store gone recovering generation 0" in (tmp_path / "left.txt").read_text()


def _member_lost_between_generations(gpu: int, port: int, out: str) -> None:
    """GPU 2 dies between generations; GPUs 0 and 1 then form generation 1 with it and with
    newcomer 3, which is alive: it learns the verdict too, and leaves (to ask to join again)."""
    if gpu == 3:
        torch.set_num_threads(1)
        m = Membership.connect(Rendezvous("127.0.0.1", port), SECRET, 3)
        while not m.store.check(["gen0/ready"]):
            time.sleep(0.05)
    else:
        m = joined(gpu, port, out, (0, 1, 2))
        dist.barrier()
        if gpu == 2:
            os._exit(0)  # without a word
        m.store.set("gen0/ready", "1")
    started = time.monotonic()
    try:
        m.form((0, 1, 2, 3), 1)
        lost: object = "formed"
    except FormationError as exc:
        lost = list(exc.lost)
    failed_s = time.monotonic() - started
    if gpu == 3:
        Path(out, "3.json").write_text(json.dumps({"lost": lost, "s": failed_s}))
        m.close()  # its heartbeat stops: the recovery stops waiting for it
        return
    survivors = m.recover(grace_s=20)
    m.form(survivors, 2)
    t = torch.ones(1)
    dist.all_reduce(t)
    Path(out, f"{gpu}.json").write_text(json.dumps({"lost": lost, "s": failed_s, "sum": float(t)}))
    m.close()


@pytest.mark.timeout(120)
def test_a_member_lost_before_a_generation_forms_fails_the_formation_within_seconds(tmp_path: Path) -> None:
    """Not gloo's rendezvous wait (the formation's 30 minutes): the leader's roll call finds the
    member's heartbeat stale, every member (the newcomer too) learns the verdict, and the others
    recover without the lost one and the newcomer."""
    assert spawned(_member_lost_between_generations, 4, tmp_path) == [0, 0, 0, 0]
    for g in (0, 1, 3):
        got = json.loads((tmp_path / f"{g}.json").read_text())
        assert got["lost"] == [2] and got["s"] < 10.0, got
        assert g == 3 or got["sum"] == 2.0, got
    log = (tmp_path / "m.log").read_text()
    assert "generation 1 did not form: GPUs [2]" in log and "lost GPUs [2, 3]" in log


def _newcomers(rank: int, port: int, out: str) -> None:
    """GPUs 0 and 1 form generation 1 with newcomer 3, which never comes (its node went down
    before it read its answer: no heartbeat), then generation 2 with newcomer 4 (rank 2 here),
    which comes 2 s late and is waited for; newcomer 5 (rank 3), told generation 2 with other
    members, is refused by the verdict."""
    if rank == 3:  # told generation 2 with other members (answered before a recovery): it learns
        torch.set_num_threads(1)  # from the verdict that the leader formed another, and leaves
        while not Path(out, "gen2").exists():
            time.sleep(0.05)
        m = Membership.connect(Rendezvous("127.0.0.1", port), SECRET, 5)
        try:
            m.form((0, 1, 5), 2)
            told: object = "formed"
        except FormationError as exc:
            told = str(exc)
        Path(out, "5.json").write_text(json.dumps(told))
        m.close()
        return
    if rank == 2:
        torch.set_num_threads(1)
        while not Path(out, "gen2").exists():
            time.sleep(0.05)
        time.sleep(2.0)
        m = Membership.connect(Rendezvous("127.0.0.1", port), SECRET, 4)
    else:
        m = joined(rank, port, out, (0, 1))
        m.join_grace_s = 3.0
        started = time.monotonic()
        try:
            m.form((0, 1, 3), 1)
            lost: object = "formed"
        except FormationError as exc:
            lost = list(exc.lost)
        failed_s = time.monotonic() - started
        assert m.recover(grace_s=20) == (0, 1)  # 3 never beat: not waited for
        Path(out, f"{rank}.json").write_text(json.dumps({"lost": lost, "s": failed_s}))
        m.join_grace_s = 30.0
        Path(out, "gen2").touch()
    m.form((0, 1, 4), 2)
    t = torch.ones(1)
    dist.all_reduce(t)
    Path(out, f"sum{m.gpu}.json").write_text(json.dumps(float(t)))
    m.close()


@pytest.mark.timeout(120)
def test_a_newcomer_that_never_comes_fails_the_formation_after_its_grace(tmp_path: Path) -> None:
    assert spawned(_newcomers, 4, tmp_path) == [0, 0, 0, 0]
    assert json.loads((tmp_path / "5.json").read_text()) == (
        "generation 2 did not form: the leader formed it with GPUs [0, 1, 4], this GPU was told [0, 1, 5]"
    )
    for g in (0, 1):
        got = json.loads((tmp_path / f"{g}.json").read_text())
        assert got["lost"] == [3] and 3.0 <= got["s"] < 10.0, got
    assert [json.loads((tmp_path / f"sum{g}.json").read_text()) for g in (0, 1, 4)] == [3.0] * 3
    assert "generation 1 did not form: GPUs [3]" in (tmp_path / "m.log").read_text()


def _next_beat(leader: Membership, gpu: int, after: Any, timeout_s: float = 5.0) -> Any:
    """The first beat of ``gpu`` the leader reads that is not ``after``."""
    deadline = time.monotonic() + timeout_s
    while (beat := leader._last_beat(gpu)) == after:
        assert time.monotonic() < deadline, "no new beat"
        time.sleep(0.02)
    return beat


def test_a_member_holding_the_interpreter_says_so_first_and_is_not_taken_for_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full garbage collection (``abandon``) holds the interpreter, the heartbeat thread's too,
    for seconds on a loaded node: the beat written before it holds the rule for ``HOLD_S``; the
    beats after it say nothing more, so a member silent after that is gone after 4 s."""
    from nereus.runtime import membership
    from nereus.runtime.rollcall import HOLD_S, STALE_S

    leader = Membership.host(SECRET, log=tmp_path / "m.log")
    leader.members = (0, 1)
    member = Membership.connect(leader.rendezvous, SECRET, 1)
    member.members = (0, 1)
    seen: list[Any] = []

    def collect() -> None:  # what the leader reads while the member's interpreter is held
        seen.append(leader._last_beat(1))

    monkeypatch.setattr(membership, "let_go", collect)
    member.start_heartbeat()
    member.abandon()
    held = seen[0]
    assert HOLD_S - 1 < held.hold <= HOLD_S
    after = leader._last_beat(1)  # written before abandon returns: a freeze right after it (a
    assert after is not None and after.hold == 0  # scripted hang) is judged by the 4 s again
    member._stop.set()  # its heartbeat stops: the held beat is the last the leader sees
    member._beat.join(5)  # type: ignore[union-attr]
    leader.store.set("hb/1", leader.signed.envelope("hb/1", held._asdict()))
    beats: dict[int, Any] = {}
    assert not leader._silent(1, True, beats, 0.0, 0.0)
    assert not leader._silent(1, True, beats, 0.0, STALE_S + 1)  # held: not gone after 4 s
    assert leader._silent(1, True, beats, 0.0, HOLD_S + 0.1)  # past the hold: gone
    member.abandon()  # without a heartbeat: no beat is written
    assert leader._last_beat(1) == held
    member.close()
    leader.close()


def test_a_beat_after_the_hold_says_no_more_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nereus.runtime import membership
    from nereus.runtime.rollcall import MAX_HOLD_S

    leader = Membership.host(SECRET, log=tmp_path / "m.log")
    member = Membership.connect(leader.rendezvous, SECRET, 1)
    member.start_heartbeat()
    with member.holding(12.0):
        inside = leader._last_beat(1)
        assert inside is not None and 11 < inside.hold <= 12
        assert _next_beat(leader, 1, inside).hold > 10  # beats while it holds say so too
    after = leader._last_beat(1)  # the beat saying no more is written before holding returns
    assert after is not None and after.hold == 0 and after.t > inside.t
    with member.holding(1e6):  # never more than the leader reads as a beat of ours
        assert leader._last_beat(1).hold <= MAX_HOLD_S  # type: ignore[union-attr]
    monkeypatch.setattr(membership, "let_go", lambda: None)  # the collection's own time aside
    started = time.monotonic()
    member.close()  # the heartbeat stops and closing holds nothing: no hold is the last beat
    assert time.monotonic() - started < 0.9
    last = leader._last_beat(1)
    assert last is not None and last.hold == 0
    leader.close()


def test_a_recovery_judges_heartbeats_on_the_leaders_clock_not_across_clocks(tmp_path: Path) -> None:
    """A live member whose node's clock runs 100 s behind the leader's, and which checks in 5 s
    into the recovery, is a survivor: its beats change, whatever their time says (read against
    the leader's clock, they said it was gone, and the recovery went on without it once the
    member whose beats stopped was lost, 4 s of the leader's clock after the recovery began)."""
    leader = Membership.host(SECRET, log=tmp_path / "m.log")
    leader.members, leader.generation = (0, 1, 2), 0
    leader.signed.put("hb/2", {"t": time.time()})  # GPU 2's last beat: it is gone
    stop = threading.Event()

    def behind() -> None:  # GPU 1: beats on a clock 100 s behind, checks in after 5 s
        started = time.monotonic()
        while not stop.is_set():
            leader.signed.put("hb/1", {"t": time.time() - 100.0})
            if time.monotonic() - started > 5.0:
                leader.signed.put("recover/0/alive/1", {"gpu": 1, "oom": ""})
            stop.wait(0.5)

    member = threading.Thread(target=behind, daemon=True)
    member.start()
    started = time.monotonic()
    try:
        survivors = leader.recover(grace_s=30.0)
    finally:
        stop.set()
        member.join(5)
    assert survivors == (0, 1)
    assert 5.0 <= time.monotonic() - started < 15.0
    assert "lost GPUs [2]" in (tmp_path / "m.log").read_text()
    leader.close()
