"""The public functional API over the native kernels.

Each op validates every argument first (errors name the argument, nothing is
written on error), allocates outputs with the caller's framework, and runs on
the caller's current stream. Each has a pure-torch twin in ``reference.py``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from . import _C, _native
# Shared with stats.py, so they live with the adapters (ops imports stats; stats must not import ops).
from ._native import BFLOAT16, FLOAT16, FLOAT32, INT32
from ._native import as_list as _as_list
from ._native import keep_until_done as _keep_until_done

_UNSCALE_INPUTS = (FLOAT32, FLOAT16, BFLOAT16)

#: Elements per chunk of the unscale kernels (the unit of parallel work and of
#: the deterministic reduction); useful to place values at chunk edges in tests.
UNSCALE_CHUNK = _C.UNSCALE_CHUNK


def unscale_and_check_(
    tensors: Sequence,
    found_inf,
    inv_scale,
    *,
    check_only: bool = False,
    return_stats: bool = False,
) -> Optional[Tuple[object, object]]:
    """Multiply every tensor by ``inv_scale`` in place and flag NaN/inf in ``found_inf``.

    The fused gradient-unscaling step of mixed-precision training, in the
    argument order of ``torch._amp_foreach_non_finite_check_and_unscale_``.

    Args:
        tensors: arrays of one device (torch tensors on the CPU or a CUDA GPU,
            numpy arrays, or DLPack arrays such as CuPy's), float32, float16
            or bfloat16 in any mix. Empty and 0-dim arrays are fine. One
            kernel launch covers the list (very long lists are chunked into a
            few launches). Contiguous and ``channels_last`` tensors are
            worked on in place; any other strided view (slices, transposes,
            lazily negated views such as ``x.conj().imag``; numpy arrays not
            C-contiguous or not in the host's byte order) goes through an
            internal contiguous copy that is copied back afterwards (extra
            memory traffic; the view's version counter is bumped by that
            copy). Views with overlapping elements (``expand``) are refused
            unless ``check_only``, as torch's in-place ops refuse them.
        found_inf: 1-element float32 array on the same device. Set to 1.0 when
            any element of any tensor is NaN or +-inf; left as it was otherwise.
        inv_scale: 1-element float32 array on the same device, read there
            (no host synchronization). Each element becomes
            ``dtype(float(x) * inv_scale)``, rounded to nearest even; with
            ``inv_scale == 1`` the tensors are left untouched.
        check_only: read the tensors and set ``found_inf`` but write nothing
            (for optimizers that unscale inside their own step).
        return_stats: also return ``(sumsq, amax)``, two 1-D float32 arrays with
            one entry per tensor: the sum of squares and the largest magnitude
            of the unscaled values (NaN when a value is NaN), computed in the
            same pass. ``sumsq.sum().sqrt()`` is the global gradient norm.

    Returns:
        ``None``, or ``(sumsq, amax)`` when ``return_stats`` is set.

    Deterministic: the same inputs give bitwise the same outputs every run.
    """
    tensors = tuple(_as_list(tensors, "tensors"))  # ours: another thread may change the caller's list
    found = _native.describe(found_inf, "found_inf", writable=True, dtypes=(FLOAT32,))
    inv = _native.describe(inv_scale, "inv_scale", writable=False, dtypes=(FLOAT32,))
    if len(tensors) == 0:
        _native.check_scalar(found, "found_inf", found.device)
        _native.check_scalar(inv, "inv_scale", found.device)
        return _empty_stats(found) if return_stats else None
    batch = _native.describe_many(tensors, "tensors", writable=not check_only, dtypes=_UNSCALE_INPUTS,
                                  strided=True, outputs=[(found_inf, "found_inf")])
    _native.check_scalar(found, "found_inf", batch.device)
    _native.check_scalar(inv, "inv_scale", batch.device)

    sumsq = amax = ws_owner = None
    sumsq_ptr = amax_ptr = ws_ptr = 0
    ws_bytes = 0
    if return_stats:
        sumsq, sumsq_ptr = _native.empty(batch.framework, batch.device, len(tensors), FLOAT32)
        amax, amax_ptr = _native.empty(batch.framework, batch.device, len(tensors), FLOAT32)
        ws_bytes = _C.unscale_workspace_bytes(batch.numels, True)
        ws_owner, ws_ptr = _native.workspace(batch.framework, batch.device, ws_bytes)

    stream = _native.current_stream(batch.framework, batch.device, batch.objs[0])
    # The launch reads the tensors' pointers again (another thread may have given one new memory since).
    _C.unscale_and_check(batch.ptrs, batch.numels, batch.dtypes, found.ptr, inv.ptr, check_only, sumsq_ptr,
                         amax_ptr, ws_ptr, ws_bytes, batch.device, stream,
                         (batch.watch, _native.watched(found), _native.watched(inv)))
    if not check_only:
        _native.write_back(batch)
        _native.mark_written(batch)
    _keep_until_done(ws_owner, batch.device)
    return (sumsq, amax) if return_stats else None


class UnscalePlan:
    """:func:`unscale_and_check_` for a fixed list of tensors, with the per-tensor host work done once.

    Describing a tensor for the kernels takes seven attribute reads per
    tensor and call (about 0.5 us each call for each tensor on a fast host:
    1 ms for 2000 tensors, more than the kernels). A plan describes the list
    once; each call then re-checks three things per tensor (data pointer,
    element count, dtype: what decides the memory the kernels touch) and
    launches in the same native call, holding the tensors and their storages
    (no other Python thread runs between the check and the launch). If
    any tensor changed (resized, moved, given new memory through ``.data`` or
    ``set_``), the call describes the list again, with full validation: a
    plan never uses a stale pointer.

    For lists whose tensors persist between calls: gradients kept with
    ``zero_grad(set_to_none=False)``, accumulation buffers, optimizer state.
    Gradients that ``zero_grad()`` (``set_to_none=True``) replaces every step
    are new tensors each time: build a new plan (no faster than
    :func:`unscale_and_check_`) or let :class:`adaptive_amp.GradScaler`, which
    plans per parameter, do it. Lists that are not all-torch, contiguous and
    unnegated run through :func:`unscale_and_check_` unchanged.

    Example::

        plan = adaptive_amp.UnscalePlan([p.grad for p in model.parameters()])
        for step in ...:
            ...backward...
            plan.unscale_and_check_(found_inf, inv_scale)
    """

    def __init__(self, tensors):
        self.tensors = tuple(_as_list(tensors, "tensors"))
        self._native = None
        self._build()

    def _build(self):
        self._native = None
        if not self.tensors:
            return
        batch = _native.describe_many(self.tensors, "tensors", writable=True, dtypes=_UNSCALE_INPUTS, strided=True)
        if batch.framework != "torch" or batch.arrays is not None:
            return  # the general path (numpy, DLPack, grad-requiring or strided tensors) every call
        dtypes = tuple(x.dtype for x in self.tensors)
        storages = tuple(x.untyped_storage() for x in self.tensors)
        self._native = _C.TensorsPlan(self.tensors, storages, batch.ptrs, batch.numels, batch.dtypes, dtypes,
                                      batch.device)
        self._device = batch.device

    def __len__(self):
        return len(self.tensors)

    def unscale_and_check_(self, found_inf, inv_scale, *, check_only: bool = False, return_stats: bool = False):
        """:func:`adaptive_amp.unscale_and_check_` of the planned tensors (same arguments and results)."""
        for _ in range(2):  # a plan that no longer holds is built again once; then the general path
            if self._native is None:
                break
            device = self._device
            found = _native.describe_scalar(found_inf, "found_inf", writable=True, device=device)
            inv = _native.describe_scalar(inv_scale, "inv_scale", writable=False, device=device)
            sumsq = amax = ws_owner = None
            sumsq_ptr = amax_ptr = ws_ptr = ws_bytes = 0
            if return_stats:
                sumsq, sumsq_ptr = _native.empty("torch", device, len(self.tensors), FLOAT32)
                amax, amax_ptr = _native.empty("torch", device, len(self.tensors), FLOAT32)
                ws_bytes = self._native.workspace_bytes
                ws_owner, ws_ptr = _native.workspace("torch", device, ws_bytes)
            # Checks the tensors and launches in one native call (no thread can run in between).
            if self._native.unscale(found.ptr, inv.ptr, check_only, sumsq_ptr, amax_ptr, ws_ptr, ws_bytes,
                                    _native.current_stream("torch", device),
                                    (_native.watched(found), _native.watched(inv))):
                del ws_owner  # torch's allocator keeps stream order (see _keep_until_done)
                return (sumsq, amax) if return_stats else None
            self._build()
        return unscale_and_check_(self.tensors, found_inf, inv_scale, check_only=check_only,
                                  return_stats=return_stats)


def update_scale_(
    scale,
    growth_tracker,
    found_inf,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    counters=None,
    hysteresis: int = 1,
    min_scale: float = 0.0,
    max_scale: Optional[float] = None,
    step_amax=None,
    amax_history=None,
    margin: int = 0,
    fmt_max: float = 65504.0,
    inv_scale=None,
):
    """Update the loss scale on its device after a step (no host synchronization).

    With the defaults this is ``torch._amp_update_scale_``: on NaN/inf
    (``found_inf != 0``) the scale is multiplied by ``backoff_factor`` and
    ``growth_tracker`` reset; after ``growth_interval`` clean steps in a row it
    is multiplied by ``growth_factor`` (only to a finite value). The keyword
    arguments add what torch's lacks: hysteresis, bounds and a predictive mode.

    Args:
        scale: the loss scale, a 1-element float32 array, updated in place.
        growth_tracker: clean steps since the last change, a 1-element int32
            array on the same device, updated in place.
        found_inf: nonzero when this step's gradients held NaN/inf, a
            1-element float32 array on the same device.
        growth_factor: the factor of a growth (torch's default 2.0).
        backoff_factor: the factor of a back-off (torch's default 0.5).
        growth_interval: clean steps in a row before a growth (torch's
            default 2000).
        counters: a 4-element int32 array ``[hysteresis_left, skipped_steps,
            history_position, extra_margin]`` kept between calls; start it at
            ``[hysteresis, 0, 0, 0]``. Needed for ``hysteresis > 1`` and the
            predictive mode; it also counts the skipped steps.
        hysteresis: overflows tolerated before backing off, counted since the
            last growth (Megatron-LM's rule; see ``csrc/scale_update.h``).
        min_scale: the smallest scale a back-off may reach.
        max_scale: the largest scale a growth may reach (None: no bound).
        step_amax: predictive mode: a 1-element float32 array, the largest
            unscaled gradient magnitude of this step. It enters the ring buffer
            `amax_history`, and the scale becomes
            ``2 ** (floor(log2(fmt_max / max(amax_history))) - margin - extra_margin)``,
            where ``extra_margin`` grows by one at each back-off and shrinks by
            one every `growth_interval` clean steps.
        amax_history: predictive mode: the ring buffer of recent `step_amax`
            values (float32, its length is the history's).
        margin: predictive mode: powers of two kept between the history's
            amax times the scale and `fmt_max`.
        fmt_max: the largest finite value of the gradients' format (fp16:
            65504).
        inv_scale: a 1-element float32 array that receives
            ``float(1 / double(scale))``, as torch's GradScaler computes it.
    """
    sc = _native.describe(scale, "scale", writable=True, dtypes=(FLOAT32,))
    gt = _native.describe(growth_tracker, "growth_tracker", writable=True, dtypes=(INT32,))
    fi = _native.describe(found_inf, "found_inf", writable=False, dtypes=(FLOAT32,))
    for arr, name in ((sc, "scale"), (gt, "growth_tracker"), (fi, "found_inf")):
        _native.check_scalar(arr, name, sc.device)
    owner = ct = am = hist = inv = None
    if counters is None:
        if hysteresis != 1 or amax_history is not None:
            raise ValueError("counters is needed with hysteresis > 1 or amax_history (it carries their state)")
        owner, counters_ptr = _native.empty(sc.framework, sc.device, 4, INT32)
        _fill_counters(owner, hysteresis)
    else:
        ct = _native.describe(counters, "counters", writable=True, dtypes=(INT32,))
        if ct.numel != 4 or ct.device != sc.device:
            raise ValueError(f"counters must be a 4-element int32 array on {_native.device_name(sc.device)}")
        counters_ptr = ct.ptr
    amax_ptr = hist_ptr = history = 0
    if amax_history is not None:
        hist = _native.describe(amax_history, "amax_history", writable=True, dtypes=(FLOAT32,))
        if hist.device != sc.device or hist.numel < 1:
            raise ValueError(f"amax_history must be a non-empty float32 array on {_native.device_name(sc.device)}")
        if step_amax is None:
            raise ValueError("step_amax is needed with amax_history (predictive mode)")
        am = _native.describe(step_amax, "step_amax", writable=False, dtypes=(FLOAT32,))
        _native.check_scalar(am, "step_amax", sc.device)
        amax_ptr, hist_ptr, history = am.ptr, hist.ptr, hist.numel
    inv_ptr = 0
    if inv_scale is not None:
        inv = _native.describe(inv_scale, "inv_scale", writable=True, dtypes=(FLOAT32,))
        _native.check_scalar(inv, "inv_scale", sc.device)
        inv_ptr = inv.ptr
    stream = _native.current_stream(sc.framework, sc.device, scale)
    _C.update_scale(sc.ptr, gt.ptr, fi.ptr, counters_ptr, float(growth_factor), float(backoff_factor),
                    int(growth_interval), int(hysteresis), float(min_scale), float(max_scale or 0.0),
                    amax_history is not None, amax_ptr, hist_ptr, history, int(margin), float(fmt_max),
                    inv_ptr, sc.device, stream,
                    tuple(_native.watched(a) for a in (sc, gt, fi, ct, am, hist, inv)))
    del owner  # torch's allocator keeps stream order; see _keep_until_done
    return scale


def _fill_counters(counters, hysteresis):
    counters[0] = hysteresis
    counters[1:] = 0


def _empty_stats(found):
    sumsq, _ = _native.empty(found.framework, found.device, 0, FLOAT32)
    amax, _ = _native.empty(found.framework, found.device, 0, FLOAT32)
    return sumsq, amax


# --------------------------------------------------------------------------- stochastic rounding
# Argument handling lives in _sround.py; the torch custom op in sround_torch.py.


def stochastic_round(x, dtype, *, generator=None, seed=None, offset=None, scale=None, saturate=False, out=None,
                     random_bits=None, return_amax=False):
    """Round ``x * scale`` to ``dtype`` stochastically: up or down with probabilities that make it unbiased.

    Each element becomes one of its two neighbours in the target format: the
    one away from zero with probability ``|y - RZ(y)| / ulp`` (``y = x * scale``,
    ``RZ`` rounding toward zero, ``ulp`` the target's spacing at ``y``), else
    ``RZ(y)``. So ``E[stochastic_round(x)] == x``: small updates accumulate
    instead of vanishing as they do with round-to-nearest.

    Args:
        x: float32, float16 or bfloat16; a torch tensor (CPU or CUDA, on the
            current stream), a numpy array, or a DLPack array such as CuPy's.
            Any shape; empty is fine. Strided or lazily negated torch tensors
            and numpy arrays that are not C-contiguous or not in the host's
            byte order are read through an internal contiguous copy (element
            ``i`` is the ``i``-th element in row-major order either way).
        dtype: ``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``
            or ``torch.float8_e5m2``, or their names as strings (also numpy /
            ml_dtypes dtypes).
        generator: torch generator to draw (seed, offset) from; default: the
            default generator of x's device (numpy/DLPack arrays: numpy's
            global generator; a CPU ``torch.Generator`` or a
            ``numpy.random.Generator`` may be passed). It is advanced, so
            ``torch.manual_seed`` reproduces a run and successive calls differ.
        seed, offset: key Philox directly (integers in [0, 2**64); offset
            defaults to 0): the result is then a pure function of (x, seed,
            offset), bitwise the same on the CPU and on CUDA.
        scale: multiply by this before rounding (per-tensor scaled fp8
            casts): a number (rounded to fp32) or a 1-element float32 tensor
            on x's device, read there (no host sync). The product is taken
            in fp32 (rounded to nearest), then stochastically rounded.
        saturate: fp16, bf16 and e5m2 values beyond the largest finite value
            go to +-max instead of (stochastically) to +-inf; +-inf inputs
            stay +-inf.
        out: write the result here (target dtype, x's shape, x's device; a torch
            ``out`` must not require grad, and its version counter is bumped as
            torch's in-place ops do).
        random_bits: int32 array of x's shape: the 32 random bits of each
            element (read as unsigned), used instead of Philox.
        return_amax: also return ``max |x|`` (before scaling; NaN if x has a
            NaN, 0 if empty) as a 1-element float32 array, from the same pass.

    Returns:
        The rounded array (torch tensor for torch input; for numpy input an
        ml_dtypes array, or numpy float16; for CuPy a float16 array, or the
        bit patterns as uint16/uint8 for bf16/fp8, which CuPy lacks), or
        ``(out, amax)`` with ``return_amax``.

    Rounding rule, exactly: with ``f = |y - RZ(y)| / ulp`` in [0, 1) and
    ``F = floor(2**32 * f)``, the result is the neighbour away from zero iff
    ``F + r >= 2**32``, ``r`` the element's 32 random bits as unsigned. So
    ``P(away) = F / 2**32``, exactly ``f`` whenever ``y`` is a multiple of
    ``ulp * 2**-32`` (all bf16 targets; fp16/fp8 unless ``y`` lies far below
    their smallest subnormal). Subnormal targets are kept (no flush to zero).
    Element ``i`` takes word ``i % 4`` of Philox4x32-10 with key ``seed`` and
    counter ``offset + 2**64 * (i // 4)``, independent of threads and blocks.

    Specials: NaN -> NaN; +-inf -> +-inf (bf16, fp16, e5m2) or +-448
    (e4m3fn, which has no inf; as torch 2.13's CPU cast, which saturates).
    Beyond the largest finite value M:
    bf16, fp16 and e5m2 round to inf with the SR probability, counting the
    gap from M to inf as one more ulp (or give +-M with ``saturate``);
    e4m3fn gives +-448 (never NaN from a finite value, also when ``x * scale``
    overflows fp32). +-0 keep their sign.

    Not differentiable (the result does not require grad); for a
    straight-through gradient use :func:`stochastic_round_ste`. Works under
    ``torch.compile(fullgraph=True)`` (a ``torch.library`` custom op).
    """
    if _native.is_torch_tensor(x):
        from . import sround_torch

        return sround_torch.stochastic_round(x, dtype, generator=generator, seed=seed, offset=offset, scale=scale,
                                             saturate=saturate, out=out, random_bits=random_bits,
                                             return_amax=return_amax)
    from . import _sround

    return _sround.stochastic_round_array(x, dtype, generator=generator, seed=seed, offset=offset, scale=scale,
                                          saturate=saturate, out=out, random_bits=random_bits,
                                          return_amax=return_amax)


def stochastic_round_ste(x, dtype, *, generator=None, seed=None, offset=None, scale=None, saturate=False,
                         random_bits=None):
    """:func:`stochastic_round` of a torch tensor with a straight-through gradient, for use inside models.

    The forward pass is exactly ``stochastic_round(x, dtype, ...)`` (same
    arguments, same bits). The backward pass treats the rounding as the
    identity: the gradient passes through unchanged (times ``scale`` when
    one is given) and comes back in x's dtype. Note that torch keeps a
    gradient in the dtype of its tensor, so the gradient arriving at an fp8
    result is itself fp8.
    """
    from . import sround_torch

    if not _native.is_torch_tensor(x):
        raise TypeError(f"x is a {type(x).__name__}; stochastic_round_ste needs a torch tensor (autograd)")
    return sround_torch.stochastic_round(x, dtype, generator=generator, seed=seed, offset=offset, scale=scale,
                                         saturate=saturate, random_bits=random_bits, ste=True)


# --------------------------------------------------------------------------- tensor statistics
# Argument handling and the TensorStats result live in stats.py.


def tensor_stats(tensors, *, fmt=None, scale=None, names=None):
    """Per-tensor statistics of many tensors in one pass: one launch, results kept on the device.

    Args:
        tensors: arrays of one device (torch tensors on the CPU or a CUDA GPU,
            numpy arrays, DLPack arrays), float32, float16 or bfloat16 in any
            mix; empty and 0-dim ones are fine. Contiguous and
            ``channels_last`` tensors are read as they are; other strided
            views (slices, transposes, expanded or lazily negated views;
            numpy arrays not C-contiguous or not in the host's byte order)
            are read through an internal contiguous copy.
        fmt: a target format to measure against: ``"float16"``,
            ``"bfloat16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` or the torch
            dtype. Adds ``overflow_count``, ``underflow_count`` and
            ``subnormal_count``.
        scale: with ``fmt``, multiply by this before measuring against the
            format (as a scaled cast would): a number, a 1-element float32
            array on the tensors' device, or a float32 array with one value
            per tensor (read on the device, no synchronization).
        names: one label per tensor, for ``table()``.

    Returns:
        A :class:`~adaptive_amp.stats.TensorStats`. Per tensor: ``numel``,
        ``nan_count``, ``inf_count``, ``zero_count``, ``min``, ``max``,
        ``amax``, ``min_abs_nonzero``, ``mean``, ``std`` (correction 1, as
        ``torch.std``), ``l2_norm``, ``dynamic_range`` (``log2(amax /
        min_abs_nonzero)``) and, with ``fmt``, the format counts.

    Semantics:
        * Value statistics are over the finite elements; NaN and +-inf are
          only counted. A statistic with nothing to measure is NaN: every
          value statistic of a tensor without finite elements, ``std`` with
          fewer than two, ``min_abs_nonzero`` and ``dynamic_range`` without a
          finite nonzero element.
        * With ``y = float32(x * scale)`` (the fp32 product, round to nearest
          even), over finite x: ``overflow_count`` counts ``|y|`` above the
          format's largest finite value (also when a value would round down
          to it, and when the product overflows fp32); ``underflow_count``
          counts nonzero x (with a nonzero scale) whose y becomes +-0 when
          cast to the format with round-to-nearest-even;
          ``subnormal_count`` counts y whose cast is a nonzero subnormal.
        * Deterministic: bitwise the same results on every run and whatever
          the thread count. Counts and extrema are exact. Mean, std and
          l2_norm are not fp64-exact: each chunk of ``STATS_CHUNK`` (65536)
          elements is summed in fp32 (shifted by a reference value, so
          ``|mean| >> std`` does not cancel), and the chunks are merged in
          fp64. Tested bound: ``|mean - exact| <= 1e-6 * mean(|x|)`` and
          relative errors of ``std`` and ``l2_norm`` ``<= 1e-6`` (measured
          worst about 2.4e-7, on bf16 data whose mean cancels).
    """
    from . import stats

    return stats.compute(tensors, fmt=fmt, scale=scale, names=names)
