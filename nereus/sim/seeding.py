"""What a simulated job starts calibrated from, before its first plan runs.

Every policy: the start-up collective sweep (``nereus.plan.sweep``) on the job's first pool,
timed on the truth with the hardware's noise — once per run (a restart keeps what the job
measured). The oracle only: a probe of the quiet truth. It plans under the priors, runs that plan
on the truth (no noise, no episodes) and seeds its calibration with the truth's seconds per op
class against the planner's ideal ones, and the truth's peak per stage against the planner's raw
one. So it knows the truth's per-class ratios at one plan and step-0 lengths (not how they change
with shape, lengths or episodes); after that it learns from telemetry as every policy does.
"""

from __future__ import annotations

from dataclasses import replace

from nereus.errors import InfeasibleError
from nereus.plan.calibration import CalibrationStore, Efficiencies, Measurement
from nereus.plan.evaluate import ideal_shapes, price, shapes_of
from nereus.plan.links import Links
from nereus.plan.problem import PlanningProblem
from nereus.plan.search import search
from nereus.plan.sweep import measurements, probes, seconds_spent
from nereus.sim.observe import holds_step_sync, merged, pair, quiet_truth, step_sync
from nereus.sim.records import Scenario
from nereus.sim.truth import PARAMS, Hardware, StageResult, collectives
from nereus.spec.workload import Stage

SEED_REPEATS = 8  # the oracle's probe counts as this many samples of each measurement


class Seeding:
    """The start-up sweep's samples and (``probe``: the oracle) its probe of the truth."""

    def __init__(self, scenario: Scenario, hw: Hardware, probe: bool) -> None:
        self.s, self.hw, self.probe = scenario, hw, probe
        self._swept: tuple[Measurement, ...] | None = None  # the start-up collective sweep
        self.sweep_s = 0.0  # what it took (charged to the first step)
        self._seed: list[tuple[Measurement, ...]] | None = None  # the oracle's probe of the truth
        self._seed_memory: list[tuple[Stage, float, float]] = []

    def sweep(self, pool: tuple[int, ...]) -> None:
        """The start-up collective sweep on the job's first pool, once per run."""
        if self._swept is not None or not self.s.collective_sweep:
            return
        cluster = self.s.cluster
        found = probes(pool, cluster.gpus_per_node)
        intra, inter = cluster.intra_node_bandwidth_gbs * 1e9, cluster.inter_node_bandwidth_gbs * 1e9
        quiet = [
            collectives.seconds(kind.value, collectives.Group(g, k), b, intra, inter, PARAMS)
            for kind, g, k, b in ((p.kind, p.per_node, p.nodes, p.nbytes) for p in found)
        ]
        timed = list(zip(found, self.hw.sweep(quiet), strict=True))
        self._swept = tuple(measurements(Links(cluster, Efficiencies()), timed))
        self.sweep_s = seconds_spent(timed)

    def store(self, problem: PlanningProblem | None = None) -> CalibrationStore:
        """A calibration store with the sweep's samples and, probing the truth on ``problem``'s
        first plan if it has not yet, the oracle's probe."""
        store = CalibrationStore(self.s.cluster.name)
        store.update(self._swept or ())
        if not self.probe:
            return store
        if self._seed is None and problem is not None and problem.pool:
            self._probe_truth(problem)
        for _ in range(SEED_REPEATS):  # every stage's samples, once per repeat
            store.update(m for ms in self._seed or [] for m in ms)
        for stage, raw, measured in self._seed_memory:
            for _ in range(SEED_REPEATS):
                store.update_memory(stage, raw, measured)
        return store

    def _probe_truth(self, problem: PlanningProblem) -> None:
        try:
            plan = search(problem).plan
        except InfeasibleError:
            return  # nothing runs on this pool: no probe, priors
        ideal = price(replace(problem, efficiencies=Efficiencies.unit()), shapes_of(plan))
        sized = ideal_shapes(problem, shapes_of(plan))
        quiet = quiet_truth(self.s.workload, self.s.models, self.s.cluster, plan, problem.seq)
        sync = step_sync(self.s.models, self.s.cluster, plan)  # async: held by gen and trainers

        def seconds(n: str, r: StageResult) -> dict[str, float]:
            return merged(r.seconds, sync) if holds_step_sync(plan, n) else dict(r.seconds)

        self._seed = [
            tuple(pair(ideal.by_class[n], seconds(n, r), sized[n], plan.workflow.get(n).stage is Stage.GEN))
            for n, r in quiet.items()
        ]
        self._seed_memory = [
            (plan.workflow.get(n).stage, ideal.active[n], r.peak_bytes)
            for n, r in quiet.items()
            if ideal.active[n] > 0
        ]
