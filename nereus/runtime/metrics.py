"""What a run reports: one rich line and one JSON object per step, TensorBoard scalars, a report.

``runs/<name>/metrics.jsonl`` holds one object per step with at least ``step``, ``reward``,
``kl``, ``step_time_s``, ``seq_len_mean``, ``gpus``, ``plan`` (layout and GPUs per model-stage)
and ``transitions`` (those executed at that step's boundary, with kind and seconds). The report
(``report.png``) is drawn from that file alone (``nereus.runtime.report``).

The file has exactly one row per step: when steps run again (a resume, or a restart from the
checkpoint, continues after the checkpoint's step), the rows from the first step that runs again
on are dropped (``drop_rows_after``, an atomic rewrite) before its new row is written.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from nereus.plan.layout import Plan
from nereus.plan.report import plan_summary
from nereus.runtime.experiment import ExperimentSpec

MODEL_LETTER = {"actor": "a", "critic": "c", "ref": "r", "reward": "w"}


def short(model_stage: str) -> str:
    """``actor.gen`` → ``ag``, ``reward.inf`` → ``wi`` (the rich line's plan column)."""
    model, stage = model_stage.split(".")
    return f"{MODEL_LETTER.get(model, model[0])}{stage[0]}"


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    reward: float
    accuracy: float | None  # the share the verifier scores 1; None under verifier: none
    kl: float
    actor_loss: float
    critic_loss: float | None
    rm_score: float | None  # the reward model's mean score (workloads with a reward model)
    step_time_s: float
    weight_sync_s: float
    seq_len_mean: float
    gpus: int
    plan: dict[str, str]
    stage_times: dict[str, float]
    transitions: list[dict[str, Any]] = field(default_factory=list)
    decision: dict[str, Any] | None = None  # the controller's replan at this step's boundary, if any
    # the leader's seconds from the step's end (after its checkpoint) until every rank has the
    # boundary's action: the reports' gather, telemetry and record, the controller's decision (a
    # replan that keeps the plan included), the broadcasts. Not in it: a pool change — deciding
    # it, re-forming the world (until every member has), waiting for newcomers to build their
    # engines — which is the membership transition's seconds; and ``plan_s``
    monitor_s: float = 0.0
    checkpoint_s: float = 0.0
    # the leader's seconds deciding the action of a transition this boundary runs (a move or a
    # restart): the transition's own planning, counted with the transitions, not as monitoring;
    # 0 when the boundary keeps its plan (a replan that keeps it is monitoring)
    plan_s: float = 0.0
    # the leader's wait at the boundary for the slowest rank to finish its step and checkpoint:
    # the step's time on that rank (the next step's barrier would wait for it with no monitor at
    # all), so not in monitor_s; accounted beside it
    straggler_s: float = 0.0
    # the leader's boundary, in seconds: "gather" (until every report arrived; "straggler" of it),
    # "decide" (the notice: the pool change probe and the action), "notice" (until every rank has it)
    monitor_parts: dict[str, float] = field(default_factory=dict)
    efficiency: dict[str, float] = field(default_factory=dict)  # achieved, per op class (η = ideal/measured)
    memory_gib: dict[str, dict[str, float]] = field(default_factory=dict)  # peak allocated/reserved (GPU)
    # per generating model-stage: tokens, engine steps, peak KV share, preemptions
    generation: dict[str, dict[str, float]] = field(default_factory=dict)
    # async RL: the trained batch's staleness and version, batches generated this step and held
    # ahead, the seconds generation and training overlapped and each side waited, batches dropped
    # by a transition at this boundary (``nereus.runtime.asynchrony``); None in a synchronous job
    asynchrony: dict[str, float] | None = None
    # data.val after this step (``nereus.runtime.validation``): reward, accuracy, prompts, seconds
    # and reward/<data source>; None where the step is not validated
    validation: dict[str, float] | None = None
    # the generation engine's probabilities of the tokens it sampled against the trainer side's
    # (actor.inf): "max", "mean", "std" of |p_engine − p_trainer| over the response tokens
    # (verl's rollout_probs_diff; ``nereus.runtime.rollout.probs_diff``); None where not measured
    rollout_probs_diff: dict[str, float] | None = None
    # the share of the step's responses cut at max_new_tokens (no stop token; verl's
    # response_length/clip_ratio); None where not measured
    truncated: float | None = None

    @classmethod
    def of(
        cls, step: int, m: dict[str, float], step_s: float, seq_len: float, plan: Plan, sync_s: float,
        stage_times: dict[str, float],
    ) -> StepRecord:  # fmt: skip
        prefix = "rollout_probs_diff_"
        diff = {k.removeprefix(prefix): v for k, v in m.items() if k.startswith(prefix)}
        return cls(
            step, m["reward"], m.get("accuracy"), m["kl"], m["actor_loss"], m.get("critic_loss"),
            m.get("rm_score"), step_s, sync_s, seq_len, len({g for c in plan.candidates for g in c.gpus}),
            plan_summary(plan), dict(sorted(stage_times.items())), rollout_probs_diff=diff or None,
            truncated=m.get("truncated"),
        )  # fmt: skip

    def with_transitions(self, transitions: list[dict[str, Any]]) -> StepRecord:
        return replace(self, transitions=list(transitions))

    def with_decision(self, decision: dict[str, Any]) -> StepRecord:
        return replace(self, decision=decision)

    def with_efficiency(self, eta: dict[str, float]) -> StepRecord:
        return replace(self, efficiency=eta)

    def with_memory(self, memory_gib: dict[str, dict[str, float]]) -> StepRecord:
        return replace(self, memory_gib=memory_gib)

    def with_generation(self, generation: dict[str, dict[str, float]]) -> StepRecord:
        return replace(self, generation=generation)

    def with_overheads(
        self, monitor_s: float, checkpoint_s: float, plan_s: float = 0.0,
        parts: dict[str, float] | None = None, straggler_s: float = 0.0,
    ) -> StepRecord:  # fmt: skip
        return replace(
            self, monitor_s=monitor_s, checkpoint_s=checkpoint_s, plan_s=plan_s,
            monitor_parts=dict(parts or {}), straggler_s=straggler_s,
        )  # fmt: skip


def _row_step(line: str) -> int | None:
    """A row's step; None for a line that is not a row (a half-written last line, say)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def read_rows(path: Path) -> list[tuple[int, str]]:
    """``(step, line)`` of every row in ``path``, in file order (no file: none)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [(step, line) for line in text.splitlines() if (step := _row_step(line)) is not None]


def drop_rows_after(path: Path, step: int) -> None:
    """Keep only rows of steps up to ``step`` in ``path``, one per step (the last written), by
    an atomic rewrite; a file that already is so is left alone."""
    path = Path(path)
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    last: dict[int, str] = {}
    for s, line in read_rows(path):
        if s <= step:
            last[s] = line
    keep = [last[s] for s in sorted(last)]
    if keep == lines:
        return
    stray = [i for i, line in enumerate(lines[:-1], 1) if line.strip() and _row_step(line) is None]
    if stray:  # not the half-written last line a stop leaves: someone else's text
        print(
            f"nereus: warning: {path}: {len(stray)} line(s) that are not metrics rows dropped "
            f"(first: line {stray[0]})", file=sys.stderr, flush=True,
        )  # fmt: skip
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in keep))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def describe_decision(d: dict[str, Any]) -> str:
    """One line for a replan: what fired, the verdict and why, and the numbers admission weighed
    where it weighed any (ΔL per step and L_tran; the reason gives the payback against γ·H)."""
    line = f"replan ({', '.join(d['triggers'])}): {d['verdict']}: {d['reason']}"
    numbers = []
    if d.get("delta_s") is not None:
        numbers.append(f"ΔL {d['delta_s']:.3g} s/step")
    if d.get("l_tran_s") is not None:
        numbers.append(f"L_tran {d['l_tran_s']:.3g} s")
    return line + (f" ({', '.join(numbers)})" if numbers else "")


class MetricsWriter:
    def __init__(self, out: Path, spec: ExperimentSpec, console: Console | None = None) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        self.last = max((s for s, _ in read_rows(self.path)), default=None)  # the last step written
        drop_rows_after(self.path, -1 if self.last is None else self.last)  # a half-written line
        self.file = self.path.open("a", encoding="utf-8")
        self.console = console or Console(highlight=False, emoji=False)
        self.spec = spec
        # a resumed run starts after its checkpoint's step; TensorBoard's events of the steps
        # after it (run before the stop, cut from metrics.jsonl) are purged, as those rows were
        self.tb: Any = self._tensorboard(None if self.last is None else self.last + 1)

    def _tensorboard(self, purge_step: int | None = None) -> Any:
        """The TensorBoard writer; ``purge_step``: the events of that step and later, which a
        resumed or recovered run writes again, are hidden (TensorBoard's own purge)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency; a trimmed install still runs
            return None
        return SummaryWriter(str(self.out / "tensorboard"), purge_step=purge_step)

    def write(self, r: StepRecord, plan_after: Plan) -> None:
        if self.last is not None and r.step <= self.last:  # the step runs again: one row per step
            self.file.close()
            drop_rows_after(self.path, r.step - 1)
            self.file = self.path.open("a", encoding="utf-8")
            if self.tb is not None:  # and one point per step in TensorBoard
                self.tb.close()
                self.tb = self._tensorboard(purge_step=r.step)
        self.file.write(json.dumps(asdict(r)) + "\n")
        self.file.flush()
        self.last = r.step
        if self.tb is not None:
            for key in (
                "reward",
                "accuracy",
                "kl",
                "actor_loss",
                "critic_loss",
                "rm_score",
                "truncated",
                "step_time_s",
                "seq_len_mean",
                "gpus",
            ):
                value = getattr(r, key)
                if value is not None:
                    self.tb.add_scalar(key, value, r.step)
            self.tb.add_scalar("transition_s", sum(t["seconds"] for t in r.transitions), r.step)
            for key, value in (r.asynchrony or {}).items():
                self.tb.add_scalar(f"async/{key}", value, r.step)
            for key, value in (r.validation or {}).items():
                self.tb.add_scalar(f"val/{key}", value, r.step)
            for key, value in (r.rollout_probs_diff or {}).items():
                self.tb.add_scalar(f"rollout/probs_diff_{key}", value, r.step)
        moved = ", ".join(f"{t['kind']} {t['seconds']:.2f}s" for t in r.transitions) or "-"
        layouts = " ".join(f"{short(k)}:{v.split(' @')[0]}" for k, v in r.plan.items())
        acc = f"{r.accuracy:4.2f}" if r.accuracy is not None else "   -"
        self.console.print(
            escape(
                f"step {r.step:>3} │ reward {r.reward:5.2f} acc {acc} │ kl {r.kl:7.4f} │ "
                f"{r.step_time_s:5.2f}s │ len {r.seq_len_mean:4.1f} │ gpus {r.gpus} │ {layouts} │ "
                f"transitions: {moved}"
            ),
            soft_wrap=True,
        )
        if r.asynchrony is not None:
            a = r.asynchrony
            self.console.print(
                f"         └ async: staleness {a['staleness']:.0f}, overlap {a['overlap_s']:.2f}s, "
                f"waits gen {a['gen_wait_s']:.2f}s train {a['train_wait_s']:.2f}s, "
                f"{a['ahead']:.0f} ahead" + (f", {a['dropped']:.0f} dropped" if a.get("dropped") else ""),
                soft_wrap=True,
            )
        if r.validation is not None:
            v = r.validation
            self.console.print(
                f"         └ validation: reward {v['reward']:.2f} acc {v['accuracy']:.2f} on "
                f"{v['prompts']:.0f} held-out prompts ({v['seconds']:.2f}s)",
                soft_wrap=True,
            )
        if r.decision is not None:
            self.console.print(escape(f"         └ {describe_decision(r.decision)}"), soft_wrap=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        from nereus.runtime.report import write_report

        write_report(self.path, self.out / "report.png", self.spec.name, self.spec.policy)
