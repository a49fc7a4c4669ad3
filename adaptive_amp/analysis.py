"""PrecisionAnalyzer: which layers can compute in which low-precision format.

For every layer (a module that owns weights, see :mod:`adaptive_amp.layers`;
chosen differently with ``include``/``exclude``) and every candidate format, the model is
run in fp32 with only that layer simulated in the format. Comparing with an
fp32 baseline gives, per layer and format, the error of the layer's output
and of the model's output, the activation range against the format's range,
and the fraction of the layer's input (and, with a loss, of its gradients)
that would flush to zero.

How a layer is simulated depends on the format, following how each is used
in training:

* fp16 and bf16 (autocast): the layer's floating-point inputs, its
  parameters and its output are rounded to the format and back to fp32,
  unscaled (a format's overflow shows as inf for fp16).
* fp8 (``float8_e4m3fn``, ``float8_e5m2``): per-tensor scaled, as
  TransformerEngine's fp8 recipes do; a plain cast would flush ordinary
  activations (below e4m3's smallest subnormal, 2**-9) to zero, which is not
  how fp8 is used. Each input and each weight (parameters of 2 or more
  dimensions) gets its own scale ``fp8_max / amax * 2**-fp8_margin`` from its
  own amax ("current scaling"; 1 when the amax is 0, float32's max when the
  quotient overflows), is multiplied by it, cast to the format with
  round-to-nearest-even, and divided by it again. Biases and the output stay
  fp32: fp8 matmuls accumulate in fp32, write a wider type and add the bias
  there. The underflow fractions are those of the scaled cast, and since a
  scaled tensor cannot exceed the format's max, ``overflow`` means only a
  non-finite output. What scaling cannot fix shows as error: an activation
  dominated by a few outliers gets a scale that pushes its ordinary values
  into the format's subnormals or to zero.

One full forward per (layer, format): meant for small sample batches.

A compiled model (``torch.compile``) is analyzed through the module it
compiled, eagerly: the analysis hooks each layer, and hooks added to a model
that dynamo has already traced would not run. Layer names are the eager
model's (no ``_orig_mod.`` prefix).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from .layers import Selector, find_layers, unwrap_model
from .ops import tensor_stats
from ._progress import progress_bar
from .stats import format_name

DEFAULT_CANDIDATES = (torch.float16, torch.bfloat16, "float8_e4m3fn")
#: Relative L2 error of the model's output above which a layer is risky in a format. bf16 rounds
#: with a relative step of 2**-8, so an ordinary layer in bf16 stays well below 0.02; a layer that
#: loses several bits of its result (cancellation, tiny values) goes above it. Scaled fp8 keeps 3
#: (e4m3) or 2 (e5m2) mantissa bits, so an ordinary layer's own error is a few percent there: its
#: thresholds are wider, else every layer would be flagged.
DEFAULT_ERROR_THRESHOLDS = {"float16": 0.02, "bfloat16": 0.02, "float8_e4m3fn": 0.1, "float8_e5m2": 0.2}
DEFAULT_ERROR_THRESHOLD = DEFAULT_ERROR_THRESHOLDS["bfloat16"]
#: Formats simulated with per-tensor scaling (see the module docstring).
SCALED_FORMATS = ("float8_e4m3fn", "float8_e5m2")


@dataclass
class LayerPrecision:
    """One layer simulated in one format. Errors are relative L2 norms (inf when the result is not finite)."""

    name: str
    layer_type: str
    dtype: str
    layer_error: float
    model_error: float
    sqnr_db: float  # of the layer's output: 10*log10(|ref|^2 / |ref - out|^2)
    amax: float  # largest finite |value| of the layer's inputs and output in fp32 (before any scaling)
    format_max: float
    # Unscaled formats: amax above the format's largest value, or a non-finite simulated output.
    # Scaled formats: a non-finite simulated output only (a scaled tensor fits the format by construction).
    overflow: bool
    underflow_fraction: float  # of the layer's input elements that flush to zero in the (scaled) cast
    grad_underflow_fraction: Optional[float] = None  # of the layer's parameter-gradient elements (with loss_fn)
    scaled: bool = False  # cast with per-tensor current scaling (fp8), see the module docstring

    def to_dict(self) -> dict:
        # JSON has no inf or NaN: a non-finite number becomes None (the overflow flag says why).
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


@dataclass
class PrecisionAnalysis:
    """The results of :meth:`PrecisionAnalyzer.analyze`."""

    results: List[LayerPrecision]
    error_threshold: Dict[str, float]  # format -> model-output error above which a layer is risky
    candidates: Tuple[str, ...]
    grad_amax: Optional[float] = None  # largest |gradient| of the model's parameters (with loss_fn)
    skipped: Dict[str, str] = field(default_factory=dict)  # layer -> why it was not analyzed

    def result(self, name: str, dtype) -> LayerPrecision:
        fmt = format_name(dtype)
        for r in self.results:
            if r.name == name and r.dtype == fmt:
                return r
        raise KeyError(f"no result for layer {name!r} in {fmt}")

    def threshold(self, dtype) -> float:
        """The model-output error above which a layer is risky in `dtype`."""
        fmt = format_name(dtype)
        t = self.error_threshold
        return float(t) if isinstance(t, (int, float)) else float(t.get(fmt, DEFAULT_ERROR_THRESHOLD))

    def risky_layers(self, dtype) -> List[Tuple[str, str]]:
        """(layer, reason) for the layers that overflow in `dtype` or whose model-output error is above
        the threshold; worst first."""
        fmt = format_name(dtype)
        risky = []
        for r in sorted((r for r in self.results if r.dtype == fmt), key=_severity, reverse=True):
            reasons = []
            if r.overflow and r.scaled:
                reasons.append("non-finite output")
            elif r.overflow:
                reasons.append(f"overflow: activation amax {r.amax:.3g} vs {fmt} max {r.format_max:.3g}"
                               + ("" if math.isfinite(r.layer_error) else ", non-finite output"))
            if not r.model_error <= self.threshold(fmt):  # also catches NaN
                reasons.append(f"model output error {r.model_error:.3g} > {self.threshold(fmt):g}")
            if reasons:
                risky.append((r.name, "; ".join(reasons)))
        return risky

    def table(self, dtype=None) -> str:
        """A text table, one line per (layer, format), worst model-output error first."""
        fmt = format_name(dtype) if dtype is not None else None
        rows = sorted((r for r in self.results if fmt is None or r.dtype == fmt), key=_severity, reverse=True)
        cols = ["layer", "type", "dtype", "scaled", "model_err", "layer_err", "sqnr_db", "amax", "fmt_max", "overflow",
                "underflow", "grad_underflow", "risky"]
        risky = {(name, f) for f in {r.dtype for r in rows} for name, _ in self.risky_layers(f)}
        cells = [[r.name or "(model)", r.layer_type, r.dtype, "yes" if r.scaled else "", _num(r.model_error), _num(r.layer_error),
                  _num(r.sqnr_db), _num(r.amax), _num(r.format_max), "yes" if r.overflow else "",
                  _pct(r.underflow_fraction), _pct(r.grad_underflow_fraction),
                  "RISKY" if (r.name, r.dtype) in risky else ""] for r in rows]
        widths = [max([len(c)] + [len(row[j]) for row in cells]) for j, c in enumerate(cols)]
        left = {"layer", "type", "dtype"}
        lines = [f"precision analysis: {len({r.name for r in rows})} layer(s), formats {', '.join(self.candidates)}, "
                 f"model-error thresholds {', '.join(f'{self.threshold(c):g} ({c})' for c in self.candidates)}"
                 + (f", grad amax {self.grad_amax:.3g}" if self.grad_amax is not None else "")]
        for row in [cols] + cells:
            lines.append("  ".join(v.ljust(w) if c in left else v.rjust(w) for v, c, w in zip(row, cols, widths)))
        for name, why in self.skipped.items():
            lines.append(f"skipped {name}: {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "error_threshold": {c: self.threshold(c) for c in self.candidates},
            "candidates": list(self.candidates),
            "grad_amax": self.grad_amax if self.grad_amax is None or math.isfinite(self.grad_amax) else None,
            "skipped": dict(self.skipped),
            "results": [r.to_dict() for r in self.results],
            "risky": {fmt: [list(x) for x in self.risky_layers(fmt)] for fmt in self.candidates},
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def __str__(self):
        return self.table()


def _severity(r: LayerPrecision):
    err = r.model_error if not math.isnan(r.model_error) else math.inf
    return (r.overflow, err)


def _num(v) -> str:
    if v is None:
        return ""
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def _pct(v) -> str:
    return "" if v is None else f"{100 * v:.2f}%"


def _tensors(value) -> List[torch.Tensor]:
    """Every floating-point tensor in a (nested) output or argument list, in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _flat(value) -> torch.Tensor:
    ts = _tensors(value)
    if not ts:
        return torch.zeros(0)
    return torch.cat([t.detach().float().reshape(-1) for t in ts])


def _round_trip(value, dtype: torch.dtype):
    """Floating-point tensors in `value` rounded to `dtype` and back to their own dtype."""
    return _map_tensors(value, lambda t: t.to(dtype).to(t.dtype))


def _scaled_round_trip(value, dtype: torch.dtype, margin: int = 0):
    """Floating-point tensors in `value` quantized to `dtype` with per-tensor current scaling and back."""
    def quantize(t):
        x = t.float()
        scale = current_scale(x, dtype, margin)
        return ((x * scale).to(dtype).float() / scale).to(t.dtype)

    return _map_tensors(value, quantize)


def _map_tensors(value, fn):
    """`value` with `fn` applied to each floating-point tensor in it (nested tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        items = [_map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
    return value


def current_scale(t: torch.Tensor, dtype, margin: int = 0) -> torch.Tensor:
    """The fp8 scale of `t` by current scaling: ``fp8_max / amax(t) * 2**-margin``, a 1-element fp32 tensor.

    As TransformerEngine computes it: the amax is over finite values; with an
    amax of 0 the scale is 1, and a quotient that overflows float32 (a tiny
    amax) becomes float32's max.
    """
    fmt_max = float(torch.finfo(getattr(torch, format_name(dtype))).max)
    x = t.detach().float().reshape(-1)
    x = x[torch.isfinite(x)]
    amax = x.abs().max() if x.numel() else torch.zeros(())
    scale = torch.where(amax > 0, (fmt_max / amax.double()).float() * 2.0 ** -margin, torch.ones(()))
    scale = torch.where(torch.isfinite(scale), scale, torch.full((), torch.finfo(torch.float32).max))
    return scale.reshape(1).to(t.device)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(out).all()):
        return math.inf
    ref_norm = float(torch.linalg.vector_norm(ref.double()))
    diff = float(torch.linalg.vector_norm((out - ref).double()))
    if ref_norm == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / ref_norm


def _sqnr_db(rel_error: float) -> float:
    if rel_error == 0:
        return math.inf
    return -20.0 * math.log10(rel_error) if math.isfinite(rel_error) else -math.inf


class PrecisionAnalyzer:
    """Simulates each layer in each candidate format and measures what it costs.

    Args:
        candidates: formats to try: torch dtypes or names (``"float16"``,
            ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``).
        include, exclude: which modules are layers: by default every module
            that owns weights; ``include`` (name patterns and/or module
            types) takes only the modules matching it, ``exclude`` leaves
            out those matching it (see :func:`adaptive_amp.layers.find_layers`).
        error_threshold: relative L2 error of the model's output above which
            a layer is risky: one number for every format, a dict by format
            name, or None for DEFAULT_ERROR_THRESHOLDS (0.02 for fp16 and
            bf16, 0.1 for e4m3, 0.2 for e5m2).
        progress: show a tqdm progress bar when tqdm is installed.
        fp8_margin: fp8 scales are ``fp8_max / amax * 2**-fp8_margin``
            (TransformerEngine's ``margin``): headroom for values larger than
            the amax the scale was taken from; 0 uses the whole range.
    """

    def __init__(self, candidates: Sequence = DEFAULT_CANDIDATES, error_threshold=None, progress: bool = True,
                 fp8_margin: int = 0, *, include: Selector = None, exclude: Selector = None):
        self.candidates = tuple(format_name(c) for c in candidates)
        find_layers(nn.Module(), include, exclude)  # a bad selector fails here, where it was written
        self.include, self.exclude = include, exclude
        if error_threshold is None:
            thresholds = dict(DEFAULT_ERROR_THRESHOLDS)
        elif isinstance(error_threshold, dict):
            thresholds = {**DEFAULT_ERROR_THRESHOLDS, **{format_name(k): v for k, v in error_threshold.items()}}
        else:
            thresholds = {fmt: error_threshold for fmt in DEFAULT_ERROR_THRESHOLDS}
        for fmt, t in thresholds.items():
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                raise ValueError(f"error_threshold for {fmt} is {t!r}; pass a positive relative error")
        self.error_threshold = {fmt: float(t) for fmt, t in thresholds.items()}
        self.progress = progress
        if isinstance(fp8_margin, bool) or not isinstance(fp8_margin, int) or fp8_margin < 0:
            raise ValueError(f"fp8_margin is {fp8_margin!r}; pass an int >= 0 (a power-of-two headroom)")
        self.fp8_margin = fp8_margin

    def analyze(self, model: nn.Module, sample_inputs, loss_fn=None) -> PrecisionAnalysis:
        """Analyze `model` on `sample_inputs` (a tensor, a tuple of positional arguments, a dict of keyword
        arguments, or ``(args, kwargs)``: see :func:`split_inputs`). With `loss_fn` (model output -> scalar loss) the parameter gradients of an
        fp32 backward are measured too."""
        args, kwargs = split_inputs(sample_inputs)
        model = unwrap_model(model)
        layers = find_layers(model, self.include, self.exclude)
        was_training = {m: m.training for m in model.modules()}
        model.eval()  # dropout would make every run differ from the baseline
        try:
            # Grad mode stays on: in eval mode without grad, nn.TransformerEncoderLayer and
            # nn.MultiheadAttention take a fused fast path that never calls their sublayers.
            with torch.enable_grad():
                return self._analyze(model, layers, args, kwargs, loss_fn)
        finally:
            for m, mode in was_training.items():
                m.training = mode

    def _analyze(self, model, layers, args, kwargs, loss_fn) -> PrecisionAnalysis:
        # fp32 baseline, recording each layer's inputs and outputs.
        seen_in: Dict[str, list] = {n: [] for n, _ in layers}
        seen_out: Dict[str, list] = {n: [] for n, _ in layers}
        handles = []
        for name, layer in layers:
            def record(mod, a, kw, out, name=name):
                seen_in[name].extend(t.detach() for t in _tensors((a, kw)))
                seen_out[name].append(_flat(out))
            handles.append(layer.register_forward_hook(record, with_kwargs=True))
        try:
            ref_output = model(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        ref_model = _flat(ref_output)

        grad_amax, grad_fraction = None, {}
        if loss_fn is not None:
            grad_amax, grad_fraction = self._gradients(model, layers, ref_output, loss_fn)
        del ref_output

        results, skipped = [], {}
        analyzed = [(n, m) for n, m in layers if seen_out[n]]
        for n, _ in layers:
            if not seen_out[n]:
                skipped[n] = "not called by the model's forward (its parent computes with its weights directly)"
        bar = progress_bar(len(analyzed) * len(self.candidates), "precision analysis", unit="run",
                           enabled=self.progress)
        try:
            for name, layer in analyzed:
                ref_layer = torch.cat(seen_out[name])
                inputs = [t.float().contiguous() for t in seen_in[name]]
                finite_in = [t[torch.isfinite(t)] for t in inputs]
                amax = max([float(t.abs().max()) for t in finite_in + [ref_layer[torch.isfinite(ref_layer)]]
                            if t.numel()] or [0.0])
                for fmt in self.candidates:
                    bar.set_postfix_str(f"{name} {fmt}")
                    dtype = getattr(torch, fmt)
                    layer_out, model_out = self._simulate(model, layer, dtype, args, kwargs)
                    layer_error = _relative_error(layer_out, ref_layer)
                    format_max = float(torch.finfo(dtype).max)
                    scaled = fmt in SCALED_FORMATS
                    results.append(LayerPrecision(
                        name=name, layer_type=type(layer).__name__, dtype=fmt,
                        layer_error=layer_error, model_error=_relative_error(model_out, ref_model),
                        sqnr_db=_sqnr_db(layer_error), amax=amax, format_max=format_max,
                        overflow=(not scaled and amax > format_max) or not math.isfinite(layer_error),
                        underflow_fraction=_underflow_fraction(inputs, fmt, self._margin(fmt)),
                        grad_underflow_fraction=grad_fraction.get((name, fmt)),
                        scaled=scaled,
                    ))
                    bar.update()
        finally:
            bar.close()
        return PrecisionAnalysis(results=results, error_threshold=self.error_threshold,
                                 candidates=self.candidates, grad_amax=grad_amax, skipped=skipped)

    def _margin(self, fmt: str) -> Optional[int]:
        """The scaling margin of `fmt`, or None for a format cast unscaled."""
        return self.fp8_margin if fmt in SCALED_FORMATS else None

    def _simulate(self, model, layer, dtype, args, kwargs):
        """Run the model with only `layer` rounded to `dtype`; returns (layer output, model output), flat fp32."""
        outputs = []
        saved = []
        margin = self._margin(format_name(dtype))
        if margin is None:
            cast = lambda v: _round_trip(v, dtype)  # noqa: E731
        else:
            cast = lambda v: _scaled_round_trip(v, dtype, margin)  # noqa: E731

        def before(mod, a, kw):
            # Swap the parameters' data (not the Parameter objects), so a weight tied to another layer
            # is rounded only while this layer runs.
            for p in mod.parameters():
                if margin is not None and p.dim() < 2:
                    continue  # fp8 matmuls add the bias in their wider output type
                saved.append((p, p.data))
                p.data = cast(p.data)
            return cast(a), cast(kw)

        def after(mod, a, kw, out):
            while saved:
                p, data = saved.pop()
                p.data = data
            if margin is None:
                out = _round_trip(out, dtype)  # the result is stored in the format too: fp16 overflow -> inf
            outputs.append(_flat(out))
            return out

        h1 = layer.register_forward_pre_hook(before, with_kwargs=True)
        h2 = layer.register_forward_hook(after, with_kwargs=True, always_call=True)
        try:
            model_out = _flat(model(*args, **kwargs))
        finally:
            h1.remove()
            h2.remove()
            while saved:  # the forward raised between the hooks
                p, data = saved.pop()
                p.data = data
        return torch.cat(outputs), model_out

    def _gradients(self, model, layers, ref_output, loss_fn):
        params = [p for p in model.parameters() if p.requires_grad]
        old_grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss_fn(ref_output).backward()
            grads = [p.grad for p in params if p.grad is not None]
            grad_amax = max([float(g.detach().abs().max()) for g in grads if g.numel()] or [0.0])
            fraction = {}
            for name, layer in layers:
                g = [p.grad.detach().float().contiguous() for p in layer.parameters() if p.grad is not None]
                if g:
                    for fmt in self.candidates:
                        fraction[(name, fmt)] = _underflow_fraction(g, fmt, self._margin(fmt))
            return grad_amax, fraction
        finally:
            for p, old in zip(params, old_grads):  # the caller's gradients are left as they were
                p.grad = old


def _underflow_fraction(tensors: List[torch.Tensor], fmt: str, margin: Optional[int] = None) -> float:
    """Fraction of the elements that flush to zero in `fmt`: cast as they are (margin None), or each
    tensor scaled by its own current scale first (fp8, margin the scaling margin)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return 0.0
    scale = None
    if margin is not None:
        scale = torch.cat([current_scale(t, fmt, margin) for t in tensors])
    d = tensor_stats(tensors, fmt=fmt, scale=scale).to_dict()
    return sum(d["underflow_count"]) / max(1, sum(d["numel"]))


def split_inputs(sample_inputs) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` for ``model(*args, **kwargs)`` from `sample_inputs`, the one rule everything that takes
    sample inputs follows (the analyzer, ``AdaptiveMixedPrecision(sample_inputs=...)``):

    * a dict: keyword arguments;
    * a pair whose first item is a tuple or list and whose second is a dict: ``(args, kwargs)``;
    * any other tuple or list: positional arguments;
    * anything else (a tensor): the one positional argument.

    (A model whose forward takes a sequence and a dict positionally: pass ``((seq, d), {})``.)"""
    if isinstance(sample_inputs, Mapping):
        return (), dict(sample_inputs)
    if isinstance(sample_inputs, (tuple, list)):
        if len(sample_inputs) == 2 and isinstance(sample_inputs[0], (tuple, list)) \
                and isinstance(sample_inputs[1], Mapping):
            return tuple(sample_inputs[0]), dict(sample_inputs[1])
        return tuple(sample_inputs), {}
    return (sample_inputs,), {}
