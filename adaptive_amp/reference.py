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
