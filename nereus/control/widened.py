"""When a replan also searches the urgent path's wider space (paper §2.9).

The wider space adds activation recomputation and micro-batches below the workload's. The paper
searches it only when nothing else fits. A replan here searches it also

- when the replan is urgent: the plan must change anyway, and the wider search may find a
  faster plan, not only a smaller one. A pipelined trainer's smaller micro-batches shrink its
  bubble ((pp-1)/(m+pp-1)): at 1,024 MI250X GCDs, tp8·pp4·dp16 trains in 120 s at micro-batch 1
  against 176 s at 4 (two micro-batches of 4 per replica);
- while the running plan is itself a wider-space plan: its successor may be one too, and a
  narrow search alone would move it back to a plan the model knows is slower.

Otherwise the narrow space alone is searched, as the paper does: a wider search on every
replan packs plans denser (smaller micro-batches free activation memory for fewer GPUs per
replica), leaving less room to move state in place.
"""

from __future__ import annotations

from nereus.control.admission import Option
from nereus.plan.candidates import trainer_micro_batches
from nereus.plan.layout import Plan
from nereus.spec.workload import Recompute, Stage, WorkloadSpec


def led_by_wider(options: list[Option], wider: list[Option]) -> list[Option]:
    """The options, led by the wider search's best where it is expected faster than theirs."""
    if wider and (not options or wider[0].expected_s < options[0].expected_s):
        return [wider[0], *(o for o in options if o.plan.candidates != wider[0].plan.candidates)]
    return options or wider


def is_widened(plan: Plan, workload: WorkloadSpec) -> bool:
    """Whether ``plan`` uses what only the wider space holds: recomputation, or a trainer's
    micro-batch below the largest that divides its replicas' batch (up to the workload's)."""
    for c in plan.candidates:
        if c.recompute is not Recompute.NONE:
            return True
        if plan.stage_of(c) is Stage.TRAIN and c.micro_batch < trainer_micro_batches(workload, c.dp)[-1]:
            return True
    return False
