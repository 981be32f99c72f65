"""Which steps' timings calibration and the efficiency triggers leave out: warm-up.

The first step on freshly built engines pays for what later steps do not: kernels compiled and
autotuned, allocator pools and KV caches grown, CUDA graphs captured (vLLM), communicators
formed. A tester's run took 2.67 s to generate at step 0 and 0.035 s at step 1; folded in, that
one step dragged the fitted decode η from 0.5 to 0.03 (Σ ideal / Σ measured over a window it
was half of), the efficiency trigger fired on the next step's recovery, and the controller moved
to a plan 4% slower, never to move back. verl and NeMo-RL time from their second step too.

``WarmUp`` strips the op-class measurements of the first step after the job started, after a
transition or a restart (its engines were rebuilt), after a step that was rolled back, and after
a boundary that re-formed the world. Memory peaks, lengths and the pool still count: a warm-up
step's memory is real memory.

The simulator's hardware truth models no warm-up (a rebuilt engine's first step runs at its
steady speed), so its controller keeps every step (``WarmUp(enabled=False)``): stripping there
would only discard the first measurement of each new plan.

Pure: steps come in with the telemetry.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.control.telemetry import Telemetry


class WarmUp:
    """Whether the next step observed runs on engines that have not run a step yet."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off: every step counts (a truth that models no warm-up)
        self._cold = enabled  # the job's first step

    def rebuilt(self) -> None:
        """The engines (some of them) were built again: the next step warms them up."""
        self._cold = self.enabled

    def strip(self, t: Telemetry) -> Telemetry:
        """``t`` without its op-class measurements if its step warmed engines up; a boundary that
        re-forms the world (``t.reformed``) makes the next step a warm-up step too."""
        reformed = t.reformed and self.enabled
        if not t.measurements:  # no step ran (a recovery's telemetry): nothing warmed up yet
            self._cold = self._cold or reformed
            return t
        cold, self._cold = self._cold, reformed
        return replace(t, measurements=()) if cold else t
