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
from typing import Any, NamedTuple, Optional, Sequence

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


def _dense_layout(x) -> bool:
    """Whether a torch tensor's elements fill one block of memory, each once, from data_ptr() up
    (contiguous, or channels_last / channels_last_3d): elementwise ops and order-free reductions can
    take it as a flat array as it is."""
    if x.is_contiguous():
        return True
    torch = _torch()
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last)
    if x.dim() == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def _lazy_flag(x) -> bool:
    """torch's lazy negation / conjugation: the memory holds -x (or conj x), the tensor reads as x."""
    return x.is_neg() or x.is_conj()


def device_of(x) -> int:
    """This layer's device number of a torch tensor on the CPU or a CUDA GPU (CPU: the host)."""
    if x.device.type == "cpu":
        return CPU
    return x.device.index if x.device.index is not None else _torch().cuda.current_device()


def _describe_torch(x, name, writable, dtypes, dense=False) -> Array:
    code = torch_dtype_code(x.dtype)
    _check_dtype(code, x.dtype, name, dtypes)
    if x.layout != _torch().strided:
        raise ValueError(f"{name} is a {x.layout} tensor; pass a dense tensor (for sparse ones, their _values())")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name} is on device '{x.device}'; adaptive_amp runs on the CPU and on CUDA GPUs")
    device = device_of(x)
    if _lazy_flag(x):
        raise ValueError(f"{name} has torch's lazy negation/conjugation flag (a view such as x.conj().imag); pass "
                         f"{name}.resolve_neg() (and copy the result back if needed)")
    # Before the layout: a strided leaf told to pass x.contiguous() would pass a copy that the write never
    # leaves (and torch refuses in-place ops on such a leaf whatever its layout).
    if writable and x.requires_grad and x.is_leaf:
        raise ValueError(
            f"{name} is a leaf tensor that requires grad; an in-place op on it would break autograd. "
            "Pass its gradient (p.grad) or p.detach()"
        )
    if not (x.is_contiguous() or (dense and _dense_layout(x))):
        if x.requires_grad and x.is_leaf:  # a parameter (the optimizers write it): its .contiguous() is a copy
            raise ValueError(f"{name} is not contiguous (a transposed or sliced view) and is a leaf that requires "
                             f"grad, such as a parameter: {name}.contiguous() would be a copy, not the parameter. "
                             "Give the parameter contiguous (or channels_last) memory where the model is built "
                             "(nn.Parameter(w.contiguous()))")
        raise ValueError(f"{name} is not contiguous; pass x.contiguous() (and copy the result back if needed)")
    return Array(x.data_ptr(), x.numel(), code, device, "torch", x)


def _describe_numpy(x: np.ndarray, name, writable, dtypes) -> Array:
    code = _CODE_BY_NAME.get(x.dtype.name)
    _check_dtype(code, x.dtype, name, dtypes)
    if not x.dtype.isnative:
        # The kernels read the host's byte order; a big-endian array would be read as garbage.
        raise ValueError(f"{name} has non-native byte order (dtype {x.dtype.str}); pass "
                         f"{name}.astype({name}.dtype.newbyteorder('='))")
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


def describe(x, name: str, *, writable: bool, dtypes: Sequence[int], dense: bool = False) -> Array:
    """One array -> Array, with errors that name `name`.

    dense: also take torch tensors in a dense permuted layout (channels_last) as they are (for ops whose
    result does not depend on the order of elements in memory)."""
    if is_torch_tensor(x):
        return _describe_torch(x, name, writable, dtypes, dense)
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
    objs: tuple  # what the pointers point into: held by the caller until the native call returns
    copies: tuple = ()  # (caller's array, contiguous copy the core sees) for strided inputs; see write_back
    watch: tuple = ()  # per item, the torch tensor whose pointer the native launch reads again (None: not torch)


def watched(a: Optional[Array]):
    """What a launch's ``watch`` argument holds for one described array: the torch tensor, whose pointer the
    native call reads again right before it launches (another thread may have given it new memory since it
    was described; see csrc/bindings.cpp, "Pointers read before the launching call"), else None (numpy arrays
    and DLPack capsules keep their memory while referenced; an argument not given)."""
    return a.obj if a is not None and a.framework == "torch" else None


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
    found = _C.describe_tensors(xs, allowed, writable)
    if found is None:
        return None
    ptrs, numels, codes, device = found
    return Batch(ptrs, numels, codes, device, "torch", None, xs, (), xs)


def _strided_copies(xs: tuple, name: str, writable: bool):
    """Contiguous copies of the arrays the kernels cannot take as they are -> (arrays to describe, copies).

    Torch tensors: strided views (slices, transposes, expanded), lazily negated views; dense permuted
    layouts (channels_last) need no copy. Numpy arrays: anything not C-contiguous or not in the host's byte
    order. A writing op refuses what torch's in-place ops refuse (overlapping memory, a leaf that requires
    grad, a read-only array) before anything is copied or written.
    """
    out, copies = list(xs), []
    for i, x in enumerate(xs):
        if is_torch_tensor(x):
            if x.layout != _torch().strided or (not _lazy_flag(x) and _dense_layout(x)):
                continue  # (describe names a sparse layout)
            if writable:
                if x.requires_grad and x.is_leaf:
                    _describe_torch(x, f"{name}[{i}]", True, (FLOAT32, FLOAT16, BFLOAT16, INT32))  # names it
                overlap = getattr(_torch(), "_debug_has_internal_overlap", None)
                if overlap is not None and overlap(x) == 1:
                    raise ValueError(f"{name}[{i}] has overlapping memory (an expanded view) and this op writes in "
                                     "place; pass a tensor whose elements are distinct (x.clone())")
            copy = x.detach().resolve_conj().resolve_neg().contiguous()
            if copy.data_ptr() == x.data_ptr() and copy.numel():
                copy = copy.clone()
        elif isinstance(x, np.ndarray):
            if x.flags.c_contiguous and x.dtype.isnative:
                continue
            if writable and not x.flags.writeable:
                continue  # describe names it
            native = x.dtype if x.dtype.isnative else x.dtype.newbyteorder("=")
            copy = np.ascontiguousarray(x, dtype=native)
        else:
            continue
        out[i] = copy
        copies.append((x, copy))
    return tuple(out), tuple(copies)


def _byte_bounds(x):
    """(device, lowest byte, one past the highest byte) that a torch tensor or numpy array spans; None if empty."""
    if is_torch_tensor(x):
        if x.numel() == 0:
            return None
        lo = hi = x.data_ptr()
        size = x.element_size()
        for extent, stride in zip(x.shape, x.stride()):
            reach = (extent - 1) * stride * size
            lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
        return str(x.device), lo, hi + size
    if isinstance(x, np.ndarray) and x.size:
        lo, hi = _np_byte_bounds(x)
        return "cpu", lo, hi
    return None


def _np_byte_bounds(x):
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy < 2
        byte_bounds = np.byte_bounds
    return byte_bounds(x)


def _check_copies_alias(originals, name, writable, outputs):
    """The core checks aliasing among the arrays it is handed, but a strided view goes to it as a copy:
    check the caller's arrays here (by the spans they cover: views that interleave count as sharing)."""
    spans = []
    for i, x in enumerate(originals):
        b = _byte_bounds(x)
        if b is not None:
            spans.append((b, f"{name}[{i}]", writable))
    for x, what in outputs:
        b = _byte_bounds(x)
        if b is not None:
            spans.append((b, what, True))
    spans.sort(key=lambda s: (s[0][0], s[0][1]))
    reach_any = reach_written = None  # the furthest-reaching span so far, and written span, of this device
    for span in spans:
        (dev, lo, hi), what, written = span
        if reach_any is not None and reach_any[0][0] != dev:
            reach_any = reach_written = None
        other = reach_any if written else reach_written
        if other is not None and lo < other[0][2]:
            raise ValueError(f"{what} shares memory with {other[1]}, and this op writes one of them; pass "
                             "separate tensors")
        if reach_any is None or hi > reach_any[0][2]:
            reach_any = span
        if written and (reach_written is None or hi > reach_written[0][2]):
            reach_written = span


def describe_many(xs: Sequence, name: str, *, writable: bool, dtypes: Sequence[int], strided: bool = False,
                  outputs: Sequence = (), dense: bool = False) -> Batch:
    """A list of arrays of one device -> Batch. Errors name `name[i]`.

    The list is copied first (a tuple the Batch holds), so another thread that clears or changes the
    caller's list cannot free an array the core is using: keep the Batch until the native call returns.

    dense: take dense permuted torch layouts (channels_last) as they are, without copying anything else
    (for elementwise ops whose caller checks that all operands share one layout).

    outputs: (array, name) pairs the op writes besides the list, checked against strided inputs (which
    the core sees only as copies).

    strided: take non-contiguous arrays too, for ops whose result does not depend on the order of
    elements in memory: dense permuted torch layouts (channels_last) as they are, everything else through
    a contiguous copy (numpy: also non-native byte order); after a writing op, write_back(batch) copies
    the results into the caller's arrays.
    """
    xs = tuple(xs)
    batch = _torch_fast_batch(xs, writable, dtypes)
    if batch is not None:
        return batch
    copies = ()
    if strided:
        originals = xs
        xs, copies = _strided_copies(xs, name, writable)
        if copies:
            _check_copies_alias(originals, name, writable, outputs)
    arrays = [describe(x, f"{name}[{i}]", writable=writable, dtypes=dtypes, dense=strided or dense)
              for i, x in enumerate(xs)]
    first = arrays[0]
    for i, a in enumerate(arrays):
        if a.device != first.device:
            raise ValueError(
                f"{name}[{i}] is on {device_name(a.device)} but {name}[0] is on {device_name(first.device)}; "
                "pass the tensors of one device per call"
            )
    return Batch([a.ptr for a in arrays], [a.numel for a in arrays], [a.dtype for a in arrays], first.device,
                 first.framework, arrays, xs, copies, tuple(watched(a) for a in arrays))


def write_back(batch: Batch):
    """Copies the results of a writing op from the contiguous copies into the caller's strided arrays
    (torch: on the current stream, its version counter bumped; not recorded by autograd)."""
    if not batch.copies:
        return
    torch = _torch()
    for orig, copy in batch.copies:
        if is_torch_tensor(orig):
            with torch.no_grad():
                orig.copy_(copy)
        else:
            orig[...] = copy


def check_scalar(a: Array, name: str, device: int):
    if a.numel != 1:
        raise ValueError(f"{name} has {a.numel} elements; pass a 1-element float32 tensor")
    if a.device != device:
        raise ValueError(f"{name} is on {device_name(a.device)} but the tensors are on {device_name(device)}")


def describe_scalar(x, name: str, *, writable: bool, device: int) -> Array:
    """describe() and check_scalar() of a 1-element float32 argument (found_inf, inv_scale). A plain torch
    tensor goes through the native batch reader (_C.describe_tensors: the same checks, a fraction of the
    time; it matters to the plans, whose per-call host work is little else); anything else, or anything it
    refuses, through describe(), which names what is wrong."""
    if is_torch_tensor(x):
        batch = _torch_fast_batch((x,), writable, (FLOAT32,))
        if batch is not None and batch.numels[0] == 1 and batch.device == device:
            return Array(batch.ptrs[0], 1, FLOAT32, device, "torch", x)
    a = describe(x, name, writable=writable, dtypes=(FLOAT32,))
    check_scalar(a, name, device)
    return a


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
        torch = _torch()
        # The raw handle without building a torch.cuda.Stream object (a few microseconds a call); the private
        # function is what inductor's generated code calls for the same purpose.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream
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
