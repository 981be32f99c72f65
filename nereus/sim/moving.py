"""A transition handed to the truth as plain numbers (``nereus.sim.truth.moves``, ``engines``).

The truth imports nothing from the planner or the transition planner; this adapter reads the DAG
a move runs (its nodes in the commit order, their predecessors, flows and senders) and the
cluster's link rates, and asks the truth how long moving that state takes; and it describes a
model-stage's engine in a plan (stage, layers, degrees, compile-cache key) for the truth to build.
"""

from __future__ import annotations

from collections.abc import Mapping

from nereus.plan.layout import Plan
from nereus.sim.truth.engines import Engine
from nereus.sim.truth.moves import STORAGE, Flow, Links, Transfer, moving_seconds
from nereus.sim.truth.params import TruthParams
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import Role, Stage
from nereus.transition.between import Transition


def transfers(tr: Transition) -> list[Transfer]:
    """``tr``'s nodes in its commit order (a topological order), each as the truth reads it."""
    dag = tr.dag
    order = dag.order if len(dag.order) == len(dag.nodes) else tuple(range(len(dag.nodes)))
    at = {node: k for k, node in enumerate(order)}
    preds = dag.preds()
    out: list[Transfer] = []
    for i in order:
        nd = dag.nodes[i]
        flows = tuple(Flow(f.dst, f.bytes, f.link.value if f.link is not None else STORAGE) for f in nd.flows)
        out.append(Transfer(tuple(sorted(at[q] for q in preds[i])), nd.gpus, flows, nd.sends))
    return out


def links(cluster: ClusterSpec) -> Links:
    return Links(
        cluster.intra_node_bandwidth_gbs * 1e9,
        cluster.inter_node_bandwidth_gbs * 1e9,
        cluster.storage_read_gbs * 1e9,
        cluster.gpus_per_node,
    )


def true_moving_seconds(tr: Transition, cluster: ClusterSpec, params: TruthParams) -> float:
    """The truth's seconds for moving ``tr``'s state on ``cluster`` (rebuilds and regroups apart)."""
    return moving_seconds(transfers(tr), tr.staging_budget, links(cluster), params)


def engine_of(plan: Plan, model_stage: str, models: Mapping[Role, ModelSpec]) -> Engine:
    """``model_stage``'s engine in ``plan``, as the truth builds it: a generation engine's compile
    cache is keyed by its model and layout."""
    ms = plan.workflow.get(model_stage)
    c = plan.candidate(model_stage)
    model = models[ms.role]
    tp, pp = c.layout.tp, c.layout.pp
    key = f"{model.name} tp{tp} pp{pp}" if ms.stage is Stage.GEN else ""
    return Engine(ms.stage.value, model.num_hidden_layers, tp, pp, max(1, c.dp), key)
