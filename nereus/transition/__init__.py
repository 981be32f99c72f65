"""Transitions between plans: local and global DAGs, schedules and L_tran (pure); ``execute`` runs a
DAG on torch.distributed (edge, imported on its own so the planner never loads torch)."""

from nereus.transition.between import NoSourceError, Transition, plan_transition, stage_moves
from nereus.transition.build import build_dag
from nereus.transition.dag import Edge, EdgeKind, Flow, Node, Primitive, TransitionDag
from nereus.transition.links import LinkModel
from nereus.transition.local import local_dag
from nereus.transition.move import StageMove, sub_layout
from nereus.transition.schedule import Schedule, best_schedule, list_schedule

__all__ = [
    "Edge",
    "EdgeKind",
    "Flow",
    "LinkModel",
    "NoSourceError",
    "Node",
    "Primitive",
    "Schedule",
    "StageMove",
    "Transition",
    "TransitionDag",
    "best_schedule",
    "build_dag",
    "list_schedule",
    "local_dag",
    "plan_transition",
    "stage_moves",
    "sub_layout",
]
