"""Typed, validated descriptions of models, clusters and RL workloads (pure)."""

from nereus.spec.cluster import ClusterSpec, CollectiveLibrary, Vendor
from nereus.spec.model import Head, ModelFamily, ModelSpec
from nereus.spec.registry import load_cluster, load_model, load_workload, names
from nereus.spec.workload import (
    STAGE_ORDER,
    Algorithm,
    ExecutionMode,
    InFlight,
    ModelStage,
    Precision,
    Recompute,
    Role,
    Stage,
    Workflow,
    WorkloadSpec,
    default_workflow,
)

__all__ = [
    "STAGE_ORDER",
    "Algorithm",
    "ClusterSpec",
    "CollectiveLibrary",
    "ExecutionMode",
    "Head",
    "InFlight",
    "ModelFamily",
    "ModelSpec",
    "ModelStage",
    "Precision",
    "Recompute",
    "Role",
    "Stage",
    "Vendor",
    "Workflow",
    "WorkloadSpec",
    "default_workflow",
    "load_cluster",
    "load_model",
    "load_workload",
    "names",
]
