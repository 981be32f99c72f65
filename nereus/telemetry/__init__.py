"""GPU inventory and health of a node (NVML for NVIDIA, amdsmi for AMD), pure value types, and
their comparison with the cluster spec. Imports neither torch nor a GPU library: the readers
import ``pynvml`` (extra ``nereus[nvidia]``) or ``amdsmi`` (extra ``nereus[rocm]``) when called.

Not to be confused with ``nereus.control.telemetry``, the step timings the controller reads.
"""

from nereus.telemetry.compare import MEMORY_TOLERANCE, compare, reconcile
from nereus.telemetry.health import (
    FATAL_XIDS,
    RETIRED_PAGE_LIMIT,
    GpuHealth,
    fatal_event,
    health_problems,
    unhealthy,
)
from nereus.telemetry.inventory import LINK_KINDS, GpuInfo, Link, NodeInventory, read_node

__all__ = [
    "FATAL_XIDS",
    "LINK_KINDS",
    "MEMORY_TOLERANCE",
    "RETIRED_PAGE_LIMIT",
    "GpuHealth",
    "GpuInfo",
    "Link",
    "NodeInventory",
    "compare",
    "fatal_event",
    "health_problems",
    "read_node",
    "reconcile",
    "unhealthy",
]
