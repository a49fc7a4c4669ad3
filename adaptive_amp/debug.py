"""Debugging helpers: how every gradient or parameter of a model sits against a format.

    >>> print(adaptive_amp.debug.grad_report(model, fmt="float16", scale=scaler.get_scale()))

One :func:`adaptive_amp.tensor_stats` launch per device covers the whole
model, and nothing is copied to the host until the report is read, so the
reports are cheap enough to take every few steps. Rows are sorted by risk:
tensors that already hold NaN or inf first, then by the fraction of
elements that overflow or underflow the format (``risk = overflow_fraction
+ underflow_fraction``).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

from . import stats as _stats
from .ops import tensor_stats

_SUPPORTED = ("float32", "float16", "bfloat16")


def grad_report(model, fmt="float16", *, scale=None, sort_by: Optional[str] = "risk") -> _stats.TensorStats:
    """The statistics of every gradient of `model` against `fmt`, sorted by risk.

    Args:
        model: a ``torch.nn.Module``, or an iterable of ``(name, tensor)``
            pairs (e.g. ``model.named_parameters()``); parameters without a
            gradient are left out.
        fmt: the format to measure against (``"float16"``, ``"bfloat16"``,
            ``"float8_e4m3fn"``, ``"float8_e5m2"`` or a torch dtype), or None
            for the value statistics alone.
        scale: multiply by this before measuring (a number or a 1-element
            float32 tensor on the gradients' device), e.g. the loss scale to
            see the scaled gradients a GradScaler would produce from these.
        sort_by: the default order of ``table()``/``rows()``/``str()``.

    Returns:
        A lazy :class:`~adaptive_amp.stats.TensorStats` named by parameter;
        ``.skipped`` lists the gradients it could not measure (sparse, or of
        another dtype than float32/float16/bfloat16).
    """
    pairs = [(name, p.grad) for name, p in _named(model) if p.grad is not None]
    return _report(pairs, fmt, scale, sort_by)


def param_report(model, fmt="bfloat16", *, scale=None, sort_by: Optional[str] = "risk") -> _stats.TensorStats:
    """The statistics of every parameter of `model` against `fmt`, sorted by risk (see :func:`grad_report`)."""
    return _report(list(_named(model)), fmt, scale, sort_by)


def _named(model) -> Iterable[Tuple[str, object]]:
    if hasattr(model, "named_parameters"):
        return model.named_parameters()
    return model


def _report(pairs, fmt, scale, sort_by):
    groups, order, skipped = {}, [], []
    for name, t in pairs:
        t = t.detach()
        if str(t.layout) != "torch.strided" or str(t.dtype).replace("torch.", "") not in _SUPPORTED:
            skipped.append(name)
            continue
        if not t.is_contiguous():
            t = t.contiguous()
        if t.device not in groups:
            groups[t.device] = ([], [])
            order.append(t.device)
        groups[t.device][0].append(name)
        groups[t.device][1].append(t)
    parts = []
    for device in order:
        names, tensors = groups[device]
        s = scale
        if hasattr(scale, "device") and scale.device != device:
            s = scale.to(device)
        parts.append(tensor_stats(tensors, fmt=fmt, scale=s if fmt is not None else None, names=names))
    if not parts:
        parts = [tensor_stats([], fmt=fmt)]
    report = _stats.join(parts, sort_by=sort_by if fmt is not None or sort_by != "risk" else None)
    report.skipped = skipped
    return report
