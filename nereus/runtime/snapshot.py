"""The state a failed step rolls back to: the sources' units at the step boundary.

Only the model-stages without a weight-sync source need keeping (trainers and frozen models; a
weight sync rebuilds the copies). Frozen models are held as they are (nothing changes them);
trainers are copied, since a step changes them in place. On the CPU the copy is a clone. On a GPU
it goes to pinned host memory on a side stream, overlapping generation and inference (which only
read the trainers); the training kernels wait for it (``fence``) and the runtime waits for the
copy itself only when it needs it (``restore``, after a failure). ``restore`` copies again, so a
second failure finds the snapshot intact. Edge module (torch).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from nereus.devices import CPU
from nereus.state.holder import RankState


class Snapshot:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.units: dict[str, RankState] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._done: torch.cuda.Event | None = None

    def take(self, units: Mapping[str, RankState], sources: Collection[str]) -> None:
        """Keep ``units`` of model-stages in ``sources`` as they are now."""
        kept = {n: rs for n, rs in units.items() if n in sources}
        if self._stream is None:
            self.units = {n: _clone(rs) if rs.policy.trains else rs for n, rs in kept.items()}
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self.units = {
                n: rs.to(CPU, pinned=True, non_blocking=True) if rs.policy.trains else rs
                for n, rs in kept.items()
            }
            self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._done.record(self._stream)

    def fence(self) -> None:
        """Before anything changes the trainers: the device waits until the copy has read them."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)

    def restore(self) -> dict[str, RankState]:
        """The kept units, on the device, as fresh copies."""
        if self._done is not None:
            self._done.synchronize()
        return {n: _clone(rs).to(self.device) if rs.policy.trains else rs for n, rs in self.units.items()}


def _clone(rs: RankState) -> RankState:
    bufs = {k: b.clone() for k, b in rs.buffers.items()}
    return RankState(rs.model_stage, rs.model, rs.layout, rs.t, rs.p, rs.policy, bufs, rs.state)
