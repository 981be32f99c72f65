"""Job checkpoints with ``torch.distributed.checkpoint``: any plan in, any plan out.

What is saved: every model-stage that nothing else can rebuild — the trainers (parameters,
master weights, Adam moments) and the frozen ones without a weight-sync source (reference,
reward model) — as DTensors on each model-stage's (dp, pp, tp) mesh (``nereus.state.checkpoint``),
plus ``meta.json`` (the step, every saved model-stage's logical state, the plan). Generation
and inference stages are restored from their trainers by a weight sync after loading.

A checkpoint is written to a hidden temporary folder and renamed when every rank has finished;
``latest`` names the newest complete one, so a failing worker never leaves a checkpoint that
looks complete. All functions are collective over the world. Edge module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nereus.errors import ConfigError
from nereus.plan.layout import Plan
from nereus.runtime.worker import Worker
from nereus.state.checkpoint import kv_mesh, layout_mesh, to_dtensors
from nereus.state.emu import LogicalState, replicas
from nereus.state.holder import RankState

LATEST = "latest"


def saved_stages(worker: Worker) -> list[str]:
    """Model-stages a checkpoint holds: those without a weight-sync source."""
    return [ms.name for ms in worker.workflow.model_stages if worker.workflow.sync_source(ms.name) is None]


def _state_dict(worker: Worker, plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in saved_stages(worker):
        c = plan.candidate(name)
        ranks = [worker.rank_of[g] for u in replicas(c) for g in u.gpus]
        model = worker.model_of(name)
        mesh, kv = layout_mesh(c.layout, ranks), kv_mesh(model, c.layout, ranks)  # collective
        rs = worker.holder.units.get(name)
        if rs is not None:
            out.update({f"{name}/{k}": v for k, v in to_dtensors(rs, mesh, kv).items()})
    return out


def save(worker: Worker, plan: Plan, step: int, folder: Path, keep: int = 2) -> Path:
    """Checkpoint after ``step`` into ``folder/step_<step>``; keeps the newest ``keep``."""
    folder = Path(folder)
    final = folder / f"step_{step:06d}"
    tmp = folder / f".step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp_save(_state_dict(worker, plan), checkpoint_id=str(tmp))
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, {n: dataclasses.asdict(rs.state) for n, rs in worker.holder.units.items()})
    if dist.get_rank() == 0:
        logical = {n: s for part in states for n, s in part.items() if n in saved_stages(worker)}
        meta = {"step": step, "logical_state": logical, "plan": _plan_json(plan)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = folder / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, folder / LATEST)
        for old in sorted(p for p in folder.glob("step_*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def latest(folder: Path) -> Path | None:
    pointer = Path(folder) / LATEST
    if not pointer.is_file():
        return None
    path = Path(folder) / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise ConfigError(f"{pointer}: names {path.name}, which is not a complete checkpoint")
    return path


def _meta(path: Path) -> tuple[int, dict[str, Any]]:
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
        return int(meta["step"]), dict(meta["logical_state"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}/meta.json: not a Nereus checkpoint ({exc})") from None


def step_of(path: Path) -> int:
    """The step after which checkpoint ``path`` was written."""
    return _meta(path)[0]


def load(worker: Worker, plan: Plan, path: Path) -> int:
    """Fill this rank's saved model-stages under ``plan`` from ``path``; returns its step."""
    step, logical = _meta(path)
    missing = sorted(set(saved_stages(worker)) - set(logical))
    if missing:
        raise ConfigError(f"{path}/meta.json: key 'logical_state': no state for {missing}")
    worker.drop()
    for name in saved_stages(worker):
        place = worker.place(plan.candidate(name))
        if place is not None:
            worker.holder.units[name] = RankState.empty(
                name, worker.model_of(name), plan.candidate(name).layout, place.t, place.p,
                worker.policy_of(name), LogicalState(**logical[name]),
            )  # fmt: skip
    dcp_load(_state_dict(worker, plan), checkpoint_id=str(path))
    return step


def _plan_json(plan: Plan) -> dict[str, Any]:
    return {
        c.model_stage: {"tp": c.layout.tp, "pp": c.layout.pp, "dp": c.dp, "gpus": list(c.gpus)}
        for c in plan.candidates
    }
