"""Authenticated values in the job's store, and a log that strangers cannot grow without bound.

A value is stored as ``{"value": …, "mac": …}`` with the MAC an HMAC-SHA256, under the job's
secret, of the canonical JSON of ``[key, value]``: a value is bound to the key it was written
under (and keys name their slot and generation), so it can be neither forged nor moved to
another key. ``read`` returns a value only if it verifies; ``UnauthenticError`` says why not. Pure
stdlib; the store is anything with ``set``/``get``/``check``/``wait`` (torch's TCPStore).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

SECRET_MIN_BYTES = 32
LOG_MAX_BYTES = 1 << 20
LOG_BURST = 10  # lines of one kind per window; the rest are counted, then summarised
LOG_WINDOW_S = 60.0


class UnauthenticError(ValueError):
    """A stored entry that does not parse or whose MAC does not verify."""


class Store(Protocol):
    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(secret: bytes, body: Any) -> str:
    """HMAC-SHA256 of the canonical JSON of ``body``."""
    return hmac.new(secret, canonical(body), hashlib.sha256).hexdigest()


class SignedStore:
    """Our keys of the job's store, written and read as authenticated JSON values."""

    def __init__(self, store: Any, secret: bytes) -> None:
        if len(secret) < SECRET_MIN_BYTES:
            raise ValueError(f"the job's secret must be at least {SECRET_MIN_BYTES} bytes, got {len(secret)}")
        self.store = store
        self.secret = secret

    def envelope(self, key: str, value: Any) -> str:
        return json.dumps({"value": value, "mac": sign(self.secret, [key, value])}, allow_nan=False)

    def open(self, key: str, raw: bytes | str) -> Any:
        """The value of an envelope written under ``key``; UnauthenticError if it is not one."""
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            raise UnauthenticError("not JSON") from None
        if not isinstance(doc, dict) or set(doc) != {"value", "mac"}:
            raise UnauthenticError("not a signed entry")
        mac = doc["mac"]
        if not isinstance(mac, str) or len(mac) != 64 or not mac.isascii():
            raise UnauthenticError("malformed MAC")
        try:
            want = sign(self.secret, [key, doc["value"]])
        except ValueError:  # NaN or infinity: not something this job writes
            raise UnauthenticError("not canonical JSON") from None
        if not hmac.compare_digest(mac, want):
            raise UnauthenticError("bad MAC")
        return doc["value"]

    def put(self, key: str, value: Any) -> None:
        self.store.set(key, self.envelope(key, value))

    def read(self, key: str) -> Any:
        """The verified value under ``key`` (a missing key is UnauthenticError, without waiting)."""
        try:
            if not self.store.check([key]):
                raise UnauthenticError("missing")
            raw = self.store.get(key)
        except UnauthenticError:
            raise
        except Exception as exc:  # the store went away
            raise UnauthenticError(f"unreadable ({type(exc).__name__})") from None
        return self.open(key, raw)

    def wait_valid(self, key: str, timeout_s: float, on_bad: Callable[[str], None]) -> Any:
        """Wait for a value under ``key`` that verifies (a forged one is reported and waited past;
        the genuine writer overwrites it). TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        while True:
            try:
                return self.read(key)
            except UnauthenticError as exc:
                on_bad(str(exc))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no authentic value under {key} in {timeout_s:.0f} s")
            time.sleep(0.1)


class BoundedLog:
    """An append-only log file capped at ``LOG_MAX_BYTES``; lines of a *kind* (what strangers can
    cause: bad join requests, forged entries) are rate-limited to ``LOG_BURST`` per minute."""

    def __init__(self, path: Path | None, max_bytes: int = LOG_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.size = path.stat().st_size if path is not None and path.exists() else 0
        self._windows: dict[str, tuple[float, int, int]] = {}  # kind → (window start, written, dropped)
        self._full = False

    def write(self, line: str, kind: str = "") -> None:
        if self.path is None:
            return
        line = line.replace("\n", " ")[:500]
        if kind:
            now = time.monotonic()
            start, written, dropped = self._windows.get(kind, (now, 0, 0))
            if now - start > LOG_WINDOW_S:
                if dropped:
                    self._append(f"{dropped} more lines like '{kind}' were not logged")
                start, written, dropped = now, 0, 0
            if written >= LOG_BURST:
                self._windows[kind] = (start, written, dropped + 1)
                return
            self._windows[kind] = (start, written + 1, dropped)
        self._append(line)

    def _append(self, line: str) -> None:
        assert self.path is not None
        if self._full:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        text = f"{stamp} {line}\n"
        if self.size + len(text) > self.max_bytes:
            self._full = True
            text = f"{stamp} the log is full ({self.max_bytes} bytes); later lines are dropped\n"
        with open(self.path, "a") as f:
            f.write(text)
        self.size += len(text.encode())
