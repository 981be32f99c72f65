"""Letting go of a failed world's objects that something outside our code still pins.

Destroying a gloo world closes this process's connections only once the last reference to each
group is gone; a peer blocked on us (a pipeline send waits for our receive, with no timeout but
the group's creation-time one) fails at once only then. Two kinds of reference outlive the
objects we drop ourselves:

- **Frozen objects.** The run moved what it built out of the cyclic collector's sight
  (``gc.freeze``); groups held in reference cycles among them are never collected.
- **Finished frames kept by a stored exception.** A library that catches an optional import's
  error at import time and keeps it (vLLM keeps ``torchcodec``'s) keeps its traceback, and
  through each frame's ``f_back`` every frame that was on the stack when the import ran —
  here an engine build's, whose locals hold the model-stages' groups and engines. The frames
  have returned; only their locals are released (``frame.clear()``, as
  ``traceback.clear_frames`` does): file, line and function stay for any traceback printed later.
"""

from __future__ import annotations

import gc
import inspect
import types

# A generator's or coroutine's frame: clearing it would finalize the generator (a context
# manager still open, an iterator half consumed), so it is left alone.
_SUSPENDABLE = (
    inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR
)


def clear_finished_frames() -> int:
    """Release the locals of every frame that has returned but is still referenced (a stored
    traceback's, or the callers such a frame keeps); frames running on any thread, and those of
    generators and coroutines, are left alone. Returns how many were cleared."""
    cleared = 0
    for obj in gc.get_objects():
        if type(obj) is not types.FrameType or obj.f_code.co_flags & _SUSPENDABLE:  # not a proxy's class
            continue
        try:
            obj.clear()
        except RuntimeError:  # running (on this thread or another)
            continue
        cleared += 1
    return cleared


def let_go() -> None:
    """Collect every object the failed world left unreferenced, frozen ones and those pinned only
    by finished frames included; the run's frozen set stays out of the collector's sight after."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    clear_finished_frames()
    gc.collect()
    if frozen:
        gc.freeze()
