"""Which layers go to fp8, and in which recipe: by measurement, each decision with its reason.

:func:`select_fp8_layers` takes a model and a few sample batches and returns,
for every nn.Linear and Conv1D, a :class:`LayerChoice`: the kind it should
run in (``"fp8-tensorwise"``, ``"fp8-rowwise"``, or None to leave it as it
is) and why, e.g. ``"gains 1.31x, error 2.1e-2 within 0.1"``,
``"skipped: 768 x 2304 on 8192 tokens too small to gain (0.92x < 1.05x in
fp8-tensorwise)"``,
``"skipped: out_features 50257 not divisible by 16"``.

The recipes are tried in order of preference, coarsest scaling first
(tensorwise, then rowwise). A layer takes the first recipe whose output and
input gradient on the real inputs stay within ``max_error`` of bf16's
(:func:`~adaptive_amp.fp8.measure.layer_error`), when its forward and
backward at its own shapes are at least ``min_gain`` times faster than bf16
autocast there (:func:`~adaptive_amp.fp8.measure.layer_gain`). A later recipe
is tried only where the earlier ones' error is too large: a finer scaling
costs more casts, so where a coarser one does not gain a finer one does not
either (on an H200, torchao's rowwise Llama-3-8B trained 13% fewer tokens/s
than its tensorwise). Layers of the same class and shapes are timed once, and
their bf16 baseline once whatever the recipes: a later recipe's time is set
against a baseline timed in an earlier call, not interleaved with it, which
only a layer that errs too much in tensorwise meets. The largest shapes are
timed first, and a shape no larger either way than one that gained too little
is judged from it rather than timed (``infer_smaller``): a compiled timing
costs two graphs to compile, and a smaller matmul has less work to amortize
fp8's casts over.

Layers called on one input (a block's query, key and value projections, an
MLP's gate and up projections) go to fp8 together where they run compiled:
one that gains less than ``min_gain`` but is not measurably slower in fp8
(at least ``SHARED_MIN_GAIN``, 0.97x) and tolerates it joins those of its
input in fp8 in the same recipe, so that a compiled backward does not keep
that input twice, in bf16 and in fp8.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..layers import gathered_layer, unwrap_model
from .config import KINDS, check_kind
from .eligibility import _conv1d_class, eligible_layers, is_conv1d, matmul_sizes
from .measure import LayerError, capture_inputs, layer_error, layer_times

#: Default smallest speed-up (bf16 time / fp8 time) worth a layer's fp8 rounding: below it, timing noise and
#: the fp8 casts' memory traffic can make a "gain" a loss in the whole step.
MIN_GAIN = 1.05
#: Default largest relative error of the output and of the input gradient against bf16. fp8's own rounding
#: (3 mantissa bits in e4m3, 2 in the e5m2 gradients of the tensorwise recipe) costs 4-6% on well-scaled data;
#: a layer beyond 10% has values that one scale per tensor (or row) cannot hold.
MAX_ERROR = 0.1


@dataclass(frozen=True)
class LayerChoice:
    """One layer's decision: `kind` (None: left as it was) and its `reason`, with what was measured;
    `saved_ms`, the milliseconds a forward and backward at its shape took less in its last measured kind than in
    bf16 (None: its gain came from a ``gain_fn``, or none was measured)."""

    name: str
    kind: Optional[str]
    reason: str
    gains: Dict[str, float] = field(default_factory=dict)
    errors: Dict[str, LayerError] = field(default_factory=dict)
    saved_ms: Optional[float] = None

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "reason": self.reason, "gains": dict(self.gains),
                "errors": {k: e.to_dict() for k, e in self.errors.items()}, "saved_ms": self.saved_ms}

    def __str__(self):
        return f"{self.name}: {self.kind or 'unchanged'} ({self.reason})"


GainFn = Callable[[nn.Module, Sequence[int], str], float]


def select_fp8_layers(model: nn.Module, batches: Iterable[Any], *,
                      run: Optional[Callable[[nn.Module, Any], Any]] = None,
                      kinds: Sequence[str] = KINDS, min_gain: float = MIN_GAIN, max_error: float = MAX_ERROR,
                      dtype: torch.dtype = torch.bfloat16, warmup: int = 5, iters: int = 20,
                      compiled: Union[bool, Callable[[str], bool]] = False, max_tokens: Optional[int] = 8192,
                      gain_fn: Optional[GainFn] = None,
                      weight_dtype: Optional[torch.dtype] = None, infer_smaller: bool = True,
                      seconds: Optional[Dict[str, float]] = None) -> Dict[str, LayerChoice]:
    """name -> :class:`LayerChoice` for every nn.Linear and Conv1D of `model` (module order).

    batches: a few sample batches; each layer's inputs are captured from ``run(model, batch)`` (see
        :func:`~adaptive_amp.fp8.measure.capture_inputs`) and its error measured on them.
    kinds: the recipes to try, in order of preference (``"fp8-tensorwise"``, ``"fp8-rowwise"``): each layer
        is measured in a later one only where the earlier ones' error is above `max_error`.
    min_gain: the smallest measured speed-up (bf16 ms / fp8 ms) that puts a layer in fp8 (default 1.05); a
        compiled layer not measurably slower in fp8 (SHARED_MIN_GAIN) also goes there when a layer of its input
        does (see the module's docs).
    max_error: the largest relative error of the output and of the input gradient against bf16 (default 0.1).
    dtype, warmup, iters, compiled: how the gain is timed (:func:`~adaptive_amp.fp8.measure.layer_gain`), at
        the largest input shape the layer saw. `compiled`: True or False for every layer, or ``(name) -> bool``
        per layer (:func:`~adaptive_amp.layers.compiled_layers`: where the blocks of a model are compiled in
        place, the output head beside them runs, and is timed, eagerly).
    max_tokens: rows of each layer's inputs, over all batches, the error is measured on (default 8192; None:
        all of them): the captures of every layer are held at once.
    gain_fn: ``(layer, input_shape, kind) -> speed-up``, in place of timing on the GPU (a gain measured
        elsewhere, a table); with it the layers are judged wherever they are.
    weight_dtype: the dtype the layers' weights will train in, when not the one they have now (bfloat16 for
        bf16-weights and bf16-pure): each gain is then timed on a copy of the layer with its parameters in it
        (the bf16 baseline then casts no weight, and fp8 casts from bf16, as in that training run).
    infer_smaller: time the largest shapes first, and judge a shape no larger either way (tokens, in, out) than
        one timed, alike, to gain less than ``min(min_gain, SHARED_MIN_GAIN)`` from it, without timing it (its
        reason names the larger shape); False times every shape. A smaller matmul has less work to amortize
        fp8's casts over, and every shape timed compiled is two graphs to compile. Not with a `gain_fn`.
    seconds: a dict to fill with where the time went: ``inputs`` (capturing them), ``gains`` (timing each
        distinct shape and kind), ``errors`` (every layer's), ``shapes``, how many gains were timed, and
        ``inferred``, how many shapes were judged from a larger one.

    Nothing on the model changes. When fp8 cannot run here (torchao missing, no GPU with fp8 matmuls) and no
    `gain_fn` is given, every layer is skipped with that reason."""
    kinds = tuple(check_kind(k) for k in kinds)
    if not kinds:
        raise ValueError("kinds is empty; pass one or more of " + ", ".join(KINDS))
    if not min_gain > 0 or not max_error > 0:
        raise ValueError(f"min_gain and max_error must be > 0, got min_gain={min_gain}, max_error={max_error}")
    root = unwrap_model(model)
    found = eligible_layers(root, check_device=gain_fn is None)
    choices: Dict[str, LayerChoice] = {}
    spent = {"inputs": 0.0, "gains": 0.0, "errors": 0.0}
    began = time.perf_counter()
    captured = capture_inputs(model, found.layers, batches, run, max_tokens, dtype) if found.layers else None
    spent["inputs"] = time.perf_counter() - began
    timed: Dict[tuple, float] = {}
    baseline: Dict[tuple, float] = {}  # a shape's bf16 milliseconds, whatever the kind
    saved: Dict[tuple, Optional[float]] = {}  # bf16 ms - the kind's ms (None: from gain_fn)

    runs_compiled = compiled if callable(compiled) else (lambda name: bool(compiled))

    def timing_key(module, shape, compiled) -> tuple:
        """What a gain's timing depends on but the kind: layers alike in it are timed once."""
        return (type(module), matmul_sizes(module), module.bias is not None, tuple(shape),
                weight_dtype or module.weight.dtype, str(module.weight.device), compiled)

    def gain_of(module, base, kind) -> Tuple[float, Optional[float]]:
        """(gain, milliseconds saved) of the layer's shape in `kind`, timed compiled or eagerly."""
        key = base + (kind,)
        if key not in timed:
            began = time.perf_counter()
            layer = module if weight_dtype in (None, module.weight.dtype) else _retyped(module, weight_dtype)
            if gain_fn is not None:
                timed[key], saved[key] = float(gain_fn(layer, base[3], kind)), None
            else:
                ms = layer_times(layer, base[3], [kind], bf16=base not in baseline, dtype=dtype, warmup=warmup,
                                 iters=iters, compiled=base[-1])
                baseline.setdefault(base, ms.get("bf16"))
                timed[key] = baseline[base] / ms[kind] if ms[kind] > 0 else math.inf
                saved[key] = baseline[base] - ms[kind]
            spent["gains"] += time.perf_counter() - began
        return timed[key], saved[key]

    order = []  # every decided layer's name, in module order
    pending: Dict[str, tuple] = {}  # name -> (timing key, kind, errors): tolerated, its gain to judge
    layer_of: Dict[tuple, nn.Module] = {}  # timing key -> the first layer of it (under FSDP2, gathered)
    for name, module in root.named_modules():
        if name in found.skipped:
            order.append(name)
            choices[name] = LayerChoice(name, None, f"skipped: {found.skipped[name]}")
            continue
        if name not in found.layers:
            continue
        order.append(name)
        # Under FSDP2 the layer's whole weight, gathered here, on every rank for the same layers (a collective).
        module = gathered_layer(module)
        xs = captured.inputs.get(name) if captured is not None else None
        if not xs:
            choices[name] = LayerChoice(name, None, "skipped: not called by the sample batches")
            continue
        shape = max(captured.shapes[name], key=lambda s: torch.Size(s).numel())
        errors: Dict[str, LayerError] = {}
        began = time.perf_counter()
        for kind in kinds:  # (each error reads a sum: synchronized); `kind` ends the first tolerated, or the last
            errors[kind] = layer_error(module, xs, kind, dtype=dtype)
            if errors[kind].worst <= max_error:
                break
        spent["errors"] += time.perf_counter() - began
        if errors[kind].worst > max_error:
            least = min(errors, key=lambda k: errors[k].worst)
            reason = f"skipped: error {errors[least].worst:.1e} above {max_error:g} in {least}"
            choices[name] = LayerChoice(name, None, reason, {}, errors)
            continue
        key = timing_key(module, shape, runs_compiled(name))
        layer_of.setdefault(key, module)
        pending[name] = (key, kind, errors)
    # The largest shapes first: a shape no larger either way than one timed to gain less than `floor` is judged
    # from it, not compiled and timed (a smaller matmul has less work to amortize fp8's casts over: on an H200,
    # GPT-2 medium's 1024 x 4096 gained 0.92x, its 1024 x 3072 0.85x, its 1024 x 1024 0.77x). Below `floor` it
    # could neither be chosen nor join the layers of its input.
    floor = min(min_gain, SHARED_MIN_GAIN)
    larger: Dict[tuple, tuple] = {}  # (timing key, kind) -> the (timing key, kind) it was judged from
    if gain_fn is None and infer_smaller:
        low = []  # (timing key, kind) timed below floor
        for key, kind in sorted(dict.fromkeys((k, kind) for k, kind, _ in pending.values()), key=_work,
                               reverse=True):
            above = next((d for d in low if _within(key, kind, *d)), None)
            if above is not None:
                larger[(key, kind)] = above
            elif gain_of(layer_of[key], key, kind)[0] < floor:
                low.append((key, kind))
    for name, (key, kind, errors) in pending.items():
        n_in, n_out = key[1]
        tokens = torch.Size(key[3][:-1]).numel()
        eagerly = ", timed eagerly: it runs outside the compiled modules" if callable(compiled) and not key[-1] \
            else ""
        if (key, kind) in larger:
            big, _ = larger[(key, kind)]
            reason = (f"skipped: {n_in} x {n_out} on {tokens} tokens too small to gain: "
                      f"{big[1][0]} x {big[1][1]} on {torch.Size(big[3][:-1]).numel()} tokens, no smaller either "
                      f"way, gained {timed[big + (kind,)]:.2f}x in {kind}{eagerly}")
            choices[name] = LayerChoice(name, None, reason, {}, errors)
            continue
        gain, saved_ms = gain_of(layer_of[key], key, kind)
        gains = {kind: gain}
        if gain >= min_gain:
            choices[name] = LayerChoice(name, kind, _chosen(gain, errors[kind], max_error), gains, errors, saved_ms)
            continue
        reason = (f"skipped: {n_in} x {n_out} on {tokens} tokens too small to gain "
                  f"({gain:.2f}x < {min_gain:g}x in {kind}{eagerly})")
        choices[name] = LayerChoice(name, None, reason, gains, errors, saved_ms)
    choices = {name: choices[name] for name in order}
    if captured is not None:
        _join_shared_inputs(choices, captured.shared, runs_compiled, max_error)
    if seconds is not None:
        seconds.update(spent, shapes=len(timed), inferred=len(larger))
    return choices


def _work(item) -> int:
    """A (timing key, kind)'s multiply-adds: tokens x in x out."""
    key, _ = item
    n_in, n_out = key[1]
    return torch.Size(key[3][:-1]).numel() * n_in * n_out


def _within(key: tuple, kind: str, big: tuple, big_kind: str) -> bool:
    """Whether `key`'s matmul is no larger either way (tokens, in, out) than `big`'s, timed alike: the same
    kind, layer class, bias, weight dtype, device and compiling."""
    (cls, (n_in, n_out), bias, shape, wdtype, device, compiled) = key
    (big_cls, (big_in, big_out), big_bias, big_shape, big_wdtype, big_device, big_compiled) = big
    return (kind, cls, bias, wdtype, device, compiled) == (big_kind, big_cls, big_bias, big_wdtype, big_device,
                                                            big_compiled) \
        and n_in <= big_in and n_out <= big_out \
        and torch.Size(shape[:-1]).numel() <= torch.Size(big_shape[:-1]).numel()


#: The smallest gain at which a layer joins the fp8 layers it shares its input with (below MIN_GAIN: its own
#: gain would not pay for its rounding, but the memory it saves does). Not 1.0: a layer that fp8 neither speeds
#: nor slows is timed either side of it (H200, a Llama-3-8B's key projection at 6,144 tokens, compiled: 1.011x and
#: 0.997x in two processes), and whether its input is kept twice should not hang on that.
SHARED_MIN_GAIN = 0.97


def _join_shared_inputs(choices: Dict[str, LayerChoice], shared: Dict[str, str], runs_compiled: Callable[[str], bool],
                        max_error: float) -> None:
    """Puts in fp8 a compiled layer left in bf16 only for gaining too little (at least SHARED_MIN_GAIN) when a
    layer called on the same input runs in the kind it tolerates. A compiled graph saves, for the backward, the
    fp8 layers' input in fp8 and the bf16 layers' in bf16: the same activation twice (a Llama-3-8B's decoder
    layer at 9 x 2048 tokens, its query projection in fp8 and its key and value projections in bf16: the
    normalized input in bf16, 144 MiB, and in fp8, 72 MiB). Eagerly torchao's fp8 matmul saves its bf16 input
    anyway: there is nothing to save."""
    groups: Dict[str, list] = {}
    for name, first in shared.items():
        groups.setdefault(first, [first]).append(name)
    for names in groups.values():
        in_fp8 = {choices[n].kind: n for n in reversed(names) if n in choices and choices[n].kind is not None}
        for name in names:
            choice = choices.get(name)
            # (a layer skipped for its error, or for what it is, has no gain: only one skipped for its gain joins)
            if choice is None or choice.kind is not None or not choice.gains or not runs_compiled(name):
                continue
            kind, gain = next(iter(choice.gains.items()))
            if gain >= SHARED_MIN_GAIN and kind in in_fp8:
                reason = (f"{_chosen(gain, choice.errors[kind], max_error)}; in fp8 with {in_fp8[kind]}, which takes "
                          "the same input, so that a compiled backward keeps it once")
                choices[name] = LayerChoice(name, kind, reason, choice.gains, choice.errors, choice.saved_ms)


def _chosen(gain: float, error: LayerError, max_error: float) -> str:
    """The reason of a layer put in fp8: its gain and its error within the bound."""
    return f"gains {gain:.2f}x, error {error.worst:.1e} within {max_error:g}"


def _retyped(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of an nn.Linear or Conv1D with its parameters in `dtype`, without the original's hooks or class
    (what is timed is its matmul alone): the layer as a run whose weights are in `dtype` computes it."""
    n_in, n_out = matmul_sizes(module)
    weight = module.weight
    with torch.device("meta"):  # (no initialization: the values are copied)
        layer = (_conv1d_class()(n_out, n_in) if is_conv1d(module) else
                 nn.Linear(n_in, n_out, bias=module.bias is not None))
    layer = layer.to_empty(device=weight.device).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if module.bias is not None:
            layer.bias.copy_(module.bias)
    return layer.requires_grad_(weight.requires_grad)
