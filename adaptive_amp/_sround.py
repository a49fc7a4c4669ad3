"""Stochastic rounding: argument handling shared by every array type, and the numpy/DLPack path.

``ops.stochastic_round`` is the public entry; torch tensors go through the
custom op in ``sround_torch.py``, everything else through
:func:`stochastic_round_array` here. Needs only numpy (and ml_dtypes for
bf16/fp8 numpy results).
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np

from . import _C, _native
from ._native import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, FLOAT32, INT32
from .names import format_name

SOURCES = (FLOAT32, FLOAT16, BFLOAT16)
TARGETS = (BFLOAT16, FLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2)
_TARGET_BY_NAME = {_native.DTYPE_NAMES[c]: c for c in TARGETS}
_TARGET_HELP = ("bfloat16 (bf16), float16 (fp16), float8_e4m3fn (e4m3) or float8_e5m2 (e5m2): a torch dtype, its "
                "name, or a numpy/ml_dtypes dtype")
_U64 = 1 << 64


_known_targets: dict = {}  # dtype arguments seen before (torch dtypes, names) -> code: a plain call's lookup


def target_code(dtype) -> int:
    """The target dtype (torch dtype, name, numpy/ml_dtypes dtype) -> our dtype code."""
    try:
        code = _known_targets.get(dtype)
    except TypeError:  # unhashable: the checks below name it
        code = None
    if code is not None:
        return code
    cacheable = False  # names and torch dtypes; numpy dtypes compare equal to other things
    if isinstance(dtype, str):
        try:  # the spellings of adaptive_amp.names ("bf16", "e4m3"); "fp8" is refused as ambiguous
            code = _TARGET_BY_NAME[format_name(dtype, tuple(_TARGET_BY_NAME), "dtype")]
        except ValueError as exc:
            raise TypeError(f"{exc} (stochastic_round's targets; their torch or numpy dtypes work too)") from None
        cacheable = True
    elif _native.is_torch_tensor(dtype):
        code = None
    else:
        torch = _native._torch()
        if torch is not None and isinstance(dtype, torch.dtype):
            code = _native.torch_dtype_code(dtype)
            cacheable = True
        else:
            try:
                code = _TARGET_BY_NAME.get(np.dtype(dtype).name)
            except TypeError:
                code = None
    if code not in TARGETS:
        raise TypeError(f"dtype is {dtype!r}; stochastic_round rounds to {_TARGET_HELP}")
    if cacheable:
        _known_targets[dtype] = code
    return code


def u64(value, name: str) -> int:
    """A seed or offset: an integer in [0, 2**64)."""
    if type(value) is int and 0 <= value < _U64:  # the common case, without the ABC check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} is a {type(value).__name__}; pass an integer in [0, 2**64)")
    value = int(value)
    if not 0 <= value < _U64:
        raise ValueError(f"{name} is {value}; pass an integer in [0, 2**64)")
    return value


def check_choice(generator, seed, offset, random_bits):
    """Exactly one source of randomness."""
    if random_bits is not None and (seed is not None or offset is not None or generator is not None):
        which = "seed" if seed is not None else ("offset" if offset is not None else "generator")
        raise ValueError(f"random_bits replaces the generator; pass random_bits or {which}, not both")
    if seed is not None and generator is not None:
        raise ValueError("generator and seed are both given; pass one (seed and offset key Philox directly)")
    if offset is not None and seed is None:
        raise ValueError("offset is given without seed; pass seed too (offset alone has no key)")


def scale_number(scale) -> Optional[float]:
    """A Python/numpy number as the fp32 the kernels multiply by; None for an array."""
    if isinstance(scale, bool):
        raise TypeError("scale is a bool; pass a number or a 1-element float32 array")
    if isinstance(scale, numbers.Real):
        return float(np.float32(scale))
    return None


def call_native(*, x, out_ptr, out_numel, out_code, bits=None, seed=0, offset=0, seed_offset_ptr=0, scale_ptr=0,
                scale_value=None, saturate=False, amax_ptr=0, device, stream, watch):
    """One call of the core (it validates everything again and writes nothing on error).

    watch: the torch tensors behind (out, seed_offset, scale, amax) or None each (see _native.watched):
    the core reads their pointers, and x's and random_bits', again right before it launches."""
    _C.stochastic_round(
        x.ptr, x.numel, x.dtype, out_ptr, out_numel, out_code,
        bits.ptr if bits is not None else 0, bits.numel if bits is not None else -1,
        bits.dtype if bits is not None else INT32,
        seed, offset, seed_offset_ptr, scale_ptr, scale_value is not None,
        scale_value if scale_value is not None else 1.0, bool(saturate), amax_ptr, device, stream,
        (_native.watched(x), watch[0], _native.watched(bits)) + tuple(watch[1:]))


# --------------------------------------------------------------------------- numpy / DLPack


def numpy_dtype(code: int):
    """The numpy dtype of a target; bf16 and fp8 need ml_dtypes."""
    if code == FLOAT16:
        return np.dtype(np.float16)
    try:
        import ml_dtypes
    except ImportError as exc:
        raise ImportError(
            f"dtype {_native.DTYPE_NAMES[code]}: numpy has no such dtype; results for numpy arrays come as "
            "ml_dtypes arrays. Fix: pip install ml_dtypes"
        ) from exc
    return np.dtype(getattr(ml_dtypes, _native.DTYPE_NAMES[code]))


def _host_seed(generator):
    """(seed, offset) for arrays that are not torch tensors."""
    if generator is None:
        seed, offset = np.random.randint(0, np.iinfo(np.int64).max, size=2, dtype=np.int64)
        return int(seed), int(offset)
    if isinstance(generator, np.random.Generator):
        seed, offset = generator.integers(0, _U64, size=2, dtype=np.uint64)
        return int(seed), int(offset)
    torch = _native._torch()
    if torch is not None and isinstance(generator, torch.Generator):
        if generator.device.type != "cpu":
            raise ValueError(f"generator is on {generator.device}; for numpy and DLPack arrays pass a CPU generator "
                             "(torch.Generator() or numpy.random.Generator), or seed")
        seed, offset = torch.empty(2, dtype=torch.int64).random_(generator=generator).tolist()
        return seed, offset
    raise TypeError(f"generator is a {type(generator).__name__}; pass a torch.Generator or numpy.random.Generator")


def _shape(a):
    shape = getattr(a, "shape", None)
    return tuple(shape) if shape is not None else None


def stochastic_round_array(x, dtype, *, generator, seed, offset, scale, saturate, out, random_bits, return_amax):
    """stochastic_round for numpy arrays and DLPack arrays (CuPy, JAX)."""
    code = target_code(dtype)
    check_choice(generator, seed, offset, random_bits)
    if isinstance(x, np.ndarray) and not (x.dtype.isnative and x.flags.c_contiguous):
        # Read through a contiguous copy in the host's byte order (element order is x's logical order).
        x = np.ascontiguousarray(x, dtype=x.dtype if x.dtype.isnative else x.dtype.newbyteorder("="))
    xa = _native.describe(x, "x", writable=False, dtypes=SOURCES)
    shape = _shape(x)
    if shape is None:  # a bare DLPack producer: the shape its capsule states
        shape = tuple(_C.dlpack_describe(xa.keepalive)["shape"])
    bits = None
    if random_bits is not None:
        bits = _native.describe(random_bits, "random_bits", writable=False, dtypes=(INT32,))
        if bits.device != xa.device:
            raise ValueError(f"random_bits is on {_native.device_name(bits.device)} but x is on "
                             f"{_native.device_name(xa.device)}")
        if _shape(random_bits) != shape:
            raise ValueError(f"random_bits has shape {_shape(random_bits)}; x has shape {shape} "
                             "(one int32 word per element)")
    scale_value = scale_number(scale) if scale is not None else None
    scale_ptr = 0
    sa = oa = None
    if scale is not None and scale_value is None:
        sa = _native.describe(scale, "scale", writable=False, dtypes=(FLOAT32,))
        _native.check_scalar(sa, "scale", xa.device)
        scale_ptr = sa.ptr
    if seed is not None:
        seed, offset = u64(seed, "seed"), u64(offset if offset is not None else 0, "offset")
    elif random_bits is None:
        seed, offset = _host_seed(generator)
    else:
        seed, offset = 0, 0

    if out is not None:
        oa = _native.describe(out, "out", writable=True, dtypes=(code,))
        if oa.device != xa.device:
            raise ValueError(f"out is on {_native.device_name(oa.device)} but x is on {_native.device_name(xa.device)}")
        if _shape(out) != shape:
            raise ValueError(f"out has shape {_shape(out)}; x has shape {shape}")
        result, out_ptr = out, oa.ptr
    elif xa.device == _native.CPU and xa.framework != "cupy":
        result = np.empty(shape, dtype=numpy_dtype(code))
        out_ptr = result.__array_interface__["data"][0] if result.size else 0
    elif xa.framework == "cupy":
        import cupy

        # CuPy has float16 but no bf16/fp8: those come as their bit patterns.
        raw = {FLOAT16: "float16", BFLOAT16: "uint16"}.get(code, "uint8")
        with cupy.cuda.Device(xa.device):
            result = cupy.empty(shape, dtype=raw)
        out_ptr = result.data.ptr
    else:
        flat, out_ptr = _native.empty(xa.framework, xa.device, xa.numel, code)
        result = flat.view(_torch_dtype(code)).reshape(shape) if _native.is_torch_tensor(flat) else flat

    amax = None
    amax_ptr = 0
    if return_amax:
        amax, amax_ptr = _native.empty("numpy" if xa.device == _native.CPU else xa.framework, xa.device, 1, FLOAT32)
    stream = _native.current_stream(xa.framework, xa.device, x)
    call_native(x=xa, out_ptr=out_ptr, out_numel=xa.numel, out_code=code, bits=bits, seed=seed, offset=offset,
                scale_ptr=scale_ptr, scale_value=scale_value, saturate=saturate, amax_ptr=amax_ptr,
                device=xa.device, stream=stream,
                watch=(_native.watched(oa), None, _native.watched(sa), None))
    return (result, amax) if return_amax else result


def _torch_dtype(code):
    torch = _native._torch()
    return getattr(torch, _native.DTYPE_NAMES[code])
