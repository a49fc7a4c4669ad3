"""StabilityMonitor: watches a mixed-precision training run without slowing it down.

Per step it keeps references to device values (loss, gradient norm,
found_inf, scale); every ``read_every`` steps, and at a step that recorded
layer outputs (so that an activation overflow is seen when it appears), it
copies them, and the per-layer statistics gathered since, to the host in one
transfer, appends them to its history and runs the detectors on the new
steps. Between reads
nothing synchronizes, so the monitor costs a few pointer appends per step.
From a CUDA device the transfer is queued at the step that ends the window
and taken at the next step (see :meth:`StabilityMonitor.poll`): the host
never waits for the device to finish its queue.

Detectors (adaptive_amp.detectors: each a small object with its own
thresholds and warm-up; ``detectors=`` replaces the default list), each
producing :class:`Event` records (step, kind, layer, message):

* ``nan_loss``: a non-finite loss.
* ``loss_spike``: a loss far above the previous ``window`` losses (robust
  z-score above ``spike_z``, 5% above their median and above all of them).
* ``overflow_rate``: the fraction of skipped (found_inf) steps over the last
  ``window`` steps is above ``overflow_rate``.
* ``scale_collapse``: the loss scale fell below ``scale_floor`` (once per fall).
* ``grad_norm_anomaly``: on a step that was not skipped, a non-finite
  gradient norm, or one 5x the recent median and above all recent norms,
  with a robust z-score of the log-norms above ``grad_norm_z``; on clipped
  steps (``record_step(max_grad_norm=...)``) only once it has lasted 5 steps,
  since the clip bounds what one spike does to the weights.
* ``underflow_rising``: the fraction of gradient elements that underflow in
  the compute format has at least doubled since the first statistics and is
  above 1%; the layer with the most underflow is named.
* ``activation_overflow``: a layer's output holds inf/NaN or values beyond
  the compute format's largest finite value while its input was finite.

Events of a read come out in step order.

``loss_trend()`` and ``loss_variance()`` summarise the recent losses (the
least-squares slope per step and the variance over a window).
"""

from __future__ import annotations

import bisect
import copy
import math
import numbers
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from . import stats as _stats
from .layers import is_sharded
from .detectors import (ActivationOverflow, Detector, Event, GradNormAnomaly, LayerStats, LossSpike, NanLoss,
                        OverflowRate, ScaleCollapse, SeriesView, UnderflowRising)

__all__ = ["StabilityMonitor", "Event", "LayerStats", "Detector", "KINDS", "LAYER_STATS_KINDS"]

#: Every kind of event the monitor emits (the controller adds its own decisions).
KINDS = ("nan_loss", "loss_spike", "overflow_rate", "scale_collapse", "grad_norm_anomaly", "underflow_rising",
         "activation_overflow")
#: What per-layer statistics describe: layer outputs, layer inputs, parameter gradients.
LAYER_STATS_KINDS = ("activation", "input", "gradient")
_COLUMNS = ("loss", "grad_norm", "found_inf", "scale", "max_grad_norm")


class StabilityMonitor:
    """Per-step loss, gradient norm, found_inf and scale; per-layer statistics every N steps.

    Args:
        read_every: steps between reads (each read is one device-to-host transfer).
        stats_every: steps between per-layer statistics (default: ``read_every``);
            :meth:`stats_due` tells the caller when to collect them.
        window: steps of history the detectors compare against.
        spike_z, grad_norm_z: robust z-score thresholds.
        overflow_rate: skipped-step fraction over ``window`` that counts as an overflow storm.
        scale_floor: a loss scale below this is a collapse.
        min_history: the detectors' warm-up: values a reference needs before it is trusted.
        detectors: the detectors to run instead of the default ones (built from the settings above).
        layer_stats_history: statistics steps whose per-layer rows :attr:`layer_stats` keeps, the oldest
            dropped first (None: every one). Each costs host memory, and checkpoints carry them: a 1.1B
            Llama's 201 layers make about 0.4 MB a statistics step, 900 MB over 100,000 steps with every one
            kept. The detectors read each step's rows when they arrive, so dropping old ones changes nothing
            they decide.
    """

    def __init__(self, *, read_every: int = 50, stats_every: Optional[int] = None, window: int = 100,
                 spike_z: float = 6.0, grad_norm_z: float = 8.0, overflow_rate: float = 0.25,
                 scale_floor: float = 1.0, min_history: int = 20, detectors: Optional[Sequence[Detector]] = None,
                 layer_stats_history: Optional[int] = 100):
        _check_int("read_every", read_every, 1, "steps between reads")
        if stats_every is not None:
            _check_int("stats_every", stats_every, 1, "steps between statistics steps, or None for read_every")
        _check_int("window", window, 2, "steps of history the detectors compare against")
        _check_int("min_history", min_history, 1, "values a detector's reference needs")
        if not 0 < overflow_rate <= 1:
            raise ValueError(f"overflow_rate must be in (0, 1], got {overflow_rate}")
        if layer_stats_history is not None and (isinstance(layer_stats_history, bool) or
                                                not isinstance(layer_stats_history, int) or layer_stats_history < 1):
            raise ValueError(f"layer_stats_history must be an int >= 1 (statistics steps kept) or None (all), got "
                             f"{layer_stats_history!r}")
        self.layer_stats_history = layer_stats_history
        self.read_every = int(read_every)
        self.stats_every = int(stats_every or read_every)
        self.window = int(window)
        self.spike_z = float(spike_z)
        self.grad_norm_z = float(grad_norm_z)
        self.overflow_threshold = float(overflow_rate)
        self.scale_floor = float(scale_floor)
        self.min_history = int(min_history)
        self._steps: List[int] = []
        self._cols: Dict[str, List[float]] = {c: [] for c in _COLUMNS}
        self._pending: List[tuple] = []  # (step, {column: tensor or float or None})
        self._pending_stats: List[tuple] = []  # (step, kind, TensorStats)
        self._in_flight: Optional[tuple] = None  # (pending, pending_stats, _HostCopy): a read poll started
        self.layer_stats: List[LayerStats] = []
        self.events: List[Event] = []
        if detectors is None:
            detectors = [NanLoss(), LossSpike(spike_z, window=window, min_history=min_history),
                         OverflowRate(overflow_rate, window=window, min_history=min_history),
                         ScaleCollapse(scale_floor),
                         GradNormAnomaly(grad_norm_z, window=window, min_history=min_history),
                         UnderflowRising(), ActivationOverflow()]
        self.detectors: List[Detector] = list(detectors)
        kinds = [d.kind for d in self.detectors]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"detectors: each kind may appear once (their state is saved by kind), got {kinds}")

    # ------------------------------------------------------------ recording
    def record_step(self, step: int, *, loss=None, grad_norm=None, found_inf=None, scale=None,
                    max_grad_norm=None) -> None:
        """Keep this step's values (device tensors or numbers; None: unknown). No synchronization.

        `max_grad_norm` is the norm the gradients were clipped to at this step
        (None: not clipped); the gradient-norm detector judges clipped steps'
        spikes by whether they last.

        Tensors are kept by reference until the next read: pass ones that are
        not modified in place afterwards (clone the scaler's scale). A
        gradient norm may also come as :class:`SumsOfSquares` (the per-tensor
        sums of squares an adaptive_amp.optim step measured): the read sums
        them, so a step launches nothing for its norm. A DTensor
        (FSDP2: torch's clip returns the total norm as a replicated one) is
        kept as its global value: a replicated one's local tensor, a partial
        or sharded one reduced or gathered (a collective: every rank records
        every step, as the controller does).
        """
        _check_int("step", step, None, "the optimizer step this records")
        values = {"loss": loss, "grad_norm": grad_norm, "found_inf": found_inf, "scale": scale,
                  "max_grad_norm": max_grad_norm}
        for name, value in values.items():
            _check_value(name, value)  # here, not at the read, where a bad one would lose the whole window
        last = self._last_step()
        if last is not None and step <= last:
            raise ValueError(f"step {step} is not after the last recorded step; steps must increase")
        self._pending.append((int(step), {k: _plain(v) for k, v in values.items()}))

    def _last_step(self) -> Optional[int]:
        """The last recorded step: pending, in a read in flight, or read."""
        for steps in (self._pending, self._in_flight[0] if self._in_flight else ()):
            if steps:
                return steps[-1][0]
        return self._steps[-1] if self._steps else None

    def stats_due(self, step: int) -> bool:
        """Whether `step` is one whose per-layer statistics the caller should collect."""
        return step % self.stats_every == 0

    def record_layer_stats(self, step: int, kind: str, stats: "_stats.TensorStats") -> None:
        """Keep per-layer statistics (a TensorStats whose names are the layers) until the next read."""
        if kind not in LAYER_STATS_KINDS:
            raise ValueError(f"kind must be one of {LAYER_STATS_KINDS}, got {kind!r}")
        _check_int("step", step, None, "the step these statistics were taken at")
        if not isinstance(stats, _stats.TensorStats):
            raise TypeError(f"stats must be a TensorStats (adaptive_amp.ops.tensor_stats(tensors, fmt=..., "
                            f"names=[layer names])), got {type(stats).__name__}")
        self._pending_stats.append((int(step), kind, stats))

    def drop_layer_stats(self, step: int) -> None:
        """Forget the per-layer statistics recorded at `step` and not yet read: a step whose forward or backward
        failed and runs again records its own."""
        self._pending_stats = [entry for entry in self._pending_stats if entry[0] != step]

    def read_due(self, step: int) -> bool:
        """Whether `step` ends a read window (reads follow the step count, so a resumed run reads
        at the same steps as an uninterrupted one)."""
        return (step + 1) % self.read_every == 0

    def poll(self, step: int) -> List[Event]:
        """After recording `step`: finish the read an earlier poll started (its events), and start one when
        `step` ends a window or recorded layer outputs (a statistics step); otherwise nothing (no
        synchronization).

        A read of values on a CUDA device only queues their copy to the host at the step that ends its
        window; the next poll, once the caller has queued that next step's work, takes the values and runs
        the detectors. By then the device has usually finished the copy, so the host does not wait for the
        device to drain its queue (6 ms a read on a compiled Llama 1.1B, H200) and the device does not idle
        while the host launches again. Its events come one step later. Values on the host are read at once.
        """
        events = self._finish_read()
        if self.read_due(step) or self._activations_pending(step):
            events += self._start_read()
        return events

    def _activations_pending(self, step: int) -> bool:
        """Whether `step` recorded layer outputs: such a step starts a read of its own, so that an overflow
        they show is diagnosed at once, not at the end of the window (a masked one makes no other sign)."""
        return any(s == step and kind == "activation" for s, kind, _ in self._pending_stats)

    # -------------------------------------------------------------- reading
    def read(self) -> List[Event]:
        """Copy everything pending to the host (one transfer) now, extend the history, run the detectors
        (a read that :meth:`poll` started is finished first)."""
        events = self._finish_read()
        if self._pending or self._pending_stats:
            pending, pending_stats = self._take_pending()
            events += self._absorb(pending, pending_stats, _HostCopy(pending, pending_stats).values())
        return events

    def _take_pending(self):
        pending, self._pending = self._pending, []
        pending_stats, self._pending_stats = self._pending_stats, []
        return pending, pending_stats

    def _start_read(self) -> List[Event]:
        """Queue the pending values' copy to the host; finish at once unless the copy waits for a device."""
        if not self._pending and not self._pending_stats:
            return []
        pending, pending_stats = self._take_pending()
        copy_ = _HostCopy(pending, pending_stats)
        if copy_.deferred:
            self._in_flight = (pending, pending_stats, copy_)
            return []
        return self._absorb(pending, pending_stats, copy_.values())

    def _finish_read(self) -> List[Event]:
        if self._in_flight is None:
            return []
        (pending, pending_stats, copy_), self._in_flight = self._in_flight, None
        return self._absorb(pending, pending_stats, copy_.values())

    def _absorb(self, pending, pending_stats, host_values) -> List[Event]:
        """Append read values to the history and run the detectors on the new steps."""
        columns, stat_values = host_values
        first_new = len(self._steps)
        self._steps.extend(step for step, _ in pending)
        for c in _COLUMNS:
            self._cols[c].extend(columns[c])
        new_stats = []
        for (step, kind, st), values in zip(pending_stats, stat_values):
            host = _stats.TensorStats(values.reshape(-1), len(st), fmt=st.fmt, names=st.names, framework="numpy",
                                      device=st._device)
            new_stats.append(LayerStats(step, kind, st.fmt, host.rows(sort_by=None)))
        self.layer_stats.extend(new_stats)
        self._trim_layer_stats()
        events = self._detect(first_new, new_stats)
        self.events.extend(events)
        return events

    def _trim_layer_stats(self) -> None:
        """Keep the rows of the last `layer_stats_history` statistics steps (the list is in step order)."""
        keep = self.layer_stats_history
        if keep is None:
            return
        seen, cut = set(), 0
        for i in range(len(self.layer_stats) - 1, -1, -1):
            seen.add(self.layer_stats[i].step)
            if len(seen) > keep:
                cut = i + 1
                break
        if cut:
            del self.layer_stats[:cut]

    # --------------------------------------------------------------- history
    @property
    def steps_recorded(self) -> int:
        """Steps read so far (pending ones not included)."""
        return len(self._steps)

    def history(self) -> Dict[str, list]:
        """The read history in the report format: step, loss, grad_norm, scale, found_inf, skipped_steps."""
        found = [1 if f is not None and f > 0 else 0 for f in self._cols["found_inf"]]
        return {"step": list(self._steps), "loss": self._column("loss").tolist(),
                "grad_norm": self._column("grad_norm").tolist(), "scale": self._column("scale").tolist(),
                "found_inf": found, "skipped_steps": np.cumsum(found).astype(int).tolist() if found else []}

    def overflow_rate(self, since_step: Optional[int] = None, window: Optional[int] = None) -> float:
        """Fraction of skipped steps over the last `window` read steps (not before `since_step`); NaN if none."""
        found = self._column("found_inf", -(window or self.window))
        steps = np.asarray(self._steps[-(window or self.window):])
        if since_step is not None:
            found = found[steps >= since_step]
        if found.size == 0:
            return math.nan
        return float(np.mean(np.nan_to_num(found) > 0))

    def steps_since(self, step: int) -> int:
        """Read steps at or after `step` (steps are recorded in increasing order)."""
        return len(self._steps) - bisect.bisect_left(self._steps, step)

    def value_at(self, column: str, step: int) -> float:
        """A read step's value of a history column (loss, grad_norm, found_inf, scale, max_grad_norm); NaN if
        unknown or not read (yet)."""
        i = bisect.bisect_left(self._steps, step)
        if i == len(self._steps) or self._steps[i] != step:
            return math.nan
        value = self._cols[column][i]
        return math.nan if value is None else float(value)

    def last_scale(self) -> float:
        for s in reversed(self._cols["scale"]):
            if s is not None and s == s:
                return s
        return math.nan

    def _recent_losses(self, window: Optional[int]) -> np.ndarray:
        loss = self._column("loss", -(window or self.window))
        return loss[np.isfinite(loss)]

    def loss_trend(self, window: Optional[int] = None) -> float:
        """Least-squares slope of the finite losses over the last `window` steps (per step); NaN if < 2."""
        loss = self._column("loss", -(window or self.window))
        steps = np.asarray(self._steps[-(window or self.window):], dtype=np.float64)
        ok = np.isfinite(loss)
        if ok.sum() < 2:
            return math.nan
        x, y = steps[ok] - steps[ok].mean(), loss[ok] - loss[ok].mean()
        denom = float(np.dot(x, x))
        return float(np.dot(x, y) / denom) if denom > 0 else math.nan

    def loss_variance(self, window: Optional[int] = None) -> float:
        """Variance (correction 1) of the finite losses over the last `window` steps; NaN if < 2."""
        loss = self._recent_losses(window)
        return float(np.var(loss, ddof=1)) if loss.size >= 2 else math.nan

    def latest_layer_stats(self, kind: str) -> Optional[LayerStats]:
        for ls in reversed(self.layer_stats):
            if ls.kind == kind:
                return ls
        return None

    def _column(self, name: str, start: int = 0) -> np.ndarray:
        """A history column from index `start` (negative: from the end) as float64, unknown values as NaN."""
        return np.asarray([math.nan if v is None else v for v in self._cols[name][start:]], dtype=np.float64)

    # ------------------------------------------------------------ detectors
    def _detect(self, first: int, new_stats: List[LayerStats]) -> List[Event]:
        # Only the new steps and the window before them matter: the detectors see that tail, not the history.
        base = max(0, first - max([self.window] + [int(getattr(d, 'window', 0)) for d in self.detectors]))
        view = SeriesView(steps=np.asarray(self._steps[base:]),
                          known_loss=np.asarray([v is not None for v in self._cols["loss"][base:]], dtype=bool),
                          loss=self._column("loss", base),
                          found=np.nan_to_num(self._column("found_inf", base)) > 0,
                          grad_norm=self._column("grad_norm", base), scale=self._column("scale", base),
                          first_new=first - base, layer_stats=new_stats,
                          max_grad_norm=self._column("max_grad_norm", base))
        events: List[Event] = []
        for detector in self.detectors:
            events.extend(detector.detect(view))
        events.sort(key=lambda e: e.step)  # stable: detectors keep their order within a step
        return events

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Everything needed to continue identically. Pending values are copied to the host but stay
        pending, so the next read happens at the same step as it would have; a read in flight (started by
        :meth:`poll`) is saved as one, so that its events come at the same step too."""
        pending, pending_stats = _saved(self._pending, self._pending_stats,
                                        _HostCopy(self._pending, self._pending_stats).values())
        in_flight = None
        if self._in_flight is not None:
            flight, flight_stats, copy_ = self._in_flight
            saved, saved_stats = _saved(flight, flight_stats, copy_.values())
            in_flight = {"pending": saved, "pending_stats": saved_stats}
        # Detectors compute from numpy columns: their states and events may hold numpy scalars, which
        # torch.load(weights_only=True) refuses. A checkpoint holds builtins only.
        return builtin_values({"version": 1, "pending": pending, "pending_stats": pending_stats,
                "in_flight": in_flight, "steps": list(self._steps),
                "columns": {c: list(v) for c, v in self._cols.items()},
                "layer_stats": [ls.to_dict() for ls in self.layer_stats],
                "events": [e.to_dict() for e in self.events],
                "detectors": {d.kind: d.state_dict() for d in self.detectors}})

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("monitor state: not a StabilityMonitor state_dict (version 1)")
        try:
            columns = dict(state["columns"])
            if "max_grad_norm" not in columns:  # a state saved before the clip was recorded
                columns["max_grad_norm"] = [None] * len(state["steps"])
            cols = {c: [_loaded_value(f"columns[{c!r}][{i}]", v) for i, v in enumerate(columns[c])] for c in _COLUMNS}
            steps = [_step_number(f"steps[{i}]", s) for i, s in enumerate(state["steps"])]
            if any(b <= a for a, b in zip(steps, steps[1:])):
                raise ValueError("monitor state: steps must increase")
            if any(len(v) != len(steps) for v in cols.values()):
                raise ValueError("monitor state: the columns and steps have different lengths")
            layer_stats = [LayerStats(int(d["step"]), d["kind"], d["fmt"], list(d["rows"]))
                           for d in state["layer_stats"]]
            events = [Event.from_dict(e) for e in state["events"]]
            pending, pending_stats = _loaded(state["pending"], state["pending_stats"])
            in_flight = state.get("in_flight")  # (absent from states saved before reads were deferred)
            if in_flight is not None:
                flight, flight_stats = _loaded(in_flight["pending"], in_flight["pending_stats"],
                                               "in_flight['pending']")
                order = steps[-1:] + [s for s, _ in flight] + [s for s, _ in pending]
            else:
                order = steps[-1:] + [s for s, _ in pending]
            if any(b <= a for a, b in zip(order, order[1:])):
                raise ValueError("monitor state: the pending steps must come after the steps read, in order")
            if in_flight is not None:
                in_flight = (flight, flight_stats, _HostCopy(flight, flight_stats))
            detector_states = state.get("detectors")
            if detector_states is None:  # a state saved before the detectors were objects
                detector_states = {"scale_collapse": {"below": state["below_floor"]},
                                   "underflow_rising": {"baseline": state["underflow_baseline"],
                                                        "flagged": state["underflow_flagged"]}}
            # Loaded into copies first, so that a refused state leaves the detectors alone.
            detectors = [copy.deepcopy(d) for d in self.detectors]
            for d in detectors:
                if d.kind in detector_states:
                    d.load_state_dict(detector_states[d.kind])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"monitor state: missing or malformed entry ({exc})") from None
        self._steps, self._cols, self.layer_stats, self.events = steps, cols, layer_stats, events
        self._pending, self._pending_stats, self._in_flight = pending, pending_stats, in_flight
        self.detectors = detectors
        self._trim_layer_stats()  # a state saved with a longer history


def _check_int(name: str, value, low: Optional[int], what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (low is not None and value < low):
        at_least = f" >= {low}" if low is not None else ""
        raise ValueError(f"{name} must be an int{at_least} ({what}), got {value!r}")


def _check_value(name: str, value) -> None:
    """A step value record_step keeps: None, a real number, a one-element tensor (or DTensor) or SumsOfSquares."""
    if value is None or isinstance(value, SumsOfSquares) or is_sharded(value):
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a one-element tensor (the step's value), got shape "
                             f"{tuple(value.shape)}; reduce it first (e.g. loss.mean())")
        return
    if isinstance(value, (bool, np.bool_)) and name != "found_inf" or \
            not isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        raise TypeError(f"{name} must be a number, a one-element tensor or None, got {type(value).__name__}")


def _native_cpu():
    from . import _native

    return _native.CPU


def builtin_values(obj):
    """`obj` with numpy scalars turned into Python ones (through dicts, lists and tuples)."""
    if isinstance(obj, dict):
        return {k: builtin_values(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(builtin_values(v) for v in obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


class SumsOfSquares:
    """A gradient norm still in parts: 1-D float tensors of per-tensor sums of squares (any devices), as
    adaptive_amp.optim's steps measure them. The monitor's read copies them with everything else and takes
    ``sqrt(sum)`` on the host, in float64."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = list(parts)


def _plain(value):
    """A plain tensor for a DTensor: its global value, so that every rank records the same number
    (full_tensor: a replicated one's local tensor, without communication)."""
    if is_sharded(value):
        return value.full_tensor()
    return value


def _saved(pending, pending_stats, host_values):
    """Pending entries with their host values, as a checkpoint holds them."""
    columns, stat_values = host_values
    saved = [[step, {c: columns[c][i] for c in _COLUMNS}] for i, (step, _) in enumerate(pending)]
    saved_stats = [{"step": step, "kind": kind, "fmt": st.fmt, "names": list(st.names),
                    "values": values.reshape(-1).tolist()}
                   for (step, kind, st), values in zip(pending_stats, stat_values)]
    return saved, saved_stats


def _step_number(where: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{where} must be a step (an int >= 0), got {value!r}")
    return int(value)


def _loaded_value(where: str, value):
    """A pending value from a checkpoint: None (unknown) or a number, as a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{where} must be None or a number, got {value!r}")
    return float(value)


def _loaded(saved, saved_stats, where: str = "pending"):
    """Pending entries from a checkpoint's (the inverse of _saved; the values are on the host)."""
    if not isinstance(saved, list):
        raise ValueError(f"{where} must be a list of [step, values], got {type(saved).__name__}")
    pending = []
    for i, entry in enumerate(saved):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], dict):
            raise ValueError(f"{where}[{i}] must be [step, {{column: value}}], got {entry!r}")
        step, values = entry
        step = _step_number(f"{where}[{i}][0]", step)
        if pending and step <= pending[-1][0]:
            raise ValueError(f"{where}[{i}][0]: steps must increase, got {step} after {pending[-1][0]}")
        # The clip is optional: states saved before it was recorded lack it.
        pending.append((step, {c: _loaded_value(f"{where}[{i}][1][{c!r}]",
                                                values.get(c) if c == "max_grad_norm" else values[c])
                               for c in _COLUMNS}))
    pending_stats = [(int(d["step"]), d["kind"], _stats.TensorStats(
        np.asarray(d["values"], dtype=np.float64), len(d["names"]), fmt=d["fmt"], names=d["names"],
        framework="numpy", device=_native_cpu())) for d in saved_stats]
    return pending, pending_stats


class _HostCopy:
    """Pending values on their way to the host, as floats (None where unknown): one copy per device.

    Per device, the 0-dim values are stacked per dtype (a launch per dtype),
    converted to float64 and concatenated with the statistics buffers, so a
    read costs a handful of launches and one copy however many steps it covers.
    From a CUDA device the copy goes to pinned memory with an event behind it
    (as StepResult's): :meth:`values` waits for that event only, never for work
    queued after the copy. (The first read allocates that memory, and
    cudaMallocHost synchronizes the device: that read waits, once. Later reads
    reuse the memory through torch's caching host allocator.) From elsewhere the
    copy is done when this is made.
    """

    def __init__(self, pending, pending_stats):
        self._copies: Dict[torch.device, tuple] = {}  # device: (host tensor, event or None, device tensor)
        self._values = None
        self._layout = self._queue(pending, pending_stats)

    @property
    def deferred(self) -> bool:
        """Whether :meth:`values` may wait for a device."""
        return self._values is None and any(event is not None for _, event, _ in self._copies.values())

    def _queue(self, pending, pending_stats):
        by_device: Dict[torch.device, Dict[torch.dtype, list]] = {}
        stat_parts: Dict[torch.device, list] = {}
        slots = []

        def put(value):
            if isinstance(value, SumsOfSquares):
                at = []
                for part in value.parts:
                    parts = stat_parts.setdefault(part.device, [])
                    # (As an optimizer's step makes them: 1-D, no autograd history; no op for those.)
                    flat = part if part.dim() == 1 else part.reshape(-1)
                    parts.append(flat.detach() if flat.requires_grad else flat)
                    at.append((part.device, len(parts) - 1))
                return ("sums", at)
            if isinstance(value, torch.Tensor):
                groups = by_device.setdefault(value.device, {})
                group = groups.setdefault(value.dtype, [])
                # (A read covers read_every steps of values: no op where none is needed.)
                value = value if value.dim() == 0 else value.reshape(-1)[0]
                group.append(value.detach() if value.requires_grad else value)
                return ("dev", value.device, value.dtype, len(group) - 1)
            return ("host", None if value is None else float(value))

        for _, values in pending:
            slots.append({c: put(values[c]) for c in _COLUMNS})
        stat_slots = []
        for _, _, st in pending_stats:
            raw = st.raw
            if isinstance(raw, torch.Tensor):
                parts = stat_parts.setdefault(raw.device, [])
                parts.append(raw.reshape(-1))
                stat_slots.append(("dev", raw.device, None, len(parts) - 1))
            else:
                stat_slots.append(("host", np.asarray(raw, dtype=np.float64)))

        orders = {}
        for dev in set(by_device) | set(stat_parts):
            groups = by_device.get(dev, {})
            orders[dev] = [(dt, len(groups[dt])) for dt in groups]
            pieces = [torch.stack(groups[dt]).to(torch.float64) for dt in groups] + stat_parts.get(dev, [])
            flat = torch.cat(pieces)
            if flat.device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(flat.device))
                # `flat` is kept until the event has passed: its memory is read by the copy until then.
                self._copies[dev] = (host, event, flat)
            else:
                self._copies[dev] = (flat.cpu(), None, None)
        return slots, stat_slots, orders, {dev: [p.numel() for p in parts] for dev, parts in stat_parts.items()}

    def values(self):
        """(columns, stat_values): per column a list of floats (None where unknown), per statistics entry a
        float64 array. Waits for the copies the first time."""
        if self._values is not None:
            return self._values
        slots, stat_slots, orders, stat_sizes = self._layout
        scalars: Dict[tuple, np.ndarray] = {}
        stat_host: Dict[tuple, np.ndarray] = {}
        for dev, (host, event, _) in self._copies.items():
            if event is not None:
                event.synchronize()
            flat = host.numpy()
            at = 0
            for dt, n in orders[dev]:
                scalars[(dev, dt)] = flat[at:at + n]
                at += n
            for i, n in enumerate(stat_sizes.get(dev, [])):
                stat_host[(dev, i)] = flat[at:at + n]
                at += n

        def scalar(slot):
            if slot[0] == "sums":
                return math.sqrt(sum(float(np.sum(stat_host[at], dtype=np.float64)) for at in slot[1]))
            return slot[1] if slot[0] == "host" else float(scalars[(slot[1], slot[2])][slot[3]])

        columns = {c: [scalar(s[c]) for s in slots] for c in _COLUMNS}
        stat_values = [s[1] if s[0] == "host" else stat_host[(s[1], s[3])] for s in stat_slots]
        self._values = (columns, stat_values)
        self._copies, self._layout = {}, None  # the device tensors and events are no longer needed
        return self._values
