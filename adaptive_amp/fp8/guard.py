"""The run-time guard of fp8 layers: a detector that demotes a layer which stops tolerating fp8.

At statistics steps each fp8 layer reports a row (a :class:`~adaptive_amp.detectors.LayerStats`
of kind ``"fp8"``, or :meth:`Fp8Guard.observe` directly)::

    {"name": "model.layers.3.mlp.down_proj", "amax": 41.5, "underflow": 2e-4, "saturated": 0.0,
     "error": 0.05}

``amax``: the largest |value| of the layer's input; ``underflow``: the
fraction of its nonzero values that the scaled e4m3 cast turns into zero;
``saturated``: the fraction beyond e4m3's range at the scale the cast used
(zero for dynamic scaling of the same tensor; a stale or delayed scale can
saturate); ``error`` (optional, NaN when not measured): the layer's output
relative error against a higher-precision recompute. :func:`cast_statistics`
computes the first three from a tensor, :func:`fp8_layer_row` the whole row
of a layer from its input.

:class:`Fp8Guard` demotes a layer to bf16 (event ``fp8_demote``) when its
row crosses a threshold: too many values underflow or saturate, the error is
too large, or amax has grown ``amax_growth`` times past the median of its own
recent history (outlier channels growing: one scale for the whole tensor then
leaves the ordinary values a few codes, or none). A demoted layer comes back
(event ``fp8_restore``) after ``stable_steps`` steps of healthy rows (the
rows of a demoted layer are what fp8 *would* do: the statistics of its input
still come); each demotion after a return doubles the wait. Pure logic, on
host numbers: the guard's own state is in ``state_dict()``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn

from ..detectors import Detector, Event
from .config import check_kind
from .execution import fp8_forward, plain_forward

#: The LayerStats kind whose rows this guard reads.
STATS_KIND = "fp8"


def cast_statistics(x: torch.Tensor, *, scale: Optional[torch.Tensor] = None, rowwise: bool = False,
                    dtype: torch.dtype = torch.float8_e4m3fn) -> dict:
    """amax of `x`, and the fractions of its values that the scaled cast to `dtype` would flush to zero
    (``underflow``, of the nonzero values) and push beyond the format's range (``saturated``). `scale`: the
    multiplier the cast uses (default: dynamic, ``max / amax``, per row when `rowwise`, as torchao's)."""
    x = x.detach().float()
    if rowwise:
        x = x.reshape(-1, x.shape[-1])
    top = torch.finfo(dtype).max
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    if scale is None:
        scale = top / amax.clamp(min=1e-12)
    scaled = x * scale
    nonzero = x != 0
    # Beyond half an ulp above the format's largest value, not above the value itself: the amax times
    # max / amax lands a rounding error above max for 4 in 10 random bf16 tensors, a value the cast rounds
    # to max anyway (no loss), and a dynamic scale would otherwise "saturate" every fifth tensor.
    half_ulp = 0.5 * 2.0 ** math.floor(math.log2(top)) * torch.finfo(dtype).eps
    saturated = scaled.abs() > top + half_ulp
    flushed = nonzero & (scaled.clamp(-top, top).to(dtype).float() == 0)
    n_nonzero = int(nonzero.sum())
    return {"amax": float(x.abs().max()) if x.numel() else 0.0,
            "underflow": int(flushed.sum()) / n_nonzero if n_nonzero else 0.0,
            "saturated": int(saturated.sum()) / x.numel() if x.numel() else 0.0}


def fp8_layer_row(name: str, module: nn.Module, input: torch.Tensor, kind: str = "fp8-tensorwise", *,
                  error: bool = True) -> dict:
    """The guard's row for one fp8 layer at a statistics step: :func:`cast_statistics` of its input (per row for
    the rowwise kind) and, with `error`, its fp8 output's relative error against a float32 recompute (of float32
    copies of its weights whatever their dtype: bf16 under bf16-weights and bf16-pure)."""
    check_kind(kind)
    row = dict(cast_statistics(input, rowwise=kind == "fp8-rowwise"), name=name)
    if error:
        with torch.no_grad(), torch.autocast(input.device.type, enabled=False):
            got = fp8_forward(module, input.float(), kind).float()
            ref = plain_forward(module, input, dtype=torch.float32)
            den = float(ref.norm())
            row["error"] = float((got - ref).norm()) / den if den > 0 else math.nan
    return row


class Fp8Guard(Detector):
    """Demote an fp8 layer to bf16 when its cast statistics or its error say it no longer fits fp8; bring it
    back after a stable period, doubling the wait at each new failure.

    Args:
        max_underflow: largest fraction of nonzero input values flushed to zero by the scaled cast (1%: a
            well-scaled activation loses about 1e-5; outlier channels 1000x the rest lose percents).
        max_saturated: largest fraction of values beyond e4m3's range (1e-4).
        max_error: largest output relative error against a higher-precision recompute (0.15: fp8's own
            rounding costs 4-6%; above the selection's 0.1, so that a layer chosen near that bound is not
            demoted by the noise of one read).
        amax_growth: amax this many times the median of the layer's previous `window` reads is growth no
            training drift makes (16).
        window: reads of a layer's amax history kept (20).
        min_history: reads of a layer before the amax-growth test applies (its warm-up; 5).
        stable_steps: steps of healthy reads before a demoted layer returns to fp8 (500); each demotion after
            a return doubles it, up to `max_wait`.
        max_wait: the longest wait, in steps (16000).
    """

    kind = "fp8_demote"
    restore_kind = "fp8_restore"

    def __init__(self, max_underflow: float = 0.01, max_saturated: float = 1e-4, max_error: float = 0.15,
                 amax_growth: float = 16.0, window: int = 20, min_history: int = 5, stable_steps: int = 500,
                 max_wait: int = 16000):
        for name, value in (("max_underflow", max_underflow), ("max_saturated", max_saturated),
                            ("max_error", max_error)):
            if not 0 <= value:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not amax_growth > 1:
            raise ValueError(f"amax_growth must be > 1, got {amax_growth}")
        if window < 1 or min_history < 1 or min_history > window:
            raise ValueError(f"need 1 <= min_history <= window, got min_history={min_history}, window={window}")
        if stable_steps < 1 or max_wait < stable_steps:
            raise ValueError(f"need 1 <= stable_steps <= max_wait, got stable_steps={stable_steps}, "
                             f"max_wait={max_wait}")
        self.max_underflow, self.max_saturated, self.max_error = float(max_underflow), float(max_saturated), \
            float(max_error)
        self.amax_growth, self.window, self.min_history = float(amax_growth), int(window), int(min_history)
        self.stable_steps, self.max_wait = int(stable_steps), int(max_wait)
        self._history: Dict[str, List[float]] = {}
        self._demoted: Dict[str, dict] = {}  # name -> {"since": step of the last unhealthy read, "wait": steps}
        self._failures: Dict[str, int] = {}

    @property
    def demoted(self) -> Dict[str, int]:
        """The layers in bf16 now -> the step from which their stable period counts."""
        return {name: d["since"] for name, d in self._demoted.items()}

    def _trouble(self, name: str, row: dict) -> List[str]:
        why = []
        under, sat = float(row.get("underflow", 0.0)), float(row.get("saturated", 0.0))
        error, amax = float(row.get("error", math.nan)), float(row.get("amax", math.nan))
        if under > self.max_underflow:
            why.append(f"{under:.2%} of its input underflows in the scaled e4m3 cast (limit {self.max_underflow:.2%})")
        if sat > self.max_saturated:
            why.append(f"{sat:.2%} of its input saturates in the e4m3 cast (limit {self.max_saturated:.2%})")
        if math.isfinite(error) and error > self.max_error:
            why.append(f"output error {error:.2g} against a higher-precision recompute (limit {self.max_error:g})")
        if not math.isfinite(amax) and "amax" in row:
            why.append("its input is not finite")
        history = self._history.get(name, [])
        if math.isfinite(amax) and len(history) >= self.min_history:
            median = float(np.median(history))
            if median > 0 and amax > self.amax_growth * median:
                why.append(f"amax {amax:.4g} is {amax / median:.0f}x the median of its last {len(history)} reads")
        return why

    def observe(self, step: int, rows: List[dict]) -> List[Event]:
        """The events of one statistics step's rows (one per fp8 layer, demoted ones included)."""
        events = []
        for row in rows:
            name = row["name"]
            why = self._trouble(name, row)
            amax = float(row.get("amax", math.nan))
            if math.isfinite(amax):
                history = self._history.setdefault(name, [])
                history.append(amax)
                del history[:-self.window]
            state = self._demoted.get(name)
            if state is None and why:
                failures = self._failures.get(name, 0)
                wait = min(self.stable_steps * 2 ** failures, self.max_wait)
                self._failures[name] = failures + 1
                self._demoted[name] = {"since": int(step), "wait": wait}
                events.append(Event(int(step), self.kind, f"demoted to bf16: {'; '.join(why)} (may return after "
                                    f"{wait} stable steps)", layer=name,
                                    data={"to": "bf16", "reasons": why, "wait": wait,
                                          "failures": failures + 1}))
            elif state is not None:
                if why:
                    state["since"] = int(step)
                elif step - state["since"] >= state["wait"]:
                    del self._demoted[name]
                    events.append(Event(int(step), self.restore_kind,
                                        f"back to fp8 after {step - state['since']} stable steps", layer=name,
                                        data={"to": "fp8", "stable_steps": int(step - state["since"])}))
        return events

    def detect(self, view) -> List[Event]:
        events = []
        for ls in view.layer_stats:
            if ls.kind == STATS_KIND:
                events.extend(self.observe(ls.step, ls.rows))
        return events

    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self._history.items()},
                "demoted": {k: dict(v) for k, v in self._demoted.items()}, "failures": dict(self._failures)}

    def load_state_dict(self, state: dict) -> None:
        self._history = {k: [float(x) for x in v] for k, v in state["history"].items()}
        self._demoted = {k: {"since": int(v["since"]), "wait": int(v["wait"])} for k, v in state["demoted"].items()}
        self._failures = {k: int(v) for k, v in state["failures"].items()}
