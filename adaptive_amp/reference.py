"""Pure-torch twins of the native ops: the oracles of the parity tests.

Written for clarity, not speed: float64 where it makes the reference more
exact, one tensor at a time, no fusion. Each function has the signature and
the semantics of its namesake in ``ops.py``.
"""

from __future__ import annotations

import torch


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
                amax_history.reshape(-1)[c[2]] = amax
                c[2] = (c[2] + 1) % amax_history.numel()
            m = float(amax_history.max().item())
            if m > 0:
                e = math.frexp(fmt_max / m)[1] - 1  # floor(log2(.)), exactly
                target = f32(2.0 ** (e - margin - c[3]))
                s = min(max(target, min_scale), upper)
    scale.fill_(s)
    growth_tracker.fill_(g)
    if counters is not None:
        counters.copy_(torch.tensor(c, dtype=torch.int32))
    if inv_scale is not None:
        inv_scale.copy_(scale.double().reciprocal().float())
    return scale
