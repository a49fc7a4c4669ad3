"""Pure-torch twins of the native ops: the oracles of the parity tests.

Written for clarity, not speed: float64 where it makes the reference more
exact, one tensor at a time, no fusion. Each function has the signature and
the semantics of its namesake in ``ops.py``.
"""

from __future__ import annotations

import math

import torch

from .names import format_name


def unscale_and_check_(tensors, found_inf, inv_scale, *, check_only=False, return_stats=False):
    """Twin of :func:`adaptive_amp.ops.unscale_and_check_`."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    inv = inv_scale.reshape(()).float()
    sumsq, amax = [], []
    for t in tensors:
        x = t.float()
        if not torch.isfinite(x).all():
            found_inf.fill_(1.0)
        # torch's kernel returns the value itself when inv_scale == 1.
        y = torch.where(inv == 1.0, x, x * inv)
        if not check_only:
            t.copy_(y)
        if return_stats:
            y64 = y.double()
            sumsq.append(y64.square().sum().float())
            amax.append(y.abs().amax() if y.numel() else y.new_zeros(()))
    if not return_stats:
        return None
    device = found_inf.device
    as_tensor = lambda xs: torch.stack(xs).to(device) if xs else torch.zeros(0, device=device)  # noqa: E731
    return as_tensor(sumsq), as_tensor(amax)


def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval, *,
                  counters=None, hysteresis=1, min_scale=0.0, max_scale=None, step_amax=None,
                  amax_history=None, margin=0, fmt_max=65504.0, inv_scale=None):
    """Twin of :func:`adaptive_amp.ops.update_scale_`, step by step on host values."""
    import math

    c = [hysteresis, 0, 0, 0] if counters is None else [int(v) for v in counters.reshape(-1).tolist()]
    s = float(scale.item())
    g = int(growth_tracker.item())
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float64).float())  # noqa: E731  (round to fp32)
    upper = max_scale if max_scale else float(torch.finfo(torch.float32).max)
    if float(found_inf.item()) != 0.0:
        c[1] += 1
        g = 0
        c[0] -= 1
        if c[0] <= 0:
            s = max(f32(s * backoff_factor), min_scale)
            if amax_history is not None:
                c[3] += 1
    else:
        g += 1
        if g == growth_interval:
            g = 0
            c[0] = hysteresis
            if amax_history is not None:
                c[3] = max(c[3] - 1, 0)
            else:
                grown = f32(s * growth_factor)
                if math.isfinite(grown):
                    s = min(grown, upper)
        if amax_history is not None:
            amax = float(step_amax.item())
            if amax > 0 and math.isfinite(amax):
                if not 0 <= c[2] < amax_history.numel():
                    c[2] = 0
                amax_history.reshape(-1)[c[2]] = amax
                c[2] = (c[2] + 1) % amax_history.numel()
            finite = amax_history[torch.isfinite(amax_history)]
            m = float(finite.max().item()) if finite.numel() else 0.0
            if m > 0:
                e = math.frexp(fmt_max / m)[1] - 1  # floor(log2(.)), exactly
                k = min(max(e - margin - c[3], -200), 200)
                target = f32(2.0 ** k)
                s = min(max(target, min_scale), upper)
    scale.fill_(s)
    growth_tracker.fill_(g)
    if counters is not None:
        counters.copy_(torch.tensor(c, dtype=torch.int32))
    if inv_scale is not None:
        inv_scale.copy_(scale.double().reciprocal().float())
    return scale


# --------------------------------------------------------------------------- stochastic rounding
# Philox4x32-10 in int64 tensors holding uint32 values. Products of two
# 32-bit words are split into 16-bit halves so that nothing exceeds 2**50.
_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo32(a, b: int):
    lo_part = a * (b & 0xFFFF)
    hi_part = a * (b >> 16)
    low = lo_part + ((hi_part & 0xFFFF) << 16)
    return (hi_part >> 16) + (low >> 32), low & _MASK32


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 of counter words c0..c3 (least significant first) under key (k0, k1).

    Counter words are int64 tensors (or ints) holding unsigned 32-bit values;
    returns four such tensors.
    """
    for _ in range(10):
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W0) & _MASK32, (k1 + _PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def philox_random_bits(shape, seed: int, offset: int = 0, device="cpu"):
    """The int32 random words ``stochastic_round(x, ..., seed=seed, offset=offset)`` uses for x of `shape`.

    Element i takes word i % 4 of Philox4x32-10 with key seed and counter
    offset + 2**64 * (i // 4).
    """
    n = torch.Size(shape).numel()
    groups = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)
    c0 = torch.full_like(groups, offset & _MASK32)
    c1 = torch.full_like(groups, (offset >> 32) & _MASK32)
    words = philox4x32_10(c0, c1, groups & _MASK32, groups >> 32, seed & _MASK32, (seed >> 32) & _MASK32)
    w = torch.stack(words, dim=1).reshape(-1)[:n]
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32).reshape(shape)


# mantissa bits, smallest normal exponent, largest finite value, has inf
_SR_FORMATS = {
    "bfloat16": (7, -126, 3.3895313892515355e38, True),
    "float16": (10, -14, 65504.0, True),
    "float8_e4m3fn": (3, -6, 448.0, False),
    "float8_e5m2": (2, -14, 57344.0, True),
}


def stochastic_round(x, dtype, *, random_bits=None, seed=None, offset=None, scale=None, saturate=False):
    """Twin of :func:`adaptive_amp.ops.stochastic_round`, in float64 arithmetic.

    Takes its random bits from ``random_bits`` (int32, x's shape) or, with
    ``seed`` (and ``offset``), from :func:`philox_random_bits`. Written from
    the definition, not from the kernel: ulp from frexp, the fractional
    position ``f = |y|/ulp - floor(|y|/ulp)``, all exact in float64; away from
    zero iff floor(2**32 f) + r >= 2**32.
    """
    name = format_name(dtype if isinstance(dtype, str) else str(dtype), tuple(_SR_FORMATS), "dtype")
    mant, emin, max_finite, has_inf = _SR_FORMATS[name]
    target = getattr(torch, name)
    v = x.float()
    negative = torch.signbit(v)
    if scale is not None:
        s = scale.float().reshape(()) if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
        s = s.to(v.device)
        v = v * s  # the fp32 product, rounded once
        negative = negative ^ torch.signbit(s)
    if random_bits is None:
        random_bits = philox_random_bits(x.shape, seed, offset or 0, device=x.device)
    # Everything below is float64 and exact (no integer tensors: compiles cleanly).
    r = random_bits.double()
    r = torch.where(r < 0, r + 2.0**32, r)  # the bits as unsigned

    a = v.double().abs()
    m, _ = torch.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    binade = torch.where(a > 0, a / (2 * m), 0.0)  # 2**(e - 1), exactly
    # The target's spacing at a: 2**-mant of the binade, or of the smallest
    # normal binade below it (subnormals are kept).
    ulp = torch.clamp(binade, min=2.0**emin) * 2.0**-mant
    q = a / ulp
    k = torch.floor(q)
    f = q - k
    big_f = torch.floor(f * 2.0**32)
    away = (big_f + r) >= 2.0**32
    mag = torch.where(away, k + 1, k) * ulp
    over = mag > max_finite
    mag = torch.where(over, float("inf") if has_inf and not saturate else max_finite, mag)
    # e4m3fn has no inf: +-inf (also an fp32 overflow of x * scale) saturates, as torch 2.13's CPU cast.
    mag = torch.where(torch.isinf(a), float("inf") if has_inf else max_finite, mag)
    mag = torch.where(torch.isnan(a), float("nan"), mag)
    return torch.where(negative, -mag, mag).float().to(target)


# --------------------------------------------------------------------------- tensor statistics
# largest finite value, smallest normal value
_STATS_FORMATS = {
    "float16": (65504.0, 2.0**-14),
    "bfloat16": (3.3895313892515355e38, 2.0**-126),
    "float8_e4m3fn": (448.0, 2.0**-6),
    "float8_e5m2": (57344.0, 2.0**-14),
}


def tensor_stats(tensors, *, fmt=None, scale=None, names=None):
    """Twin of :func:`adaptive_amp.ops.tensor_stats`: the same statistics as a dict of lists.

    One tensor at a time, in float64. The format counts use torch's own
    round-to-nearest-even cast of the fp32 product ``x * scale`` rather than
    thresholds, so they check the kernels' thresholds independently.
    ``names`` is accepted for signature parity and not used.
    """
    import math

    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    try:
        name = None if fmt is None else format_name(fmt if isinstance(fmt, str) else str(fmt), tuple(_STATS_FORMATS))
    except ValueError:
        name = fmt
    if name is not None and name not in _STATS_FORMATS:
        raise ValueError(f"fmt is {fmt!r}; expected one of {', '.join(_STATS_FORMATS)}")
    keys = ["numel", "nan_count", "inf_count", "zero_count", "min", "max", "amax", "min_abs_nonzero", "mean", "std",
            "l2_norm", "dynamic_range"]
    if name is not None:
        keys += ["overflow_count", "underflow_count", "subnormal_count"]
    out = {k: [] for k in keys}
    nan = float("nan")
    for i, t in enumerate(tensors):
        x = t.detach().reshape(-1)
        x64 = x.double()
        finite = torch.isfinite(x64)
        v = x64[finite]
        n = v.numel()
        nonzero = v[v != 0].abs()
        out["numel"].append(x.numel())
        out["nan_count"].append(int(torch.isnan(x64).sum()))
        out["inf_count"].append(int(torch.isinf(x64).sum()))
        out["zero_count"].append(int((x64 == 0).sum()))
        out["min"].append(float(v.min()) if n else nan)
        out["max"].append(float(v.max()) if n else nan)
        amax = float(v.abs().max()) if n else nan
        man = float(nonzero.min()) if nonzero.numel() else nan
        out["amax"].append(amax)
        out["min_abs_nonzero"].append(man)
        out["mean"].append(float(v.mean()) if n else nan)
        out["std"].append(float(v.std(correction=1)) if n > 1 else nan)
        out["l2_norm"].append(float(torch.linalg.vector_norm(v)) if n else nan)
        out["dynamic_range"].append(math.log2(amax / man) if nonzero.numel() else nan)
        if name is None:
            continue
        if scale is None:
            s = torch.tensor(1.0)
        elif isinstance(scale, torch.Tensor):
            flat = scale.detach().reshape(-1).float().cpu()
            s = flat[i] if flat.numel() > 1 else flat[0]
        else:
            s = torch.tensor(scale, dtype=torch.float32)
        s = s.float().to(x.device)
        y = x.float() * s  # the fp32 product, rounded once
        cast = y.to(getattr(torch, name)).double()
        fmt_max, smallest_normal = _STATS_FORMATS[name]
        out["overflow_count"].append(int((finite & (y.double().abs() > fmt_max)).sum()))
        out["underflow_count"].append(int((finite & (x64 != 0) & (s != 0) & (cast == 0)).sum()))
        out["subnormal_count"].append(int((finite & (cast != 0) & (cast.abs() < smallest_normal)).sum()))
    return out


class _StraightThrough(torch.autograd.Function):
    """Forward: the rounded tensor; backward: the gradient unchanged, times scale, in x's dtype."""

    @staticmethod
    def forward(ctx, x, rounded, scale):
        ctx.x_dtype, ctx.scale = x.dtype, scale
        return rounded

    @staticmethod
    def backward(ctx, grad):
        g = grad.to(ctx.x_dtype)
        if ctx.scale is not None:
            g = g * ctx.scale
        return g, None, None


def stochastic_round_ste(x, dtype, *, random_bits=None, seed=None, offset=None, scale=None, saturate=False):
    """Twin of :func:`adaptive_amp.ops.stochastic_round_ste`: :func:`stochastic_round`'s forward, the gradient
    passed straight through (times ``scale``)."""
    rounded = stochastic_round(x.detach(), dtype, random_bits=random_bits, seed=seed, offset=offset, scale=scale,
                               saturate=saturate)
    return _StraightThrough.apply(x, rounded, scale)


# --------------------------------------------------------------------------- fused optimizers
# Twins of adaptive_amp.optim.adamw_step_ / sgd_step_ (contract: csrc/optim.h).
# Every operation is one fp32 torch op (rounded once; torch does not fuse
# eager ops), in the contract's order; the host constants are rounded to fp32
# from Python's doubles, the bias corrections computed in doubles. Divisors
# are full tensors: torch turns division by a 0-dim tensor into
# multiplication by its reciprocal, which rounds twice.
_OPTIM_STREAMS = 3


def _f32(value) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def _optim_pow(b: float, t: int) -> float:
    r = 1.0
    while t:
        if t & 1:
            r = r * b
        b = b * b
        t >>= 1
    return r


def _optim_bits(random_bits, k, stream, x, seed, offset):
    """The int32 words of value `stream` of tensor k (explicit, or Philox at offset + 3k + stream)."""
    if random_bits is not None:
        bits = random_bits[k]
        if isinstance(bits, (tuple, list)):
            bits = bits[stream]
        elif stream != 0:
            raise ValueError(f"random_bits[{k}]: bf16 moments need a (param, exp_avg, exp_avg_sq) tuple of words")
        return bits.reshape(x.shape)
    off = (int(offset or 0) + _OPTIM_STREAMS * k + stream) % (1 << 64)
    return philox_random_bits(x.shape, seed, off, device=x.device)


def _optim_store(dst, y, stochastic_rounding, random_bits, k, stream, seed, offset):
    """y (fp32) into dst: as is for fp32, by stochastic rounding or to nearest for bf16."""
    if dst.dtype == torch.float32:
        dst.copy_(y)
    elif stochastic_rounding:
        dst.copy_(stochastic_round(y, torch.bfloat16, random_bits=_optim_bits(random_bits, k, stream, y, seed, offset)))
    else:
        dst.copy_(y.to(torch.bfloat16))


def _optim_grad(grad, grad_scale, maximize):
    g = grad.float()
    if grad_scale is not None:
        g = g / torch.full_like(g, float(grad_scale.reshape(-1)[0]))
    return -g if maximize else g


def _optim_sumsq(grads, grad_scale, skipped):
    """The contract's grad_sumsq: per tensor the sum of g*g (g after grad_scale), in double, as float32 on the
    grads' device; NaN everywhere for a skipped step."""
    device = grads[0].device if len(grads) else torch.device("cpu")
    if skipped:
        return torch.full((len(grads),), float("nan"), dtype=torch.float32, device=device)
    sums = [float(_optim_grad(g, grad_scale, False).double().square().sum()) for g in grads]
    return torch.tensor(sums, dtype=torch.float64).to(torch.float32).to(device)


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay,
                maximize=False, stochastic_rounding=True, grad_scale=None, found_inf=None, random_bits=None,
                seed=None, offset=None, grad_sumsq=False):
    """Twin of :func:`adaptive_amp.optim.adamw_step_`.

    Random words: ``random_bits[k]`` (int32, the tensor's size; with bf16
    moments a tuple (param, exp_avg, exp_avg_sq) of them), or Philox with
    ``seed`` at ``offset + 3k + s`` as the contract states. With ``grad_sumsq``
    returns the per-tensor sums of squares of the gradients the step used (exact, in double; the kernels sum
    in fp32 per chunk, so they agree to fp32 rounding).
    """
    skipped = found_inf is not None and float(found_inf.reshape(-1)[0]) != 0.0
    sumsq = _optim_sumsq(list(grads), grad_scale, skipped) if grad_sumsq else None
    if skipped:
        return sumsq
    lr_f, b1, b2, eps_f = _f32(lr), _f32(beta1), _f32(beta2), _f32(eps)
    lr_wd, omb1, omb2 = _f32(lr * weight_decay), _f32(1.0 - beta1), _f32(1.0 - beta2)
    for k, (p, grad, m, v, st) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        dev = p.device
        t = int(float(st.reshape(-1)[0]) + 1.0)
        bc1 = _f32(1.0 - _optim_pow(float(beta1), t)).to(dev)
        bc2_sqrt = _f32(math.sqrt(1.0 - _optim_pow(float(beta2), t))).to(dev)
        c = [x.to(dev) for x in (lr_f, b1, b2, eps_f, lr_wd, omb1, omb2)]
        lr_d, b1_d, b2_d, eps_d, lr_wd_d, omb1_d, omb2_d = c
        g = _optim_grad(grad, grad_scale, maximize)
        x = p.float()
        if weight_decay != 0:
            x = x - lr_wd_d * x
        mv = b1_d * m.float() + omb1_d * g
        vv = b2_d * v.float() + omb2_d * (g * g)
        step_size = torch.full_like(x, float(lr_f)) / torch.full_like(x, float(bc1))
        # sqrt in double, rounded once to fp32: the exactly rounded fp32 sqrt
        # (torch's vectorized fp32 sqrt is within 0.5001 ulp, not exact).
        denom = torch.sqrt(vv.double()).float() / torch.full_like(vv, float(bc2_sqrt)) + eps_d
        x = x - (step_size * mv) / denom
        _optim_store(m, mv, stochastic_rounding, random_bits, k, 1, seed, offset)
        _optim_store(v, vv, stochastic_rounding, random_bits, k, 2, seed, offset)
        _optim_store(p, x, stochastic_rounding, random_bits, k, 0, seed, offset)
    return sumsq


def sgd_step_(params, grads, momentum_buffers, first=(), *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
              nesterov=False, maximize=False, stochastic_rounding=True, grad_scale=None, found_inf=None,
              random_bits=None, seed=None, offset=None, grad_sumsq=False):
    """Twin of :func:`adaptive_amp.optim.sgd_step_` (random words and ``grad_sumsq`` as in
    :func:`adamw_step_`; stream 1 is the momentum buffer)."""
    skipped = found_inf is not None and float(found_inf.reshape(-1)[0]) != 0.0
    sumsq = _optim_sumsq(list(grads), grad_scale, skipped) if grad_sumsq else None
    if skipped:
        return sumsq
    lr_f, mom, omd, wd = _f32(lr), _f32(momentum), _f32(1.0 - dampening), _f32(weight_decay)
    for k, (p, grad) in enumerate(zip(params, grads)):
        dev = p.device
        lr_d, mom_d, omd_d, wd_d = (x.to(dev) for x in (lr_f, mom, omd, wd))
        g = _optim_grad(grad, grad_scale, maximize)
        x = p.float()
        if weight_decay != 0:
            g = g + wd_d * x
        if momentum != 0:
            buf = momentum_buffers[k]
            b = g if first[k] else mom_d * buf.float() + omd_d * g
            g = g + mom_d * b if nesterov else b
            _optim_store(buf, b, stochastic_rounding, random_bits, k, 1, seed, offset)
        x = x - lr_d * g
        _optim_store(p, x, stochastic_rounding, random_bits, k, 0, seed, offset)
    return sumsq
