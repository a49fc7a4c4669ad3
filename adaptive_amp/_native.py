"""Array adapters: torch tensors, numpy arrays and DLPack arrays -> native arguments.

The native core takes (pointer, element count, dtype code) triples, a device
index (-1 for the host) and a stream handle. This module turns the caller's
arrays into those, takes the caller's framework's current stream, and
allocates outputs and workspaces with the caller's framework (torch's caching
allocator for torch tensors), so the core never allocates.

Errors name the argument (``tensors[3]``, ``found_inf``) and say how to fix it.
Nothing here writes to an array: ops validate everything first.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Sequence

import numpy as np

from . import _C

# Mirrors enum aamp::DType in csrc/core.h.
FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, INT32 = range(6)
DTYPE_NAMES = {
    FLOAT32: "float32",
    FLOAT16: "float16",
    BFLOAT16: "bfloat16",
    FLOAT8_E4M3FN: "float8_e4m3fn",
    FLOAT8_E5M2: "float8_e5m2",
    INT32: "int32",
}
_CODE_BY_NAME = {name: code for code, name in DTYPE_NAMES.items()}

# DLPack (type code, bits) -> our dtype code.
_DLPACK_CODES = {(2, 32): FLOAT32, (2, 16): FLOAT16, (4, 16): BFLOAT16, (10, 8): FLOAT8_E4M3FN,
                 (12, 8): FLOAT8_E5M2, (0, 32): INT32}
_DL_CPU, _DL_CUDA = 1, 2

CPU = -1  # device index of the host


class Array(NamedTuple):
    """One array as the core sees it."""

    ptr: int
    numel: int
    dtype: int
    device: int  # -1: host, else CUDA device index
    framework: str  # "torch", "numpy", "cupy" or "dlpack"
    obj: Any  # the caller's array (torch tensors need their autograd version bumped)
    keepalive: Any = None  # a DLPack capsule that must outlive the call


def device_name(device: int) -> str:
    return "cpu" if device == CPU else f"cuda:{device}"


def _torch():
    return sys.modules.get("torch")


def _torch_codes():
    torch = _torch()
    codes = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16, torch.int32: INT32}
    for attr, code in (("float8_e4m3fn", FLOAT8_E4M3FN), ("float8_e5m2", FLOAT8_E5M2)):
        if hasattr(torch, attr):
            codes[getattr(torch, attr)] = code
    return codes


_torch_code_cache: dict = {}


def torch_dtype_code(dtype) -> int | None:
    if not _torch_code_cache:
        _torch_code_cache.update(_torch_codes())
    return _torch_code_cache.get(dtype)


def _allowed_names(dtypes: Sequence[int]) -> str:
    names = [DTYPE_NAMES[d] for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _check_dtype(code, shown, name, dtypes):
    if code is None or code not in dtypes:
        raise TypeError(f"{name} has dtype {shown}; expected {_allowed_names(dtypes)}")


def is_torch_tensor(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _describe_torch(x, name, writable, dtypes) -> Array:
    code = torch_dtype_code(x.dtype)
    _check_dtype(code, x.dtype, name, dtypes)
    if x.layout != _torch().strided:
        raise ValueError(f"{name} is a {x.layout} tensor; pass a dense tensor (for sparse ones, their _values())")
    if x.device.type == "cuda":
        device = x.device.index if x.device.index is not None else _torch().cuda.current_device()
    elif x.device.type == "cpu":
        device = CPU
    else:
        raise ValueError(f"{name} is on device '{x.device}'; adaptive_amp runs on the CPU and on CUDA GPUs")
    if not x.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass x.contiguous() (and copy the result back if needed)")
    if writable and x.requires_grad and x.is_leaf:
        raise ValueError(
            f"{name} is a leaf tensor that requires grad; an in-place op on it would break autograd. "
            "Pass its gradient (p.grad) or p.detach()"
        )
    return Array(x.data_ptr(), x.numel(), code, device, "torch", x)


def _describe_numpy(x: np.ndarray, name, writable, dtypes) -> Array:
    code = _CODE_BY_NAME.get(x.dtype.name)
    _check_dtype(code, x.dtype, name, dtypes)
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} is not C-contiguous; pass np.ascontiguousarray(x)")
    if writable and not x.flags.writeable:
        raise ValueError(f"{name} is read-only and this op writes in place; pass a writeable copy (x.copy())")
    return Array(x.__array_interface__["data"][0], x.size, code, CPU, "numpy", x)


def _is_cupy(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def _dlpack_capsule(x, device_type):
    """Export x, asking a CUDA producer to order its work before our stream."""
    kwargs = {}
    if device_type == _DL_CUDA:
        stream = dlpack_stream(x)
        kwargs["stream"] = stream if stream != 0 else 1  # 1: the legacy default stream
    try:
        return x.__dlpack__(max_version=(1, 0), **kwargs)
    except TypeError:  # producer predates DLPack 1.0
        return x.__dlpack__(**kwargs)


def _describe_dlpack(x, name, writable, dtypes) -> Array:
    device_type, device_id = x.__dlpack_device__()
    if device_type not in (_DL_CPU, _DL_CUDA):
        raise ValueError(f"{name} lives on DLPack device type {device_type}; adaptive_amp runs on the CPU and CUDA")
    capsule = _dlpack_capsule(x, device_type)
    info = _C.dlpack_describe(capsule)
    code_, bits, lanes = info["dtype"]
    code = _DLPACK_CODES.get((code_, bits)) if lanes == 1 else None
    _check_dtype(code, f"(DLPack code {code_}, {bits} bits, {lanes} lanes)", name, dtypes)
    shape = info["shape"]
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if info["strides"] is not None and numel > 1:
        expected, step = [], 1
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        expected.reverse()
        if any(e > 1 and s != c for e, s, c in zip(shape, info["strides"], expected)):
            raise ValueError(f"{name} is not contiguous; pass a contiguous copy")
    read_only = info["read_only"] or type(x).__module__.split(".")[0] in ("jax", "jaxlib")
    if writable and read_only:
        raise ValueError(f"{name} is read-only (an immutable array) and this op writes in place; pass a mutable copy")
    device = CPU if device_type == _DL_CPU else device_id
    return Array(info["data"], numel, code, device, "cupy" if _is_cupy(x) else "dlpack", x, capsule)


def describe(x, name: str, *, writable: bool, dtypes: Sequence[int]) -> Array:
    """One array -> Array, with errors that name `name`."""
    if is_torch_tensor(x):
        return _describe_torch(x, name, writable, dtypes)
    if isinstance(x, np.ndarray):
        return _describe_numpy(x, name, writable, dtypes)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return _describe_dlpack(x, name, writable, dtypes)
    raise TypeError(
        f"{name} is a {type(x).__module__}.{type(x).__qualname__}; expected a torch tensor, a numpy array "
        "or an array with __dlpack__ (CuPy, JAX)"
    )


class Batch(NamedTuple):
    ptrs: list
    numels: list
    dtypes: list
    device: int
    framework: str
    arrays: list  # Array per item when described one by one, else None
    objs: Sequence


_allowed_code_maps: dict = {}


def _torch_fast_batch(xs, writable, dtypes) -> Batch | None:
    """All-torch lists: one C++ loop (_C.describe_tensors) instead of one describe() per item.

    Returns None when anything is unusual; the slow path then finds and names it.
    """
    torch = _torch()
    if torch is None:
        return None
    key = tuple(dtypes)
    allowed = _allowed_code_maps.get(key)
    if allowed is None:
        torch_dtype_code(None)  # fills the cache
        allowed = _allowed_code_maps[key] = {dt: c for dt, c in _torch_code_cache.items() if c in dtypes}
    found = _C.describe_tensors(xs if type(xs) is list else list(xs), allowed, writable)
    if found is None:
        return None
    ptrs, numels, codes, device = found
    return Batch(ptrs, numels, codes, device, "torch", None, xs)


def describe_many(xs: Sequence, name: str, *, writable: bool, dtypes: Sequence[int]) -> Batch:
    """A list of arrays of one device -> Batch. Errors name `name[i]`."""
    batch = _torch_fast_batch(xs, writable, dtypes)
    if batch is not None:
        return batch
    arrays = [describe(x, f"{name}[{i}]", writable=writable, dtypes=dtypes) for i, x in enumerate(xs)]
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.device != first.device:
            raise ValueError(
                f"{name}[{i}] is on {device_name(a.device)} but {name}[0] is on {device_name(first.device)}; "
                "pass the tensors of one device per call"
            )
    return Batch([a.ptr for a in arrays], [a.numel for a in arrays], [a.dtype for a in arrays], first.device,
                 first.framework, arrays, xs)


def check_scalar(a: Array, name: str, device: int):
    if a.numel != 1:
        raise ValueError(f"{name} has {a.numel} elements; pass a 1-element float32 tensor")
    if a.device != device:
        raise ValueError(f"{name} is on {device_name(a.device)} but the tensors are on {device_name(device)}")


def dlpack_stream(x) -> int:
    if _is_cupy(x):
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return 0


def current_stream(framework: str, device: int, sample=None) -> int:
    """The stream the caller's framework would run on now (0 on the host)."""
    if device == CPU:
        return 0
    if framework == "torch":
        return _torch().cuda.current_stream(device).cuda_stream
    if framework == "cupy":
        return dlpack_stream(sample) if sample is not None else 0
    return 0  # other producers were asked (through __dlpack__) to be ready on the legacy default stream


def empty(framework: str, device: int, numel: int, dtype: int):
    """An uninitialized 1-D output of `numel` elements with the caller's framework -> (array, pointer)."""
    names = {FLOAT32: "float32", INT32: "int32"}
    if framework == "torch" or (framework == "dlpack" and device != CPU and _torch() is not None):
        torch = _torch()
        out = torch.empty(numel, dtype=getattr(torch, names.get(dtype, "uint8")),
                          device="cpu" if device == CPU else f"cuda:{device}")
        return out, out.data_ptr()
    if framework == "cupy":
        import cupy

        with cupy.cuda.Device(device):
            out = cupy.empty(numel, dtype=names.get(dtype, "uint8"))
        return out, out.data.ptr
    if device == CPU:
        out = np.empty(numel, dtype=names.get(dtype, "uint8"))
        return out, out.__array_interface__["data"][0]
    raise RuntimeError("cannot allocate outputs for this CUDA array type; install torch or cupy")


def workspace(framework: str, device: int, nbytes: int):
    """Scratch memory for the core -> (owner, pointer); (None, 0) when none is needed."""
    if nbytes == 0:
        return None, 0
    return empty(framework, device, nbytes, dtype=-1)


def mark_written(batch: Batch):
    """Torch tracks in-place writes in a version counter; bump it as torch's own ops would."""
    if batch.framework != "torch" or batch.arrays is None:
        return  # the fast path admits no tensor that requires grad
    torch = _torch()
    written = [x for x in batch.objs if is_torch_tensor(x) and x.requires_grad]
    if written:
        torch.autograd.graph.increment_version(written)


def as_list(tensors, name):
    """A list argument of tensors as a list; one bare array is a list of one."""
    if isinstance(tensors, (list, tuple)):
        return tensors
    if is_torch_tensor(tensors) or hasattr(tensors, "__dlpack__") or hasattr(tensors, "__array_interface__"):
        return [tensors]
    raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")


def keep_until_done(owner, device):
    """A workspace freed right after an asynchronous launch must not be reused too early.

    torch's caching allocator only hands a block back to the same stream, in
    stream order, so freeing it after enqueueing is safe (as torch's own ops
    do). Other frameworks' pools are not stream-ordered: wait for the work.
    """
    if owner is None or device == CPU or is_torch_tensor(owner):
        return
    import cupy

    cupy.cuda.get_current_stream().synchronize()
