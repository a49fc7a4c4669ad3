"""Measured policy selection: try candidate recipes on the user's own model and batches, pick the fastest
that keeps the loss and fits the memory budget.

``AdaptivePrecisionSelector.tune(model, optimizer, batches, loss_fn, ...)`` (and
``AdaptiveMixedPrecision(policy="tune")``) build the candidate recipes and run a
:class:`Tuner` here:

1. A :class:`Snapshot` of parameters, buffers, gradients, the optimizer's state
   and hyperparameters, and the RNG states (torch CPU and CUDA, python's
   ``random``, numpy's global generator) is taken once; every trial starts
   from it and it is restored, bitwise, after the last one.
2. Each candidate (a :class:`~adaptive_amp.recipes.Recipe`) trains ``steps``
   steps on the batches from the snapshot, without the gradients it holds; the
   cosine between its first step's gradient and the reference's (compared
   between that step's backward and its optimizer step) is the first-step
   gradient-direction agreement. The reference keeps its gradient from a
   probe of its own (one forward and backward on the first batch, without an
   optimizer step, from the same RNG state as the first step; what it changed
   in the buffers is put back before the trajectory), and so do
   candidates with loss scaling (their probe backs off the scale until the
   gradient is finite, where the first step would be skipped); where a
   candidate has fp8 layers, the reference runs a second probe, on the second
   batch, whose distance from its first is the sampling noise of one batch's
   gradient. Each trial records each loss, its memory (CUDA: the
   peak allocated; CPU: the bytes of parameters, gradients and optimizer
   state, plus, for eager models, the bytes autograd saves for the backward of
   the first step).
3. The reference is the safest candidate (fp32, TF32 where native) that runs
   and fits; the others are compared with it on identical batches: the
   per-step loss differences ``d_k = loss_k - ref_k``, the 95% t-interval of
   their mean and the paired t-test's p-value. A candidate *agrees* when all
   its losses are finite, the interval's upper end is at most
   ``loss_tolerance`` (relative to the mean reference loss; a candidate may be
   better, not worse), and the gradient cosine is at least ``min_cosine`` or,
   for a recipe with fp8 layers, the gradient's distance from the reference's
   is within ``noise_fraction`` of the sampling noise of the batches tuned on,
   with a positive cosine (fp8 on a deep model: its first gradient is far from
   fp32's, but nearer than the gradients of two batches are to each other, and
   SGD lives with those; each fp8 layer's own error is bounded by the fp8
   selection; with one batch only the cosine judges). The d_k of successive
   steps are not independent (the trajectories drift apart), so the interval
   is a guide, not an exact test: it is wide when the differences wander,
   which is what should stop a recipe from being picked.
4. Step times: the trajectories are the first round (every step after the
   first is timed); then ``rounds - 1`` more rounds, each running every
   contender for one warm-up step and ``timed_steps`` timed steps, in an order
   rotated each round so that drift (clocks, thermals) falls on all; the
   median is kept (candidates run later, once the others' rounds showed they
   were needed, time as many rounds among themselves). A contender agrees,
   fits, may be chosen (step 5's bf16 moments rule) and was within ``contenders``
   (20%) of the fastest such candidate in the first round: the extra rounds
   are there to settle close calls, so a candidate that cannot win (fp32 on a
   GPU with bf16 tensor cores, one that disagrees) is not timed again.
   CUDA steps are timed with events, CPU steps with ``perf_counter``.
   Where the tuning's own time went (snapshot, probes, trajectories, timing
   rounds, clean-up) is in ``TuneResult.phase_seconds``.
5. The pick: the fastest candidate that agrees and fits; one within
   ``tie`` (1%) of it but safer wins the tie. A candidate that keeps more in
   bf16 than torch's autocast does (each counts: bf16 weights, bf16 moments,
   bf16 compute outside the matmuls as in bf16-pure) must also be faster than
   every agreeing candidate that keeps less in bf16 by more than
   ``state_margin`` (10%): a few trial steps cannot show a slower convergence
   that appears after hundreds. Measured on an H200 (bench/RESULTS.md): Llama
   1.1B with bf16 weights and moments ended 7% above torch's bf16 autocast
   after 2000 steps, with bf16 weights and fp32 moments level with it;
   compiled, that Llama in bf16 throughout (bf16-pure) ended 1.1% above it,
   with bf16 weights under autocast (bf16-weights) 1.5% below it. bf16
   moments are chosen only when no agreeing candidate with fp32 moments fits
   the budget: they save memory, little time, and cost that Llama its 7%
   (with state_margin=0 the fastest wins, whatever it keeps in bf16). So once
   the reference keeps fp32 moments (it fits and agrees with itself), a
   candidate with bf16 moments cannot be chosen and is not tried: its probe
   and trajectory would be spent for nothing. It
   is listed as skipped, with why. Nor is a candidate tried whose "+fp8"
   twin (the same recipe with the measured fp8 layers) agrees and fits, when
   the fp8 map timed those layers, as the trials are timed (compiled for a
   compiled model), to save more than ``tie`` of the reference's step: the
   twin computes every other op as it does, so it could not be faster, nor
   within ``tie`` and safer. It waits behind its twin in the queue, is listed
   as skipped with the saving, and runs after all when the twin then fails or
   no candidate with fp8 layers can be chosen; among the candidates without
   fp8 layers the twin stands for it (compiled, one keeping as little in bf16,
   such as fp32, is a finalist only when its eager steps beat the twin's). A
   twin that needed checkpointing stands only for the recipe's checkpointed
   variant: fp8's casts take a little more memory, so the recipe may fit
   without. On the Llama-3-8B shape that spares the checkpointed trials of bf16
   autocast and bf16-weights and their block compiles. When a
   candidate does not fit
   the budget (or runs out of memory) and the model has repeated blocks, the
   same candidate with activation checkpointing is tried next. A trial that
   already takes more memory than the budget after a step stops there (its
   peak only grows over the steps): it has no loss comparison.

Compiled models (a ``torch.compile`` wrapper, or modules compiled in place with
``module.compile()``: each repeated block, as large models are often compiled, or
the whole model; their compiled calls are set aside while tuning and put back
after). Running every trial on the
compiled model, as eager ones run, compiled the whole model once per candidate
(each changes dtypes or autocast, so dynamo retraces): on an H200, 27 s per
candidate for Llama 1.1B and 33 s for GPT-2 medium, a quarter to a third of a
10,000-step run. So tuning a compiled model screens eagerly and compiles only
what can win:

* The screen: the probes and trajectories (steps 2-3) run on the module the
  user compiled (``unwrap_model``), eagerly: the losses and the gradient
  cosine, which compiling does not change beyond rounding, are judged there,
  and nothing is compiled per candidate. The memory checked against the budget
  is the eager one: on CUDA the eager peak, which saves more activations than
  the compiled graph does, so the check is conservative (a candidate that
  would fit only compiled is passed over, or tried with checkpointing; one that
  ran out of memory is timed compiled beside its checkpointed twin, below); on
  the CPU the state alone, as before. No eager timing rounds follow: eager step
  times only pick what to compile.
* The finalists: eager and compiled step times rank recipes differently,
  because inductor fuses the casts and elementwise kernels that make autocast
  slow eagerly (H200, 8 x 512 tokens: GPT-2 small's bf16-pure took 0.79x bf16
  autocast's step eagerly and 1.22x compiled; GPT-2 medium's 0.74x and 0.97x).
  Keeping more in bf16 gains less compiled. So for each bf16 extent (step 5:
  autocast, bf16 weights, bf16 throughout) the eligible candidate with the
  fastest eager steps is a finalist if it is the lowest extent's (torch's
  recipe, the one that must never be lost to) or if its eager steps beat every
  lower finalist's by more than half of ``state_margin`` (it must beat them by
  all of it, compiled, to be chosen). With ``state_margin`` > 0 there are at
  most two such finalists, the lowest extent's and the next that qualifies: a third
  would have to beat the second by ``state_margin`` compiled, and compiled the
  second gains most of what bf16 saves (H200, GPT-2 medium, 8 x 1024 tokens:
  bf16-weights trained at 1.12x bf16 autocast's tokens/s; bf16-pure's trial was
  1.07x). Each compile costs seconds, which the budget of a few percent of a
  run cannot spend on a candidate that is not expected to win. A lone finalist
  is chosen without compiling anything. Candidates with fp8 layers are ranked
  apart and give up to two finalists more: eagerly torchao's casts are
  kernels of their own (H200, Llama-3-8B shape: bf16-pure with fp8 took 1070
  ms a step eagerly against bf16-pure's 591, and 387 compiled against bf16
  autocast's 530). Those casts, the same in each, also dilute what keeping
  more in bf16 gains (5% eagerly, 11% compiled there), so the second fp8
  finalist is the fastest of those keeping more in bf16 than the lowest
  extent's, when faster at all. A recipe that ran out of memory in
  the screen, beside a checkpointed twin that is a finalist, is a finalist
  too: compiled it saves fewer activations (H200, the same model: bf16
  autocast ran out of memory eagerly and trained compiled at 124 GiB); if it
  runs, it takes the twin's agreement, since checkpointing recomputes the same
  arithmetic, and its compiled memory is checked against the budget; when it
  fits, the twin is not compiled (checkpointing only adds work).
* Compiled timing: each finalist is applied to the eager module with its
  repeated blocks (:func:`~adaptive_amp.recipes.find_blocks`) compiled by the
  user's backend (:func:`compiled_blocks`): one graph that all blocks share,
  compiled once per finalist (a block's compile, not the model's), then one
  warm-up step and ``rounds * timed_steps`` timed steps. The rest of the model
  (embeddings, head, loss) runs eagerly in all finalists alike. The choice
  (step 5) uses these times; ``Trial.eager_step_times_ms`` keeps the screen's.
  Afterwards the blocks are as they were (``_compiled_call_impl`` back, the
  graphs dropped), and the user's compiled model compiles the chosen recipe
  at its first step, as it would have without tuning: that compile is counted
  once, in training, not per candidate. ``TuneResult.timing`` says how the
  times were taken and ``phase_seconds["compiling"]`` what compiling cost.

Under torch.distributed (``process_group``; ``CollectiveAdaptiveMixedPrecision``
passes its own) every rank runs every trial, since a DDP or FSDP2 step is
collective, and so every rank must run the same steps: what each trial
measured (losses, gradient cosine, memory, step times, errors) is rank 0's on
every rank as soon as it is measured, and every branch above follows from
those. Each rank's own figures differ: its batch, its GPU's clock.

Every trial, its numbers and why it was or was not chosen go into the
returned policy's ``reasons`` and into :class:`TuneResult` (``table()``,
``to_dict()``, ``plot(path)``).
"""

from __future__ import annotations

import functools
import gc
import math
import numbers
import random
import sys
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ._process_group import rank_zeros
from .adjust import forget_compiled_graphs
from .compile_cache import describe_graphs
from .layers import compile_context, compiled_in_place, compiled_whole, is_sharded, unwrap_model
from .recipes import AppliedRecipe, Recipe, convertible, find_blocks
from .regional import compile_backend
from .report import _jsonable, _matplotlib, _save, comparison_table

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

#: How far apart one recipe's speed-up over another was timed from one tuning to the next: on an H200, four
#: tunings of a Llama-3-8B at 3 sequences, compiled, timed bf16-pure with fp8 9.7, 10.8, 11.2 and 11.4% faster than
#: bf16 autocast with fp8, either side of the 10% state_margin, and chose either (bench/RESULTS.md). A choice whose
#: speed-up lies this close to state_margin says so (TuneResult.close_call).
CLOSE_CALL = 0.02


# ---------------------------------------------------------------------------- statistics


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function with `df` degrees of freedom."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass
class LossComparison:
    """Paired per-step loss differences (candidate - reference) on identical batches, and their t-interval."""

    differences: List[float]
    mean: float
    ci_low: float
    ci_high: float
    confidence: float = 0.95
    p_value: float = math.nan  # paired t-test of "no difference" (two-sided)

    @classmethod
    def of(cls, losses: Sequence[float], reference: Sequence[float], confidence: float = 0.95) -> "LossComparison":
        d = [float(a) - float(b) for a, b in zip(losses, reference)]
        n = len(d)
        if n == 0:
            return cls([], math.nan, math.nan, math.nan, confidence)
        mean = sum(d) / n
        if n == 1 or not all(math.isfinite(v) for v in d):
            half = math.inf if math.isfinite(mean) else math.nan
            return cls(d, mean, mean - half, mean + half, confidence)
        sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
        se = sd / math.sqrt(n)
        half = t_quantile(0.5 + confidence / 2, n - 1) * se
        p = (1.0 if mean == 0 else 0.0) if se == 0 else 2.0 * (1.0 - t_cdf(abs(mean) / se, n - 1))
        return cls(d, mean, mean - half, mean + half, confidence, p)


# ---------------------------------------------------------------------------- snapshot


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])


_COMPARE_SLICE = 2**22  # elements of a gradient compared at a time (their float64 temporaries: about 130 MB)
_ALIGN = 64  # bytes: each copy in a host block starts on a cache line (and is aligned for every dtype's view)


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers exactly its numel elements of storage (contiguous, channels_last, any permutation of
    dimensions): a copy can then keep its strides in a slice of numel elements."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and the same strides along every dimension longer than 1 (the others' strides are arbitrary)."""
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def plan_offsets(tensors: Sequence[torch.Tensor], align: int = _ALIGN) -> Tuple[List[int], int]:
    """Byte offsets of a copy of each tensor in one buffer, each aligned to `align`, and the buffer's size."""
    if align < 1 or align & (align - 1):
        raise ValueError(f"align is {align}; pass a power of two (bytes)")
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // align) * align
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


class HostBlock:
    """One host buffer holding copies of many tensors (:func:`host_copies`).

    `pin`: page-locked, so that copies with a GPU run asynchronously at the bus's speed. The memory is allocated
    at its exact size and registered with CUDA (``cudaHostRegister``) rather than taken from torch's pinned
    allocator, which rounds a request up to a power of two (a 4.4 GB snapshot would lock 8 GiB) and keeps the
    block cached, page-locked, after it is freed; where registration is not available it falls back to
    ``torch.empty(..., pin_memory=True)``. A registered block is unregistered when this object is collected,
    after the copies recorded by :meth:`used` have finished.
    """

    def __init__(self, nbytes: int, pin: bool = False):
        self.nbytes, self.registered = int(nbytes), False
        self._uses: List[Any] = []  # CUDA events after the latest copies from or to the block
        self._release = None  # unregisters a registered block
        self.data = _registered(self.nbytes, self) if pin and self.nbytes else None
        if self.data is None:
            self.data = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=bool(pin and self.nbytes))
        self.pinned = bool(pin and self.nbytes)

    def used(self, devices) -> None:
        """Copies involving the block were just enqueued on `devices`' current streams: freeing it waits for
        them."""
        if self.registered:
            self._uses[:] = [torch.cuda.current_stream(d).record_event() for d in devices if d.type == "cuda"]


def _registered(nbytes: int, owner: HostBlock) -> Optional[torch.Tensor]:
    """`nbytes` of host memory page-locked with ``cudaHostRegister``, unregistered when `owner` is collected; None
    where that is not possible (no CUDA runtime binding, registration refused)."""
    try:
        cudart = torch.cuda.cudart()
    except Exception:  # noqa: BLE001 - no binding: torch's pinned allocator instead
        return None
    data = torch.empty(nbytes, dtype=torch.uint8)
    # Every page touched by torch's threads first, else registering faults them in one at a time (ik_llama.cpp
    # measured this 2x faster than cudaHostAlloc, which also faults them in one at a time).
    data.zero_()
    # The whole allocation from its first byte, so that torch sees it as pinned (is_pinned asks CUDA about a
    # storage's first byte). 1: cudaHostRegisterPortable, page-locked for every device's context.
    ptr = data.data_ptr()
    if int(cudart.cudaHostRegister(ptr, nbytes, 1)) != 0:
        _consume_cuda_error()
        return None
    owner.registered = True
    # The finalizer holds `data` until it is unregistered; `owner._uses` is the list `used` refills.
    owner._release = weakref.finalize(owner, _unregister, cudart, ptr, data, owner._uses)
    owner._release.atexit = False  # at exit the process's memory goes anyway, maybe after the CUDA runtime
    return data


def _consume_cuda_error() -> None:
    """A failed runtime call stays the thread's "last error", which torch's next kernel launch check would
    report as its own: read it now, by kernel launches whose check raises it."""
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


def _unregister(cudart, ptr: int, data: torch.Tensor, uses: list) -> None:
    try:
        for event in uses:  # the last copies from or to the block
            event.synchronize()
        if int(cudart.cudaHostUnregister(ptr)) != 0:
            _consume_cuda_error()
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the pages stay locked until exit
        pass


def host_copies(tensors: Sequence[torch.Tensor], pin: bool = False,
                align: int = _ALIGN) -> Tuple[HostBlock, List[torch.Tensor]]:
    """One :class:`HostBlock` sized for `tensors` and a view into it for each, with its dtype, shape and strides
    (dense layouts such as channels_last keep them; other layouts get contiguous views), each aligned to `align`
    bytes. The views are not filled: copy into them."""
    offsets, total = plan_offsets(tensors, align)
    block = HostBlock(total, pin)
    views = []
    for t, start in zip(tensors, offsets):
        flat = block.data[start:start + t.numel() * t.element_size()].view(t.dtype)
        views.append(flat.as_strided(t.shape, t.stride()) if _dense(t) else flat.view(t.shape))
    return block, views


def filled_host_copies(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None):
    """:func:`host_copies` of `tensors` (converted to `dtype` when given), filled: the GPU tensors' copies
    enqueued asynchronously, then one synchronization per device, so that the caller may change the tensors as
    soon as this returns. Returns (block, views, the CUDA devices copied from)."""
    templates = tensors if dtype is None else [torch.empty_like(t, dtype=dtype, device="meta") for t in tensors]
    block, views = host_copies(templates, pin=any(t.is_cuda for t in tensors))
    for v, t in zip(views, tensors):
        v.copy_(t, non_blocking=t.is_cuda)
    devices = {t.device for t in tensors if t.is_cuda}
    for d in devices:
        torch.cuda.synchronize(d)
    return block, views, devices


def times_compiled(model: nn.Module) -> bool:
    """Whether a tuning of `model` screens it eagerly and compiles and times its finalists itself: a torch.compile
    wrapper that compiles, or a model with modules compiled in place (their compiled calls it can set aside). A
    model compiled otherwise (a forward replaced by a compiled one, as Lightning's ``from_compiled`` does) runs
    its trials as it is, compiled; a ``torch.compiler.disable`` wrapper runs them eagerly (but for modules
    compiled in place inside it)."""
    return (unwrap_model(model) is not model and compiled_whole(model)[0]) or bool(compiled_in_place(model))


def check_unsharded(model: nn.Module) -> None:
    """ValueError, naming the parameter, when `model` is sharded by FSDP2: a trial's snapshot restore would copy
    whole tensors into the shards. Nothing is changed."""
    sharded = next((n for n, p in model.named_parameters() if is_sharded(p)), None)
    if sharded is not None:
        raise ValueError(f"model: {sharded} is sharded by FSDP2 (a DTensor); tuning a sharded model is not "
                         "supported: tune the model unsharded on one GPU, then train it sharded with the policy "
                         "the tuning chose (amp.tuning.policy, e.g. policy='bf16-pure')")


def trained_parameters(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> List[torch.Tensor]:
    """The model's parameters, then those the optimizers train outside it (a loose ``nn.Parameter``, the head a
    loss function uses), each once: everything a training step can change."""
    seen: Dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _generators(optimizers) -> List[torch.Generator]:
    """The torch.Generator objects the optimizers draw from (adaptive_amp.optim's ``generator``), each once."""
    found: Dict[int, torch.Generator] = {}
    for opt in optimizers:
        g = getattr(opt, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


class Snapshot:
    """Parameters (the model's and any other the optimizers train), buffers, gradients, optimizer state and
    hyperparameters, RNG states (the optimizers' own generators included) and train/eval mode, copied so that
    :meth:`restore` puts them back bitwise.

    The copies live on the CPU when `offload` (the default for CUDA models), so that a trial's peak memory is
    that of training alone: all of them in one :class:`HostBlock`, page-locked when a tensor comes from a GPU,
    filled by asynchronous copies and one synchronization (one copy and one pinned allocation a tensor took 3.1 s
    for Llama 1.1B's 4.4 GB on an H200, 1.4 GB/s), and copied back asynchronously. Without `offload` they are
    clones on each tensor's device. Parameter objects keep their identity (the optimizer holds them); their data
    is copied back in place where dtype, shape, device and strides still match, else replaced by a copy with
    the saved strides (channels_last stays channels_last; a parameter that was not dense, such as a slice,
    comes back contiguous). Buffers are copied back in place where dtype, shape and device match. A tensor held
    in two places (the same object) is copied once.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], offload: Optional[bool] = None):
        root = unwrap_model(model)
        self.model = root
        self.optimizers = list(optimizers)
        trained = trained_parameters(root, self.optimizers)
        device = next((p.device for p in trained), torch.device("cpu"))
        self.offload = device.type != "cpu" if offload is None else bool(offload)
        self.host: Optional[HostBlock] = None
        self._host_devices: set = set()
        params = [(p, p.detach(), p.grad) for p in trained]
        buffers = [(m, name, b) for m in root.modules() for name, b in m._buffers.items()]
        states = [{p: dict(st) for p, st in opt.state.items()} for opt in self.optimizers]
        live = [t for _, d, g in params for t in (d, g) if t is not None] + \
            [b for _, _, b in buffers if b is not None] + \
            [v for state in states for st in state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        saved = self._copy_all(live)
        self.params = [(p, saved[id(d)], None if g is None else saved[id(g)]) for p, d, g in params]
        self.buffers = [(m, name, None if b is None else saved[id(b)]) for m, name, b in buffers]
        self.training = [(m, m.training) for m in root.modules()]
        self.opt_states = []
        for opt, state in zip(self.optimizers, states):
            # (is a tensor, copy): no reference to the live state, so that a trial can free it.
            state = {p: {k: (True, saved[id(v)]) if isinstance(v, torch.Tensor) else (False, _deep(v))
                         for k, v in st.items()} for p, st in state.items()}
            groups = [{k: _deep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            self.opt_states.append((state, groups, [list(g["params"]) for g in opt.param_groups]))
        self.rng = _rng_states()
        self.generators = [(g, g.get_state()) for g in _generators(self.optimizers)]

    def _copy_all(self, tensors: Sequence[torch.Tensor]) -> Dict[int, tuple]:
        """id(tensor) -> (copy, device) for each tensor: views into one host block when offloading (the device's
        copies enqueued on its current stream, then one synchronization: the trials change the live tensors as
        soon as this returns), else clones on its own device."""
        unique = list({id(t): t.detach() for t in tensors}.items())
        if not self.offload:
            return {i: (t.clone(), t.device) for i, t in unique}
        # Plain dense tensors go into the block; others (sparse gradients, quantized or subclass tensors) are
        # copied on their own.
        plain = {i for i, t in unique if t.layout == torch.strided and not t.is_quantized and type(t) is torch.Tensor}
        strided = [(i, t) for i, t in unique if i in plain]
        saved = {i: (t.to("cpu", copy=True), t.device) for i, t in unique if i not in plain}
        if strided:
            self.host, views, self._host_devices = filled_host_copies([t for _, t in strided])
            saved.update((i, (v, t.device)) for (i, t), v in zip(strided, views))
        return saved

    @staticmethod
    def _back(saved) -> torch.Tensor:
        c, device = saved
        # Asynchronous from the pinned block, which stays alive and is no longer written.
        return c.to(device, copy=True, non_blocking=device.type == "cuda")

    @torch.no_grad()
    def restore(self, rng: bool = True) -> None:
        recast = False
        for p, (c, device), g in self.params:
            if p.dtype == c.dtype and p.device == device and _same_layout(p, c):
                p.data.copy_(c, non_blocking=device.type == "cuda")
            else:
                recast |= p.dtype != c.dtype
                p.data = self._back((c, device))
            p.grad = None if g is None else self._back(g)
        if recast:  # e.g. after a "bf16-pure" run: no graph traced for the other dtype may run on this memory
            forget_compiled_graphs()
        for m, name, b in self.buffers:
            now = m._buffers.get(name)
            if b is not None and now is not None and now.dtype == b[0].dtype and now.shape == b[0].shape \
                    and now.device == b[1]:
                # in place, whatever the layout: other attributes may hold the same tensor (rotary caches)
                now.copy_(b[0], non_blocking=b[1].type == "cuda")
            else:
                m._buffers[name] = None if b is None else self._back(b)
        for m, mode in self.training:
            m.training = mode
        for opt, (state, groups, params) in zip(self.optimizers, self.opt_states):
            new_state = defaultdict(dict)
            for p, st in state.items():
                new_state[p] = {k: self._back(v[1]) if v[0] else _deep(v[1]) for k, v in st.items()}
            opt.state = new_state
            for g, saved, ps in zip(opt.param_groups, groups, params):
                g.clear()
                g.update(_deep(saved))
                g["params"] = ps
            if hasattr(opt, "_plans"):
                opt._plans = {}
        if self.host is not None:
            self.host.used(self._host_devices)
        if rng:
            _set_rng_states(self.rng)
            for g, state in self.generators:
                g.set_state(state)

    @torch.no_grad()
    def restore_buffer_values(self) -> None:
        """The buffers' saved values copied back into the buffers as they are now, each in its current dtype
        (a recipe may have cast it): what a forward changed (batch-norm statistics, spectral norm's vectors)
        is undone without undoing the recipe. A buffer whose shape or device changed is left as it is."""
        for m, name, b in self.buffers:
            now = m._buffers.get(name)
            if b is not None and now is not None and now.shape == b[0].shape and now.device == b[1]:
                now.copy_(b[0], non_blocking=b[1].type == "cuda")

    def bytes(self) -> int:
        """Bytes of the parameters' copies."""
        return sum(c.numel() * c.element_size() for _, (c, _), _ in self.params)


def _deep(v):
    import copy

    return copy.deepcopy(v)


# ---------------------------------------------------------------------------- candidates


def parse_budget(value) -> Optional[int]:
    """Bytes from a number or a string such as ``"20GiB"``, ``"512 MB"``; None stays None. Anything else (inf,
    nan, a number <= 0 or under one byte, an unknown unit) is refused, naming memory_budget."""
    if value is None:
        return None
    how = "pass a finite number of bytes > 0 or a string such as '20GiB' or '512 MB'"
    if isinstance(value, bool):
        raise ValueError(f"memory_budget is {value!r}; {how}")
    if isinstance(value, (int, float)):
        n, unit = value, "b"
    else:
        text = str(value).strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):] or "b"
        if unit not in _UNITS:
            raise ValueError(f"memory_budget {value!r}: unknown unit {unit!r} (use B, KB, MB, GB, KiB, MiB, GiB, "
                             "TiB)")
        try:
            n = float(number)
        except ValueError:
            raise ValueError(f"memory_budget {value!r}: expected a number and a unit, e.g. '20GiB'") from None
    if not (math.isfinite(n) and n > 0) or n * _UNITS[unit] < 1:
        raise ValueError(f"memory_budget is {value!r}; {how}")
    return int(n * _UNITS[unit])


# ---------------------------------------------------------------------------- trials


@dataclass
class Trial:
    """One candidate's measurements (None where not measured; ``error`` when it could not run)."""

    name: str
    recipe: Dict[str, Any]
    safety: int
    losses: List[float] = field(default_factory=list)
    step_times_ms: List[float] = field(default_factory=list)
    peak_bytes: Optional[int] = None  # CUDA: max_memory_allocated during the trial
    state_bytes: Optional[int] = None  # parameters + gradients + optimizer state
    activation_bytes: Optional[int] = None  # saved for backward on the first step (eager models only)
    grad_cosine: Optional[float] = None
    # ||g - g_ref|| / ||g_ref||, the first-step gradients (None: not measured)
    grad_distance: Optional[float] = None
    # A candidate for the reference (the reference, or one before it that failed later), where an fp8 candidate
    # runs: ||g(batch 1) - g(batch 0)|| / (sqrt(2) ||g(batch 0)||), one batch's sampling noise (two independent
    # batches' gradients are sqrt(2) noise apart), at the same weights
    grad_noise: Optional[float] = None
    comparison: Optional[LossComparison] = None
    error: Optional[str] = None
    fits: Optional[bool] = None
    agrees: Optional[bool] = None
    verdict: str = ""
    # Compiled models: the eager screen's step times (step_times_ms then holds the compiled ones, finalists only)
    eager_step_times_ms: List[float] = field(default_factory=list)
    # Compiled models: the checkpointed trial whose agreement this one took (it ran out of memory eagerly)
    agreement_from: Optional[str] = None
    # Its gradient agreed through the sampling-noise test (fp8 layers), its cosine being below min_cosine
    within_noise: bool = False

    @property
    def step_time_ms(self) -> Optional[float]:
        return _median(self.step_times_ms)

    @property
    def eager_step_time_ms(self) -> Optional[float]:
        """Compiled models: the median of the eager screen's steps."""
        return _median(self.eager_step_times_ms)

    @property
    def memory_bytes(self) -> Optional[int]:
        """What the budget is checked against: the CUDA peak, else state plus saved activations."""
        if self.peak_bytes is not None:
            return self.peak_bytes
        if self.state_bytes is None:
            return None
        return self.state_bytes + (self.activation_bytes or 0)

    @property
    def memory_source(self) -> str:
        if self.peak_bytes is not None:
            return "cuda peak allocated"
        if self.state_bytes is None:
            return "n/a"
        return "state + saved activations" if self.activation_bytes is not None else "state only (compiled)"

    def to_dict(self) -> dict:
        c = self.comparison
        return {"name": self.name, "recipe": self.recipe, "step_time_ms": self.step_time_ms,
                "step_times_ms": list(self.step_times_ms), "peak_bytes": self.peak_bytes,
                "state_bytes": self.state_bytes, "activation_bytes": self.activation_bytes,
                "memory_bytes": self.memory_bytes, "memory_source": self.memory_source,
                "losses": list(self.losses), "grad_cosine": self.grad_cosine,
                "grad_distance": self.grad_distance, "grad_noise": self.grad_noise,
                "loss_diff_mean": None if c is None else c.mean, "loss_diff_ci": None if c is None else [c.ci_low, c.ci_high],
                "loss_diff_p": None if c is None else c.p_value, "loss_diffs": None if c is None else list(c.differences),
                "error": self.error, "fits": self.fits, "agrees": self.agrees, "verdict": self.verdict,
                "eager_step_time_ms": self.eager_step_time_ms, "eager_step_times_ms": list(self.eager_step_times_ms),
                "agreement_from": self.agreement_from, "within_noise": self.within_noise}


def _has_fp8(recipe: Recipe) -> bool:
    """Whether `recipe`'s per-layer map puts a layer in fp8."""
    return any(kind.startswith("fp8-") for _, kind in recipe.policy.layers)


def _median(values: Sequence[float]) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for backward (parameters excluded), while active."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.seen = {}

    def pack(self, t):
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in self.skip:
                self.seen[ptr] = s.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
            pass
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _state_bytes(model: nn.Module, optimizer) -> int:
    seen = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            seen[(s.device.type, s.data_ptr())] = s.nbytes()
    for p in trained_parameters(model, [optimizer]):
        add(p.detach())
        add(p.grad)
    for st in optimizer.state.values():
        for v in st.values():
            add(v)
    return sum(seen.values())


class _ReferenceGrads(NamedTuple):
    block: HostBlock  # holds the grads' memory (a registered block is unregistered when it goes)
    grads: List[torch.Tensor]


def _reference_copies(grads: List[torch.Tensor]) -> _ReferenceGrads:
    """The reference gradients kept for the cosines, on the host: bf16 (half the bytes to allocate and copy; its
    rounding moves a cosine over many elements by far less than the 0.95 threshold's margin), in one block,
    pinned when they are on a GPU so that copying them back for each candidate is fast (a pinned allocation and
    a synchronous copy each cost as the snapshot's did)."""
    # (After one wait for all, any stream may read the block, and it may go any time.)
    block, copies, _ = filled_host_copies(grads, torch.bfloat16)
    return _ReferenceGrads(block, copies)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, start):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append((start, e))
        else:
            self.marks.append((start, time.perf_counter()))

    def times_ms(self) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.marks]
        return [(b - a) * 1e3 for a, b in self.marks]


class Tuner:
    """Runs the trials of :func:`tune` (see the module docstring); one instance per tuning."""

    def __init__(self, model, optimizer, batches, loss_fn, capabilities, recipes: Sequence[Recipe],
                 skipped: Sequence[Tuple[str, str]] = (), *, steps: int = 8,
                 memory_budget=None, analysis=None, rounds: int = 3, timed_steps: int = 3,
                 loss_tolerance: float = 0.01, min_cosine: float = 0.95, noise_fraction: float = 1.0,
                 tie: float = 0.01,
                 contenders: float = 0.2, state_margin: float = 0.1, checkpoint_when_needed: bool = True,
                 offload_snapshot: Optional[bool] = None, progress: Optional[Callable[[str], None]] = None,
                 process_group=None, fp8_saved_ms: Optional[float] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model is a {type(model).__name__}; pass the torch.nn.Module to tune")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer is a {type(optimizer).__name__}; pass one torch.optim.Optimizer")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn is a {type(loss_fn).__name__}; pass fn(model, batch) -> loss")
        if progress is not None and not callable(progress):
            raise TypeError(f"progress is a {type(progress).__name__}; pass fn(message) or None")
        for name, value in (("steps", steps), ("rounds", rounds), ("timed_steps", timed_steps)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} is {value!r}; pass an int")
        for name, value in (("contenders", contenders), ("state_margin", state_margin)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} is {value!r}; pass a fraction >= 0")
        try:
            self.batches = list(batches)
        except TypeError:
            raise TypeError(f"batches is a {type(batches).__name__}; pass a list of the batches the trials train "
                            "on") from None
        if not self.batches:
            raise ValueError("batches is empty; pass the batches the trials train on (a few are enough)")
        if steps < 2:
            raise ValueError(f"steps is {steps}; pass at least 2 (the loss comparison needs two differences)")
        if rounds < 1 or timed_steps < 1:
            raise ValueError(f"rounds ({rounds}) and timed_steps ({timed_steps}) must be >= 1")
        if isinstance(noise_fraction, bool) or not isinstance(noise_fraction, (int, float)) or \
                not (math.isfinite(noise_fraction) and noise_fraction >= 0):
            raise ValueError(f"noise_fraction is {noise_fraction!r}; pass a finite fraction >= 0 (1: a recipe with "
                             "fp8 layers whose first-step gradient is nearer the reference's than one batch's "
                             "sampling noise, with a positive cosine, agrees; 0: only min_cosine judges it)")
        for name, value in (("tie", tie), ("loss_tolerance", loss_tolerance)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value)
                                                                                     and value >= 0):
                raise ValueError(f"{name} is {value!r}; pass a finite fraction >= 0 (0.01: 1%)")
        if isinstance(min_cosine, bool) or not isinstance(min_cosine, (int, float)) or math.isnan(min_cosine):
            raise ValueError(f"min_cosine is {min_cosine!r}; pass a cosine (0.95: the first step's gradient must "
                             "point where the reference's does; above 1 only the reference agrees)")
        if not contenders >= 0:
            raise ValueError(f"contenders is {contenders!r}; pass a fraction >= 0 (0.2: candidates within 20% of "
                             "the fastest are timed in every round)")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.capabilities = capabilities
        self.steps, self.rounds, self.timed_steps = int(steps), int(rounds), int(timed_steps)
        self.budget = parse_budget(memory_budget)
        self.analysis = analysis
        self.loss_tolerance, self.min_cosine, self.tie = float(loss_tolerance), float(min_cosine), float(tie)
        self.contenders, self.noise_fraction = float(contenders), float(noise_fraction)
        if not state_margin >= 0:
            raise ValueError(f"state_margin is {state_margin!r}; pass a fraction >= 0 (0.1: a recipe that keeps "
                             "more in bf16 (weights, moments, compute outside the matmuls) is chosen only when "
                             "more than 10% faster than every agreeing recipe that keeps less; 0: the fastest "
                             "wins)")
        self.state_margin = float(state_margin)
        # What the "+fp8" candidates' layers were timed to save a step against bf16 (their map's saved_ms).
        self.fp8_saved_ms = fp8_saved_ms
        self._dominated: List[Recipe] = []  # not run: their "+fp8" twin agrees and fits (_dominated_by)
        self._stood: List[Trial] = []  # not compiled: a twin stood for their bf16 extent (_stood_for)
        self.phases: Dict[str, float] = defaultdict(float)
        self.checkpoint_when_needed = checkpoint_when_needed
        self.offload = offload_snapshot
        self.say = progress or (lambda msg: None)
        self.device = next((p.device for p in trained_parameters(model, [optimizer])), torch.device("cpu"))
        # Under torch.distributed every rank runs every trial (a DDP or FSDP2 step is collective), so every rank
        # must take the same branches: what each measured (step times, memory, losses, errors) is rank 0's.
        self._agree = rank_zeros(process_group, self.device)
        wrapped = unwrap_model(model) is not model
        # What the trials run (module docstring, "Compiled models"): compiled, the module the user compiled, eager.
        self.module = unwrap_model(model) if wrapped else model
        # Modules compiled in place (``module.compile()``: each block, as for large models, or the whole model):
        # their compiled calls are set aside while tuning, so that the screen runs eagerly as for a wrapper.
        self._in_place = compiled_in_place(self.module)
        self.compiled = times_compiled(model)
        whole = wrapped and compiled_whole(model)[0]  # (a torch.compiler.disable wrapper compiles nothing)
        self.backend = (compile_backend(getattr(model, "dynamo_ctx", None)) if whole else
                        compile_backend(compile_context(self._in_place[0]._compiled_call_impl)) if self._in_place
                        else None)
        self.finalists: List[str] = []  # compiled: the candidates whose blocks were compiled and timed
        self.recipes, self.skipped = list(recipes), list(skipped)
        why = convertible(optimizer)
        if why is not None:
            keep = [r for r in self.recipes if r.moment_dtype is None]
            self.skipped += [(r.name, why) for r in self.recipes if r.moment_dtype is not None]
            self.recipes = keep
        self.recipes.sort(key=lambda r: r.safety)
        # Only fp8 candidates are judged by the sampling noise: the reference measures it only for them.
        self._fp8_candidates = any(_has_fp8(r) for r in self.recipes)
        if not self.recipes:
            raise ValueError("candidates: none of them can run here (" +
                             "; ".join(f"{n}: {why}" for n, why in self.skipped) + "); name others")

    @contextmanager
    def _phase(self, name: str):
        """Adds the wall time of the block (its device work included) to ``phases[name]``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.phases[name] += time.perf_counter() - t0

    # -------------------------------------------------------------- one trial
    def _step(self, a: AppliedRecipe, batch, saved: Optional[_SavedBytes] = None,
              after_backward: Optional[Callable[[], None]] = None):
        with a.autocast():
            if saved is not None:
                with saved.hooks():
                    loss = self.loss_fn(self.module, batch)
            else:
                loss = self.loss_fn(self.module, batch)
        a.scaler.scale(loss).backward()
        if after_backward is not None:
            after_backward()
        a.scaler.step(a.optimizer)
        a.scaler.update()
        return loss.detach().float()

    def _probe(self, a: AppliedRecipe, index: int = 0) -> List[torch.Tensor]:
        """Unscaled fp32 gradients of one forward/backward on batch `index` (no step); the scale backs off
        until they are finite, as the scaler would."""
        scale = a.scaler.get_scale() if a.scaler.is_enabled() else 1.0
        params = self._probed_parameters(a)
        for _ in range(8):
            for p in params:
                p.grad = None
            with a.autocast():
                loss = self.loss_fn(self.module, self.batches[index])
            (loss * scale if scale != 1.0 else loss).backward()
            grads = [(p.grad.float() / scale) if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
                     for p in params]
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
            for p in params:
                p.grad = None
            if finite or scale == 1.0:
                return grads
            scale = max(1.0, scale / 2**4)
        return grads

    def _probed_parameters(self, a: AppliedRecipe) -> List[torch.Tensor]:
        """The parameters whose gradients are compared, in one order for the reference and every candidate."""
        return [p for p in trained_parameters(unwrap_model(self.model), [a.optimizer]) if p.requires_grad]

    def _step_gradients(self, a: AppliedRecipe):
        """The gradients a step's backward left (without loss scaling), in the order :meth:`_probe` returns them,
        as they are (:meth:`_compare` widens a slice at a time); a parameter without one, zeros that take no
        memory (a broadcast zero)."""
        return (p.grad if p.grad is not None else
                torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
                for p in self._probed_parameters(a))

    @staticmethod
    def _compare(grads: Iterable[torch.Tensor], ref: List[torch.Tensor]) -> Tuple[float, float]:
        """(cosine, ||g - ref|| / ||ref||) of two gradients given per parameter; `ref` (on the host) comes over
        a tensor at a time. Summed on the device in float64, a slice of at most 2**22 elements at a time (the
        temporaries of one slice, not of the largest tensor; a gradient that is not contiguous, as a
        channels_last one, is copied whole first), read once; nan where not finite."""
        sums = None
        for g, r in zip(grads, ref):
            g, r = g.reshape(-1), r.reshape(-1)
            for i in range(0, max(1, g.numel()), _COMPARE_SLICE):
                gi = g[i:i + _COMPARE_SLICE].double()
                ri = r[i:i + _COMPARE_SLICE].to(g.device, non_blocking=True).double()
                part = torch.stack([(gi * ri).sum(), gi.pow(2).sum(), ri.pow(2).sum(), (gi - ri).pow(2).sum()])
                sums = part if sums is None else sums + part
        if sums is None:
            return math.nan, math.nan
        dot, n1, n2, diff = (float(v) for v in sums.cpu())
        if not (math.isfinite(dot) and n1 > 0 and n2 > 0 and math.isfinite(n1) and math.isfinite(diff)):
            return math.nan, math.nan
        return dot / math.sqrt(n1 * n2), math.sqrt(diff / n2)

    def _trajectory(self, recipe: Recipe, trial: Trial, ref_grads):
        self._restore()
        cuda = self.device.type == "cuda"
        with self._phase("recipes applied and undone"):
            a = AppliedRecipe(recipe, self.module, self.optimizer)
        try:
            # The probe of a candidate compared with the reference is its trajectory's first step: the same weights,
            # batch and RNG state, so the same gradient, compared between its backward and its optimizer step
            # (one forward and backward fewer a candidate). With loss scaling the probe runs on its own: it backs
            # off the scale until the gradient is finite, where the first step would only be skipped.
            at_first_step = ref_grads is not None and not a.scaler.is_enabled()
            out = None

            def first_step_probe():
                nonlocal out
                out, trial.grad_distance = self._compare(self._step_gradients(a), ref_grads.grads)
            with self._phase("probes"):
                if ref_grads is None:
                    grads = self._probe(a)
                    # Kept, on the host, before the trajectory, so that they are not in its peak memory.
                    out = _reference_copies(grads)
                    del grads
                    # A candidate for the reference: its sampling noise, which only fp8 candidates are judged by.
                    if len(self.batches) > 1 and self._fp8_candidates:
                        other = self._probe(a, 1)
                        trial.grad_noise = self._compare(other, out.grads)[1] / math.sqrt(2)
                        del other
                elif not at_first_step:
                    out, trial.grad_distance = self._compare(self._probe(a), ref_grads.grads)
            if not at_first_step:
                # Every trajectory starts from the snapshot's state: the probes' forwards changed no weight, but may
                # have changed buffers (batch-norm statistics, spectral norm's vectors).
                self.snapshot.restore_buffer_values()
            # ... and without the gradients the snapshot put back (a probe leaves none either).
            for p in trained_parameters(unwrap_model(self.model), [a.optimizer]):
                p.grad = None
            _set_rng_states(self.snapshot.rng)
            with self._phase("trajectories"):
                if cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                saved = (_SavedBytes(trained_parameters(unwrap_model(self.model), [a.optimizer]))
                         if not self.compiled else None)
                losses = []
                timer = _Timer(self.device)
                for k in range(self.steps):
                    # Every step after the first is timed: the trajectory is the first timing round.
                    start = timer.start() if k else None
                    loss = self._step(a, self.batches[k % len(self.batches)], saved if k == 0 else None,
                                      first_step_probe if at_first_step and k == 0 else None)
                    losses.append(loss)
                    if k == 0:
                        trial.state_bytes = _state_bytes(unwrap_model(self.model), a.optimizer)
                        if saved is not None:
                            trial.activation_bytes = saved.total
                    a.optimizer.zero_grad(set_to_none=True)
                    if k:
                        timer.stop(start)
                    if self._over_budget_already(trial, cuda, k + 1):
                        break  # (the peak only grows: the other steps would be spent for nothing)
                trial.losses = [float(v) for v in torch.stack(losses).cpu()]
                trial.step_times_ms.extend(timer.times_ms())
                if cuda:
                    torch.cuda.synchronize()
                    trial.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        finally:
            a.optimizer.zero_grad(set_to_none=True)
            with self._phase("recipes applied and undone"):
                a.undo()
        return out

    def _over_budget_already(self, trial: Trial, cuda: bool, done: int) -> bool:
        """After `done` steps of a trajectory: whether the trial's memory so far is over the budget (it cannot
        fit, and the trial stops there). On the CPU the measure is complete after the first step; on CUDA it is
        the peak so far (allocator bookkeeping: no synchronization), which with an optimizer that has no state
        yet reaches its full height only in the second step, when the moments exist during the backward."""
        if self.budget is None or done >= self.steps:
            return False
        memory = int(torch.cuda.max_memory_allocated(self.device)) if cuda else trial.memory_bytes
        if not self._agree(memory is not None and memory > self.budget):  # (rank 0's: all stop at one step)
            return False
        if cuda and memory is not None:
            trial.peak_bytes = memory
        trial.verdict = (f"does not fit the budget: {_bytes(memory)} > {_bytes(self.budget)} after {done} of "
                         f"{self.steps} steps (stopped there)")
        return True

    def _time_round(self, recipe: Recipe, trial: Trial, offset: int):
        self._restore()
        with self._phase("recipes applied and undone"):
            a = AppliedRecipe(recipe, self.module, self.optimizer)
        timer = _Timer(self.device)
        try:
            with self._phase("timing rounds"):
                n = len(self.batches)
                self._step(a, self.batches[offset % n])  # warm-up: allocator, caches, a changed graph
                a.optimizer.zero_grad(set_to_none=True)
                for k in range(self.timed_steps):
                    start = timer.start()
                    self._step(a, self.batches[(offset + 1 + k) % n])
                    a.optimizer.zero_grad(set_to_none=True)
                    timer.stop(start)
                trial.step_times_ms.extend(timer.times_ms())
        finally:
            a.optimizer.zero_grad(set_to_none=True)
            with self._phase("recipes applied and undone"):
                a.undo()

    def _finalists(self, trials: List[Trial], recipes: Dict[str, Recipe]) -> List[Trial]:
        """Compiled: the candidates whose blocks are compiled and timed (module docstring, "Compiled models"):
        those of :meth:`_extent_finalists` among the eager screen's eligible trials without fp8 layers, and
        among those with fp8 layers, ranked apart (eagerly torchao's casts are kernels of their own, so fp8
        loses there what it gains compiled; the fp8 map's gains were timed compiled). The others' verdicts say
        why they were not compiled."""
        ok = self._eligible([t for t in trials if _usable(t)], recipes)
        fp8 = [t for t in ok if _has_fp8(recipes[t.name])]
        plain = [t for t in ok if t not in fp8 and not self._stood_for(t, fp8, recipes)]
        return self._extent_finalists(plain, recipes) + self._extent_finalists(fp8, recipes, diluted=True)

    def _stood_for(self, trial: Trial, fp8: List[Trial], recipes: Dict[str, Recipe]) -> bool:
        """Whether an fp8 twin stands for `trial`'s bf16 extent among the candidates without fp8 layers: a recipe
        of that extent was not run for that twin (:meth:`_dominated_by`), and `trial`'s eager steps were no
        faster than the twin's (which torchao's unfused casts slow down eagerly), so that it would not have been
        its extent's finalist beside the recipe not run. Then it is not compiled, and says why."""
        extent = _bf16_extent(recipes[trial.name])
        for r in self._dominated:
            twin = next((t for t in fp8 if t.name in self._twins(r)), None)
            if _bf16_extent(r) == extent and twin is not None and twin.step_time_ms <= trial.step_time_ms:
                if not trial.verdict:
                    trial.verdict = (f"agrees; not compiled: eager {_num(trial.step_time_ms)} ms/step against "
                                     f"{_num(twin.step_time_ms)} for {twin.name}, which keeps as much in bf16 and "
                                     f"stands for {r.name}")
                self._stood.append(trial)
                return True
        return False

    def _extent_finalists(self, ok: List[Trial], recipes: Dict[str, Recipe], diluted: bool = False) -> List[Trial]:
        """For each bf16 extent (:func:`_bf16_extent`) the one of `ok` with the fastest eager steps (one within
        `tie` of it but safer wins the tie), kept when it is the lowest extent's or its eager steps beat every
        lower kept one's by more than half of `state_margin`; with `state_margin` > 0 no more than two (the
        lowest extent's and one above it).

        diluted: the eager steps dilute what keeping more in bf16 gains compiled (fp8 candidates: torchao's
        unfused casts, the same in each, take most of an eager step; H200, Llama-3-8B shape at 3 x 2048 tokens:
        bf16-pure with fp8 was 5% faster than bf16 autocast with fp8 eagerly, 11% compiled). Then the one
        above the lowest extent's is the fastest of the higher extents (one within `tie` of it but safer wins
        the tie), kept when faster at all; with `state_margin` = 0 every extent's that is faster than the
        lowest's is kept (the fastest wins compiled, whatever it keeps in bf16)."""
        levels: Dict[int, List[Trial]] = defaultdict(list)
        for t in ok:
            levels[_bf16_extent(recipes[t.name])].append(t)
        picks = []
        for level in sorted(levels):
            pool = levels[level]
            pick = self._fastest_or_safer(pool)[1]
            for t in pool:
                if t is not pick and not t.verdict:
                    t.verdict = (f"agrees; not compiled: eager {_num(t.step_time_ms)} ms/step against "
                                 f"{_num(pick.step_time_ms)} for {pick.name}, which keeps as much in bf16")
            picks.append(pick)
        if diluted and len(picks) > 2 and self.state_margin > 0:  # the fastest above the lowest's to compare
            above = self._fastest_or_safer(picks[1:])[1]
            for pick in picks[1:]:
                if pick is not above and not pick.verdict:
                    pick.verdict = (f"agrees; not compiled: eager {_num(pick.step_time_ms)} ms/step against "
                                    f"{_num(above.step_time_ms)} for {above.name}, compiled instead of it among "
                                    f"those keeping more in bf16 than {picks[0].name}")
            picks = [picks[0], above]
        margin = 0.0 if diluted else self.state_margin / 2
        kept: List[Trial] = []
        for pick in picks:
            if len(kept) == 2 and self.state_margin > 0:
                if not pick.verdict:
                    pick.verdict = (f"agrees; not compiled: to be chosen it would have to be more than "
                                    f"state_margin={self.state_margin:.0%} faster compiled than the finalist "
                                    f"{kept[1].name}, which keeps less in bf16 and gains most of what bf16 "
                                    "saves compiled")
                continue
            behind = [k for k in kept if pick.step_time_ms * (1 + margin) >= k.step_time_ms]
            if behind:
                if not pick.verdict:
                    pick.verdict = (f"agrees; not compiled: eager {_num(pick.step_time_ms)} ms/step, " +
                                    (f"not faster than {behind[0].name}'s {_num(behind[0].step_time_ms)}, which "
                                     "keeps less in bf16" if diluted else
                                     f"not more than state_margin/2={self.state_margin / 2:.0%} faster than "
                                     f"{behind[0].name}'s {_num(behind[0].step_time_ms)}, which keeps less in "
                                     "bf16 (compiled, the gain of keeping more in bf16 shrinks)"))
                continue
            kept.append(pick)
        return kept

    def _fastest_or_safer(self, pool: List[Trial]) -> Tuple[Trial, Trial]:
        """(the fastest of `pool`, the one to take): a safer trial within `tie` of the fastest takes it, the
        difference being within timing noise."""
        fastest = min(pool, key=lambda t: t.step_time_ms)
        return fastest, min((t for t in pool if t.step_time_ms <= fastest.step_time_ms * (1 + self.tie)),
                            key=lambda t: t.safety)

    def _time_finalists(self, trials: List[Trial], recipes: Dict[str, Recipe], more: bool = False) -> None:
        """Compiled: the eager screen's step times move to ``eager_step_times_ms``; each finalist's blocks are
        compiled and its steps timed (:meth:`_time_compiled`); a lone finalist keeps its eager times (nothing to
        compare).

        A checkpointed finalist whose recipe without checkpointing ran out of memory in the eager screen brings
        that recipe along: compiled it saves fewer activations and may fit (H200, the Llama-3-8B shape at 3 x 2048
        tokens: bf16 autocast ran out of memory eagerly, and compiled trains at 124 GiB). It is timed compiled
        first; if it runs, it takes the checkpointed trial's agreement (checkpointing recomputes the same
        arithmetic) and its compiled memory, and it fits if that is within the budget; then the checkpointed
        trial is not compiled (it only adds the recomputed forward: 640 ms a step against 527 there). (A recipe
        whose eager peak went over the budget is not retried: the eager check is conservative by design, and
        the checkpointed twin that fits is what the budget asked for.)

        more: `trials` are screened after the others were timed compiled (:meth:`_run_dominated`): their
        finalists are timed compiled too, even one alone, to be compared with those."""
        finalists = self._finalists(trials, recipes)
        by_name = {t.name: t for t in trials}
        twin_of: Dict[str, Trial] = {}
        for t in list(finalists):
            base = by_name.get(t.name[:-len("+ckpt")]) if t.name.endswith("+ckpt") else None
            if base is not None and base.fits is False and (base.error or "").startswith("out of memory"):
                twin_of[base.name] = t
                finalists.insert(finalists.index(t), base)
        for t in trials:
            t.eager_step_times_ms, t.step_times_ms = list(t.step_times_ms), []
        if len(finalists) == 1 and not more:
            finalists[0].step_times_ms = list(finalists[0].eager_step_times_ms)
            return
        if finalists:
            self.say("tune: compiled timing of " + ", ".join(t.name for t in finalists))
        offset = self.steps
        fitted = set()  # recipes that ran compiled without checkpointing and fit
        for t in finalists:
            base = t.name[:-len("+ckpt")] if t.name.endswith("+ckpt") else None
            if base in fitted:  # (rank 0's figures: every rank skips it, or none)
                t.verdict = (f"agrees; not compiled: {base} ran compiled without checkpointing and fits, and "
                             "checkpointing only adds the recomputed forward")
                continue
            twin, peak = twin_of.get(t.name), None
            if twin is not None:
                t.error, t.fits = None, None  # (the eager screen's out of memory; timed compiled now)
            try:
                peak = self._time_compiled(recipes[t.name], t, offset)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot compile is recorded, not fatal
                if not _is_oom(exc) and not isinstance(exc, (RuntimeError, ValueError, TypeError)):
                    raise
                t.step_times_ms = []
                if _is_oom(exc):
                    t.error, t.fits = f"out of memory while timed compiled: {_short(exc)}", False
                else:
                    t.error = f"could not be timed compiled: {type(exc).__name__}: {_short(exc)}"
                if twin is not None:
                    t.error = "out of memory eagerly, then " + t.error
                self._free()
            self._agree_timing(t)
            if twin is not None and t.error is None:  # (rank 0's error: every rank takes this branch, or none)
                self._adopt_agreement(t, twin, self._agree(peak))
                if t.fits:
                    fitted.add(t.name)
            if t.error is None:
                self.finalists.append(t.name)

    def _adopt_agreement(self, trial: Trial, twin: Trial, peak: Optional[int]):
        """`trial` ran out of memory eagerly and has now run compiled (CUDA peak `peak`, rank 0's): it agrees as
        its checkpointed `twin` did, and fits if its compiled memory (on the CPU: its state, the twin's, as for
        any compiled trial there) is within the budget."""
        trial.agrees, trial.comparison = twin.agrees, twin.comparison
        trial.losses, trial.grad_cosine, trial.grad_distance = list(twin.losses), twin.grad_cosine, twin.grad_distance
        trial.within_noise = twin.within_noise
        trial.agreement_from, trial.peak_bytes = twin.name, peak
        trial.state_bytes, trial.activation_bytes = twin.state_bytes, None
        memory = trial.memory_bytes
        trial.fits = self.budget is None or memory is None or memory <= self.budget
        trial.verdict = "" if trial.fits else (f"does not fit the budget compiled: {_bytes(memory)} > "
                                               f"{_bytes(self.budget)}")

    def _time_compiled(self, recipe: Recipe, trial: Trial, offset: int):
        """The recipe applied to the eager module with its blocks compiled (:func:`compiled_blocks`, the user's
        backend): one step that compiles ("compiling"), one warm-up step, then ``rounds * timed_steps`` timed
        steps ("compiled timing"). Undone afterwards. Returns the peak memory of the steps after the compiling one
        (CUDA; None on the CPU)."""
        self._restore()
        with self._phase("recipes applied and undone"):
            a = AppliedRecipe(recipe, self.module, self.optimizer)
        timer = _Timer(self.device)
        n = len(self.batches)
        try:
            with compiled_blocks(self.module, self.backend):
                with self._phase("compiling"):
                    self._step(a, self.batches[offset % n])
                    a.optimizer.zero_grad(set_to_none=True)
                cuda = self.device.type == "cuda"
                if cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                with self._phase("compiled timing"):
                    self._step(a, self.batches[(offset + 1) % n])  # warm-up: allocator, caches
                    a.optimizer.zero_grad(set_to_none=True)
                    for k in range(self.rounds * self.timed_steps):
                        start = timer.start()
                        self._step(a, self.batches[(offset + 2 + k) % n])
                        a.optimizer.zero_grad(set_to_none=True)
                        timer.stop(start)
                    trial.step_times_ms = timer.times_ms()
                return int(torch.cuda.max_memory_allocated(self.device)) if cuda else None
        finally:
            a.optimizer.zero_grad(set_to_none=True)
            with self._phase("recipes applied and undone"):
                a.undo()

    def _free(self, collect: bool = True):
        """Cached device memory back to the driver (after an error and at the end); `collect`: Python's
        garbage first (after an error, whose traceback holds the step's frames and tensors)."""
        with self._phase("clean-up"):
            if collect:
                gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _restore(self):
        """The snapshot back before a trial. Reference counting frees the last trial's tensors; only when device
        memory above the snapshot's is still held (a reference cycle) is the garbage collected, so that it does
        not count in this trial's peak (a full collection takes a few hundred ms in a process with a large
        model). What a collection leaves is no garbage (likely cuBLAS's workspaces, allocated at a process's
        first matrix products): it becomes the level compared against, else every trial would collect (on the
        H200 a process's first tuning spent 3-5 s collecting, its second 0.3 s)."""
        with self._phase("snapshot restores"):
            self.snapshot.restore()
        if self.device.type == "cuda" and torch.cuda.memory_allocated(self.device) > self._allocated:
            self._free()
            self._allocated = max(self._allocated, torch.cuda.memory_allocated(self.device))

    def _contenders(self, runnable: List[Trial], recipes: Dict[str, Recipe]) -> List[Trial]:
        """The candidates worth more timing rounds: they agree, fit, may be chosen (:meth:`_eligible`), and
        their first round was within `contenders` of the fastest such candidate's."""
        ok = self._eligible([t for t in runnable if _usable(t)], recipes)
        if not ok:
            return []
        best = min(t.step_time_ms for t in ok)
        return [t for t in ok if t.step_time_ms <= best * (1 + self.contenders)]

    # -------------------------------------------------------------- all trials
    def run(self) -> "TuneResult":
        started = time.perf_counter()
        dynamo_limit = _raise_recompile_limit(len(self.recipes) * 2 + 8)
        set_aside = [(m, m._compiled_call_impl) for m in self._in_place]
        for m, _ in set_aside:
            m._compiled_call_impl = None
        try:
            return self._run(started)
        finally:
            for m, impl in set_aside:
                m._compiled_call_impl = impl
            _restore_recompile_limit(dynamo_limit)

    def _run(self, started: float) -> "TuneResult":
        with self._phase("snapshot"):
            self.snapshot = Snapshot(self.model, [self.optimizer], offload=self.offload)
        self._allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        trials: List[Trial] = []
        recipes: Dict[str, Recipe] = {}
        self._reference, self._ref_grads = None, None
        passed_over: List[Recipe] = []  # skipped: they could not be chosen (see _cannot_win)
        try:
            self._run_queue(list(self.recipes), trials, recipes, passed_over)
            self._timing_rounds(trials, recipes)
            if passed_over and not self._full_moments_left(trials, recipes):
                # Every candidate with fp32 moments ran out of memory in a timing round: the ones passed over
                # may be chosen after all.
                names = {r.name for r in passed_over}
                self.skipped = [(n, why) for n, why in self.skipped if n not in names]
                self.say("tune: no candidate with fp32 moments is left; trials of " + ", ".join(sorted(names)))
                start = len(trials)
                self._run_queue(passed_over, trials, recipes, None)
                self._timing_rounds(trials[start:], recipes)
            if self.compiled:
                self._time_finalists(trials, recipes)
            self._run_dominated(trials, recipes)
        finally:
            self._restore()
            self.snapshot = self._ref_grads = None
            self._free(collect=False)
        return self._choose(trials, self._reference, recipes, time.perf_counter() - started)

    def _timing_rounds(self, trials: List[Trial], recipes: Dict[str, Recipe]) -> None:
        """Eagerly, the timing rounds after the trajectories (module docstring, step 4) for the contenders among
        `trials` (those run later time theirs when they run, as many). Compiled, the eager screen's times only
        pick what to compile: no eager rounds."""
        if self.compiled:
            return
        contenders = self._contenders([t for t in trials if t.error is None and t.fits], recipes)
        if self.rounds > 1 and contenders:
            self.say("tune: timing rounds for " + ", ".join(t.name for t in contenders))
        for r in range(1, self.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)] if contenders else []
            for t in order:
                try:
                    self._time_round(recipes[t.name], t, offset=r * (self.timed_steps + 1))
                except Exception as exc:  # noqa: BLE001
                    if not _is_oom(exc):
                        raise
                    t.error, t.fits = f"out of memory while timed: {_short(exc)}", False
                    self._free()
                self._agree_timing(t)
                if t.error is not None:
                    contenders.remove(t)

    def _run_queue(self, queue: List[Recipe], trials: List[Trial], recipes: Dict[str, Recipe],
                   passed_over: Optional[List[Recipe]]):
        """Each recipe's trial, in order (a +ckpt variant goes next after one that does not fit); the first
        that fits with finite losses becomes the reference. With `passed_over` a list, recipes that could not
        be chosen are skipped into it instead."""
        blocks = bool(find_blocks(self.model))
        while queue:
            recipe = queue.pop(0)
            why = None if passed_over is None else self._cannot_win(recipe, self._reference, recipes)
            if why is not None:
                self.skipped.append((recipe.name, why))
                passed_over.append(recipe)
                continue
            twin = self._fp8_twin(recipe) if passed_over is not None else None
            if twin is not None and any(r.name == twin for r in queue):
                queue.insert(next(i for i, r in enumerate(queue) if r.name == twin) + 1, recipe)  # after it
                continue
            why = None if twin is None else self._dominated_by(recipe, twin, trials)
            if why is not None:
                self.skipped.append((recipe.name, why))
                self._dominated.append(recipe)
                continue
            trial = Trial(recipe.name, recipe.to_dict(), recipe.safety)
            recipes[recipe.name] = recipe
            trials.append(trial)
            self.say(f"tune: trial {recipe.name}")
            out = None
            try:
                out = self._trajectory(recipe, trial, self._ref_grads)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is recorded, not fatal
                if not _is_oom(exc) and not isinstance(exc, (RuntimeError, ValueError, TypeError)):
                    raise
                trial.error = ("out of memory" if _is_oom(exc) else type(exc).__name__) + f": {_short(exc)}"
                trial.fits = False if _is_oom(exc) else None
                self._free()
            out = self._agree_trial(trial, out)
            if trial.error is not None:
                if trial.fits is False:  # out of memory
                    self._maybe_checkpoint(recipe, trial, queue, blocks)
                continue
            # No empty_cache between trials: the next trial would pay cudaMalloc again in its timed steps
            # (on the H200 trials' first steps ran 10-30% slower than the same recipe alone; this is the
            # likely cause), and the allocator frees cached blocks by itself before running out of memory.
            trial.fits = self.budget is None or trial.memory_bytes is None or trial.memory_bytes <= self.budget
            if not trial.fits:
                self._maybe_checkpoint(recipe, trial, queue, blocks)
                if len(trial.losses) < self.steps:  # stopped over the budget: no loss comparison
                    trial.grad_cosine = out if self._reference is not None else None
                    continue
            if self._reference is None:
                if trial.fits and all(math.isfinite(v) for v in trial.losses):
                    self._reference, self._ref_grads = trial, out
                    trial.grad_cosine, trial.grad_distance, trial.agrees = 1.0, 0.0, True
                    trial.comparison = LossComparison.of(trial.losses, trial.losses)
                continue
            trial.grad_cosine = out
            self._judge(trial, self._reference, recipe)

    def _agree_trial(self, trial: Trial, out):
        """`trial` as rank 0 measured it, on every rank (nothing changes in one process), and `out`: the
        trajectory's gradient cosine, rank 0's too; the reference's probe gradients stay each rank's own."""
        cosine = out if isinstance(out, float) else None
        measured, cosine = self._agree((dict(vars(trial)), cosine))
        vars(trial).update(measured)
        return cosine if cosine is not None else out

    def _agree_timing(self, trial: Trial) -> None:
        """After a timing round or the compiled timing: its step times and any error, rank 0's on every rank."""
        trial.step_times_ms, trial.error, trial.fits = self._agree((trial.step_times_ms, trial.error, trial.fits))

    @staticmethod
    def _full_moments_left(trials: List[Trial], recipes: Dict[str, Recipe]) -> bool:
        """Whether a trial with fp32 moments (or the optimizer's own) agrees, fits and was timed."""
        return any(_usable(t) and _fp32_moments(recipes[t.name]) for t in trials)

    def _cannot_win(self, recipe: Recipe, reference: Optional[Trial], recipes: Dict[str, Recipe]) -> Optional[str]:
        """Why `recipe` need not run (None: it must): bf16 moments are chosen only when no agreeing candidate
        with fp32 moments fits (:meth:`_eligible`), and a reference with fp32 moments is one. (Should every
        candidate with fp32 moments run out of memory in a later timing round, the recipes passed over run
        then.)"""
        if self.state_margin == 0 or recipe.moment_dtype != torch.bfloat16 or reference is None:
            return None
        if not _fp32_moments(recipes[reference.name]):
            return None
        return (f"bf16 moments are chosen only when no candidate with fp32 moments fits, and the reference "
                f"{reference.name} does (state_margin=0 tries it)")

    def _fp8_twin(self, recipe: Recipe) -> Optional[str]:
        """The name of `recipe`'s "+fp8" twin among the candidates (the same recipe with the measured fp8 layers),
        when the fp8 layers were timed to save more than `tie` of the reference's step (so much that `recipe`
        could not even tie with the twin); else None."""
        if self.fp8_saved_ms is None or self._reference is None or self._reference.step_time_ms is None:
            return None
        if not self.fp8_saved_ms > self.tie * self._reference.step_time_ms:
            return None
        if _has_fp8(recipe):
            return None
        twins = self._twins(recipe)  # (the last is the candidate's name, without checkpointing)
        return twins[0] if any(r.name == twins[-1] for r in self.recipes) else None

    @staticmethod
    def _twins(recipe: Recipe) -> Tuple[str, ...]:
        """The names of the trials that may stand for `recipe` (:meth:`_dominated_by`): its "+fp8" twin, and for
        a checkpointed recipe also the twin without checkpointing (faster still). Not the checkpointed twin for a
        recipe without: fp8's casts take a little more memory, so the recipe may fit where its twin needed
        checkpointing, and run faster than the twin does checkpointed."""
        if recipe.checkpoint:
            base = recipe.name[:-len("+ckpt")]
            return (base + "+fp8+ckpt", base + "+fp8")
        return (recipe.name + "+fp8",)

    def _dominated_by(self, recipe: Recipe, twin: str, trials: List[Trial]) -> Optional[str]:
        """Why `recipe` need not run (None: it must): a trial of :meth:`_twins` (its fp8 twin `twin`, or for a
        checkpointed recipe the twin without checkpointing) agrees and fits. The twin computes every other op as
        `recipe` does, and its fp8 layers were timed to save more than `tie` of a step, so `recipe` cannot be
        faster, nor within `tie` of it and safer. (It runs after all if the twin then fails:
        :meth:`_run_dominated`.)"""
        held = self._held_twin(recipe, trials)
        if held is None:
            return None
        return (f"{held.name} agrees and fits, and its fp8 layers were timed {self.fp8_saved_ms:.4g} ms a step "
                f"faster than in bf16 (more than tie={self.tie:g} of the reference's "
                f"{self._reference.step_time_ms:.4g} ms): {recipe.name} cannot be faster; it runs if {held.name} "
                "fails later")

    def _held_twin(self, recipe: Recipe, trials: List[Trial]) -> Optional[Trial]:
        """The first trial of :meth:`_twins` that ran without error, fits and agrees; None if none does."""
        return next((t for t in trials if t.name in self._twins(recipe) and _holds(t)), None)

    def _run_dominated(self, trials: List[Trial], recipes: Dict[str, Recipe]) -> None:
        """The recipes not run for their fp8 twin (:meth:`_dominated_by`) run after all when no twin of theirs
        still holds, or no candidate with fp8 layers can be chosen (each failed when timed: out of memory, an
        error compiling): their trials, and compiled, their finalists timed beside the others, with the trials
        the twins stood for (:meth:`_stood_for`) and a checkpointed recipe's own that ran out of memory."""
        fp8_ok = any(_usable(t) and _has_fp8(recipes[t.name]) for t in trials)
        lost = [r for r in self._dominated if not fp8_ok or self._held_twin(r, trials) is None]
        self._dominated = []
        if not lost:
            return
        names = {r.name for r in lost}
        self.skipped = [(n, why) for n, why in self.skipped if n not in names]
        self.say("tune: no fp8 twin stands for " + ", ".join(sorted(names)) + " now; their trials")
        bases = {r.name[:-len("+ckpt")] for r in lost if r.checkpoint}
        again = [t for t in trials if t.name in bases] + self._stood
        for t in self._stood:  # (judged compiled now, beside the recipes they were set aside for)
            t.verdict, t.step_times_ms = "", list(t.eager_step_times_ms)
        self._stood = []
        start = len(trials)
        self._run_queue(lost, trials, recipes, None)
        self._timing_rounds(trials[start:], recipes)
        if self.compiled:
            self._time_finalists(again + trials[start:], recipes, more=True)

    def _maybe_checkpoint(self, recipe: Recipe, trial: Trial, queue: List[Recipe], blocks: bool):
        if recipe.checkpoint or not self.checkpoint_when_needed:
            return
        if not blocks:  # (after where a trial stopped over the budget, when it says so)
            trial.verdict = (f"{trial.verdict}; " if trial.verdict else "does not fit; ") + \
                "the model has no repeated blocks to checkpoint"
            return
        variant = recipe.replace(name=recipe.name + "+ckpt", checkpoint=True, safety=recipe.safety + 1)
        if all(r.name != variant.name for r in queue):
            queue.insert(0, variant)

    def _judge(self, trial: Trial, reference: Trial, recipe: Recipe):
        trial.comparison = c = LossComparison.of(trial.losses, reference.losses)
        scale = sum(abs(v) for v in reference.losses) / len(reference.losses)
        tol = self.loss_tolerance * scale
        finite = all(math.isfinite(v) for v in trial.losses)
        cos_ok = trial.grad_cosine is not None and math.isfinite(trial.grad_cosine) and \
            trial.grad_cosine >= self.min_cosine
        # fp8 layers: their tolerance is measured layer by layer (the fp8 selection); over a deep model their
        # rounding adds up to a first gradient far from fp32's, by nature, so the whole model is held to the
        # sampling noise instead. Elsewhere a low cosine is a defect's signature (bf16 autocast keeps 0.99).
        # It must still point the reference's way (a positive cosine): with noise above 1 (batches whose
        # gradients point apart) a distance within it would admit any direction.
        fp8 = _has_fp8(recipe)
        noise = reference.grad_noise if fp8 else None
        within_noise = (self.noise_fraction > 0 and noise is not None and math.isfinite(noise)
                        and trial.grad_distance is not None and trial.grad_distance <= self.noise_fraction * noise
                        and trial.grad_cosine is not None and trial.grad_cosine > 0)
        trial.within_noise = within_noise and not cos_ok
        cos_ok = cos_ok or within_noise
        trial.agrees = bool(finite and math.isfinite(c.ci_high) and c.ci_high <= tol and cos_ok)
        if not trial.agrees:
            why = []
            if not finite:
                why.append("non-finite loss")
            if finite and not (math.isfinite(c.ci_high) and c.ci_high <= tol):
                why.append(f"loss difference CI upper {c.ci_high:+.3g} > tolerance {tol:.3g}")
            if not cos_ok:
                why.append(f"first-step gradient cosine {_num(trial.grad_cosine)} < {self.min_cosine:g}"
                           + self._noise_clause(trial, noise, fp8))
            trial.verdict = "disagrees: " + "; ".join(why)

    def _noise_clause(self, trial: Trial, noise: Optional[float], fp8: bool) -> str:
        """What the gradient distance said, when it was measured, for a disagreeing verdict."""
        if fp8 and self.noise_fraction > 0 and len(self.batches) < 2:
            return " (fp8 layers: the sampling-noise test needs two or more batches)"
        if self.noise_fraction == 0 or noise is None or not math.isfinite(noise) or trial.grad_distance is None:
            return ""
        if trial.grad_cosine is not None and trial.grad_cosine <= 0:
            return ", and within the sampling noise it must still point the reference's way (a positive cosine)"
        bound = "the" if self.noise_fraction == 1 else f"{self.noise_fraction:g}x the"
        return (f", and its distance from the reference's {_num(trial.grad_distance)} > {bound} sampling noise "
                f"{_num(noise * self.noise_fraction)}")

    def _eligible(self, ok: List[Trial], recipes: Dict[str, Recipe]) -> List[Trial]:
        """The agreeing, fitting trials that may be chosen: bf16 moments only when none with fp32 moments is
        among them, unless state_margin is 0 (the fastest wins). They are a memory measure: they save 4 bytes a
        parameter but little time (the optimizer's step is a small part of a step), and their risk shows only
        after hundreds of steps. Measured (H200, Llama 1.1B eager, 2000 steps, bench/RESULTS.md): bf16 weights
        and moments ended 7% above torch's bf16 autocast, in two separate runs, while their trials agreed and were
        5-12% faster than bf16 weights with fp32 moments."""
        full = [t for t in ok if _fp32_moments(recipes[t.name])]
        if self.state_margin == 0 or not full:
            return ok
        for t in ok:
            if t not in full and not t.verdict:
                t.verdict = ("agrees, but keeps its moments in bf16: chosen only when no candidate with fp32 "
                             "moments fits the memory budget (state_margin=0: the fastest wins)")
        return full

    def _choose(self, trials, reference, recipes, seconds) -> "TuneResult":
        ok = [t for t in trials if _usable(t)]
        ok = self._eligible(ok, recipes)
        reasons = []
        where = getattr(self.capabilities, "name", str(self.device))
        tried = ("; trials: " + "; ".join(f"{t.name}: {t.error or t.verdict or 'does not fit'}" for t in trials) +
                 ". Raise memory_budget, use smaller batches, or add candidates ending in +ckpt")
        if reference is None:
            raise RuntimeError(self._no_reference(trials))
        if not ok:  # (the reference itself ran out of memory in a later timing round)
            raise RuntimeError("tune: every candidate that agreed with the reference ran out of memory while timed"
                               + tried)

        best, chosen = self._fastest_or_safer(ok)
        why_chosen = "" if chosen is best else f" (within {self.tie:.0%} of {best.name}, and safer)"
        # More in bf16 than autocast keeps must pay for itself by more than `state_margin` (module docstring,
        # step 5).
        close_calls = []
        while _bf16_extent(recipes[chosen.name]):
            keeps_less = [t for t in ok if _bf16_extent(recipes[t.name]) < _bf16_extent(recipes[chosen.name])]
            if not keeps_less:
                break
            _, alternative = self._fastest_or_safer(keeps_less)
            close_calls += self._close_call(chosen, alternative)
            if alternative.step_time_ms > chosen.step_time_ms * (1 + self.state_margin):
                break
            why_chosen = (f" (within state_margin={self.state_margin:.0%} of {chosen.name}, which keeps more "
                          "in bf16)")
            chosen = alternative
        for t in trials:
            if t is chosen:
                t.verdict = "chosen" + why_chosen
            elif not t.verdict:
                if t.error:
                    t.verdict = "could not run: " + t.error
                elif not t.fits:
                    t.verdict = f"does not fit the budget ({_bytes(t.memory_bytes)} > {_bytes(self.budget)})"
                elif t.agrees and t.step_time_ms < chosen.step_time_ms:
                    t.verdict = (f"agrees, faster ({_num(t.step_time_ms)} ms vs {_num(chosen.step_time_ms)} ms), "
                                 f"but not by more than tie={self.tie:.0%} or, for more kept in bf16, "
                                 f"state_margin={self.state_margin:.0%} over the safer {chosen.name}")
                elif t.agrees:
                    t.verdict = f"agrees, slower ({_num(t.step_time_ms)} ms vs {_num(chosen.step_time_ms)} ms)"
        reasons.append(f"tune: measured {len(trials)} candidate(s) on {where}, {self.steps} steps each on the same "
                       f"batches, {self.rounds} timing round(s) of {self.timed_steps} step(s); reference "
                       f"{reference.name}; {seconds:.1f} s")
        timing = self._timing()
        if self.compiled:
            reasons.append(f"tune: {timing}")
        recipe = recipes[chosen.name]
        reasons.append(f"tune: chose {chosen.name} ({recipe.describe()}): {_num(chosen.step_time_ms)} ms/step, "
                       f"memory {_bytes(chosen.memory_bytes)} ({chosen.memory_source})")
        close_call = "; ".join(close_calls) or None
        if close_call:
            reasons.append(f"tune: a close call: {close_call}")
        for t in trials:
            reasons.append(f"trial {t.name}: {_trial_line(t)}")
        for name, why in self.skipped:
            reasons.append(f"trial {name}: skipped: {why}")
        policy = recipe.policy.replace(reasons=tuple(reasons))
        return TuneResult(policy=policy, recipe=recipe, trials=trials, skipped=list(self.skipped),
                          reference=reference.name, budget=self.budget, seconds=seconds,
                          device=str(self.device), compiled=self.compiled, phase_seconds=dict(self.phases),
                          timing=timing, close_call=close_call)

    def _close_call(self, lean: Trial, safe: Trial) -> List[str]:
        """[why the choice between `lean` (keeping more in bf16, faster) and `safe` may fall the other way when
        timed again, the memory each took, and how to decide] when `lean`'s speed-up lies within
        :data:`CLOSE_CALL` of `state_margin`, the speed-up it must exceed to be chosen; else []."""
        if self.state_margin <= 0 or not (lean.step_time_ms or 0) > 0 or not safe.step_time_ms:
            return []
        gain = safe.step_time_ms / lean.step_time_ms - 1
        if gain <= 0 or abs(gain - self.state_margin) > CLOSE_CALL:
            return []
        why = (f"{lean.name} was timed {gain:.1%} faster than {safe.name} ({_num(lean.step_time_ms)} against "
               f"{_num(safe.step_time_ms)} ms/step), within {CLOSE_CALL:.0%} of state_margin="
               f"{self.state_margin:.0%}, the speed-up that keeping more in bf16 must exceed (tunings of one model "
               "at one batch timed it that far apart): timed again, the choice may fall the other way")
        advice = "state_margin=0 takes the faster"
        lm, sm = lean.memory_bytes, safe.memory_bytes
        if lm is not None and sm is not None:
            why += (f"; {lean.name} took {_bytes(abs(sm - lm))} {'less' if lm <= sm else 'more'} memory "
                    f"({_bytes(lm)} against {_bytes(sm)})")
            if lm < sm:
                advice += f", a memory_budget from {_bytes(lm)} to under {_bytes(sm)} takes {lean.name}"
        return [f"{why}. To decide: {advice}"]

    def _timing(self) -> str:
        """How the step times were measured, for TuneResult.timing and the reasons."""
        if not self.compiled:
            return f"eager: the trajectories and {self.rounds - 1} more timing round(s) of the contenders"
        backend = self.backend if isinstance(self.backend, str) else getattr(
            self.backend, "compiler_name", getattr(self.backend, "__name__", type(self.backend).__name__))
        if not self.finalists:
            return ("eager screen (probes, trajectories and memory on the module the user compiled), no compiled "
                    "timing: one candidate could be chosen, timed eagerly")
        return (f"eager screen (probes, trajectories and memory on the module the user compiled), then "
                f"{', '.join(self.finalists)} timed with the blocks compiled ({backend}), "
                f"{self.phases.get('compiling', 0.0):.1f} s compiling")


    def _no_reference(self, trials: List[Trial]) -> str:
        """Why no trial could be the reference, from what the trials met: a failure, the budget, non-finite
        losses (the advice follows the cause: raising a budget cures no NaN)."""
        lines = "; trials: " + "; ".join(f"{t.name}: {_trial_fault(t, self.budget)}" for t in trials)
        ran = [t for t in trials if t.error is None]
        over = [t for t in ran if t.fits is False]
        nonfinite = [t for t in ran if t.fits is not False and not all(math.isfinite(v) for v in t.losses)]
        if ran and len(nonfinite) == len(ran):
            return ("tune: every candidate's loss was non-finite (inf or NaN) in its trial, the safest ("
                    f"{ran[0].name}) too: the model, its loss_fn or the batches give inf/NaN whatever the precision "
                    "(check the loss in float32, the learning rate, the inputs)" + lines)
        if over and len(over) + len(nonfinite) == len(ran):
            return (f"tune: no candidate fit the memory budget ({_bytes(self.budget)})" + lines +
                    ". Raise memory_budget, use smaller batches, or add candidates ending in +ckpt")
        if not ran:
            return "tune: no candidate could run" + lines
        return "tune: no candidate ran with finite losses within the memory budget" + lines


def _trial_fault(t: Trial, budget) -> str:
    if t.error:
        return t.error
    if t.fits is False:
        return t.verdict or f"does not fit the budget ({_bytes(t.memory_bytes)} > {_bytes(budget)})"
    bad = [i for i, v in enumerate(t.losses) if not math.isfinite(v)]
    if bad:
        return f"non-finite loss at step {bad[0]} ({t.losses[bad[0]]})"
    return t.verdict or "no reference"


def _holds(t: Trial) -> bool:
    """Whether a trial ran without error, fits and agrees (timed or not)."""
    return t.error is None and bool(t.fits) and bool(t.agrees)


def _usable(t: Trial) -> bool:
    """Whether a trial may be chosen as far as it alone goes: it ran, fits, agrees and was timed."""
    return _holds(t) and t.step_time_ms is not None


def _fp32_moments(recipe) -> bool:
    """Whether `recipe` keeps fp32 moments (or leaves the optimizer's own, None)."""
    return recipe.moment_dtype in (None, torch.float32)


def _bf16_extent(recipe) -> int:
    """How much `recipe` keeps in bf16 beyond torch's autocast, one for each: bf16 weights, bf16 moments, bf16
    compute outside the matmuls (bf16-pure's residual stream and norms). 0 for autocast, fp16 and fp32.

    fp8 layers (a "+fp8" recipe's per-layer map) add nothing to their base's: they round a matmul's operands,
    not state that carries over steps (weights and moments stay in their recipe's dtype), so the trial's loss
    and gradient agreement see what they cost as they see autocast's rounding, and while training the Fp8Guard
    demotes a layer that stops tolerating fp8, which nothing does for a slow drift of bf16 state. Among
    candidates within `tie` the safer (fp8's base) still wins."""
    return (int(recipe.param_dtype != torch.float32) + int(not _fp32_moments(recipe))
            + int(recipe.policy.pure))


def _raise_recompile_limit(n: int):
    """Every candidate (compiled, every finalist) compiles its own graph: let dynamo keep them all (else it falls
    back to eager)."""
    cfg = getattr(torch, "_dynamo", None) and torch._dynamo.config
    if cfg is None:
        return None
    key = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    before = getattr(cfg, key)
    setattr(cfg, key, max(before, n))
    return key, before


def _call_block(module: nn.Module, *args, **kwargs):
    """A block's call, compiled by :func:`compiled_blocks`: the module is an argument, so that every block of one
    class runs the same graph (dynamo's inlined nn modules), and the graphs live on this function's code alone."""
    return module._call_impl(*args, **kwargs)


@contextmanager
def compiled_blocks(module: nn.Module, backend="inductor"):
    """`module`'s repeated blocks (:func:`~adaptive_amp.recipes.find_blocks`; the whole module if it has none)
    run compiled with `backend` inside the block: one graph that every block shares, compiled at the first call.
    Afterwards each block's ``_compiled_call_impl`` is what it was and the graphs are dropped. Yields the number of
    modules compiled."""
    blocks = [b for _, b in find_blocks(module)] or [module]
    before = [b._compiled_call_impl for b in blocks]
    compiled = torch.compile(_call_block, backend=backend)
    try:
        for b in blocks:
            b._compiled_call_impl = functools.partial(compiled, b)
        yield len(blocks)
    finally:
        for b, impl in zip(blocks, before):
            b._compiled_call_impl = impl
        reset_code = getattr(getattr(torch._dynamo, "eval_frame", None), "reset_code", None)
        if reset_code is not None:
            reset_code(_call_block.__code__)


def _restore_recompile_limit(saved):
    if saved is not None:
        setattr(torch._dynamo.config, saved[0], saved[1])


def _short(exc: BaseException, n: int = 160) -> str:
    s = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return s if len(s) <= n else s[:n - 3] + "..."


def _num(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a" if v is None else str(v)
    return f"{v:.4g}"


def _bytes(n) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _trial_line(t: Trial) -> str:
    c = t.comparison
    parts = [f"{_num(t.step_time_ms)} ms/step", f"memory {_bytes(t.memory_bytes)}"]
    if c is not None and t.error is None:
        parts.append(f"loss diff {c.mean:+.3g} [{c.ci_low:+.3g}, {c.ci_high:+.3g}] (p={c.p_value:.2g})")
    if t.grad_cosine is not None:
        parts.append(f"grad cosine {_num(t.grad_cosine)}")
    if t.grad_distance is not None:
        parts.append(f"grad distance {_num(t.grad_distance)}")
    if t.within_noise:
        parts.append("gradient within the sampling noise")
    if t.agreement_from:
        parts.append(f"agreement from {t.agreement_from} (out of memory eagerly)")
    return ", ".join(parts) + f": {t.verdict or 'reference'}"


# ---------------------------------------------------------------------------- result


@dataclass
class TuneResult:
    """What :func:`tune` measured and chose. ``policy`` carries every trial in its reasons."""

    policy: Any  # the PrecisionPolicy chosen, every trial in its reasons
    recipe: Recipe
    trials: List[Trial]
    skipped: List[Tuple[str, str]]
    reference: str
    budget: Optional[int]
    seconds: float
    device: str
    compiled: bool
    phase_seconds: Dict[str, float] = field(default_factory=dict)  # where `seconds` went (Tuner._phase)
    timing: str = ""  # how the step times were measured (compiled: the eager screen, the compiled finalists)
    close_call: Optional[str] = None  # why the choice may fall the other way when timed again (Tuner._close_call)
    # What inductor compiled while tuning, and loaded from its on-disk cache (compile_cache.GraphCount; None: nothing
    # counted), in the process that tuned (under torch.distributed, rank 0's, whose result every rank takes): a
    # machine that compiled the same graphs before tunes faster.
    inductor_graphs: Optional[Dict[str, int]] = None

    @property
    def compile_seconds(self) -> float:
        """Seconds of the tuning spent compiling (compiled models' finalists; 0 otherwise)."""
        return float(self.phase_seconds.get("compiling", 0.0))

    @property
    def chosen(self) -> Trial:
        """The chosen candidate's trial (losses, step time, memory, verdict)."""
        return next(t for t in self.trials if t.name == self.recipe.name)

    def apply(self, model: nn.Module, optimizer) -> AppliedRecipe:
        """Apply the chosen recipe to `model` and `optimizer` (for a loop of your own); ``.undo()`` reverts. A
        recipe with adaptive_amp.optim's optimizer converts `optimizer` itself, in place, state included
        (``.optimizer`` is `optimizer`): checkpoint it the usual way."""
        return AppliedRecipe(self.recipe, model, optimizer, in_place=True)

    def table(self) -> str:
        """The A/B table: every candidate's step time, memory, loss agreement and verdict."""
        return tuning_table(self._data())

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        """Plain data, the A/B table included as text (``"table"``)."""
        d = self._data()
        d["table"] = tuning_table(d)
        return d

    def _data(self) -> dict:
        chosen = self.chosen
        return {"chosen": self.recipe.name, "recipe": self.recipe.to_dict(), "describe": self.recipe.describe(),
                "policy": str(self.policy), "reference": self.reference, "budget_bytes": self.budget,
                "seconds": self.seconds, "phase_seconds": dict(self.phase_seconds), "device": self.device,
                "compiled": self.compiled, "timing": self.timing, "compile_seconds": self.compile_seconds,
                "close_call": self.close_call, "inductor_graphs": self.inductor_graphs,
                "memory_source": chosen.memory_source, "trials": [t.to_dict() for t in self.trials],
                "skipped": [{"name": n, "why": w} for n, w in self.skipped], "reasons": list(self.policy.reasons)}

    def plot(self, path: str) -> str:
        """Write the trials as a PNG to `path` (needs matplotlib); returns the path."""
        return plot_tuning(self._data(), path)

    def save(self, directory: str, plots: bool = True) -> Dict[str, str]:
        """tune.txt, tune.json and (with matplotlib) tune.png in `directory`."""
        import json
        import os

        os.makedirs(directory, exist_ok=True)
        out = {"text": os.path.join(directory, "tune.txt"), "json": os.path.join(directory, "tune.json")}
        with open(out["text"], "w") as f:
            f.write(self.table() + "\n\nreasons:\n" + "\n".join("  - " + r for r in self.policy.reasons) + "\n")
        with open(out["json"], "w") as f:
            f.write(json.dumps(_jsonable(self.to_dict()), indent=2) + "\n")
        if plots:
            out["plot"] = self.plot(os.path.join(directory, "tune.png"))
        return out


# ---------------------------------------------------------------------------- A/B report (from the dict form,
# so that a report read back from JSON renders the same)


def tuning_rows(d: dict) -> List[dict]:
    rows = []
    for t in d["trials"]:
        ci = t.get("loss_diff_ci")
        ok_ci = ci is not None and not t.get("error") and None not in ci
        rows.append({"candidate": t["name"], "ms/step": t.get("step_time_ms"),
                     "memory MiB": None if t.get("memory_bytes") is None else t["memory_bytes"] / 2**20,
                     "loss diff": t.get("loss_diff_mean") if not t.get("error") else None,
                     "95% CI": f"[{ci[0]:+.3g}, {ci[1]:+.3g}]" if ok_ci else "-",
                     "p": t.get("loss_diff_p") if ok_ci else None,
                     "grad cos": "-" if t.get("grad_cosine") is None else f"{t['grad_cosine']:.6f}",
                     "grad dist": "-" if t.get("grad_distance") is None else f"{t['grad_distance']:.3g}",
                     "verdict": (t.get("verdict") or "reference") + _adopted(t)
                     + (" (its gradient within the sampling noise)" if t.get("within_noise") else "")})
    for s in d.get("skipped", []):
        rows.append({"candidate": s["name"], "ms/step": None, "memory MiB": None, "loss diff": None, "95% CI": "-",
                     "p": None, "grad cos": "-", "grad dist": "-", "verdict": "skipped: " + s["why"]})
    if any(t.get("eager_step_times_ms") for t in d["trials"]):  # compiled: the eager screen's times too
        eager = {t["name"]: t.get("eager_step_time_ms") for t in d["trials"]}
        rows = [{**{k: v for k, v in r.items() if k != "verdict"}, "eager ms/step": eager.get(r["candidate"]),
                 "verdict": r["verdict"]} for r in rows]
    return rows


def _adopted(t: dict) -> str:
    if not t.get("agreement_from"):
        return ""
    return (f" (out of memory eagerly, timed and its memory measured compiled; the loss and gradient agreement are "
            f"{t['agreement_from']}'s, the same arithmetic)")


def tuning_table(d: dict) -> str:
    """The A/B table of a TuneResult.to_dict(): one row per candidate, then the choice."""
    head = (f"A/B of precision recipes on {d['device']}{' (compiled)' if d.get('compiled') else ''}: reference "
            f"{d['reference']}, memory budget {_bytes(d.get('budget_bytes'))}, memory as {d.get('memory_source')}; "
            f"tuning took {d['seconds']:.1f} s")
    noise = next((t.get("grad_noise") for t in d["trials"] if t["name"] == d["reference"]), None)
    phases = d.get("phase_seconds") or {}
    if phases:
        head += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])) + ")"
    if d.get("inductor_graphs"):
        head += "; " + describe_graphs(d["inductor_graphs"])
    if d.get("compiled") and d.get("timing"):
        head += "\ntiming: " + d["timing"]
    if noise is not None:
        head += (f"\ngrad dist: the first-step gradient's distance from the reference's, relative to its norm; one "
                 f"batch's sampling noise is {noise:.3g} (the reference's on two batches, over sqrt 2)")
    return (head + "\n" + comparison_table(tuning_rows(d)) +
            f"\nchosen: {d['chosen']} ({d.get('describe') or d.get('policy')})" +
            (f"\na close call: {d['close_call']}" if d.get("close_call") else ""))


def plot_tuning(d: dict, path: str) -> str:
    """One PNG of a TuneResult.to_dict(): step time and memory per candidate (bars; the budget as a dashed
    line) and the mean loss difference against the reference with its 95% interval. Green: chosen; red: does
    not fit, disagrees or failed; blue: agrees but slower."""
    Figure, FigureCanvasAgg = _matplotlib()
    trials = d["trials"]
    fig = Figure(figsize=(13, 1.6 + 0.45 * max(len(trials), 3)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    fig.suptitle(f"adaptive_amp tune on {d['device']}{' (compiled)' if d.get('compiled') else ''}: chose "
                 f"{d['chosen']} (reference {d['reference']})")
    ys = list(range(len(trials)))
    colors = ["tab:green" if t["name"] == d["chosen"] else "tab:red" if (t.get("error") or t.get("fits") is False
              or t.get("agrees") is False) else "tab:blue" for t in trials]
    axes[0].barh(ys, [t.get("step_time_ms") or 0.0 for t in trials], color=colors)
    axes[0].set_title("median step time (ms)")
    # GiB for a real model's memory (tens of thousands of MiB read badly), MiB for a small one.
    unit, scale = ("GiB", 2**30) if max((t.get("memory_bytes") or 0) for t in trials) >= 2**30 else ("MiB", 2**20)
    axes[1].barh(ys, [(t.get("memory_bytes") or 0) / scale for t in trials], color=colors)
    axes[1].set_title(f"memory ({unit}; {d.get('memory_source')})", fontsize=9)
    if d.get("budget_bytes"):
        axes[1].axvline(d["budget_bytes"] / scale, color="black", linestyle="--", linewidth=1, label="budget")
        axes[1].legend(fontsize=7)
    for y, t in zip(ys, trials):
        if t.get("step_time_ms") is None:
            why = "failed" if t.get("error") else "does not fit" if t.get("fits") is False else "not timed"
            axes[0].text(0, y, " " + why, va="center", fontsize=7)
        ci, mean = t.get("loss_diff_ci"), t.get("loss_diff_mean")
        if t.get("error") or mean is None or ci is None or None in ci:
            axes[2].text(0, y, " n/a", va="center", fontsize=7)
            continue
        lo, hi = (ci[0] if math.isfinite(ci[0]) else mean), (ci[1] if math.isfinite(ci[1]) else mean)
        axes[2].errorbar([mean], [y], xerr=[[mean - lo], [hi - mean]], fmt="o", color=colors[y], capsize=3)
    axes[2].axvline(0.0, color="gray", linewidth=0.8)
    axes[2].set_title("loss - reference loss (mean, 95% CI)")
    # Differences of 1e-4 would otherwise print as long labels that run into each other.
    axes[2].locator_params(axis="x", nbins=5)
    axes[2].ticklabel_format(axis="x", style="sci", scilimits=(-2, 3))
    for ax in axes:
        ax.set_yticks(ys)
        ax.set_yticklabels([t["name"] for t in trials] if ax is axes[0] else [""] * len(trials), fontsize=8)
        ax.set_ylim(len(trials) - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
    _save(fig, path)
    return path
