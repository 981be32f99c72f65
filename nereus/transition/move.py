"""One model-stage's part of a transition: the EMUs it has, the EMUs it needs (paper §2.12).

A ``StageMove`` names the intact units of the current plan (``<model-stage>/u<i>``) and the units
of the target (``<model-stage>/v<i>``) as ``Emu`` values. A model-stage with no intact unit is
*restored* into the target layout from its weight-sync source (``restore_from`` a model-stage,
reading the GPUs ``restore_gpus``) or from shared storage (``STORAGE``). Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nereus.plan.layout import Layout
from nereus.spec.model import ModelSpec
from nereus.state.buffers import StatePolicy
from nereus.state.emu import Emu


def sub_layout(a: Layout, b: Layout) -> Layout:
    """T_sub = (min tp, min pp): the layout both sides of a reshard split down to."""
    return Layout(min(a.tp, b.tp), min(a.pp, b.pp))


_new, _set = object.__new__, object.__setattr__
_NO_STATE = Emu.__dataclass_fields__["state"].default


def emu(model_stage: str, layout: Layout, gpus: tuple[int, ...], uid: str) -> Emu:
    """``Emu(model_stage, layout, gpus, id=uid)``, the same value and the same checks, without the
    frozen dataclass's field-by-field ``__init__`` (the planner makes thousands at 1,024 GPUs)."""
    if len(gpus) != layout.size or len(set(gpus)) != len(gpus):
        return Emu(model_stage, layout, gpus, id=uid)  # raises, with the message
    u: Emu = _new(Emu)
    _set(u, "model_stage", model_stage)
    _set(u, "layout", layout)
    _set(u, "gpus", gpus)
    _set(u, "state", _NO_STATE)
    _set(u, "id", uid)
    return u


def units(name: str, layout: Layout, gpus: Sequence[Sequence[int]], prefix: str) -> tuple[Emu, ...]:
    """EMUs of ``name`` on the GPU lists ``gpus`` (one per replica), named ``<name>/<prefix><i>``."""
    stem = f"{name}/{prefix}"
    return tuple(emu(name, layout, tuple(g), stem + str(i)) for i, g in enumerate(gpus))


@dataclass(frozen=True, slots=True)
class StageMove:
    """One model-stage's intact current units and its target units."""

    name: str
    model: ModelSpec
    policy: StatePolicy
    current_layout: Layout
    current: tuple[Emu, ...]  # intact units of the current plan, ``<name>/u<i>``
    target_layout: Layout
    target: tuple[Emu, ...]  # units of the target plan, ``<name>/v<i>``
    restore_from: str = ""  # when no unit is intact: a model-stage (weight sync) or STORAGE
    restore_gpus: tuple[int, ...] = ()  # the GPUs of that model-stage

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError(f"{self.name}: the target has no units")
        if not self.current and not self.restore_from:
            raise ValueError(f"{self.name}: no intact unit and no source to restore from")
        for side, layout, us, prefix in (
            ("current", self.current_layout, self.current, "u"),
            ("target", self.target_layout, self.target, "v"),
        ):
            stem = f"{self.name}/{prefix}"
            for i, u in enumerate(us):
                if u.model_stage != self.name or u.layout != layout or u.id != stem + str(i):
                    raise ValueError(
                        f"{self.name}: {side} unit {i} must be {self.name}/{prefix}{i} of {layout}, "
                        f"got {u.id or '(unnamed)'} of {u.model_stage} {u.layout}"
                    )

    @classmethod
    def between(
        cls, name: str, model: ModelSpec, policy: StatePolicy,
        current_layout: Layout, current: Sequence[Sequence[int]],
        target_layout: Layout, target: Sequence[Sequence[int]],
        restore_from: str = "", restore_gpus: tuple[int, ...] = (),
    ) -> StageMove:  # fmt: skip
        """The move from replicas on ``current`` GPU lists to replicas on ``target`` GPU lists."""
        return cls(
            name, model, policy,
            current_layout, units(name, current_layout, current, "u"),
            target_layout, units(name, target_layout, target, "v"),
            restore_from, restore_gpus,
        )  # fmt: skip

    @property
    def unchanged(self) -> bool:
        return self.current_layout == self.target_layout and sorted(u.gpus for u in self.current) == sorted(
            u.gpus for u in self.target
        )
