"""tensor_stats: argument handling and the :class:`TensorStats` result.

``ops.tensor_stats`` is the public entry; this module validates its
arguments, runs the native kernel (csrc/stats.h) and wraps the device-side
result. Needs only numpy; torch tensors, numpy arrays and DLPack arrays all
work.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import _C, _native
from .names import format_name as _spelled_format
from ._native import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT16, FLOAT32

#: Every column of the native result, in order (see csrc/stats.h).
FIELDS = tuple(_C.STATS_FIELDS)
#: The columns that need a format.
FORMAT_FIELDS = ("overflow_count", "underflow_count", "subnormal_count")
COUNT_FIELDS = ("numel", "nan_count", "inf_count", "zero_count") + FORMAT_FIELDS
#: Elements per chunk of the kernels (the unit of the deterministic reduction).
STATS_CHUNK = _C.STATS_CHUNK

INPUTS = (FLOAT32, FLOAT16, BFLOAT16)
FORMATS = {"float16": FLOAT16, "bfloat16": BFLOAT16, "float8_e4m3fn": FLOAT8_E4M3FN, "float8_e5m2": FLOAT8_E5M2}
_FORMAT_HELP = ("'float16' (fp16), 'bfloat16' (bf16), 'float8_e4m3fn' (e4m3) or 'float8_e5m2' (e5m2), or the torch "
                "dtype")
# Derived columns that table() can show and sort by.
DERIVED = ("overflow_fraction", "underflow_fraction", "risk")


def format_name(fmt) -> Optional[str]:
    """A format given as a name or a torch/numpy dtype -> its canonical name; None for None."""
    if fmt is None:
        return None
    name = None
    if isinstance(fmt, str):  # the spellings of adaptive_amp.names ("bf16", "e4m3"); "fp8" is ambiguous
        try:
            return _spelled_format(fmt, tuple(FORMATS), "fmt")
        except ValueError as exc:
            raise ValueError(f"{exc} (their torch or numpy dtypes work too)") from None
    else:
        torch = _native._torch()
        if torch is not None and isinstance(fmt, torch.dtype):
            name = str(fmt)[len("torch."):]
        else:
            try:
                name = np.dtype(fmt).name
            except TypeError:
                name = None
    if name not in FORMATS:
        raise ValueError(f"fmt is {fmt!r}; expected {_FORMAT_HELP}")
    return name


def _check_names(names, count):
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"names is a {type(names).__name__}; pass a list of {count} strings (one per tensor)")
    if len(names) != count:
        raise ValueError(f"names has {len(names)} entries; pass one per tensor ({count})")
    return [str(n) for n in names]


def compute(tensors, *, fmt=None, scale=None, names=None) -> "TensorStats":
    """Implementation of :func:`adaptive_amp.ops.tensor_stats` (documented there)."""
    tensors = tuple(_native.as_list(tensors, "tensors"))  # ours: another thread may change the caller's list
    fmt = format_name(fmt)
    names = _check_names(names, len(tensors))
    if scale is not None and fmt is None:
        raise ValueError("scale is given without fmt; the scale only applies to the format counts (pass fmt=...)")
    if len(tensors) == 0:
        return TensorStats(None, 0, fmt=fmt, names=names or [], framework="numpy", device=_native.CPU)
    batch = _native.describe_many(tensors, "tensors", writable=False, dtypes=INPUTS, strided=True)
    scale_ptr, per_tensor, has_value, value = 0, False, False, 1.0
    arr = None
    if scale is not None:
        if isinstance(scale, bool):
            raise TypeError("scale is a bool; pass a number, or a float32 array of 1 or one per tensor")
        if isinstance(scale, numbers.Real):
            has_value, value = True, float(np.float32(scale))
        else:
            arr = _native.describe(scale, "scale", writable=False, dtypes=(FLOAT32,))
            if arr.device != batch.device:
                raise ValueError(f"scale is on {_native.device_name(arr.device)} but the tensors are on "
                                 f"{_native.device_name(batch.device)}")
            if arr.numel not in (1, len(tensors)):
                raise ValueError(f"scale has {arr.numel} elements; pass 1 (for all tensors) or one per tensor "
                                 f"({len(tensors)})")
            scale_ptr, per_tensor = arr.ptr, arr.numel == len(tensors) and arr.numel > 1
    nfields = len(FIELDS)
    out, out_ptr = _native.empty(batch.framework, batch.device, len(tensors) * nfields * 8, -1)
    ws_bytes = _C.stats_workspace_bytes(batch.numels)
    ws_owner, ws_ptr = _native.workspace(batch.framework, batch.device, ws_bytes)
    stream = _native.current_stream(batch.framework, batch.device, batch.objs[0])
    _C.tensor_stats(batch.ptrs, batch.numels, batch.dtypes, FORMATS[fmt] if fmt else -1, scale_ptr, per_tensor,
                    has_value, value, out_ptr, ws_ptr, ws_bytes, batch.device, stream,
                    (batch.watch, _native.watched(arr)))
    _native.keep_until_done(ws_owner, batch.device)
    return TensorStats(out, len(tensors), fmt=fmt, names=names, framework=batch.framework, device=batch.device)


def _fraction(count, numel):
    return count / numel if numel else 0.0


class TensorStats:
    """Per-tensor statistics of a list of tensors, kept on the device until read.

    Creating one launches the kernels and returns at once; the first read
    (``to_dict()``, ``table()``, ``rows()``, indexing) copies every
    statistic to the host in one transfer, which waits for the kernels.

    * ``stats["amax"]`` or ``stats.to_dict()["amax"]``: one value per tensor.
    * ``stats.table(sort_by="risk")``: a text table.
    * ``stats.raw``: the device buffer itself, shape ``(len(stats), len(FIELDS))``
      float64 (columns in :data:`FIELDS` order), for code that wants to stay
      on the device (no synchronization).
    """

    def __init__(self, buffer, count, *, fmt, names, framework, device, sort_by=None):
        self._buffer = buffer  # raw bytes: count * len(FIELDS) float64
        self._count = count
        self.fmt = fmt
        self._names = list(names) if names is not None else None  # default labels made on first use
        self._framework = framework
        self._device = device
        self._host = None
        self.sort_by = sort_by  # default order of table() and rows()
        self._stream = None
        if framework == "torch" and device != _native.CPU:
            self._stream = _native._torch().cuda.current_stream(device)

    @property
    def names(self) -> List[str]:
        """Row labels: the names given to tensor_stats, else ``tensors[i]``."""
        if self._names is None:
            self._names = [f"tensors[{i}]" for i in range(self._count)]
        return self._names

    def __len__(self):
        return self._count

    @property
    def fields(self) -> tuple:
        """The statistics this result holds (format counts only with a format)."""
        return FIELDS if self.fmt else tuple(f for f in FIELDS if f not in FORMAT_FIELDS)

    @property
    def raw(self):
        """The device buffer as a (tensors, fields) float64 array of the caller's framework."""
        if self._buffer is None:
            return np.zeros((0, len(FIELDS)))
        b = self._buffer
        if self._framework == "torch" or _native.is_torch_tensor(b):
            return b.view(_native._torch().float64).view(self._count, len(FIELDS))
        return b.view(np.float64 if isinstance(b, np.ndarray) else "float64").reshape(self._count, len(FIELDS))

    def _values(self) -> np.ndarray:
        """Every statistic as a host (tensors, fields) float64 array; one transfer, then cached."""
        if self._host is None:
            raw = self.raw
            if _native.is_torch_tensor(raw):
                torch = _native._torch()
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):  # ordered after the kernels
                        host = raw.cpu()
                else:
                    host = raw
                self._host = host.numpy().copy()
            elif isinstance(raw, np.ndarray):
                self._host = raw.copy()
            else:  # CuPy
                self._host = raw.get()
        return self._host

    def to_dict(self) -> Dict[str, list]:
        """Statistic name -> list with one entry per tensor (counts as ints)."""
        values = self._values()
        out = {}
        for j, name in enumerate(FIELDS):
            if name not in self.fields:
                continue
            col = values[:, j].tolist()
            out[name] = [int(v) for v in col] if name in COUNT_FIELDS else col
        return out

    def __getitem__(self, stat: str) -> list:
        if stat in DERIVED:
            return [row[stat] for row in self.rows(sort_by=None)]
        try:
            return self.to_dict()[stat]
        except KeyError:
            raise KeyError(f"{stat!r} is not a statistic here; choose from {', '.join(self.fields)}") from None

    def rows(self, sort_by: Optional[str] = "default", descending: Optional[bool] = None) -> List[dict]:
        """One dict per tensor (``name``, every statistic, and the derived
        ``overflow_fraction``, ``underflow_fraction`` and ``risk``), in list
        order or sorted by a column; NaN sorts last."""
        d = self.to_dict()
        keys = ("index", "name") + tuple(d)
        # (zip over the columns: a monitor read makes 600 of these rows on a 1B Llama, and a dict
        # comprehension indexing every column took twice as long)
        rows = [dict(zip(keys, values)) for values in zip(range(self._count), self.names, *d.values())]
        if self.fmt:
            for row in rows:
                n = row["numel"]
                over, under = _fraction(row["overflow_count"], n), _fraction(row["underflow_count"], n)
                row["overflow_fraction"], row["underflow_fraction"], row["risk"] = over, under, over + under
        if sort_by == "default":
            sort_by = self.sort_by
        if sort_by is None:
            return rows
        return sort_rows(rows, sort_by, descending)

    def table(self, names: Optional[Sequence[str]] = None, sort_by: Optional[str] = "default",
              descending: Optional[bool] = None, limit: Optional[int] = None,
              columns: Optional[Sequence[str]] = None) -> str:
        """A readable text table, one line per tensor.

        Args:
            names: row labels (default: the names given to tensor_stats, else ``tensors[i]``).
            sort_by: any column (a statistic, ``name``, or with a format
                ``overflow_fraction``, ``underflow_fraction``, ``risk``);
                default: list order (or the order the result was made with,
                e.g. risk for the debug reports).
            descending: default True for numbers, False for ``name``.
            limit: show only the first `limit` rows (after sorting).
            columns: the columns to show (default: all).
        """
        if names is not None:
            names = _check_names(names, self._count)
        rows = self.rows(sort_by=None)
        if names is not None:
            for row, n in zip(rows, names):
                row["name"] = n
        if sort_by == "default":
            sort_by = self.sort_by
        if sort_by is not None:
            rows = sort_rows(rows, sort_by, descending)
        if limit is not None:
            rows = rows[:limit]
        cols = list(columns) if columns is not None else ["name", *self.fields] + (["risk"] if self.fmt else [])
        for c in cols:
            if c not in ("name", "index", *self.fields, *(DERIVED if self.fmt else ())):
                raise ValueError(f"columns: {c!r} is not a column here")
        cells = [[_cell(row.get(c)) for c in cols] for row in rows]
        widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(cols)]
        title = f"tensor_stats: {self._count} tensor(s)" + (f", format {self.fmt}" if self.fmt else "")
        lines = [title, "  ".join(c.rjust(w) if c != "name" else c.ljust(w) for c, w in zip(cols, widths))]
        for r in cells:
            lines.append("  ".join(v.ljust(w) if c == "name" else v.rjust(w) for v, c, w in zip(r, cols, widths)))
        return "\n".join(lines)

    def __repr__(self):
        state = "read" if self._host is not None else "on device, not read yet"
        return f"TensorStats({self._count} tensors, fmt={self.fmt!r}, {state})"

    def __str__(self):
        return self.table()


def sort_rows(rows, sort_by, descending=None):
    if not rows:
        return rows
    if sort_by not in rows[0]:
        raise ValueError(f"sort_by is {sort_by!r}; choose one of {', '.join(k for k in rows[0] if k != 'index')}")
    if descending is None:
        descending = sort_by != "name"
    if sort_by == "name":
        return sorted(rows, key=lambda r: r["name"], reverse=descending)
    good, bad = [], []
    for r in rows:
        (bad if isinstance(r[sort_by], float) and math.isnan(r[sort_by]) else good).append(r)
    if sort_by == "risk":
        # Tensors that already hold NaN or inf come first, then by risk.
        def key(r):
            return (r["nan_count"] + r["inf_count"] > 0, r["risk"])
    else:
        def key(r):
            return r[sort_by]
    return sorted(good, key=key, reverse=descending) + bad


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "nan"
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


class _Joined(TensorStats):
    """Several results (e.g. one per device) read as one; each part is read with one transfer."""

    def __init__(self, parts: List[TensorStats], *, sort_by=None):
        fmt = parts[0].fmt if parts else None
        names = [n for p in parts for n in p.names]
        super().__init__(None, len(names), fmt=fmt, names=names, framework="numpy", device=_native.CPU,
                         sort_by=sort_by)
        self._parts = parts

    @property
    def raw(self):
        raise AttributeError("a result joined from several devices has no single device buffer; use .parts")

    @property
    def parts(self) -> List[TensorStats]:
        return list(self._parts)

    def _values(self) -> np.ndarray:
        if self._host is None:
            vals = [p._values() for p in self._parts]
            self._host = np.concatenate(vals) if vals else np.zeros((0, len(FIELDS)))
        return self._host


def join(parts: List[TensorStats], *, sort_by=None) -> TensorStats:
    """One result from several (their rows in order)."""
    if len(parts) == 1:
        parts[0].sort_by = sort_by
        return parts[0]
    return _Joined(parts, sort_by=sort_by)
