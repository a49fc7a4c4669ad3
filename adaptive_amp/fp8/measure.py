"""What fp8 would do to one layer, measured: its speed and its error, on the user's device and data.

* :func:`capture_inputs`: the inputs each layer sees, from a few sample
  batches, through forward pre-hooks (removed afterwards; nothing trains),
  at most ``max_tokens`` rows a layer, with their full shapes.
* :func:`layer_error`: the layer's output and input gradient (and weight
  gradient) in fp8 against bf16 autocast, on those inputs, with one fixed
  random output gradient: relative error (``||fp8 - bf16|| / ||bf16||``)
  and cosine. The parameters' ``.grad`` are not touched.
* :func:`layer_gain`: forward and backward of the layer at its own shapes,
  fp8 (quantization included) against bf16 autocast, timed with CUDA
  events after a warm-up, interleaved, medians; gain = bf16 time / fp8 time.
  A compiled layer is compiled for its own shapes, and its events time the
  GPU's work alone (the GPU waits while the host queues each call): in a
  compiled model a layer costs its kernels, and the host's overhead is the
  whole graph's. An eager layer's events take the host's time in where it is
  the longer, as an eager model's do.
  :func:`layer_times` gives the milliseconds themselves, for several kinds at
  once or without the bf16 baseline.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._process_group import world_group
from ..hardware import sleep_cycles_per_ms
from .config import check_kind
from .execution import fp8_forward, plain_forward


def _call(model: nn.Module, batch: Any):
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


@dataclass
class Captured:
    """What :func:`capture_inputs` saw: each layer's inputs (at most `max_tokens` rows of them all together),
    the full shape of each input (what the layer's timing runs at), and `shared`: each layer called on the same,
    unchanged tensor as the layer called just before it (a block's key and value projections after its query's,
    an MLP's up projection after its gate's), mapped to the first layer called on it."""

    inputs: Dict[str, List[torch.Tensor]]
    shapes: Dict[str, List[Tuple[int, ...]]]
    shared: Dict[str, str] = field(default_factory=dict)


def capture_inputs(model: nn.Module, layers: Dict[str, nn.Module], batches: Iterable[Any],
                   run: Optional[Callable[[nn.Module, Any], Any]] = None,
                   max_tokens: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> Captured:
    """The inputs (first positional argument, detached) that each of `layers` (name -> module) received while
    ``run(model, batch)`` (default: ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple, else
    ``model(batch)``) ran on each batch, without gradients. `max_tokens`: keep at most that many rows
    (positions) of each layer's inputs, over all batches together, as ``(rows, features)``, so that a large
    model's captures fit beside it whatever the number of batches (a batch that finds a layer full adds only
    its shape); the shapes are kept whole. Once every layer is full, a batch whose tensors have the shapes and
    dtypes of one already run (with the same other values) is not run: it would add only the shapes that one
    did, in a model whose shapes follow its inputs' (not one whose layers' rows depend on the values, as a
    mixture of experts' do: pass batches of the shapes to measure). Under torch.distributed every batch runs.
    With `max_tokens`, layers called one after another on the same, unchanged tensor (a block's query, key and
    value projections) share one kept copy, and `dtype` (the autocast dtype the layers will be measured under,
    which their matmuls read anyway) keeps wider floating inputs in it; without `max_tokens` the inputs are kept
    as they are. A layer not called has no entry."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (or None: all), got {max_tokens}")
    run = run or _call
    out = Captured({}, {})
    # The last input seen (held, so that `is` cannot meet a recycled one), its version (a tensor written in place
    # between two layers is another input), its copy (with max_tokens), and the first layer called on it.
    last: List[Any] = [None, None, None, None]
    rows: Dict[str, int] = {}  # rows kept of each layer's inputs so far

    def hook_for(name):
        def hook(module, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                x = args[0].detach()
                out.shapes.setdefault(name, []).append(tuple(x.shape))
                version = None if args[0].is_inference() else args[0]._version  # (inference tensors have none)
                same = last[0] is args[0] and last[1] == version
                if same and last[3] != name:
                    out.shared.setdefault(name, last[3])
                elif not same:
                    last[:] = [args[0], version, None, name]
                if max_tokens is not None:
                    room = max_tokens - rows.get(name, 0)
                    if room <= 0:
                        return
                    flat = x.reshape(-1, x.shape[-1])
                    room = min(room, flat.shape[0])
                    if last[2] is None or last[2].shape[0] < room:
                        kept = flat[:room]
                        wider = dtype is not None and kept.dtype.itemsize > dtype.itemsize
                        last[2] = kept.to(dtype) if wider else kept.clone()
                    x = last[2] if last[2].shape[0] == room else last[2][:room]
                    rows[name] = rows.get(name, 0) + x.shape[0]
                out.inputs.setdefault(name, []).append(x)
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in layers.items()]
    try:
        # Eager even where the model (or its blocks) is compiled: the hooks are each layer's own, and tracing
        # them would compile a graph per layer for a measurement that trains nothing.
        seen = set()  # the signatures of the batches run
        # Under torch.distributed every rank runs every batch: a forward may be collective (FSDP2's all-gathers,
        # DDP's buffer broadcast), and each rank's batches and rows are its own.
        alone = world_group() is None
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for batch in batches:
                signature = _signature(batch)
                # Once every layer is full, a batch shaped as one already run would add only the shapes that
                # one did: a tuning's batches are usually alike, and at 8 x 2048 tokens a Llama-3-8B's first
                # batch fills the default 8192 rows of every layer, so the others' forwards were spent for nothing.
                if alone and signature is not None and signature in seen and max_tokens is not None and \
                        all(rows.get(n, 0) >= max_tokens for n in layers):
                    continue
                run(model, batch)
                if signature is not None:
                    seen.add(signature)
    finally:
        for h in handles:
            h.remove()
        last.clear()
    return out


def _signature(batch) -> Optional[tuple]:
    """What decides the shapes a batch gives every layer, for a model whose shapes follow its inputs': each
    tensor's shape, dtype and device, and the other plain values, in the batch's structure; None when the batch
    holds something else (it is then always run)."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape), batch.dtype, str(batch.device))
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return ("value", batch)
    if isinstance(batch, dict):
        items = [(k, _signature(v)) for k, v in batch.items()]
        if not all(isinstance(k, str) for k, _ in items):
            return None
        items.sort(key=lambda kv: kv[0])
    elif isinstance(batch, (list, tuple)):
        items = [(i, _signature(v)) for i, v in enumerate(batch)]
    else:
        return None
    if any(sig is None for _, sig in items):
        return None
    return (type(batch).__name__, tuple(items))


@dataclass(frozen=True)
class LayerError:
    """fp8 against bf16 on one layer: relative errors and cosines of the output, the input gradient and the
    weight gradient."""

    output: float
    grad_input: float
    grad_weight: float
    output_cosine: float
    grad_input_cosine: float
    grad_weight_cosine: float

    @property
    def worst(self) -> float:
        """The largest of the output and input-gradient relative errors (what the selection bounds)."""
        return max(self.output, self.grad_input)

    def to_dict(self) -> dict:
        return dict(vars(self))


class _Sums:
    """||a - b||^2, ||b||^2, a.b and ||a||^2 accumulated over several tensors, in float64."""

    def __init__(self):
        self.diff = self.ref = self.dot = self.own = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor):
        a, b = a.double(), b.double()
        # One read of the four sums (a large model measures hundreds of layers, each a host sync).
        sums = torch.stack([(a - b).pow(2).sum(), b.pow(2).sum(), (a * b).sum(), a.pow(2).sum()])
        diff, ref, dot, own = sums.tolist()
        self.diff += diff
        self.ref += ref
        self.dot += dot
        self.own += own

    def relative(self) -> float:
        return math.sqrt(self.diff / self.ref) if self.ref > 0 else (0.0 if self.diff == 0 else math.inf)

    def cosine(self) -> float:
        den = math.sqrt(self.ref * self.own)
        return self.dot / den if den > 0 else (1.0 if self.diff == 0 else 0.0)


def _forward_backward(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, fn, dtype: torch.dtype):
    x = x.detach().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=dtype):
        out = fn(module, x)
    grad_x, grad_w = torch.autograd.grad(out, (x, module.weight), grad.to(out.dtype))
    return out.detach(), grad_x, grad_w


def layer_error(module: nn.Module, inputs: Sequence[torch.Tensor], kind: str = "fp8-tensorwise", *,
                dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> LayerError:
    """`module` run in fp8 (`kind`) against `dtype` autocast on each of `inputs`, backward with the same random
    normal output gradient (drawn from `seed`): the errors over all inputs together."""
    check_kind(kind)
    if not inputs:
        raise ValueError("inputs is empty; pass the layer's inputs (capture_inputs)")
    sums = [_Sums() for _ in range(3)]
    gens = {}
    for x in inputs:
        with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype):
            shape = plain_forward(module, x).shape  # (not module(x): none of its hooks)
        # Drawn where the layer runs: on the host, a large model's gradients took minutes to draw.
        if x.device not in gens:
            gens[x.device] = torch.Generator(device=x.device).manual_seed(seed)
        grad = torch.randn(shape, generator=gens[x.device], device=x.device)
        ref = _forward_backward(module, x, grad, plain_forward, dtype)
        got = _forward_backward(module, x, grad, lambda m, t: fp8_forward(m, t, kind), dtype)
        for s, a, b in zip(sums, got, ref):
            s.add(a, b)
    return LayerError(*(s.relative() for s in sums), *(s.cosine() for s in sums))


@dataclass(frozen=True)
class LayerGain:
    """Median forward+backward milliseconds of one layer at one input shape, bf16 autocast and fp8."""

    bf16_ms: float
    fp8_ms: float

    @property
    def gain(self) -> float:
        return self.bf16_ms / self.fp8_ms if self.fp8_ms > 0 else math.inf

    def to_dict(self) -> dict:
        return {"bf16_ms": self.bf16_ms, "fp8_ms": self.fp8_ms, "gain": self.gain}


#: dynamo's recompile limit while layers are timed compiled: room for every shape and kind of a large model.
_RECOMPILE_LIMIT = 256

#: The longest the GPU waits before a timed compiled call while the host queues it (milliseconds).
_MAX_AHEAD_MS = 100.0


def layer_times(module: nn.Module, input_shape: Sequence[int], kinds: Sequence[str] = ("fp8-tensorwise",), *,
                bf16: bool = True, dtype: torch.dtype = torch.bfloat16, warmup: int = 5, iters: int = 20,
                compiled: bool = False) -> Dict[str, float]:
    """Median forward+backward milliseconds of `module` on a random input of `input_shape`, in each fp8 kind of
    `kinds` and, when `bf16`, under `dtype` autocast (key ``"bf16"``): what :func:`layer_gain` compares, for
    several kinds at once, or without the baseline where it is already known (a selection times each shape's
    bf16 baseline once, whatever the kinds). Compiled, each call's events time the GPU's work alone (the module's
    docstring says why)."""
    kinds = [check_kind(k) for k in kinds]
    if not kinds and not bf16:
        raise ValueError("nothing to time: kinds is empty and bf16=False")
    device = module.weight.device
    if device.type != "cuda":
        raise ValueError(f"module is on {device}; layers are timed with CUDA events: move it to a CUDA GPU")
    if warmup < 0 or iters < 1:
        raise ValueError(f"warmup must be >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tuple(input_shape), device=device, generator=gen).requires_grad_(True)
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        grad = torch.randn(plain_forward(module, x).shape, device=device, generator=gen, dtype=dtype)
    params = [p for p in (module.weight, module.bias) if p is not None]

    def step(fn):
        forward = (lambda t: fn(module, t))
        if compiled:  # the forward compiled (AOT autograd compiles its backward); autograd.grad stays outside
            # For this shape, as a compiled model's graph is: after a first shape, dynamo would otherwise make the
            # next layer's sizes symbolic, and time kernels the model does not run.
            forward = torch.compile(forward, dynamic=False)

        def run():
            with torch.autocast("cuda", dtype=dtype):
                out = forward(x)
            return torch.autograd.grad(out, [x, *params], grad)
        return run

    runs = {"bf16": step(plain_forward)} if bf16 else {}
    for kind in kinds:
        runs[kind] = step(lambda m, t, kind=kind: fp8_forward(m, t, kind))
    # Every call compiles the same lambdas, one graph per layer shape and kind: past dynamo's recompile limit
    # (8) the later shapes would run eagerly, their casts unfused, and fp8 would be judged too slow for them
    # (measured on an H200: a Llama-3-8B slice's down_proj and lm_head were skipped that way).
    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT), torch.cuda.device(device):
        for _ in range(warmup):
            for run in runs.values():
                run()
        ahead = 0
        if compiled:
            # Before each timed call the GPU spins twice as long as the host took to queue one (and 1 ms more),
            # so that the events time the GPU's work alone. A small layer's compiled call takes longer on the host
            # (guards, autograd) than on the GPU (H200, a 4096 x 1024 layer at 6,144 tokens compiled in bf16:
            # 0.97 ms a call with the host's time, 0.29 ms without); in a compiled model that overhead is the whole
            # graph's, once. (Eager, the host's time is the model's too: an eager model launches each kernel.)
            # The host's time is read from one more round, after the warm-up has compiled.
            host_ms = 0.0
            for run in runs.values():
                began = time.perf_counter()
                run()
                host_ms = max(host_ms, (time.perf_counter() - began) * 1e3)
            ahead = int(sleep_cycles_per_ms(device) * min(2 * host_ms + 1.0, _MAX_AHEAD_MS))
        times: Dict[str, List[Any]] = {k: [] for k in runs}
        for _ in range(iters):  # interleaved: a clock that drifts moves every kind alike
            for name, run in runs.items():
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if ahead:
                    torch.cuda._sleep(ahead)
                start.record()
                run()
                stop.record()
                times[name].append((start, stop))
        torch.cuda.synchronize(device)
    return {k: statistics.median(a.elapsed_time(b) for a, b in v) for k, v in times.items()}


def layer_gain(module: nn.Module, input_shape: Sequence[int], kind: str = "fp8-tensorwise", *,
               dtype: torch.dtype = torch.bfloat16, warmup: int = 5, iters: int = 20,
               compiled: bool = False) -> LayerGain:
    """Forward and backward (input and weight gradients) of `module` on a random input of `input_shape`,
    in fp8 (`kind`, its casts included) and under `dtype` autocast, `iters` times each, interleaved, after
    `warmup` calls each; CUDA-event medians. compiled=True times both through torch.compile (what a compiled
    model runs: the casts fused). Needs the module on a CUDA device."""
    ms = layer_times(module, input_shape, [kind], dtype=dtype, warmup=warmup, iters=iters, compiled=compiled)
    return LayerGain(ms["bf16"], ms[kind])
