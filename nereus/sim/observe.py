"""What the simulator observes of the truth, and how it becomes the planner's telemetry.

``quiet_truth`` runs every model-stage of a plan on the truth (``nereus.sim.truth``) on a quiet
machine; ``pair`` turns one model-stage's true seconds per op class into calibration
measurements against the planner's ideal seconds of the same class. A class the truth charges but
the planner has no ideal time for on that model-stage is folded into the closest class the planner
has there: the same collective on the other link, else the planner's largest collective class;
compute classes into gemm, else memory, else decode, else attention. So no measured second is dropped; a class
the planner prices but the truth does not charge yields no measurement. Given the shape of each
class's work (``nereus.plan.evaluate.ideal_shapes``), a measurement carries it (size and ranks per
node), as a real worker's timer would know the shapes it ran: calibration by shape.
"""

from __future__ import annotations

from collections.abc import Mapping

from nereus.plan.calibration import Measurement
from nereus.plan.evaluate import ClassShape
from nereus.plan.layout import Plan
from nereus.plan.opclass import OpClass
from nereus.plan.problem import SeqStats
from nereus.sim.truth import Lengths, Placement, StageResult, run_stage
from nereus.sim.truth.asynchrony import sync_step, weight_sync_seconds
from nereus.spec.cluster import ClusterSpec
from nereus.spec.model import ModelSpec
from nereus.spec.workload import ExecutionMode, Role, Stage, WorkloadSpec


def _closest(name: str, planner: Mapping[str, float]) -> str | None:
    """The planner's op class (of one model-stage) that a truth class without a planner
    counterpart is folded into."""
    kind, _, link = name.partition(".")
    if link:
        other = f"{kind}.{'intra' if link == 'inter' else 'inter'}"
        if other in planner:
            return other
        collectives = [n for n in planner if "." in n]
        if collectives:
            return max(collectives, key=lambda n: planner[n])
    for n in ("gemm", "memory", "decode", "attention"):
        if n in planner:
            return n
    return max(planner, key=lambda n: planner[n]) if planner else None


ROOFLINE = ("gemm", "attention", "memory", "decode")


def pair(
    ideal: Mapping[OpClass, float],
    measured: Mapping[str, float],
    shapes: Mapping[OpClass, ClassShape] | None = None,
    roofline: bool = False,
) -> list[Measurement]:
    """Measurements of one model-stage: the planner's ideal seconds of each class against the
    truth's measured seconds of that class (classes only the truth has folded in), each with its
    class's shape where ``shapes`` has it (else size unknown).

    ``roofline`` (generation): decode is the larger of its HBM reads and its matmuls, and the
    model and the hardware may disagree on which side a step lands, so their split of compute and
    memory seconds is not comparable class by class (the truth's decode matmuls against a GEMM
    ideal that holds prefill alone). The compute and memory classes are then paired as one: all
    their measured seconds against all their ideal seconds, in the planner's largest of them."""
    planner = {op.value: t for op, t in ideal.items() if t > 0}
    mine = [n for n in ROOFLINE if n in planner] if roofline else []
    if mine:
        top = max(mine, key=lambda n: planner[n])
        joined = sum(planner[n] for n in mine)
        planner = {n: t for n, t in planner.items() if n not in mine}
        planner[top] = joined
        roof = sum(t for n, t in measured.items() if n in ROOFLINE)
        measured = {n: t for n, t in measured.items() if n not in ROOFLINE}
        measured[top] = measured.get(top, 0.0) + roof
    folded: dict[str, float] = {}
    for name, t in measured.items():
        target = name if name in planner else _closest(name, planner)
        if target is not None and t > 0:
            folded[target] = folded.get(target, 0.0) + t
    out = []
    for n, t in folded.items():
        shape = (shapes or {}).get(OpClass(n))
        size, group = (shape.size, shape.group) if shape is not None else (0.0, 0.0)
        out.append(Measurement(OpClass(n), planner[n], t, size, group))
    return out


def quiet_truth(
    w: WorkloadSpec, models: Mapping[Role, ModelSpec], cluster: ClusterSpec, plan: Plan, seq: SeqStats
) -> dict[str, StageResult]:
    """The truth of every model-stage of ``plan`` on a quiet machine. Generation engines size
    their KV pool to what their fullest GPU has free beside the idle state of co-located
    model-stages of other stages."""
    lengths = Lengths(seq.prompt_len, seq.response_len, seq.response_p95)
    stage_of = {c.model_stage: plan.stage_of(c) for c in plan.candidates}
    on_gpu: dict[int, list[str]] = {}
    for c in plan.candidates:
        for g in c.gpus:
            on_gpu.setdefault(g, []).append(c.model_stage)
    out: dict[str, StageResult] = {}
    for c in sorted(plan.candidates, key=lambda c: stage_of[c.model_stage] is Stage.GEN):
        ms = plan.workflow.get(c.model_stage)
        model = models[ms.role].with_head(ms.head)
        where = Placement.of(
            c.layout.tp, c.layout.pp, c.dp, c.gpus, cluster.gpus_per_node, c.micro_batch, c.recompute
        )
        free = None
        if ms.stage is Stage.GEN:
            idle = max(
                sum(out[o].resident_bytes for o in on_gpu[g] if o in out and stage_of[o] is not Stage.GEN)
                for g in c.gpus
            )
            free = cluster.gpu_memory_bytes - cluster.runtime_reserved_gib * 2**30 - idle
        # async: generation's weights arrive by the pipeline's own sync (``truth.asynchrony``)
        own_sync = w.mode is ExecutionMode.ASYNC and ms.stage is Stage.GEN
        syncs = plan.workflow.sync_source(ms.name) is not None and not own_sync
        out[ms.name] = run_stage(model, w, cluster, ms.stage, where, w.sequences(ms), lengths, free, syncs)
    return out


def step_sync(models: Mapping[Role, ModelSpec], cluster: ClusterSpec, plan: Plan) -> dict[str, float]:
    """Async: the truth's quiet seconds per op class of the weight sync that ends a step (the
    actor's trainer broadcasts its new weights to the generation engine's GPUs); ``{}`` in sync
    mode, where each receiver's sync is its own (``quiet_truth``)."""
    if plan.mode is not ExecutionMode.ASYNC:
        return {}
    (gen,) = plan.workflow.by_stage(Stage.GEN)
    trainer = plan.workflow.sync_source(gen.name)
    if trainer is None:
        return {}
    gpus = {c.model_stage: c.gpus for c in plan.candidates}
    return weight_sync_seconds(models[Role.ACTOR], cluster, gpus[trainer], gpus[gen.name])


def holds_step_sync(plan: Plan, name: str) -> bool:
    """Whether model-stage ``name``'s own time, as its worker times it, holds the async weight
    sync that ends the step: generation receives it, each trainer waits on it (the planner
    prices it on both sides, ``nereus.plan.commcost.CommTerms._async_sync``)."""
    return plan.mode is ExecutionMode.ASYNC and plan.workflow.get(name).stage in (Stage.GEN, Stage.TRAIN)


def with_step_sync(plan: Plan, seconds: Mapping[str, float], sync_s: float) -> dict[str, float]:
    """Model-stage seconds with the step's async weight sync on the model-stages that hold it."""
    return {n: t + (sync_s if holds_step_sync(plan, n) else 0.0) for n, t in seconds.items()}


def steady_step(plan: Plan, seconds: Mapping[str, float]) -> float:
    """A plan's step from its model-stages' seconds, without waits: synchronous, each stage's
    slowest in turn; asynchronous, generation beside inference and training (given seconds
    ``with_step_sync``, max(gen, inf + train) + sync, the truth's steady step)."""
    wf = plan.workflow
    if plan.mode is not ExecutionMode.ASYNC:
        return sync_step([seconds[m.name] for m in wf.by_stage(s)] for s in wf.stages)
    gen = sync_step([[seconds[m.name] for m in wf.by_stage(Stage.GEN)]])
    rest = sync_step([seconds[m.name] for m in wf.by_stage(s)] for s in wf.stages if s is not Stage.GEN)
    return max(gen, rest)


def merged(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Seconds per op class of ``a`` and ``b`` together."""
    out = dict(a)
    for op, t in b.items():
        out[op] = out.get(op, 0.0) + t
    return out


def out_of_memory(
    cluster: ClusterSpec, plan: Plan, peaks: Mapping[str, float], resident: Mapping[str, float]
) -> bool:
    """Whether any GPU of ``plan`` runs out of memory: a model-stage's true peak there plus the
    idle-resident bytes of the co-located model-stages of other stages, plus the runtime's
    reserve, over the GPU's memory."""
    capacity = cluster.gpu_memory_bytes
    reserve = cluster.runtime_reserved_gib * 2**30
    stage_of = {c.model_stage: plan.stage_of(c) for c in plan.candidates}
    on_gpu: dict[int, list[str]] = {}
    for c in plan.candidates:
        for g in c.gpus:
            on_gpu.setdefault(g, []).append(c.model_stage)
    for c in plan.candidates:
        for g in c.gpus:
            idle = sum(resident[o] for o in on_gpu[g] if stage_of[o] is not stage_of[c.model_stage])
            if peaks[c.model_stage] + idle + reserve > capacity:
                return True
    return False
