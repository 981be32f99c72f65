"""Calibration: per-op-class efficiencies and memory corrections, fitted from measurements.

The cost model reads an immutable ``Efficiencies`` snapshot; the ``CalibrationStore`` owns the
samples, refits after every ``update`` (paper §2.5: refined after every step), and persists to a
JSON file keyed by cluster name so another job (or another model) on that cluster starts warm.

Estimator (our choice; the paper leaves it open, paper-notes §5.3): per class, a window of the
latest samples (ideal seconds at η = 1, measured seconds); samples whose ratio lies more than
3 scaled MADs (at least 5% of the median) from the median are dropped; η = Σ ideal / Σ measured
over the rest, clipped to [0.01, 1]. Memory: per stage, the ratio measured/predicted peak; the
correction is the median plus two scaled MADs (an upper estimate, so feasibility stays
conservative), clipped to [0.5, 4].

By shape (``nereus.plan.shapefit``): a measurement may carry the size of the work it timed and,
for collectives, the ranks per node of its group. The store keeps the latest ``SHAPE_WINDOW`` sized
samples per class beside the window above and fits each class's η as a curve of size (and
group); the cost model prices each candidate at its own size (``Efficiencies.at``). Without sized
samples a class has no curve and every price is the class-wide η's, exactly as before.

File format 2 adds the sized samples (``shaped``: [ideal_s, measured_s, size, group] per sample);
format 1 files still load (no sized samples).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np

from nereus.errors import ConfigError
from nereus.plan.opclass import PRIOR_EFFICIENCY, OpClass
from nereus.plan.replica import FloatArray
from nereus.plan.shapefit import ETA_MAX as SHAPED_ETA_MAX
from nereus.plan.shapefit import ShapeCurve, fit_curve
from nereus.spec.files import brief, load_json, shorten
from nereus.spec.workload import Stage

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)  # format 1: no sized samples
SHAPE_WINDOW = 512  # sized samples kept per op class (the curve needs more than one plan's shapes)
MAD_SCALE = 1.4826  # MAD → standard deviation for normal data
RELATIVE_FLOOR = 0.05
MEMORY_CAP = 4.0  # the largest memory correction (the model is not that wrong)
MEMORY_MIN = 0.5  # the smallest
ETA_MIN, ETA_MAX = 0.01, 1.0  # a fitted efficiency's bounds
# a compute class's work cannot beat the GPU's peak; a collective's curve may pass its ring ideal
COMPUTE = frozenset({OpClass.GEMM, OpClass.ATTENTION, OpClass.MEMORY, OpClass.DECODE})
CURVE_MAX = 1.0
OOM_STEP = 1.25  # an out-of-memory error raises a stage's memory correction by this factor


@dataclass(frozen=True, slots=True)
class Measurement:
    """One timed operation: what it would take at η = 1, and what it took; ``size``: the size
    of the work (``nereus.plan.shapefit``; 0 when unknown), ``group``: a collective's ranks per
    node (0 when unknown or not a collective)."""

    op_class: OpClass
    ideal_s: float
    measured_s: float
    size: float = 0.0
    group: float = 0.0

    def __post_init__(self) -> None:
        if not (self.ideal_s > 0 and self.measured_s > 0):
            raise ValueError(f"{self.op_class}: ideal_s and measured_s must be positive")
        if not (
            math.isfinite(self.size) and self.size >= 0 and math.isfinite(self.group) and self.group >= 0
        ):
            raise ValueError(f"{self.op_class}: size and group must be finite and non-negative")


@dataclass(frozen=True, slots=True)
class Efficiencies:
    """Snapshot read by the cost model: η per op class and a memory factor per stage."""

    eta: Mapping[OpClass, float] = field(default_factory=lambda: MappingProxyType(PRIOR_EFFICIENCY))
    memory_correction: Mapping[Stage, float] = field(
        default_factory=lambda: MappingProxyType({s: 1.0 for s in Stage})
    )
    curves: Mapping[OpClass, ShapeCurve] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        missing = set(OpClass) - set(self.eta)
        if missing:
            raise ValueError(f"efficiency missing for {sorted(missing)}")
        for op, value in self.eta.items():
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency of {op} must be in (0, 1], got {value}")
        for stage, value in self.memory_correction.items():
            if value <= 0:
                raise ValueError(f"memory correction of {stage} must be positive, got {value}")

    def __getitem__(self, op: OpClass) -> float:
        return self.eta[op]

    def at(
        self, op: OpClass, size: FloatArray | float, group: FloatArray | float | None = None
    ) -> FloatArray | float:
        """η of ``op`` at each row's size (and group): the class's curve where it has one (rows of
        size ≤ 0 take the class-wide η), else the class-wide η itself (the same float, so prices
        without curves are bit for bit what they were)."""
        curve = self.curves.get(op)
        if curve is None:
            return self.eta[op]
        sized = np.asarray(size, dtype=np.float64)
        return np.where(sized > 0, curve.eta(sized, group), self.eta[op])

    def shaped(self, *ops: OpClass) -> bool:
        """Whether any of ``ops`` is priced by a curve."""
        return any(op in self.curves for op in ops)

    @classmethod
    def unit(cls) -> Efficiencies:
        """η = 1 everywhere and no memory correction: costs become ideal (peak-rate) seconds."""
        return cls(eta=MappingProxyType({op: 1.0 for op in OpClass}))

    def memory(self, stage: Stage) -> float:
        return self.memory_correction.get(stage, 1.0)


def _inliers(ratios: list[float]) -> list[int]:
    """Indices of ratios within 3 robust deviations of the median.

    The deviation is the scaled MAD, floored at 5% of the median so that a run of identical
    samples still rejects a straggler.
    """
    med = statistics.median(ratios)
    mad = statistics.median(abs(r - med) for r in ratios) * MAD_SCALE
    scale = max(mad, RELATIVE_FLOOR * abs(med))
    return [i for i, r in enumerate(ratios) if abs(r - med) <= 3 * scale]


class CalibrationStore:
    """Measured samples for one cluster and the efficiencies fitted from them."""

    def __init__(self, cluster: str, window: int = 64) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self.cluster = cluster
        self.window = window
        self._samples: dict[OpClass, deque[tuple[float, float]]] = {}
        self._shaped: dict[OpClass, deque[tuple[float, float, float, float]]] = {}
        self._memory: dict[Stage, deque[float]] = {}
        self._floor: dict[Stage, float] = {}  # lower bounds from out-of-memory errors (not persisted)
        self._fitted: Efficiencies | None = None  # ``efficiencies()`` until the samples change

    # ---------------------------------------------------------------- updates
    def update(self, measurements: Iterable[Measurement]) -> None:
        self._fitted = None
        for m in measurements:
            self._append(m.op_class, m.ideal_s, m.measured_s)
            if m.size > 0:
                shaped = self._shaped.setdefault(m.op_class, deque(maxlen=SHAPE_WINDOW))
                shaped.append((m.ideal_s, m.measured_s, m.size, m.group))

    def _append(self, op: OpClass, ideal_s: float, measured_s: float) -> None:
        """One sample of ``op``."""
        self._samples.setdefault(op, deque(maxlen=self.window)).append((ideal_s, measured_s))

    def raise_memory_floor(self, stage: Stage, step: float = OOM_STEP) -> float:
        """A stage ran out of memory: its correction is at least ``step`` times what it was (the
        model under-predicted it; repeated out-of-memory errors escalate). Returns the new floor."""
        floor = min(MEMORY_CAP, max(self._floor.get(stage, 1.0), self.memory_factor(stage)) * step)
        self._floor[stage] = floor
        self._fitted = None
        return floor

    def update_memory(self, stage: Stage, predicted_bytes: float, measured_bytes: float) -> None:
        if predicted_bytes <= 0 or measured_bytes <= 0:
            raise ValueError("predicted and measured memory must be positive")
        bucket = self._memory.setdefault(stage, deque(maxlen=self.window))
        bucket.append(measured_bytes / predicted_bytes)
        self._fitted = None

    # ---------------------------------------------------------------- fit
    def efficiency(self, op: OpClass) -> float:
        raw = self._raw_efficiency(op)
        return PRIOR_EFFICIENCY[op] if raw is None else min(ETA_MAX, max(ETA_MIN, raw))

    def _raw_efficiency(self, op: OpClass) -> float | None:
        samples = self._samples.get(op)
        if not samples:
            return None
        pairs = list(samples)
        keep = _inliers([i / m for i, m in pairs])
        return sum(pairs[i][0] for i in keep) / sum(pairs[i][1] for i in keep)

    def memory_factor(self, stage: Stage) -> float:
        floor = self._floor.get(stage, 0.0)  # raised by out-of-memory errors
        raw = self._raw_memory(stage)
        return max(1.0, floor) if raw is None else max(floor, min(MEMORY_CAP, max(MEMORY_MIN, raw)))

    def _raw_memory(self, stage: Stage) -> float | None:
        ratios = list(self._memory.get(stage, ()))
        if not ratios:
            return None
        kept = [ratios[i] for i in _inliers(ratios)]
        med = statistics.median(kept)
        return med + 2 * statistics.median(abs(r - med) for r in kept) * MAD_SCALE

    def clipped(self) -> list[str]:
        """The fitted values far outside their bounds (more than 10% past), each named with the
        bound used instead: a file whose samples imply them was not measured on this cluster's model,
        and a user who named it is told rather than planned for in silence."""
        out = []
        for op in OpClass:
            raw = self._raw_efficiency(op)
            if raw is not None and not ETA_MIN / 1.1 <= raw <= ETA_MAX * 1.1:
                used = self.efficiency(op)
                out.append(
                    f"{op.value} efficiency {raw:.3g} is outside [{ETA_MIN:g}, {ETA_MAX:g}]; using {used:g}"
                )
        for stage in Stage:
            raw = self._raw_memory(stage)
            if raw is not None and not MEMORY_MIN / 1.1 <= raw <= MEMORY_CAP * 1.1:
                used = self.memory_factor(stage)
                bounds = f"[{MEMORY_MIN:g}, {MEMORY_CAP:g}]"
                out.append(f"{stage.value} memory ratio {raw:.3g} is outside {bounds}; using {used:g}")
        for op, shaped in self._shaped.items():  # a curve may pass 1 only where a collective's
            etas = [i / m for i, m, _, _ in shaped]  # hierarchy beats the planner's ring ideal
            if not etas:
                continue
            high = CURVE_MAX if op in COMPUTE else SHAPED_ETA_MAX
            if min(etas) < ETA_MIN / 1.1 or max(etas) > high * 1.1:
                out.append(
                    f"{op.value} sized samples' efficiencies {min(etas):.3g}–{max(etas):.3g} pass "
                    f"[{ETA_MIN:g}, {high:g}]; their curve keeps within [{ETA_MIN:g}, {high:g}]"
                )
        return out

    def curve(self, op: OpClass) -> ShapeCurve | None:
        """η of ``op`` by size, fitted from its sized samples (None: too few, or one size)."""
        shaped = self._shaped.get(op)
        high = CURVE_MAX if op in COMPUTE else SHAPED_ETA_MAX  # no work computes above peak
        return fit_curve(list(shaped), self.efficiency(op), high) if shaped else None

    def efficiencies(self) -> Efficiencies:
        """What the samples fit to (kept until the next update: the controller asks every replan,
        and a curve's fit is a few least-squares solves)."""
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> Efficiencies:
        curves = {op: c for op in self._shaped if (c := self.curve(op)) is not None}
        return Efficiencies(
            eta=MappingProxyType({op: self.efficiency(op) for op in OpClass}),
            memory_correction=MappingProxyType({s: self.memory_factor(s) for s in Stage}),
            curves=MappingProxyType(curves),
        )

    def sample_count(self, op: OpClass) -> int:
        return len(self._samples.get(op, ()))

    # ---------------------------------------------------------------- persistence
    def _to_json(self) -> dict[str, object]:
        return {
            "window": self.window,
            "samples": {op.value: [list(p) for p in s] for op, s in self._samples.items()},
            "memory": {st.value: list(r) for st, r in self._memory.items()},
            "shaped": {op.value: [list(p) for p in s] for op, s in self._shaped.items()},
        }

    def save(self, path: Path) -> None:
        """Write (or merge into) the JSON file, atomically: temp file, then rename."""
        doc: dict[str, object] = {"format": FORMAT_VERSION, "clusters": {}}
        if path.exists():
            doc = _read(path)
            doc["format"] = FORMAT_VERSION  # a format-1 file's entries are valid format 2
        clusters = doc["clusters"]
        assert isinstance(clusters, dict)
        clusters[self.cluster] = self._to_json()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, cluster: str, strict: bool = False) -> CalibrationStore:
        """The store for ``cluster`` from ``path``; priors if the file or the cluster is absent,
        unless ``strict`` (a file the user named: then both must be there, or ``ConfigError``)."""
        if not strict and not path.exists():
            return cls(cluster)
        entry = _read(path)["clusters"]
        assert isinstance(entry, dict)
        data = entry.get(cluster)
        if data is None and strict:
            held = ", ".join(shorten(str(k), 30) for k in list(entry)[:8]) or "none"
            raise ConfigError(f"{path}: no calibration for cluster {cluster} (clusters in it: {held})")
        if data is None:
            return cls(cluster)
        key = f"{path}: key 'clusters.{cluster}"
        if (
            not isinstance(data, dict)
            or not {"window", "samples", "memory"} <= set(data)
            or not set(data) <= {"window", "samples", "memory", "shaped"}
        ):
            raise ConfigError(
                f"{key}': malformed calibration (expected a mapping of window, samples, memory[, shaped])"
            )
        window = data["window"]
        if not _integer(window) or not 1 <= window <= MAX_WINDOW:
            raise ConfigError(f"{key}.window': expected an integer in [1, {MAX_WINDOW}], got {brief(window)}")
        store = cls(cluster, window=window)
        for field_, kind, width in (("samples", OpClass, 2), ("memory", Stage, 1), ("shaped", OpClass, 4)):
            entries = data.get(field_, {})
            allowed = ", ".join(k.value for k in kind)
            if not isinstance(entries, dict):
                raise ConfigError(f"{key}.{field_}': expected a mapping of {allowed}, got {brief(entries)}")
            for name, values in entries.items():
                where = f"{key}.{field_}.{shorten(str(name), 30)}'"
                if name not in {k.value for k in kind}:
                    raise ConfigError(f"{where}: malformed calibration (allowed: {allowed})")
                what = {
                    1: "ratios",
                    2: "[ideal_s, measured_s] pairs",
                    4: "[ideal_s, measured_s, size, group] lists",
                }[width]
                if not isinstance(values, list) or not all(_sample(v, width) for v in values):
                    numbers = f"numbers in [{SAMPLE_MIN:g}, {SAMPLE_MAX:g}]"
                    sizes = f"; size and group 0 or up to {SIZE_MAX:g}" if width == 4 else ""
                    raise ConfigError(f"{where}: expected a list of {what} ({numbers}{sizes})")
                if width == 2:
                    for i, m in values:
                        store._append(OpClass(name), float(i), float(m))
                elif width == 4:
                    shaped = store._shaped.setdefault(OpClass(name), deque(maxlen=SHAPE_WINDOW))
                    shaped.extend((float(i), float(m), float(s), float(g)) for i, m, s, g in values)
                else:
                    bucket = store._memory.setdefault(Stage(name), deque(maxlen=store.window))
                    bucket.extend(float(r) for r in values)
        store._fitted = None  # (filled past ``update``)
        return store


MAX_WINDOW = 1 << 16
SAMPLE_MIN, SAMPLE_MAX = 1e-12, 1e12  # seconds and memory ratios a calibration file may hold
SIZE_MAX = 1e21  # a sized sample's size (FLOPs, bytes: 70B inference is 1.6e13) and group
MAX_FILE_BYTES = 64 << 20  # a file of many clusters' full windows (one is under 1 MiB)
TOP_KEYS = ("format", "clusters")


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and SAMPLE_MIN <= value <= SAMPLE_MAX
    )


def _sample(value: object, width: int) -> bool:
    """A memory ratio (``width`` 1), an [ideal_s, measured_s] pair (``width`` 2) or an [ideal_s,
    measured_s, size, group] list (``width`` 4: size and group may also be 0, unknown), in range."""
    if width == 1:
        return _number(value)
    if not isinstance(value, list) or len(value) != width:
        return False
    return all(_number(v) for v in value[:2]) and all(_size(v) for v in value[2:])


def _size(value: object) -> bool:
    """A sized sample's size or group: 0 (unknown), or a positive number up to ``SIZE_MAX``."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value == 0 or SAMPLE_MIN <= value <= SIZE_MAX)
    )


def _read(path: Path) -> dict[str, object]:
    doc = load_json(path, "calibration file", MAX_FILE_BYTES)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object with keys format and clusters, got {brief(doc)}")
    unknown = sorted(str(k) for k in doc if k not in TOP_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key {brief(unknown[0])} (allowed: {', '.join(TOP_KEYS)})")
    fmt = doc.get("format")
    if not _integer(fmt) or fmt not in READABLE_FORMATS:  # True == 1 and 2.0 == 2 in Python
        raise ConfigError(f"{path}: key 'format': expected 1 or 2 (this Nereus reads both), got {brief(fmt)}")
    if not isinstance(doc.get("clusters"), dict):
        raise ConfigError(f"{path}: key 'clusters': expected a mapping")
    return doc
