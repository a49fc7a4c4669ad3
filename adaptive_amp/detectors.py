"""The StabilityMonitor's detectors: each a small object with its own thresholds and warm-up.

A detector looks at a :class:`SeriesView` (the steps just read, with the
``window`` steps before them, as host arrays, and the per-layer statistics
just read) and returns :class:`Event` records. Detectors that remember
something between reads (a scale below the floor, an underflow baseline)
keep it in ``state_dict()``. To tune one, pass your own list to
``StabilityMonitor(detectors=...)``; to add one, subclass :class:`Detector`.

Ordinary training must raise nothing. Early training moves fast (the loss
falls steeply, gradient norms shrink or rise several-fold, the fp16 loss
scale searches for its level), and a long plateau is so quiet that noise of
a few percent is many robust standard deviations. So a value is unusual
only when it is both far out in robust standard deviations *and* large in
absolute terms (a relative size, a factor), and above everything in the
reference window: a loss that climbs back towards where it was a few steps
earlier is early training, not a spike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

_MAD_TO_SIGMA = 0.6745  # the MAD of a normal distribution is 0.6745 sigma

#: The smallest spread a z-score divides by, relative to max(|median|, 1): a reference window of (nearly)
#: equal values (a fixed batch, losses quantized to bf16) must not turn a change in the last bits into a
#: "spike" of millions of standard deviations.
_MIN_SPREAD = 1e-3


@dataclass(frozen=True)
class Event:
    """Something the monitor saw or the controller decided, at a step."""

    step: int
    kind: str
    message: str
    layer: Optional[str] = None
    data: Dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict:
        return {"step": self.step, "kind": self.kind, "layer": self.layer, "message": self.message,
                "data": dict(self.data)}

    @classmethod
    def from_dict(cls, d: dict) -> "Event":
        return cls(step=int(d["step"]), kind=str(d["kind"]), message=str(d["message"]), layer=d.get("layer"),
                   data=dict(d.get("data") or {}))

    def __str__(self):
        where = f" [{self.layer}]" if self.layer else ""
        return f"step {self.step}: {self.kind}{where}: {self.message}"


@dataclass
class LayerStats:
    """Per-layer statistics of one step, on the host."""

    step: int
    kind: str  # one of monitor.LAYER_STATS_KINDS
    fmt: Optional[str]
    rows: List[dict]

    def to_dict(self) -> dict:
        return {"step": self.step, "kind": self.kind, "fmt": self.fmt, "rows": self.rows}


@dataclass
class SeriesView:
    """What a read hands the detectors: per-step columns (float64, unknown = NaN) over the steps just read
    (indices ``first_new`` onwards) and the history window before them, plus the layer statistics just read."""

    steps: np.ndarray
    known_loss: np.ndarray  # bool: a loss was recorded (NaN in `loss` is then a real NaN)
    loss: np.ndarray
    found: np.ndarray  # bool: the step overflowed and was skipped
    grad_norm: np.ndarray
    scale: np.ndarray
    first_new: int
    layer_stats: List[LayerStats]
    max_grad_norm: Optional[np.ndarray] = None  # the clip of each step (NaN: not clipped)

    @property
    def new(self) -> range:
        return range(self.first_new, len(self.steps))


def _check_number(name: str, value, *, positive: bool = True, at_most: Optional[float] = None) -> float:
    """A detector threshold: a finite number (> 0 unless `positive` is False; <= `at_most` when given)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
            not math.isfinite(value) or (positive and value <= 0) or (at_most is not None and value > at_most):
        rule = " > 0" if positive else ""
        rule += f" and <= {at_most}" if at_most is not None else ""
        raise ValueError(f"{name} must be a finite number{rule}, got {value!r}")
    return float(value)


def _check_count(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def robust_z(reference: np.ndarray, value: float, min_count: int) -> float:
    """(value - median) / MAD in standard deviations (MAD floored, see _MIN_SPREAD); -inf when the reference
    has fewer than `min_count` finite values or `value` is not finite."""
    ref = reference[np.isfinite(reference)]
    if ref.size < min_count or not math.isfinite(value):
        return -math.inf
    med = float(np.median(ref))
    mad = float(np.median(np.abs(ref - med)))
    if mad == 0.0:
        mad = float(np.mean(np.abs(ref - med)))
    mad = max(mad, _MIN_SPREAD * max(abs(med), 1.0))
    return _MAD_TO_SIGMA * (value - med) / mad


def window_medians(x: np.ndarray, at, window: int):
    """For each index i of `at`: the median and the maximum of the finite values among x[max(0, i - window):i]
    (NaN where there are none), and their count. The same numbers as np.median and max of each window, in one
    sort instead of one np.median call a step: a read hands the detectors every step since the last one."""
    at = np.asarray(at, dtype=np.int64)
    if at.size == 0 or window < 1:
        empty = np.full(at.size, np.nan)
        return empty, empty.copy(), np.zeros(at.size, np.int64)
    padded = np.full(window + x.size, np.nan)
    padded[window:] = np.where(np.isfinite(x), x, np.nan)
    rows = np.sort(np.lib.stride_tricks.sliding_window_view(padded, window)[at], axis=1)  # NaN sorts last
    count = np.isfinite(rows).sum(axis=1)
    lo, hi = np.maximum(count - 1, 0) // 2, count // 2
    take = np.arange(at.size)
    a, b = rows[take, lo], rows[take, np.minimum(hi, window - 1)]
    # np.median: the middle value, or the mean of the two middle ones ((a + b) / 2, as np.mean computes it)
    median = np.where(lo == hi, a, (a + b) / 2)
    top = rows[take, np.maximum(count - 1, 0)]
    none = count == 0
    median[none], top[none] = np.nan, np.nan
    return median, top, count


class Detector:
    """One kind of trouble. ``detect`` sees each read once, in step order."""

    kind = "detector"

    def detect(self, view: SeriesView) -> List[Event]:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def __repr__(self):
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"


class NanLoss(Detector):
    """A non-finite loss: one event per read, at the first such step, with the count and how many of those
    steps were skipped (the controller skips every one whose loss it recorded)."""

    kind = "nan_loss"

    def detect(self, view):
        bad = [i for i in view.new if view.known_loss[i] and not math.isfinite(view.loss[i])]
        if not bad:
            return []
        first, last = int(view.steps[bad[0]]), int(view.steps[bad[-1]])
        skipped = int(sum(bool(view.found[i]) for i in bad))
        said = ("skipped, weights unchanged" if skipped == len(bad) else
                f"{skipped} of them skipped, {len(bad) - skipped} stepped")
        return [Event(first, self.kind, f"loss is NaN or inf at {len(bad)} of {len(view.new)} steps "
                      f"(steps {first}..{last}): {said}", data={"count": len(bad), "skipped": skipped})]


class LossSpike(Detector):
    """A loss far above the recent ones: robust z-score (median and MAD of the previous `window` finite
    losses) above `z`, at least `rel` (a fraction) above that median, and above every loss of the window.

    Robust statistics, so that spikes do not widen the yardstick that detects them; the relative size, so
    that a plateau's tiny noise does not make a 1% wobble a spike; the window's maximum, so that early
    training (a steep fall that bumps back up a little) is not one. Positive losses (cross-entropy, MSE)
    are compared as logarithms, as gradient norms are: their batch-to-batch noise grows with their level
    and, near zero, is skewed (a nearly converged classifier's batch with one hard example costs a hundred
    times the median); a real spike is many times the loss's own relative noise. Warm-up: `min_history`
    finite losses.

    And the rise must be at least `of_level` (a fraction) of the run's loss level, the highest window median
    seen so far (usually the starting loss): a model that has memorized its data (a ResNet at 1e-4 after
    starting at 4.7, on the H200) has batches at 3x its median that are still nothing.
    """

    kind = "loss_spike"

    def __init__(self, z: float = 6.0, rel: float = 0.05, window: int = 100, min_history: int = 20,
                 of_level: float = 0.01):
        self.z, self.rel = _check_number("z", z), _check_number("rel", rel, positive=False)
        self.window, self.min_history = _check_count("window", window), _check_count("min_history", min_history)
        self.of_level = _check_number("of_level", of_level, positive=False)
        self._level = 0.0

    def detect(self, view):
        events = []
        new = view.new
        medians, tops, counts = window_medians(view.loss, new, self.window)
        for i, med, top, count in zip(new, medians.tolist(), tops.tolist(), counts.tolist()):
            if count:
                self._level = max(self._level, abs(med))
            value = view.loss[i]
            # Every condition of a spike must hold: the cheap ones first, the z-score (three medians) last.
            if not count or not value > top or value - med < self.rel * max(abs(med), 1e-12) or \
                    value - med < self.of_level * self._level:
                continue
            ref = view.loss[max(0, i - self.window):i]
            ref = ref[np.isfinite(ref)]
            log = value > 0 and ref.size and ref.min() > 0
            if log:
                z = robust_z(np.log(ref), math.log(value), self.min_history)
            else:  # a loss that can be zero or negative: its noise need not scale with it
                z = robust_z(ref, value, self.min_history)
            if z <= self.z:
                continue
            events.append(Event(int(view.steps[i]), self.kind,
                                f"loss {value:.4g} is {z:.1f} robust standard deviations"
                                f"{' of the log-losses' if log else ''} above the median {med:.4g} of the "
                                f"previous {ref.size} steps", data={"z": z, "loss": value}))
        return events


    def state_dict(self):
        return {"level": self._level}

    def load_state_dict(self, state):
        self._level = float(state.get("level", 0.0))  # (states saved before the level existed: none yet)


class OverflowRate(Detector):
    """The fraction of skipped steps over the last `window` steps above `threshold`, the new steps
    overflowing too (a storm that has just been cured is not reported again). Warm-up: `min_history` steps."""

    kind = "overflow_rate"

    def __init__(self, threshold: float = 0.25, window: int = 100, min_history: int = 20):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.integer, np.floating)) or \
                not 0 < threshold <= 1:
            raise ValueError(f"overflow_rate must be in (0, 1], got {threshold!r}")
        self.threshold = float(threshold)
        self.window, self.min_history = _check_count("window", window), _check_count("min_history", min_history)

    def detect(self, view):
        n = len(view.steps)
        lo = max(0, n - self.window)
        span = n - lo
        rate = float(view.found[lo:].mean()) if span else 0.0
        chunk = float(view.found[view.first_new:].mean()) if n > view.first_new else 0.0
        if span >= min(self.window, self.min_history) and rate > self.threshold and chunk > self.threshold:
            return [Event(int(view.steps[-1]), self.kind,
                          f"{rate:.0%} of the last {span} steps overflowed and were skipped "
                          f"(threshold {self.threshold:.0%})", data={"rate": rate, "steps": span})]
        return []


class ScaleCollapse(Detector):
    """The loss scale fell below `floor`: once per fall."""

    kind = "scale_collapse"

    def __init__(self, floor: float = 1.0):
        self.floor = _check_number("floor", floor, positive=False)
        self._below = False

    def detect(self, view):
        events = []
        for i in view.new:
            scale = view.scale[i]
            if not math.isfinite(scale):
                continue
            if scale < self.floor and not self._below:
                events.append(Event(int(view.steps[i]), self.kind,
                                    f"loss scale fell to {scale:.3g}, below the floor {self.floor:g}",
                                    data={"scale": scale}))
            self._below = bool(scale < self.floor)  # a numpy bool would not load with weights_only
        return events

    def state_dict(self):
        return {"below": self._below}

    def load_state_dict(self, state):
        self._below = bool(state["below"])


class GradNormAnomaly(Detector):
    """On a step that was not skipped: a non-finite gradient norm, or a norm at least `factor` times the
    median of the previous `window` norms of unskipped steps, above all of them, with a robust z-score of
    the log-norms above `z`. Gradient norms move several-fold in early training and drift on plateaus;
    an explosion is an order of magnitude. Warm-up: `min_history` norms.

    On a clipped step (the view's ``max_grad_norm`` is known) the clip bounds the update whatever the norm,
    so a finite spike is not trouble by itself: early transformer training has isolated 5-30x spikes that
    the clip absorbs while the loss keeps falling (GPT-2 small on an H200 had five in 2000 steps). There
    the norm must stay that high for `persist` unskipped steps in a row (each step judged against the
    window before the first of them), as it does when training diverges. An unclipped spike moves the
    weights by that much and is reported at its step. Reported once per episode: not again until a norm
    falls back under the level that was exceeded.
    """

    kind = "grad_norm_anomaly"

    def __init__(self, z: float = 8.0, factor: float = 5.0, window: int = 100, min_history: int = 20,
                 persist: int = 5):
        self.z, self.factor = _check_number("z", z), _check_number("factor", factor)
        self.window, self.min_history = _check_count("window", window), _check_count("min_history", min_history)
        self.persist = _check_count("persist", persist)
        self._level: Optional[float] = None  # the level an episode exceeded; None: no episode going on

    def detect(self, view):
        events = []
        norm, found = view.grad_norm, view.found
        clipped = np.isfinite(view.max_grad_norm) if view.max_grad_norm is not None else np.zeros(len(norm), bool)
        usable = ~found & np.isfinite(norm) & (norm > 0)
        kept = np.flatnonzero(usable)  # the usable steps' indices; a run is the last `need` of them up to i
        for i in view.new:
            if found[i] or math.isnan(norm[i]):
                continue
            if math.isinf(norm[i]):
                events.append(Event(int(view.steps[i]), self.kind, "gradient norm is inf on a step that was "
                                    "not skipped", data={"norm": norm[i]}))
                continue
            if not usable[i]:
                continue
            if self._level is not None:
                if norm[i] >= self._level:
                    continue
                self._level = None
            need = self.persist if clipped[i] else 1
            at = int(np.searchsorted(kept, i))  # (i is usable: kept[at] == i)
            run = kept[max(0, at + 1 - need):at + 1]
            if run.size < need or not clipped[run].all() and need > 1:
                continue
            first = int(run[0])
            lo = max(0, first - self.window)
            ref = norm[lo:first][usable[lo:first]]
            if ref.size < self.min_history:
                continue
            low = float(norm[run].min())
            if low <= float(ref.max()):  # (before the median: most steps stop here)
                continue
            med = float(np.median(ref))
            if low < self.factor * med:
                continue
            z = robust_z(np.log(ref), math.log(low), self.min_history)
            if z <= self.z:
                continue
            self._level = self.factor * med
            if need == 1:
                message = (f"gradient norm {norm[i]:.4g} is {norm[i] / med:.1f}x the median of the previous "
                           f"{ref.size} steps ({z:.1f} robust standard deviations of the log-norms)")
            else:
                message = (f"gradient norm stayed at least {low / med:.1f}x the median of the previous {ref.size} "
                           f"steps for {need} clipped steps since step {int(view.steps[first])} (now {norm[i]:.4g}, "
                           f"clip {view.max_grad_norm[i]:g}; {z:.1f} robust standard deviations of the log-norms)")
            events.append(Event(int(view.steps[i]), self.kind, message,
                                data={"z": z, "norm": float(norm[i]), "steps": need}))
        return events

    def state_dict(self):
        return {"level": self._level}

    def load_state_dict(self, state):
        level = state.get("level")
        self._level = None if level is None else float(level)


class UnderflowRising(Detector):
    """The fraction of gradient elements that underflow in the compute format (at the loss scale) has at
    least doubled since the first statistics and is above `min_fraction`; names the layer with the most.
    Reported again only after it has come down."""

    kind = "underflow_rising"

    def __init__(self, min_fraction: float = 0.01):
        self.min_fraction = _check_number("min_fraction", min_fraction, positive=False, at_most=1.0)
        self._baseline: Optional[float] = None
        self._flagged = False

    def detect(self, view):
        events = []
        for ls in view.layer_stats:
            if ls.kind != "gradient" or not ls.fmt:
                continue
            total = sum(r["numel"] for r in ls.rows)
            if not total:
                continue
            frac = sum(r["underflow_count"] for r in ls.rows) / total
            if self._baseline is None:
                self._baseline = frac
                continue
            rising = frac > self.min_fraction and frac >= 2 * self._baseline
            if rising and not self._flagged:
                worst = max(ls.rows, key=lambda r: r["underflow_count"] / r["numel"] if r["numel"] else 0)
                events.append(Event(ls.step, self.kind,
                                    f"{frac:.2%} of gradient elements underflow in {ls.fmt} (was "
                                    f"{self._baseline:.2%}); most in {worst['name']}", layer=worst["name"],
                                    data={"fraction": frac, "baseline": self._baseline}))
            self._flagged = rising
        return events

    def state_dict(self):
        return {"baseline": self._baseline, "flagged": self._flagged}

    def load_state_dict(self, state):
        baseline = state["baseline"]
        self._baseline = None if baseline is None else float(baseline)
        self._flagged = bool(state["flagged"])


def finite_inputs(layer_stats: List[LayerStats]) -> Dict[tuple, bool]:
    """(step, layer) -> whether the layer's recorded input was free of inf/NaN."""
    return {(ls.step, row["name"]): row["inf_count"] + row["nan_count"] == 0
            for ls in layer_stats if ls.kind == "input" for row in ls.rows}


def overflowing_rows(ls: LayerStats, inputs: Dict[tuple, bool]) -> List[dict]:
    """The activation rows of `ls` whose layer made inf/NaN or values beyond the format out of finite inputs
    (a layer handed infs only passes them on; with no input statistics the layer is taken to have made
    its output from what it was given)."""
    if ls.kind != "activation":
        return []
    return [row for row in ls.rows
            if row.get("inf_count", 0) + row.get("nan_count", 0) + row.get("overflow_count", 0)
            and inputs.get((ls.step, row["name"]), True)]


class ActivationOverflow(Detector):
    """A layer's output holds inf/NaN or values beyond the compute format while its input was finite: one
    event per such layer and statistics step, none for the layers downstream that only carry its infs."""

    kind = "activation_overflow"

    def detect(self, view):
        inputs = finite_inputs(view.layer_stats)
        events = []
        for ls in view.layer_stats:
            for row in overflowing_rows(ls, inputs):
                bad = row.get("inf_count", 0) + row.get("nan_count", 0) + row.get("overflow_count", 0)
                what = f"{ls.fmt} range" if ls.fmt else "finite range"
                events.append(Event(ls.step, self.kind, f"{bad} of {row['numel']} output elements are inf/NaN "
                                    f"or beyond the {what} (amax {row['amax']:.4g})", layer=row["name"],
                                    data={"count": bad, "numel": row["numel"], "amax": row["amax"]}))
        return events
