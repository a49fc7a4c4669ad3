"""Stochastic rounding for torch tensors: ``torch.library`` custom ops and a straight-through autograd rule.

Two custom ops carry the native kernel into torch:

* ``adaptive_amp::stochastic_round`` (functional; returns ``(out, amax)``),
  with a fake implementation, so ``torch.compile(fullgraph=True)`` traces it
  without a graph break, and a straight-through gradient (registered with
  ``torch.library.register_autograd``) that :func:`adaptive_amp.stochastic_round_ste`
  uses;
* ``adaptive_amp::stochastic_round_out`` (writes ``out``; returns ``amax``).

Both are tagged ``nondeterministic_seeded`` so that graph passes never merge
two calls. The Python wrapper below validates the arguments (without
touching data, so that it traces) and draws (seed, offset) from torch's
generator as a 2-element int64 tensor on x's device, so the draw needs no
host synchronization and is safe inside CUDA graph capture.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from . import _native, _sround
from ._native import INT32

_TAGS = (torch.Tag.nondeterministic_seeded,)
try:
    _is_compiling = torch.compiler.is_compiling
except AttributeError:  # torch < 2.3
    _is_compiling = torch._dynamo.is_compiling
_SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_I64_LIMIT = 1 << 63


def _as_i64(value: int) -> int:
    """uint64 -> the int64 with the same bits (op schemas carry int64)."""
    return value - (1 << 64) if value >= _I64_LIMIT else value


def _as_u64(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


def _fp32(value: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(value))


# The current stream as a raw handle, without building a torch.cuda.Stream per call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: int) -> int:
    if device == _native.CPU:
        return 0
    return _raw_stream(device) if _raw_stream is not None else _native.current_stream("torch", device)


def _checked(t: Tensor, code: int) -> _native.Array:
    """A tensor that stochastic_round() has validated (dtype, device, layout, contiguity) as the core sees it."""
    return _native.Array(t.data_ptr(), t.numel(), code, t.get_device(), "torch", t)  # get_device(): -1 on the CPU


def _run(x, dtype, seed, offset, seed_offset, scale, scale_value, saturate, random_bits, out, amax,
         checked=False) -> None:
    """The eager body of both ops and of plain calls: describe, call the core (amax: None, or 1 element).

    checked: the arguments come from stochastic_round(), which validated them,
    so they skip the generic description (a few microseconds per tensor).
    """
    code = _native.torch_dtype_code(dtype)
    if checked:
        xa, oa = _checked(x, _native.torch_dtype_code(x.dtype)), _checked(out, code)
        bits = _checked(random_bits, INT32) if random_bits is not None else None
    else:
        xa = _native.describe(x, "x", writable=False, dtypes=_sround.SOURCES)
        oa = _native.describe(out, "out", writable=True, dtypes=(code,))
        bits = None
        if random_bits is not None:
            bits = _native.describe(random_bits, "random_bits", writable=False, dtypes=(INT32,))
    _sround.call_native(
        x=xa, out_ptr=oa.ptr, out_numel=oa.numel, out_code=code, bits=bits,
        seed=_as_u64(seed) if seed is not None else 0, offset=_as_u64(offset) if offset is not None else 0,
        seed_offset_ptr=seed_offset.data_ptr() if seed_offset is not None else 0,
        scale_ptr=scale.data_ptr() if scale is not None else 0,
        scale_value=_fp32(scale_value) if scale_value is not None else None,
        saturate=saturate, amax_ptr=amax.data_ptr() if amax is not None else 0,
        device=xa.device, stream=_stream(xa.device), watch=(out, seed_offset, scale, amax))


def _amax_for_op(x: Tensor, return_amax: bool) -> Tensor:
    """The ops' second output: amax, or an empty tensor (their schema returns a tensor either way)."""
    return torch.empty(1 if return_amax else 0, dtype=torch.float32, device=x.device)


@torch.library.custom_op("adaptive_amp::stochastic_round", mutates_args=(), tags=_TAGS)
def stochastic_round_op(
    x: Tensor,
    dtype: torch.dtype,
    seed: Optional[int],
    offset: Optional[int],
    seed_offset: Optional[Tensor],
    scale: Optional[Tensor],
    scale_value: Optional[float],
    saturate: bool,
    random_bits: Optional[Tensor],
    return_amax: bool,
) -> Tuple[Tensor, Tensor]:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    amax = _amax_for_op(x, return_amax)
    _run(x, dtype, seed, offset, seed_offset, scale, scale_value, saturate, random_bits, out,
         amax if return_amax else None)
    return out, amax


@stochastic_round_op.register_fake
def _stochastic_round_fake(x, dtype, seed, offset, seed_offset, scale, scale_value, saturate, random_bits,
                           return_amax):
    return torch.empty_like(x, dtype=dtype), x.new_empty((1 if return_amax else 0,), dtype=torch.float32)


@torch.library.custom_op("adaptive_amp::stochastic_round_out", mutates_args=("out",), tags=_TAGS)
def stochastic_round_out_op(
    x: Tensor,
    dtype: torch.dtype,
    seed: Optional[int],
    offset: Optional[int],
    seed_offset: Optional[Tensor],
    scale: Optional[Tensor],
    scale_value: Optional[float],
    saturate: bool,
    random_bits: Optional[Tensor],
    return_amax: bool,
    out: Tensor,
) -> Tensor:
    amax = _amax_for_op(x, return_amax)
    _run(x, dtype, seed, offset, seed_offset, scale, scale_value, saturate, random_bits, out,
         amax if return_amax else None)
    return amax


@stochastic_round_out_op.register_fake
def _stochastic_round_out_fake(x, dtype, seed, offset, seed_offset, scale, scale_value, saturate, random_bits,
                               return_amax, out):
    return x.new_empty((1 if return_amax else 0,), dtype=torch.float32)


# Straight-through: the rounding counts as the identity, so d out / d x is the
# scale (1 without one); the gradient comes back in x's dtype.
def _setup_context(ctx, inputs, output):
    x, scale, scale_value = inputs[0], inputs[5], inputs[6]
    ctx.x_dtype = x.dtype
    ctx.scale_value = scale_value
    ctx.save_for_backward(scale)


def _backward(ctx, grad_out, grad_amax):
    (scale,) = ctx.saved_tensors
    grad = grad_out
    if scale is not None:
        grad = grad.float() * scale
    elif ctx.scale_value is not None:
        grad = grad.float() * _fp32(ctx.scale_value)
    return grad.to(ctx.x_dtype), None, None, None, None, None, None, None, None, None


torch.library.register_autograd("adaptive_amp::stochastic_round", _backward, setup_context=_setup_context)


def _check_tensor_arg(t, name, x, dtype, shape=True):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} is a {type(t).__name__}; pass a torch tensor like x")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype}")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} is a {t.layout} tensor; pass a dense tensor")
    if shape and t.shape != x.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; x has shape {tuple(x.shape)}")
    if not t.is_contiguous():
        if name == "out":  # out.contiguous() would be a copy, which the result never leaves
            raise ValueError("out is not contiguous; pass a contiguous out (and copy it into yours) or no out")
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
    if not _is_compiling() and (t.is_neg() or t.is_conj()):
        raise ValueError(f"{name} has torch's lazy negation/conjugation flag; pass {name}.resolve_neg()")


def stochastic_round(x: Tensor, dtype, *, generator=None, seed=None, offset=None, scale=None, saturate=False,
                     out=None, random_bits=None, return_amax=False, ste=False):
    """The torch path of :func:`adaptive_amp.stochastic_round` (see its docstring)."""
    code = _sround.target_code(dtype)
    target = getattr(torch, _native.DTYPE_NAMES[code])
    _sround.check_choice(generator, seed, offset, random_bits)
    if x.dtype not in _SOURCE_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x is on device '{x.device}'; adaptive_amp runs on the CPU and on CUDA GPUs")
    if x.layout != torch.strided:
        raise ValueError(f"x is a {x.layout} tensor; pass a dense tensor")
    # (dynamo cannot trace is_neg(); a compiled graph's custom op describes, and refuses, a negated view.)
    if not x.is_contiguous() or (not _is_compiling() and x.is_neg()):
        # Strided or lazily negated views are read through a contiguous copy (element i is x's i-th element
        # in row-major order, as for x.contiguous()).
        x = x.resolve_neg().contiguous()
    if random_bits is not None:
        _check_tensor_arg(random_bits, "random_bits", x, torch.int32)
    scale_t = scale_value = None
    if scale is not None:
        if isinstance(scale, Tensor):
            _check_tensor_arg(scale, "scale", x, torch.float32, shape=False)
            if scale.numel() != 1:
                raise ValueError(f"scale has {scale.numel()} elements; pass a 1-element float32 tensor or a number")
            scale_t = scale
        elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
            scale_value = float(scale)
        else:
            raise TypeError(f"scale is a {type(scale).__name__}; pass a number or a 1-element float32 tensor")
    if out is not None:  # checked before the generator is drawn from: a refused call changes nothing
        if ste:
            raise ValueError("out is not supported by stochastic_round_ste (autograd needs a fresh output)")
        if isinstance(out, Tensor) and out.requires_grad:  # (before its layout: out.contiguous() of a strided out would be a copy)
            raise ValueError("out requires grad; stochastic_round has no gradient into out, so writing into it "
                             "would break autograd. Pass out.detach() or a fresh tensor (or use "
                             "stochastic_round_ste without out)")
        _check_tensor_arg(out, "out", x, target)
    seed_offset = None
    if seed is not None:
        seed = _as_i64(_sround.u64(seed, "seed"))
        offset = _as_i64(_sround.u64(offset if offset is not None else 0, "offset"))
    elif random_bits is None:
        if generator is not None:
            if not isinstance(generator, torch.Generator):
                raise TypeError(f"generator is a {type(generator).__name__}; pass a torch.Generator")
            if generator.device.type != x.device.type:
                raise ValueError(f"generator is on {generator.device} but x is on {x.device}; pass a generator "
                                 "of x's device")
        # Two 63-bit draws, on x's device: no host sync, and capturable.
        if generator is None:  # (torch.compile traces randint, but not a generator argument)
            seed_offset = torch.randint(0, _I64_LIMIT - 1, (2,), dtype=torch.int64, device=x.device)
        else:
            seed_offset = torch.randint(0, _I64_LIMIT - 1, (2,), dtype=torch.int64, device=x.device,
                                        generator=generator)
    # Plain eager calls skip the custom-op dispatch (tens of microseconds per
    # call): the ops exist for torch.compile (which traces this function, so
    # _is_compiling() is true there), for the straight-through gradient and for
    # tensor subclasses (fake tensors, modes). The kernel call is the same.
    direct = type(x) is Tensor and not _is_compiling() and not (ste and x.requires_grad and torch.is_grad_enabled())
    if direct:
        result = out if out is not None else torch.empty(x.shape, dtype=target, device=x.device)
        amax = torch.empty(1, dtype=torch.float32, device=x.device) if return_amax else None
        _run(x, target, seed, offset, seed_offset, scale_t, scale_value, bool(saturate), random_bits, result, amax,
             checked=True)
        if out is not None:  # as torch's own in-place ops: a graph that saved out sees it changed
            torch.autograd.graph.increment_version(out)
        return (result, amax) if return_amax else result
    if out is not None:
        amax = stochastic_round_out_op(x.detach(), target, seed, offset, seed_offset, scale_t, scale_value,
                                       bool(saturate), random_bits, bool(return_amax), out)
        return (out, amax) if return_amax else out
    result, amax = stochastic_round_op(x if ste else x.detach(), target, seed, offset, seed_offset, scale_t,
                                       scale_value, bool(saturate), random_bits, bool(return_amax))
    return (result, amax) if return_amax else result
