"""GradScaler: a faster drop-in replacement for ``torch.amp.GradScaler``.

A subclass of ``torch.amp.GradScaler`` (``isinstance`` holds) with the same
constructor, methods, errors, private hooks (``_unscale_grads_``,
``_maybe_opt_step``, ``_check_inf_per_device``, the per-optimizer state),
``state_dict`` format and, in mode ``"dynamic"`` (the default), bitwise the
same scale trajectory and parameters. What differs is the cost and what you
can ask of it:

* The grouping of an optimizer's parameters by device is built once; a step
  only collects the gradients' pointers (in C++, skipping parameters without
  a gradient: frozen or unused ones), and each device gets one native
  launch for all its gradients, fp32, fp16 and bf16 mixed. float64 gradients
  go through torch's own kernel, as in torch's scaler (a model turned back
  to float32 is replanned at its next step).
* ``unscale_`` also yields each gradient's sum of squares and amax from the
  same read, so :meth:`clip_grad_norm_` needs no second pass (while the
  gradients provably did not change since) and the last gradient norm is
  always at hand as a device tensor.
* Optimizers that unscale inside their own step (``fused=True``) get a
  read-only check pass instead of torch's read-write pass; with
  :meth:`clip_grad_norm_` the clip coefficient is folded into their
  ``grad_scale`` instead of rewriting the gradients.
* ``update()`` is one native call on the device, and ``scale``, ``unscale_``,
  ``update`` and the amp-aware ``step`` never synchronize with the host: the
  whole step can be captured in a CUDA graph.
* Beyond torch: ``min_scale``, ``max_scale``, ``hysteresis``, a
  ``"predictive"`` mode, skipped-step counting, ``process_group`` for sharded
  or replicated data-parallel training.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import warnings
import weakref
from collections import abc, defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch.amp.grad_scaler import OptState

from . import _C, _native, ops
from .layers import is_sharded

__all__ = ["GradScaler", "OptState"]

_MODES = ("dynamic", "predictive")
_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Taken by torch's _amp_foreach_non_finite_check_and_unscale_ but not by our kernel.
_TORCH_KERNEL_DTYPES = (torch.float64,)
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _refresh_per_optimizer_state() -> Dict[str, Any]:
    # Exactly torch's keys: third-party code reads and writes this dict.
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class _DeviceGroup:
    """Parameters of one optimizer on one device, with what stays fixed between steps.

    A group is either native (float32/float16/bfloat16 plain tensors: one
    native plan collects the gradients' pointers in C++, skipping parameters
    without a gradient) or general (other dtypes, DTensors: gradients are
    collected one by one in Python). ``by_dtype`` marks a general group that is
    general only for its parameters' dtype: one that later holds a gradient of
    a native dtype (``model.float()`` after ``model.double()``) is replanned.
    """

    __slots__ = ("device", "index", "params", "names", "has_fp16", "native", "by_dtype")

    def __init__(self, device: torch.device, slots: List[tuple], names: List[str], native: bool,
                 by_dtype: bool = False):
        self.device = device
        self.index = -1 if device.type == "cpu" else (device.index if device.index is not None
                                                      else torch.cuda.current_device())
        self.params = [group_params[i] for group_params, i in slots]
        self.names = names  # "param_groups[g]['params'][i]", for errors
        self.has_fp16 = any(p.dtype == torch.float16 for p in self.params)
        self.by_dtype = by_dtype and not native
        # The native plan keeps each gradient's expected dtype, size and device
        # and re-checks them every step (a gradient matches its parameter, and
        # a parameter that changed makes the plan report itself stale).
        self.native = None
        if native:
            codes = [_native.torch_dtype_code(p.dtype) for p in self.params]
            self.native = _C.GradPlan(slots, list(self.params), [p.numel() for p in self.params],
                                      [p.dtype for p in self.params], codes, self.index)

    def stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.index >= 0 else 0


class _Plan:
    """An optimizer's parameters grouped by device, built once and reused while it holds."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = weakref.ref(optimizer)
        self.signature = _signature(optimizer)
        by_key: Dict[tuple, tuple] = {}
        for g, group in enumerate(optimizer.param_groups):
            params = group["params"]
            for i, param in enumerate(params):
                if not isinstance(param, torch.Tensor):
                    raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                # DTensor (FSDP2) gradients hold a local shard: the general path unwraps them.
                dtensor = is_sharded(param)
                native = param.dtype in _NATIVE_DTYPES and not dtensor
                slots, names = by_key.setdefault((param.device, native, dtensor), ([], []))
                slots.append((params, i))
                names.append(f"param_groups[{g}]['params'][{i}]")
        self.groups = [_DeviceGroup(device, slots, names, native, by_dtype=not dtensor)
                       for (device, native, dtensor), (slots, names) in by_key.items()]
        self.sharded = any(is_sharded(p) for g in self.groups for p in g.params)


class _GradStats:
    """What the last unscale (or check) pass of one optimizer measured, and when it is still true.

    ``stats`` is a list of (sumsq, amax) device tensors of the unscaled
    gradients. ``snapshot`` holds (param, grad, grad._version) per gradient
    when taken: the statistics describe the current gradients only while
    every parameter still has the same gradient tensor, not written since
    (torch bumps ``_version`` on every in-place write; our own kernels'
    writes happen before the snapshot). Writes through ``.data`` are not
    versioned by torch and cannot be seen.
    """

    __slots__ = ("optimizer", "stats", "snapshot")

    def __init__(self, optimizer, stats, snapshot=None):
        self.optimizer = weakref.ref(optimizer)
        self.stats = stats
        self.snapshot = snapshot

    def holds(self, optimizer) -> bool:
        if self.optimizer() is not optimizer or self.snapshot is None:
            return False
        return all(p.grad is g and (g is None or g._version == v) for p, g, v in self.snapshot)


def _grad_snapshot(plan: _Plan) -> list:
    out = []
    for group in plan.groups:
        for p in group.params:
            g = p.grad
            out.append((p, g, None if g is None else g._version))
    return out


_grad_scaler_kwarg: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _takes_grad_scaler(step) -> bool:
    """Whether optimizer.step accepts grad_scaler=, asked once per step function (inspect is slow)."""
    key = getattr(step, "__func__", step)
    try:
        known = _grad_scaler_kwarg.get(key)
    except TypeError:  # not weak-referenceable: ask every time
        return "grad_scaler" in inspect.signature(step).parameters
    if known is None:
        known = _grad_scaler_kwarg[key] = "grad_scaler" in inspect.signature(step).parameters
    return known


def _signature(optimizer):
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


def _local(grad):
    """The local shard of a DTensor gradient (FSDP2), else the gradient itself."""
    return grad.to_local() if is_sharded(grad) else grad


_TENSOR_INDEX = re.compile(r"\btensors\[(\d+)\]")


def _name_params(exc: Exception, names: List[str]) -> Exception:
    """The same error with the kernel's list positions ("tensors[3]") replaced by parameter names."""
    def name(m):
        i = int(m.group(1))
        return f"{names[i]}.grad" if i < len(names) else m.group(0)
    text = _TENSOR_INDEX.sub(name, str(exc))
    return type(exc)(text) if text != str(exc) else exc


def _unscale_with_torch(grads: List[torch.Tensor], found, inv, check_only: bool):
    """Dtypes our kernel does not take (float64): torch's own kernel, as torch's scaler; returns (sumsq, amax).

    torch's kernel always writes; the check-only pass runs it with inv_scale 1
    (values unchanged, as torch's _check_inf_per_device does).
    """
    one = torch.ones_like(inv)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one if check_only else inv)
    l2 = torch.stack(torch._foreach_norm(grads, 2))
    amax = torch.stack(torch._foreach_norm(grads, float("inf")))
    if check_only:  # statistics of the unscaled values, as the native pass gives
        l2, amax = l2 * inv.double(), amax * inv.double()
    return l2.square().float(), amax.float()


class GradScaler(torch.amp.GradScaler):
    """Drop-in ``torch.amp.GradScaler`` with native kernels; see the module docstring.

    torch's arguments come first, with the same meaning and defaults.

    Args:
        device: device type of the scale, "cuda" or "cpu".
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as torch.
            ``growth_interval`` may be any int (0, negative or beyond int32,
            e.g. ``sys.maxsize``: the scale never grows, as in torch).
            ``init_scale`` is clamped into [min_scale, max_scale].
        mode: "dynamic" (torch's rule, bitwise) or "predictive": after each clean
            step the scale becomes the largest power of two that keeps the
            recent unscaled gradients' amax times the scale ``2**margin`` under
            ``fmt_max`` (fp16's 65504); an overflow still backs off and skips.
        min_scale, max_scale: bounds of the scale (None: unbounded); finite
            float32 values, min_scale >= 0, max_scale > 0.
        hysteresis: overflows tolerated before backing off, counted since the
            last growth (Megatron-LM's rule); 1 (default) backs off at every
            overflow, as torch. Every overflowing step is skipped either way.
        margin, history: predictive mode's headroom exponent and the number of
            steps whose amax it remembers.
        fmt_max: predictive mode's largest representable value (finite,
            float32-representable, > 0).
        process_group: a torch.distributed group (not pickled: set it again
            after unpickling; DTensor gradients use the default group when
            none is given); ``found_inf`` is all-reduced
            over it (so every rank skips together), and with sharded gradients
            (FSDP2 DTensors, or ``sharded_grads=True``) so is the gradient norm.
        sharded_grads: each rank holds a different part of the gradients
            (ZeRO-style optimizers whose gradients are plain tensors).

    Every argument is checked here, so a bad value fails at construction, never
    at the first ``update()`` after the optimizer has stepped. As torch, the
    arguments of a disabled scaler are not checked.

    A NaN scale (``init_scale=nan``, ``update(new_scale=nan)``) stays NaN, as in
    torch: every step then sees NaN gradients and is skipped.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        mode: str = "dynamic",
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        hysteresis: int = 1,
        margin: int = 4,
        history: int = 16,
        fmt_max: float = 65504.0,
        process_group=None,
        sharded_grads: bool = False,
    ) -> None:
        # torch's __init__ is not called: it sets only the attributes set here
        # (every torch method that reads them is overridden), and its warning
        # would point into this file.
        self._device = device
        self._enabled = enabled
        if self._device == "cuda" and enabled and not torch.cuda.is_available():
            warnings.warn("adaptive_amp.GradScaler(device='cuda') is enabled, but torch sees no CUDA GPU: it is "
                          "disabled (scale() and step() pass through). Pass device='cpu' to scale on the CPU, or "
                          "enabled=False to silence this.", stacklevel=2)
            self._enabled = False
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        self._hysteresis = _arg_int("hysteresis", hysteresis, 1, _INT32_MAX,
                                    "1 backs off at every overflow, as torch")
        min32 = None if min_scale is None else _arg_float32("min_scale", min_scale, "None for no lower bound")
        max32 = None if max_scale is None else _arg_float32("max_scale", max_scale, "None for no upper bound")
        if min32 is not None and min32 < 0:
            raise ValueError(f"min_scale must be >= 0 (None for no lower bound), got {min_scale!r}")
        if max32 is not None and not max32 > 0:
            raise ValueError(f"max_scale must be > 0 as a float32 (None for no upper bound), got {max_scale!r}")
        if min32 is not None and max32 is not None and max32 < min32:
            raise ValueError(f"max_scale ({max_scale}) must be >= min_scale ({min_scale})")
        self._history = _arg_int("history", history, 1, _INT32_MAX, "the number of steps whose amax is kept")
        self._margin = _arg_int("margin", margin, _INT32_MIN, _INT32_MAX, "predictive mode's headroom exponent")
        fmt32 = _arg_float32("fmt_max", fmt_max, "65504.0 for float16")
        if not fmt32 > 0:
            raise ValueError(f"fmt_max must be > 0 as a float32 (65504.0 for float16), got {fmt_max!r}")
        self._mode = mode
        self._min_scale = float(min_scale or 0.0)
        self._max_scale = max_scale
        self._fmt_max = float(fmt_max)
        self._process_group = process_group
        self._sharded_grads = sharded_grads
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
            _check_growth_factor(growth_factor)
            _check_backoff_factor(backoff_factor)
            _check_growth_interval(growth_interval)
            self._init_scale = self._clamp(_check_init_scale(init_scale))
            self._scale: Optional[torch.Tensor] = None
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
            self._init_growth_tracker = 0
            self._growth_tracker: Optional[torch.Tensor] = None
            self._per_optimizer_states: Dict[int, Dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
            # Beyond torch, all on the scale's device: 1/scale, the counters of
            # scale_update.h, predictive mode's amax history, the last step's
            # found_inf and gradient statistics.
            self._init_counters = [self._hysteresis, 0, 0, 0]
            self._init_amax_history: Optional[List[float]] = None
            self._inv_scale: Optional[torch.Tensor] = None
            self._counters: Optional[torch.Tensor] = None
            self._amax_history: Optional[torch.Tensor] = None
            self._last_found_inf: Optional[torch.Tensor] = None
            self._last_stats: List = []
            self._reset_caches()

    def _reset_caches(self) -> None:
        """State that is never pickled: plans, the tensors 1/scale was computed from, per-step statistics."""
        # Plans hold the optimizer's parameters; keyed weakly so that a dead
        # optimizer's plan goes with it (and a new optimizer reusing its id
        # can never find it).
        self._plans: "weakref.WeakKeyDictionary[Any, _Plan]" = weakref.WeakKeyDictionary()
        self._inv_of = None  # (scale tensor, its _version) that _inv_scale is 1/of
        self._native_checked = None  # (scale, growth_tracker) last validated for the native update
        self._grad_stats: Dict[int, _GradStats] = {}  # reusable by a clip while they describe the gradients
        # Each optimizer's statistics for this step as measured before this
        # scaler clipped its gradients (the record above is dropped by a clip
        # that rewrites them): what update() keeps for last_grad_norm and
        # predictive mode's amax (a clipped amax would understate the headroom).
        self._step_stats: Dict[int, List[tuple]] = {}
        self._clipped: set = set()
        self._clip_coef: Dict[int, torch.Tensor] = {}
        self._snapshot_grads = False  # set once a clip found no provably fresh statistics
        self._step_taken: Optional[bool] = None

    def _clamp(self, scale):
        """scale clamped into [min_scale, max_scale]; NaN passes through (comparisons are false)."""
        if self._min_scale and scale < self._min_scale:
            return self._min_scale
        if self._max_scale is not None and scale > self._max_scale:
            return self._max_scale
        return scale

    # ------------------------------------------------------------------ state
    def _check_scale_growth_tracker(self, funcname: str):
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return self._scale, self._growth_tracker

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        if self._growth_tracker is not None:
            raise AssertionError("_growth_tracker initialized before _scale")
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full((), self._init_growth_tracker, dtype=torch.int32, device=dev)
        self._refresh_inv_scale()
        self._counters = torch.tensor(self._init_counters, dtype=torch.int32, device=dev)
        if self._mode == "predictive":
            hist = self._init_amax_history or [0.0] * self._history
            self._amax_history = torch.tensor(hist, dtype=torch.float32, device=dev)

    def _refresh_inv_scale(self):
        scale = self._scale
        _check_state_tensor("_scale", scale, torch.float32, self._growth_tracker)
        # FP32 division can be imprecise, so the reciprocal is taken in FP64, as torch does.
        self._inv_scale = scale.double().reciprocal().float()
        self._inv_of = (scale, scale._version)

    def _current_inv_scale(self) -> torch.Tensor:
        """1/scale, recomputed (on the device, no sync) when the scale tensor was replaced or written by torch.

        Our native update writes scale and inv_scale together (no version
        bump); anything else that changes the scale (``scaler._scale.fill_``,
        ``scaler._scale = t``) is seen through the tensor's identity or
        ``_version``.
        """
        scale = self._scale
        inv_of = self._inv_of
        if inv_of is None or inv_of[0] is not scale or inv_of[1] != scale._version or self._inv_scale is None:
            self._refresh_inv_scale()
        return self._inv_scale

    # ------------------------------------------------------------------ scale
    def scale(self, outputs):
        """Multiply a tensor or (nested) lists/tuples of tensors by the scale factor."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(outputs.device)
            return outputs * self._scale.to(device=outputs.device, non_blocking=True)

        per_device: Dict[torch.device, torch.Tensor] = {}

        def scale_on(device):
            if device not in per_device:
                if self._scale is None:
                    self._lazy_init_scale_growth_tracker(device)
                per_device[device] = self._scale.to(device=device, non_blocking=True, copy=True)
            return per_device[device]

        def apply_scale(val):
            if isinstance(val, torch.Tensor):
                return val * scale_on(val.device)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # ---------------------------------------------------------------- unscale
    def _plan(self, optimizer) -> _Plan:
        try:
            plan = self._plans.get(optimizer)
        except TypeError:  # an optimizer class that is unhashable: no caching
            return _Plan(optimizer)
        if plan is None or plan.optimizer() is not optimizer or plan.signature != _signature(optimizer):
            plan = self._plans[optimizer] = _Plan(optimizer)
        return plan

    def _drop_plan(self, optimizer) -> None:
        try:
            self._plans.pop(optimizer, None)
        except TypeError:
            pass

    def _unscale_grads_(self, optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        """torch's hook, with torch's signature and result: unscale in place, return {device: found_inf}.

        Each device's found_inf starts as a copy of ``found_inf`` (set to 1 where
        a gradient holds NaN/inf). Subclasses may override it as they would
        torch's; ``unscale_`` and the check before a fused step then go
        through the override.
        """
        return self._unscale_and_measure(optimizer, inv_scale, allow_fp16, check_only=False, found_inf=found_inf)[0]

    def _uses_torch_hook(self) -> bool:
        return type(self)._unscale_grads_ is not GradScaler._unscale_grads_

    def _unscale_and_measure(self, optimizer, inv_scale: torch.Tensor, allow_fp16: bool, check_only: bool,
                             found_inf: Optional[torch.Tensor] = None, agree: bool = True):
        """One native pass per device group: unscale (or only check) and take statistics.

        Parameters without a gradient are skipped on either path. Groups that
        need the general path (sparse or non-contiguous gradients; float64
        ones; fp16 ones where torch refuses them) are
        collected, and refused, before any group is written. Returns
        ({device: found_inf}, [(sumsq, amax), ...]); with ``agree`` the found_infs
        are all-reduced over the process group (a re-measurement whose
        found_inf is not used runs no collective).
        """
        found_per_device: Dict[torch.device, torch.Tensor] = {}
        stats: List[tuple] = []
        with torch.no_grad():
            for _ in range(2):  # a stale plan is rebuilt once; nothing is written before all groups are read
                plan = self._plan(optimizer)
                groups = plan.groups
                general = {id(g): self._collect_slow(g, allow_fp16) for g in groups
                           if g.native is None or (g.has_fp16 and not allow_fp16)}
                outcomes = {id(g): g.native.collect() for g in groups if id(g) not in general}
                # float64 parameters turned native (model.float()): the dtype check rides on the
                # general path's own gradients, so native groups pay nothing for it.
                retyped = any(g.by_dtype and any(grad.dtype in _NATIVE_DTYPES for grad, _ in general[id(g)])
                              for g in groups if g.native is None)
                if not retyped and _C.PLAN_STALE not in outcomes.values():
                    break
                self._drop_plan(optimizer)
            for group in groups:  # (a plan still stale after its rebuild takes the general path too)
                if outcomes.get(id(group), _C.PLAN_DONE) != _C.PLAN_DONE:
                    general[id(group)] = self._collect_slow(group, allow_fp16)
            for group in groups:
                device = group.device
                grads = general.get(id(group))
                if not (grads if grads is not None else group.native.collected_count):
                    continue  # no gradient on this device: torch records no found_inf for it either
                found = found_per_device.get(device)
                if found is None:
                    found = (torch.zeros((), dtype=torch.float32, device=device) if found_inf is None
                             else found_inf.to(device, non_blocking=True, copy=True))
                    found_per_device[device] = found
                inv = inv_scale.to(device, non_blocking=True)
                if grads is None:
                    try:
                        stats.append(self._launch_plan(group, found, inv, check_only))
                    except (ValueError, TypeError, RuntimeError) as exc:
                        raise _name_params(exc, [group.names[i] for i in group.native.collected]) from None
                else:
                    stats.extend(self._launch_general(grads, found, inv, check_only))
        group = self._group(sharded=plan.sharded) if agree else None
        if group is not None:
            for found in found_per_device.values():
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
        return found_per_device, stats

    @staticmethod
    def _collect_slow(group: _DeviceGroup, allow_fp16: bool) -> List[tuple]:
        """(gradient, parameter name) one by one, as torch does: None skipped, sparse ones by their values."""
        grads = []
        for param, name in zip(group.params, group.names):
            grad = param.grad
            if grad is None:
                continue
            if (not allow_fp16) and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            if grad.dtype not in _NATIVE_DTYPES and grad.dtype not in _TORCH_KERNEL_DTYPES:
                raise TypeError(f"{name}.grad has dtype {grad.dtype}; GradScaler unscales float32, float16, "
                                f"bfloat16 and float64 gradients (torch's scaler takes no other either)")
            if grad.is_sparse:
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            grad = _local(grad)
            if grad.device != group.device:
                raise ValueError(f"{name}.grad is on {grad.device} but the parameter is on {group.device}; "
                                 f"move the gradient to its parameter's device")
            grads.append((grad, name))
        return grads

    @staticmethod
    def _launch_plan(group: _DeviceGroup, found, inv, check_only):
        """The fast path: one native pass over the pointers the plan collected (statistics for those only)."""
        n, device = group.native.collected_count, group.device
        sumsq = torch.empty(n, dtype=torch.float32, device=device)
        amax = torch.empty(n, dtype=torch.float32, device=device)
        ws_bytes = group.native.workspace_bytes
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes else None
        group.native.launch(found.data_ptr(), inv.data_ptr(), check_only, sumsq.data_ptr(), amax.data_ptr(),
                            workspace.data_ptr() if workspace is not None else 0, ws_bytes, group.stream(),
                            (found, inv))
        return sumsq, amax

    @staticmethod
    def _launch_general(grads, found, inv, check_only) -> List[tuple]:
        """Full validation through ops (non-contiguous gradients through a contiguous copy); float64 through torch."""
        stats = []
        ours = [(g, n) for g, n in grads if g.dtype in _NATIVE_DTYPES]
        theirs = [g for g, _ in grads if g.dtype not in _NATIVE_DTYPES]
        if ours:
            dense = [g if g.is_contiguous() else g.contiguous() for g, _ in ours]
            try:
                stats.append(ops.unscale_and_check_(dense, found, inv, check_only=check_only, return_stats=True))
            except (ValueError, TypeError) as exc:
                raise _name_params(exc, [n for _, n in ours]) from None
            if not check_only:
                for (g, _), d in zip(ours, dense):
                    if d is not g:
                        g.copy_(d)
        if theirs:
            stats.append(_unscale_with_torch(theirs, found, inv, check_only))
        return stats

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place (no host sync).

        Also takes each gradient's sum of squares and amax in the same pass, for
        :meth:`clip_grad_norm_` and :attr:`last_grad_norm`.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        inv_scale = self._current_inv_scale()
        if self._uses_torch_hook():
            found = torch.full((), 0.0, dtype=torch.float32, device=self._scale.device)
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, inv_scale, found, False)
            self._grad_stats.pop(id(optimizer), None)
            self._step_stats.pop(id(optimizer), None)
        else:
            state["found_inf_per_device"], stats = self._unscale_and_measure(
                optimizer, inv_scale, allow_fp16=False, check_only=False)
            snapshot = _grad_snapshot(self._plan(optimizer)) if self._snapshot_grads else None
            self._grad_stats[id(optimizer)] = _GradStats(optimizer, stats, snapshot)
            self._step_stats[id(optimizer)] = stats
        coef = self._clip_coef.pop(id(optimizer), None)
        if coef is not None:  # a clip folded for a fused step: the gradients unscaled here take it instead
            self._mul_grads(optimizer, coef)
            self._grad_stats.pop(id(optimizer), None)  # they changed: a later clip measures again
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer):
        """Read-only pass for optimizers that unscale in their own step."""
        _scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        state = self._per_optimizer_states[id(optimizer)]
        if self._uses_torch_hook():  # torch's way: the hook with inv_scale 1
            dummy_inv_scale = torch.full((), 1.0, dtype=torch.float32, device=_scale.device)
            found = torch.full((), 0.0, dtype=torch.float32, device=_scale.device)
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, dummy_inv_scale, found, True)
            self._grad_stats.pop(id(optimizer), None)
            self._step_stats.pop(id(optimizer), None)
            return state["found_inf_per_device"]
        # The real inv_scale (not torch's 1.0): nothing is written, and the
        # statistics come out unscaled.
        state["found_inf_per_device"], stats = self._unscale_and_measure(
            optimizer, self._current_inv_scale(), allow_fp16=True, check_only=True)
        self._grad_stats[id(optimizer)] = _GradStats(optimizer, stats)
        self._step_stats[id(optimizer)] = stats
        return state["found_inf_per_device"]

    def _found_inf_per_device(self, optimizer):
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    # ------------------------------------------------------------------- clip
    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the optimizer's gradients to ``max_norm``; return the total norm as a device tensor.

        Replaces ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, max_norm)``:
        the norm comes from the unscale pass (no second read of the gradients)
        when that pass ran in this call, or when the gradients provably did
        not change since (same tensors, same ``_version``: edits through
        ``.data`` are invisible to torch's version counters); otherwise it is
        measured again, so the result is always the norm of the current
        gradients, as torch's. For optimizers that unscale in their own step
        (``fused=True``) the clip coefficient is folded into the
        ``grad_scale`` they receive, so the gradients are not rewritten at all
        (a second call multiplies the coefficients; an ``unscale_`` before the
        step applies the coefficient to the gradients it unscales, as torch's
        recipe leaves them clipped). Norm types 2 and inf use
        the statistics; others fall back to torch's clip on the unscaled
        gradients. The norm is accumulated per chunk and in fp64 across
        chunks, so it can differ from torch's in the last bits.
        """
        if not self._enabled:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        key = id(optimizer)
        state = self._per_optimizer_states[key]
        supports_scaling = getattr(optimizer, "_step_supports_amp_scaling", False)
        fresh = False
        if state["stage"] is OptState.READY:
            if supports_scaling:
                self._check_inf_per_device(optimizer)
                state["stage"] = OptState.READY  # still to be unscaled, by the optimizer itself
            else:
                self.unscale_(optimizer)
            fresh = True
        elif state["stage"] is OptState.STEPPED:
            raise RuntimeError("clip_grad_norm_() is being called after step().")
        if any(p.grad is not None and p.grad.is_sparse for g in optimizer.param_groups for p in g["params"]):
            raise NotImplementedError("clip_grad_norm_ does not support sparse gradients "
                                      "(nor does torch.nn.utils.clip_grad_norm_)")
        folded = supports_scaling and state["stage"] is OptState.READY
        pending = self._clip_coef.get(key) if folded else None
        norm_type = float(norm_type)
        if norm_type not in (2.0, float("inf")):
            if state["stage"] is not OptState.UNSCALED:
                self.unscale_(optimizer)  # (which applies a coefficient folded by an earlier call first)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._grad_stats.pop(key, None)
            self._clipped.add(key)
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        record = self._grad_stats.get(key)
        if record is not None and (fresh or record.holds(optimizer)):
            stats = record.stats
        else:
            stats = self._measure_again(optimizer, unscaled=not folded)
            self._snapshot_grads = True  # next steps: snapshot at unscale_, so the pass can be reused
        total = self._total_norm(stats, norm_type)
        if pending is not None:
            total = total * pending
        if error_if_nonfinite and not torch.isfinite(total):  # syncs, as torch's does
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
                               "clipped. To disable this error and scale the gradients by the non-finite norm "
                               "anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clipped.add(key)
        if folded:
            self._clip_coef[key] = coef if pending is None else pending * coef  # folded into grad_scale by step()
        else:
            self._mul_grads(optimizer, coef)
            self._grad_stats.pop(key, None)  # the gradients changed: a later clip measures again
        return total

    def _mul_grads(self, optimizer, coef: torch.Tensor) -> None:
        with torch.no_grad():
            for group in self._plan(optimizer).groups:
                grads = [_local(p.grad) for p in group.params if p.grad is not None and not p.grad.is_sparse]
                if grads:
                    torch._foreach_mul_(grads, coef.to(group.device))

    def _measure_again(self, optimizer, unscaled: bool) -> List[tuple]:
        """Statistics of the current gradients (a read-only pass); records them for this step."""
        inv = torch.ones_like(self._scale) if unscaled else self._current_inv_scale()
        _, stats = self._unscale_and_measure(optimizer, inv, allow_fp16=True, check_only=True, agree=False)
        key = id(optimizer)
        self._grad_stats[key] = _GradStats(optimizer, stats)
        if key not in self._clipped:  # the gradients changed after unscale_, not by a clip: the step's own
            self._step_stats[key] = stats
        return stats

    def _total_norm(self, stats, norm_type):
        device = self._scale.device
        if norm_type == 2.0:
            parts = [sumsq.sum(dtype=torch.float32).to(device) for sumsq, _ in stats]
            total = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
            if self._reduce_norm():
                torch.distributed.all_reduce(total, group=self._group(sharded=True))
            return total.sqrt()
        parts = [amax.max().to(device) for _, amax in stats if amax.numel()]
        total = torch.stack(parts).max() if parts else torch.zeros((), device=device)
        if self._reduce_norm():
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=self._group(sharded=True))
        return total

    def _reduce_norm(self) -> bool:
        sharded = self._sharded_grads or any(plan.sharded for plan in self._plans.values())
        return sharded and self._group(sharded=True) is not None

    def _group(self, sharded: bool):
        """The group to agree over: the one given, else, for DTensor (FSDP2) gradients, the default group.

        Sharded gradients give each rank only part of the overflow picture, so
        ranks must all-reduce found_inf to skip together even when the user
        named no group (torch's ShardedGradScaler does the same).
        """
        if self._process_group is not None:
            return self._process_group
        dist = torch.distributed
        if sharded and dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    # ------------------------------------------------------------------- step
    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: Dict[str, Any],
                        *args: Any, **kwargs: Any):
        """torch's hook: ``optimizer.step()`` unless a found_inf is nonzero (the one host sync of a step)."""
        retval = None
        stepped = not sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        if stepped:
            retval = optimizer.step(*args, **kwargs)
        self._step_taken = stepped
        return retval

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """Unscale (unless done), then ``optimizer.step()`` unless a gradient was NaN/inf.

        Returns what ``optimizer.step`` returned when it returned something;
        otherwise whether the optimizer stepped: a Python bool when that was
        decided on the host, a 0-dim bool tensor on the device (no sync) for
        optimizers that skip by themselves (``fused=True``).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            kwargs_ = kwargs
            has_grad_scaler_kwarg = _takes_grad_scaler(optimizer.step)
            if has_grad_scaler_kwarg:
                warnings.warn(
                    "GradScaler is going to stop passing itself as a keyword argument to the passed "
                    "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                    "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                    FutureWarning, stacklevel=2)
                kwargs_.update({"grad_scaler": self})
                found_inf = None
            else:
                if not state["found_inf_per_device"]:
                    self._check_inf_per_device(optimizer)
                scale = self._scale
                found_infs = state["found_inf_per_device"].values()
                # No gradient this step (the other optimizer of a GAN's step): nothing to skip, and the step
                # is a no-op, as torch's (whose sum over no found_inf is 0).
                found_inf = (self._combine(found_infs, scale.device) if found_infs
                             else torch.zeros((), dtype=torch.float32, device=scale.device))
                coef = self._clip_coef.pop(id(optimizer), None)
                if state["stage"] == OptState.UNSCALED:
                    optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
                else:
                    grad_scale = scale * getattr(optimizer, "grad_scale", 1)
                    optimizer.grad_scale = grad_scale if coef is None else grad_scale / coef
                optimizer.found_inf = found_inf
            retval = optimizer.step(*args, **kwargs_)
            state["stage"] = OptState.STEPPED
            if not has_grad_scaler_kwarg:
                del optimizer.grad_scale
                del optimizer.found_inf
            if retval is None and found_inf is not None:
                return found_inf == 0
            return retval

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if len(state["found_inf_per_device"]) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        self._step_taken = None
        retval = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        stepped, self._step_taken = self._step_taken, None
        # (an overriding _maybe_opt_step that does not report: torch's return value)
        return stepped if retval is None and stepped is not None else retval

    @staticmethod
    def _combine(found_infs, device) -> torch.Tensor:
        found = [f.to(device, non_blocking=True) for f in found_infs]
        return found[0] if len(found) == 1 else torch.stack(found).sum()

    # ----------------------------------------------------------------- update
    def update(self, new_scale=None) -> None:
        """Update the scale: back off after NaN/inf, grow after ``growth_interval`` clean steps.

        One native call on the device (no host sync). ``new_scale`` (a float or
        a 1-element tensor) sets the scale instead, as in torch (not clamped to
        min_scale/max_scale; a NaN stays NaN).
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, float):
                self._scale.fill_(new_scale)
            else:
                reason = ("new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                          "torch.FloatTensor with requires_grad=False.")
                if new_scale.device.type != self._device:
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
                self._scale.copy_(new_scale)
            self._refresh_inv_scale()
        else:
            states = self._per_optimizer_states.values()
            found_infs = [f for s in states for f in s["found_inf_per_device"].values()]
            if len(found_infs) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            found = self._combine(found_infs, _scale.device)
            stats = [st for per_opt in self._step_stats.values() for st in per_opt]
            step_amax = None
            if self._mode == "predictive":
                amaxes = [amax.max().to(_scale.device) for _, amax in stats if amax.numel()]
                step_amax = torch.stack(amaxes).max() if amaxes else torch.zeros((), device=_scale.device)
            self._current_inv_scale()  # a scale changed by hand since: inv_scale follows it
            self._native_update(found, step_amax)
            self._last_found_inf = found
            self._last_stats = stats
        self._abandon_step()

    def _abandon_step(self) -> None:
        """Forget this iteration's per-optimizer states and statistics, as update() does at its end (what a
        caller whose step failed part-way uses to start the next one afresh)."""
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._grad_stats = {}
        self._step_stats = {}
        self._clipped = set()
        self._clip_coef = {}

    def _native_update(self, found: torch.Tensor, step_amax: Optional[torch.Tensor]):
        self._check_native_state()
        device = self._scale.device
        index = -1 if device.type == "cpu" else device.index
        stream = torch.cuda.current_stream(device).cuda_stream if index >= 0 else 0
        hist = self._amax_history
        _C.update_scale(self._scale.data_ptr(), self._growth_tracker.data_ptr(), found.data_ptr(),
                        self._counters.data_ptr(), float(self._growth_factor), float(self._backoff_factor),
                        _native_growth_interval(self._growth_interval), self._hysteresis, self._min_scale,
                        float(self._max_scale or 0.0), hist is not None,
                        step_amax.data_ptr() if step_amax is not None else 0,
                        hist.data_ptr() if hist is not None else 0, hist.numel() if hist is not None else 0,
                        self._margin, self._fmt_max, self._inv_scale.data_ptr(), index, stream,
                        (self._scale, self._growth_tracker, found, self._counters, step_amax, hist,
                         self._inv_scale))

    def _check_native_state(self) -> None:
        """The native update writes through raw pointers: tensors replaced by hand must still fit."""
        pair = (self._scale, self._growth_tracker)
        checked = self._native_checked
        if checked is not None and checked[0] is pair[0] and checked[1] is pair[1]:
            return
        _check_state_tensor("_scale", self._scale, torch.float32, self._growth_tracker)
        _check_state_tensor("_growth_tracker", self._growth_tracker, torch.int32, self._scale)
        self._native_checked = pair

    # ------------------------------------------------------- observability
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def found_inf(self) -> Optional[torch.Tensor]:
        """The last updated step's combined found_inf (device tensor; nonzero: skipped)."""
        return self._last_found_inf

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for NaN/inf since this scaler started (one device read)."""
        if not self._enabled:
            return 0
        if self._counters is None:
            return self._init_counters[1]
        return int(self._counters[1].item())

    @property
    def skipped_steps_tensor(self) -> Optional[torch.Tensor]:
        """The skipped-step count as a device tensor (no sync)."""
        return None if self._counters is None else self._counters[1]

    @property
    def last_grad_norm(self) -> Optional[torch.Tensor]:
        """The L2 norm of the unscaled gradients of the last updated step, as a device tensor (no sync).

        Taken from the unscale pass (or, when the gradients were changed after
        it, from the clip's re-measurement), before this scaler clipped; None
        before the first update and when a ``_unscale_grads_`` override did
        the unscaling (it takes no statistics). With sharded gradients it is this rank's part (no collective
        runs here); ``clip_grad_norm_`` returns the global norm.
        """
        if not self._last_stats:
            return None
        device = self._scale.device
        parts = [sumsq.sum(dtype=torch.float32).to(device) for sumsq, _ in self._last_stats]
        return torch.stack(parts).sum().sqrt()

    # -------------------------------------------------------------- getters
    def _get_scale_async(self) -> Optional[torch.Tensor]:
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); syncs."""
        if self._enabled:
            return self._init_scale if (scale := self._get_scale_async()) is None else float(scale.item())
        return 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        _check_growth_factor(new_factor)  # here, not at the next update()
        self._growth_factor = new_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_backoff_factor(new_factor)
        self._backoff_factor = new_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        _check_growth_interval(new_interval)
        self._growth_interval = new_interval

    def _get_growth_tracker(self) -> int:
        if self._enabled:
            return self._init_growth_tracker if self._growth_tracker is None else int(self._growth_tracker.item())
        return 0

    def is_enabled(self) -> bool:
        return self._enabled

    # ----------------------------------------------------------- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """torch's five entries (a torch GradScaler loads it), plus ours under "adaptive_amp".

        Every value is a fresh Python object: editing the returned dict never
        changes the scaler.
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "adaptive_amp": self._extra_state(),
        }

    def _extra_state(self) -> Dict[str, Any]:
        # Copies, never the scaler's own lists (a caller may edit the state dict).
        counters = list(self._init_counters) if self._counters is None else [int(v) for v in self._counters.tolist()]
        if self._amax_history is not None:
            hist = self._amax_history.tolist()
        else:
            hist = None if self._init_amax_history is None else list(self._init_amax_history)
        return {"mode": self._mode, "hysteresis": self._hysteresis, "min_scale": self._min_scale,
                "max_scale": self._max_scale, "margin": self._margin, "counters": counters,
                "amax_history": hist}

    _TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    _EXTRA_KEYS = ("mode", "hysteresis", "min_scale", "max_scale", "margin", "counters", "amax_history")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state saved by this class or by torch.amp.GradScaler; all or nothing.

        Everything is validated before anything is written, so a rejected
        state dict leaves the scaler exactly as it was. Errors name the key and
        what it must hold: ``RuntimeError`` for an empty dict (torch's message),
        ``KeyError`` for a missing key, ``TypeError`` for a value of the wrong
        type, ``ValueError`` for one out of range or inconsistent. The first two
        are ValueErrors too, so ``except ValueError`` catches every refusal.

        * torch's five keys are required: ``scale`` a number finite and > 0 in
          float32, ``growth_factor`` finite and > 1, ``backoff_factor`` in
          (0, 1), ``growth_interval`` any int (as torch: 0, negative or beyond
          int32 means the scale never grows), ``_growth_tracker`` an int in
          [0, 2**31 - 1]. They are applied, as by torch (they override the
          constructor's values); the scale is clamped into [min_scale,
          max_scale].
        * ``"adaptive_amp"`` is optional (a torch checkpoint has none: then the
          counters and amax history are left as they are). When present it must
          be a dict with all of its seven keys. ``mode`` must equal this
          scaler's mode: a mismatch is a ``ValueError`` (the counters and the
          amax history mean different things in the two modes; construct the
          scaler with the saved mode, or drop ``state_dict["adaptive_amp"]`` to
          load only torch's fields). ``hysteresis`` (int >= 1), ``min_scale``
          (a number, not NaN), ``max_scale`` (None or a number > 0 and
          >= min_scale), ``margin`` (int) are checked but not applied: those
          settings stay the constructor's. ``counters`` is 4 ints:
          hysteresis_left <= the saved hysteresis (loaded capped at this
          scaler's hysteresis), skipped >= 0, history position in
          [0, len(amax_history)) (0 without a history), extra margin >= 0 (0
          in mode "dynamic"). ``amax_history`` is None in mode "dynamic"; in
          mode "predictive" None (a fresh scaler: loads as all zeros) or a
          non-empty list of numbers finite and >= 0 in float32; a list of
          another length than this scaler's ``history`` loads as its largest
          value in every slot, with the position reset to 0.
        * Unknown keys, at the top level or under ``"adaptive_amp"``, are
          ignored, as torch ignores keys it does not read (so a checkpoint
          from a later version still loads).
        """

        if not self._enabled:
            return
        if not isinstance(state_dict, abc.Mapping):
            raise StateTypeError(f"GradScaler.load_state_dict expects a dict (from GradScaler.state_dict()), "
                            f"got {_ck_describe(state_dict)}")
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        missing = [k for k in self._TORCH_KEYS if k not in state_dict]
        if missing:
            raise StateKeyError(f"GradScaler state_dict lacks {missing} (it needs all of {list(self._TORCH_KEYS)}); "
                           f"it does not come from GradScaler.state_dict()")

        # ---- validate everything (nothing is written before this block ends)
        scale = _ck_real("state_dict['scale']", state_dict["scale"])
        scale32 = float(torch.tensor(scale, dtype=torch.float32))
        if not (math.isfinite(scale32) and scale32 > 0.0):
            raise ValueError(f"state_dict['scale'] must be finite and > 0 as a float32, got {scale!r}")
        growth_factor = _ck_real("state_dict['growth_factor']", state_dict["growth_factor"])
        if not (math.isfinite(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"state_dict['growth_factor'] must be finite and > 1.0, got {growth_factor!r}")
        backoff_factor = _ck_real("state_dict['backoff_factor']", state_dict["backoff_factor"])
        if not (0.0 < backoff_factor < 1.0):
            raise ValueError(f"state_dict['backoff_factor'] must be in (0, 1), got {backoff_factor!r}")
        growth_interval = _ck_int("state_dict['growth_interval']", state_dict["growth_interval"], None, None)
        growth_tracker = _ck_int("state_dict['_growth_tracker']", state_dict["_growth_tracker"], 0, _INT32_MAX)

        new_counters: Optional[List[int]] = None
        new_hist: Optional[List[float]] = None
        if "adaptive_amp" in state_dict:
            new_counters, new_hist = self._check_extra_state(state_dict["adaptive_amp"])
        counters_src = None if new_counters is None else torch.tensor(new_counters, dtype=torch.int32)
        hist_src = None if new_hist is None else torch.tensor(new_hist, dtype=torch.float32)

        # ---- apply (plain assignments and in-place copies that cannot fail on valid values)
        scale = self._clamp(scale)
        self._init_scale = scale
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._init_growth_tracker = growth_tracker
        if self._scale is not None:
            self._scale.fill_(scale)
            self._refresh_inv_scale()
        if self._growth_tracker is not None:
            self._growth_tracker.fill_(growth_tracker)
        if counters_src is not None:
            self._init_counters = new_counters
            if self._counters is not None:
                self._counters.copy_(counters_src)
        if hist_src is not None:
            self._init_amax_history = hist_src.tolist()
            if self._amax_history is not None:
                self._amax_history.copy_(hist_src)

    def _check_extra_state(self, extra) -> tuple:
        """Validate state_dict["adaptive_amp"]; return the (counters, amax_history) to load (history None: dynamic)."""

        where = "state_dict['adaptive_amp']"
        if not isinstance(extra, abc.Mapping):
            raise StateTypeError(f"{where} must be a dict (as written by adaptive_amp.GradScaler.state_dict()), "
                            f"got {_ck_describe(extra)}")
        missing = [k for k in self._EXTRA_KEYS if k not in extra]
        if missing:
            raise StateKeyError(f"{where} lacks {missing} (it needs all of {list(self._EXTRA_KEYS)}); drop "
                           f"state_dict['adaptive_amp'] to load only torch's fields")
        mode = extra["mode"]
        if not isinstance(mode, str):
            raise StateTypeError(f"{where}['mode'] must be a str, one of {_MODES}, got {_ck_describe(mode)}")
        if mode not in _MODES:
            raise ValueError(f"{where}['mode'] must be one of {_MODES}, got {mode!r}")
        if mode != self._mode:
            raise ValueError(f"{where}['mode'] is {mode!r} but this scaler's mode is {self._mode!r}: the saved "
                             f"counters and amax history do not carry over between modes; construct the "
                             f"GradScaler with mode={mode!r}, or drop state_dict['adaptive_amp'] to load only "
                             f"torch's fields")
        hysteresis = _ck_int(f"{where}['hysteresis']", extra["hysteresis"], 1, _INT32_MAX)
        min_scale = _ck_real(f"{where}['min_scale']", extra["min_scale"])
        if math.isnan(min_scale):
            raise ValueError(f"{where}['min_scale'] must be a number, got nan")
        max_scale = extra["max_scale"]
        if max_scale is not None:
            max_scale = _ck_real(f"{where}['max_scale']", max_scale, none_ok=True)
            if not (max_scale > 0 and max_scale >= min_scale):
                raise ValueError(f"{where}['max_scale'] must be None or > 0 and >= min_scale "
                                 f"({min_scale!r}), got {max_scale!r}")
        _ck_int(f"{where}['margin']", extra["margin"], _INT32_MIN, _INT32_MAX)

        hist = extra["amax_history"]
        if mode == "dynamic":
            if hist is not None:
                raise ValueError(f"{where}['amax_history'] must be None in mode 'dynamic', got "
                                 f"{_ck_describe(hist)}")
        elif hist is not None:
            if not isinstance(hist, (list, tuple)):
                raise StateTypeError(f"{where}['amax_history'] must be None or a list of floats, got "
                                f"{_ck_describe(hist)}")
            if len(hist) == 0:
                raise ValueError(f"{where}['amax_history'] must be None or a non-empty list, got []")
            hist = [_ck_real(f"{where}['amax_history'][{i}]", v) for i, v in enumerate(hist)]
            for i, v in enumerate(hist):
                v32 = float(torch.tensor(v, dtype=torch.float32))
                if not (math.isfinite(v32) and v32 >= 0.0):
                    raise ValueError(f"{where}['amax_history'][{i}] must be finite and >= 0 as a float32, "
                                     f"got {v!r}")

        counters = extra["counters"]
        if not isinstance(counters, (list, tuple)):
            raise StateTypeError(f"{where}['counters'] must be a list of 4 ints [hysteresis_left, skipped, "
                            f"history_position, extra_margin], got {_ck_describe(counters)}")
        if len(counters) != 4:
            raise ValueError(f"{where}['counters'] must have 4 entries [hysteresis_left, skipped, "
                             f"history_position, extra_margin], got {len(counters)}: {_ck_describe(counters)}")
        npos = len(hist) if hist is not None else 1
        ranges = (("hysteresis_left", _INT32_MIN, hysteresis),
                  ("skipped", 0, _INT32_MAX),
                  ("history_position", 0, npos - 1),
                  ("extra_margin", 0, _INT32_MAX if mode == "predictive" else 0))
        counters = [_ck_int(f"{where}['counters'][{i}] ({name})", v, lo, hi)
                    for i, (v, (name, lo, hi)) in enumerate(zip(counters, ranges))]

        # What to load. More overflows left than this scaler tolerates per growth period: cap.
        counters[0] = min(counters[0], self._hysteresis)
        new_hist = None
        if mode == "predictive":
            if hist is None:  # saved before its first update: an empty (all-zero) history
                new_hist = [0.0] * self._history
            elif len(hist) != self._history:
                # Another history length: keep its largest amax in every slot (conservative).
                new_hist = [max(hist)] * self._history
                counters[2] = 0
            else:
                new_hist = hist
        return counters, new_hist

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError("A GradScaler instance may only be pickled at the beginning "
                                     "of an iteration, or at the end after scaler.update().")
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            extra = self._extra_state()
            state["_init_counters"] = extra["counters"]
            state["_init_amax_history"] = extra["amax_history"]
            for key in ("_scale", "_growth_tracker", "_inv_scale", "_counters", "_amax_history",
                        "_last_found_inf"):
                state[key] = None
            state["_last_stats"] = []
            for key in ("_plans", "_inv_of", "_native_checked", "_grad_stats", "_step_stats", "_clipped",
                        "_clip_coef", "_step_taken"):
                state.pop(key, None)  # rebuilt by __setstate__ (the plans hold a WeakKeyDictionary)
            state["_process_group"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._enabled:
            self._reset_caches()


# ------------------------------------------------------------ checkpoint helpers
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class StateTypeError(TypeError, ValueError):
    """A state_dict entry of the wrong type: a TypeError as before, and a ValueError as every other refused
    value, so that ``except ValueError`` catches every refused checkpoint."""


class StateKeyError(KeyError, ValueError):
    """A state_dict that lacks an entry: a KeyError, as torch's, and a ValueError (see StateTypeError)."""

    def __str__(self) -> str:  # the message itself, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


def _ck_describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _ck_real(where: str, value, none_ok: bool = False) -> float:
    """A real number (int or float, not bool) as a float, else TypeError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StateTypeError(f"{where} must be a float{' or None' if none_ok else ''}, got {_ck_describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{where} must be a finite float, got {_ck_describe(value)}") from None


def _ck_int(where: str, value, lo: Optional[int], hi: Optional[int]) -> int:
    """An int (not bool) in [lo, hi] (None: unbounded), else TypeError/ValueError naming `where`."""
    span = "an int" if lo is None else f"an int in [{lo}, {hi}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise StateTypeError(f"{where} must be {span}, got {_ck_describe(value)}")
    value = int(value)
    if lo is not None and not lo <= value <= hi:
        raise ValueError(f"{where} must be {span}, got {value}")
    return value


# ------------------------------------------------------------ constructor and setter checks
def _arg_int(name: str, value, lo: int, hi: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int ({hint}), got {_ck_describe(value)}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}] ({hint}), got {value}")
    return int(value)


def _arg_float32(name: str, value, hint: str) -> float:
    """A real number finite as a float32 (the scale's dtype), as a float32 value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float ({hint}), got {_ck_describe(value)}")
    v = float(value)
    if not (math.isfinite(v) and abs(v) <= _FLOAT32_MAX):
        raise ValueError(f"{name} must be a finite float32 value ({hint}), got {value!r}")
    return float(torch.tensor(v, dtype=torch.float32))


def _check_growth_factor(value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"growth_factor must be a float > 1.0, got {_ck_describe(value)}")
    if not value > 1.0:  # NaN included (torch would accept it and never grow)
        raise ValueError(f"growth_factor must be > 1.0, got {value!r}")


def _check_backoff_factor(value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"backoff_factor must be a float in (0, 1), got {_ck_describe(value)}")
    if not 0.0 < value < 1.0:  # 0 or less would zero or negate the scale
        raise ValueError(f"backoff_factor must be in (0, 1), got {value!r}")


def _check_growth_interval(value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"growth_interval must be an int (0, a negative value or sys.maxsize: never grow), "
                        f"got {_ck_describe(value)}")


def _check_init_scale(value):
    """A real number (or a 1-element tensor, as torch.full takes); NaN and inf are kept, as torch."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"init_scale must be a float or a 1-element tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"init_scale must be a float, got {_ck_describe(value)}")
    return value


def _native_growth_interval(value: int) -> int:
    """growth_interval for the native int32 argument: out of int32's range it can never equal the
    (int32) count of clean steps, as in torch; 0 says the same natively."""
    value = int(value)
    return value if _INT32_MIN <= value <= _INT32_MAX else 0


def _check_state_tensor(name: str, t, dtype: torch.dtype, other) -> None:
    """scaler._scale / _growth_tracker, possibly replaced by user code, as the native update needs them."""
    ok = isinstance(t, torch.Tensor) and t.dtype == dtype and t.numel() == 1 and t.layout == torch.strided
    if ok and isinstance(other, torch.Tensor):
        ok = t.device == other.device
    if not ok:
        where = f" on {other.device}" if isinstance(other, torch.Tensor) else ""
        got = (f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise TypeError(f"scaler.{name} must be a 1-element {dtype} tensor{where} (the scale update writes it "
                        f"in place), got a {got}; assign a tensor like that, or fill_() the existing one")
