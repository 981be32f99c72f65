"""A stranger on the loopback interface attacks a running job through its store, and the job ends
exactly as an unattacked run of the same experiment does, with a bounded log.

The stranger knows the store's address (it reads ``rendezvous.json``, as a port scan would find
it) but not the job's secret. While the job runs — a worker leaves at step 2 and a new process
joins at step 4 — it pushes join requests whose MAC is not ASCII, is garbage, is too long, or is
made with another secret; takes the real newcomer's request off the queue, forges the leader's
answer to it and posts the request again twice (a replay); bumps the old join counter; and writes
forged heartbeats, node names and recovery entries for every GPU.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch._C._distributed_c10d import TCPStore

from nereus.runtime.membership import JOIN_QUEUE
from nereus.runtime.signed import SignedStore
from tests.test_runtime_e2e import nereus_run

pytestmark = pytest.mark.e2e


def _stranger(out: Path, stop: threading.Event, seen: dict[str, int]) -> None:
    path = out / "rendezvous.json"
    while not path.is_file() and not stop.is_set():
        time.sleep(0.02)
    if stop.is_set():
        return
    secret = secrets.token_bytes(32)  # a key of its own, not the job's

    def connect() -> tuple[TCPStore, SignedStore]:
        doc = json.loads(path.read_text())
        store = TCPStore(doc["host"], doc["port"], None, False, timeout=timedelta(seconds=10))
        return store, SignedStore(store, secret)

    def body() -> dict[str, object]:
        return {"ticket": secrets.token_hex(16), "time": time.time(), "host": "x", "pid": 1, "gpu": 0}

    connection: tuple[TCPStore, SignedStore] | None = None
    tick = 0
    while not stop.is_set():
        tick += 1
        try:
            connection = connection or connect()
            store, mine = connection
            _steal(store, mine, seen)
        except Exception:  # a dropped connection (a loaded machine): connect again, as an attacker would
            connection = None
            time.sleep(0.05)
            continue
        with contextlib.suppress(Exception):  # the job's store goes away when the job ends
            if tick % 25:  # the floods every 50 ms; the queue is watched every 2 ms
                time.sleep(0.002)
                continue
            store.queue_push(JOIN_QUEUE, json.dumps({"value": body(), "mac": "\u00e9" * 64}))
            store.queue_push(JOIN_QUEUE, "{not json")
            store.queue_push(JOIN_QUEUE, "x" * 20_000)
            store.queue_push(JOIN_QUEUE, mine.envelope(JOIN_QUEUE, body()))
            store.add("join/count", 1)
            for g in range(8):
                store.set(f"hb/{g}", "not a heartbeat")
                store.set(f"host/{g}", mine.envelope(f"host/{g}", {"node": "elsewhere"}))
            for gen in range(8):
                key = f"recover/{gen}/members"
                store.set(key, mine.envelope(key, {"members": [0]}))


def _steal(store: TCPStore, mine: SignedStore, seen: dict[str, int]) -> None:
    """Take every request off the queue; forge the leader's answer to a real newcomer's and post
    its request back three times (two replays); post the rest back once."""
    for _ in range(int(store.queue_len(JOIN_QUEUE))):
        raw = store.queue_pop(JOIN_QUEUE, False)
        copies = 1
        with contextlib.suppress(ValueError, KeyError, TypeError):
            value = json.loads(raw)["value"]
            ticket = value["ticket"]
            if value["host"] != "x" and ticket not in seen:  # a real newcomer's request
                seen[ticket] = 1
                answer = {"gpu": 7, "generation": 99, "members": [7]}
                store.set(f"join/answer/{ticket}", mine.envelope(f"join/answer/{ticket}", answer))
                copies = 3
        for _ in range(copies):
            store.queue_push(JOIN_QUEUE, raw)


@pytest.mark.timeout(400)
def test_a_stranger_cannot_change_a_running_job(tmp_path: Path, drifted_ppo_run: Path) -> None:
    calm = drifted_ppo_run  # the same experiment, unattacked: nereus_run(..., 6, drift=True)
    (tmp_path / "attacked").mkdir()
    stop, seen = threading.Event(), {}
    out = tmp_path / "attacked" / "runs" / "attacked"
    attacker = threading.Thread(target=_stranger, args=(out, stop, seen), daemon=True)
    attacker.start()
    try:
        attacked, proc = nereus_run(tmp_path / "attacked", "attacked", 6, drift=True)
    finally:
        stop.set()
        attacker.join(15)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert seen, "the stranger never saw a join request to attack"
    a = (calm / "hf" / "actor" / "model.safetensors").read_bytes()
    b = (attacked / "hf" / "actor" / "model.safetensors").read_bytes()
    assert a == b  # bit for bit: the stranger changed nothing
    calm_rows = (calm / "metrics.jsonl").read_text().splitlines()
    attacked_rows = (attacked / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["reward"] for r in calm_rows] == [json.loads(r)["reward"] for r in attacked_rows]
    log = (attacked / "membership.log").read_text()
    assert "accepted join request" in log and "refused join request" in log
    assert len(log) < 64 * 1024, len(log)  # rate-limited: the flood is summarised, not logged line by line
