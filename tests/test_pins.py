"""What a failed world leaves pinned, let go (``nereus/runtime/pins.py``).

A library that keeps an exception it caught keeps, through its traceback's frames and their
callers, the locals of every frame on the stack then: here a build whose local is a stand-in for
a process group. Clearing finished frames frees it; a running frame, a suspended generator, and a
dead weak proxy among the collector's objects are left as they are.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from nereus.runtime.pins import clear_finished_frames, let_go

pytestmark = pytest.mark.pure

KEPT: list[BaseException] = []  # a library's module-level "import failed" error


class Group:
    """Stands in for a process group whose last reference closes its connections."""


def _optional_import() -> None:
    try:
        raise ModuleNotFoundError("No module named 'torchcodec'")
    except ModuleNotFoundError as exc:
        KEPT.append(exc)


def _build(group: Group) -> None:  # an engine build: its local holds the group
    _optional_import()


def _counter() -> object:
    yield 1
    yield 2


def test_a_kept_traceback_pins_its_callers_locals_until_finished_frames_are_cleared() -> None:
    group = Group()
    alive = weakref.ref(group)
    _build(group)
    del group
    gc.collect()
    assert alive() is not None, "the kept traceback no longer pins the build's frame"
    assert clear_finished_frames() > 0
    gc.collect()
    assert alive() is None
    tb = KEPT.pop().__traceback__
    assert tb is not None and tb.tb_frame.f_code.co_name == "_optional_import"  # still printable


def test_running_frames_suspended_generators_and_dead_proxies_are_left_alone() -> None:
    here = Group()
    gen = _counter()
    assert next(gen) == 1
    target = Group()
    proxies = [weakref.proxy(target)]
    del target
    with pytest.raises(ReferenceError):  # the collector's objects hold a dead proxy
        isinstance(proxies[0], Group)
    let_go()  # looks past it
    assert isinstance(here, Group)  # this frame's locals are intact
    assert next(gen) == 2  # the generator was not finalized


def test_let_go_keeps_the_frozen_set_frozen() -> None:
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0
        let_go()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
