"""adaptive_amp.tensor_stats: parity with the reference, formats, accuracy, determinism, bad input, debug reports.

Oracle: ``adaptive_amp.reference.tensor_stats`` (plain torch, float64; its
format counts come from torch's own round-to-nearest-even casts). Counts,
min, max, amax and min_abs_nonzero must match exactly; mean, std and l2_norm
to a relative 1e-5 (the kernels sum in fp32 within small blocks, fp64 beyond).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import adaptive_amp
from adaptive_amp import reference
from adaptive_amp.stats import FIELDS, STATS_CHUNK
from conftest import assert_stats_match, requires_cuda

CHUNK = STATS_CHUNK
FORMATS = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF, NAN = float("inf"), float("nan")


def cuda_test(fn):
    return pytest.mark.cuda(requires_cuda(fn))


# --------------------------------------------------------------------------- data

_SPECIALS = [NAN, INF, -INF, 0.0, -0.0, 65504.0, 65520.0, -70000.0, 448.0, 464.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
             2.0**-14, 2.0**-14 - 2.0**-25, 1e-40, -1.401298464324817e-45, 3.3895313892515355e38, 1.0, -1.0]


def make(n, dtype=torch.float32, seed=0, *, specials=None, spread=20, device="cpu"):
    """Random data over many binades; specials "all" (with NaN/inf) or "finite" planted at random places."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).float())
    if specials and n:
        values = [v for v in _SPECIALS if specials == "all" or math.isfinite(v)]
        k = min(n, len(values))
        idx = torch.randperm(n, generator=g)[:k]
        x[idx] = torch.tensor(values[:k], dtype=torch.float32)
    return x.to(dtype).to(device)


def mixed_list(device, seed=0, specials="all"):
    """Mixed dtypes and sizes around the chunk and block edges, plus the corner cases."""
    sizes = [2 * CHUNK + 3, 777, 1, 0, CHUNK, 1025, 5000]
    ts = [make(n, DTYPES[i % 3], seed + i, specials=specials, device=device) for i, n in enumerate(sizes)]
    ts += [
        torch.zeros(300, device=device),                                # all zero
        torch.full((10,), NAN, device=device),                          # no finite element
        torch.tensor([INF, -INF, 2.5], device=device),                  # one finite element
        torch.tensor([-0.0, 0.0, -0.0], device=device, dtype=torch.float16),
        torch.tensor(7.0, device=device, dtype=torch.bfloat16),         # 0-dim
        make(40000, torch.float32, seed + 50, device=device)[3:3 + 20000],   # view at an odd offset
        make(4000, torch.float16, seed + 51, device=device).reshape(40, 100)[5:],  # 2-D view with an offset
        make(3000, torch.float32, seed + 52, spread=0, device=device) * 1e-33,   # tiny (careful path)
        make(3000, torch.float32, seed + 53, spread=0, device=device) * 1e33,    # huge: squares overflow fp32
        1000.0 + 1e-3 * make(5000, torch.float32, seed + 54, spread=0, device=device),  # |mean| >> std
    ]
    return ts


# ----------------------------------------------------------------------- parity


@pytest.mark.parametrize("specials", [None, "all"])
def test_parity_without_format(device, specials):
    ts = mixed_list(device, 1, specials)
    got = adaptive_amp.tensor_stats(ts).to_dict()
    assert_stats_match(got, reference.tensor_stats(ts), "no format")
    assert "overflow_count" not in got


def _scales(kind, ts, device):
    if kind == "none":
        return None
    if kind == "number":
        return 1024.0
    if kind == "one":
        return torch.tensor([2.0**-8], device=device)
    g = torch.Generator().manual_seed(len(ts))
    exps = torch.randint(-12, 13, (len(ts),), generator=g).float()
    s = torch.exp2(exps)
    s[1], s[2] = 0.0, INF  # a zero and an infinite scale are allowed
    return s.to(device)


@pytest.mark.parametrize("scale", ["none", "number", "one", "per_tensor"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_parity_with_format(device, fmt, scale):
    ts = mixed_list(device, 2)
    s = _scales(scale, ts, device)
    got = adaptive_amp.tensor_stats(ts, fmt=fmt, scale=s).to_dict()
    assert_stats_match(got, reference.tensor_stats(ts, fmt=fmt, scale=s), f"{fmt} scale={scale}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_edges(device, fmt):
    """Values at and next to every threshold: half the smallest subnormal, the normal boundary, the max."""
    info = torch.finfo(getattr(torch, fmt))
    sub = info.smallest_normal * info.eps  # smallest subnormal
    points = [sub / 2, sub, info.smallest_normal - sub / 2, info.smallest_normal, info.max,
              info.max + info.eps * info.max / 4, 2 * info.max, sub / 4, 3 * sub / 4]
    vals = []
    for p in points:
        p32 = torch.tensor(p, dtype=torch.float32)
        vals += [p32, torch.nextafter(p32, torch.tensor(INF)), torch.nextafter(p32, torch.tensor(0.0))]
    x = torch.stack(vals)
    x = torch.cat([x, -x, torch.tensor([0.0, 3.4e38, -3.4e38])]).to(device)
    for s in (None, 0.5, 3.0):
        got = adaptive_amp.tensor_stats([x], fmt=fmt, scale=s).to_dict()
        exp = reference.tensor_stats([x], fmt=fmt, scale=s)
        assert_stats_match(got, exp, f"{fmt} scale={s}")
    # The reference counts with torch's casts; check it against the definitions once.
    exp = reference.tensor_stats([x], fmt=fmt)
    ax = x.double().abs()
    ax = ax[torch.isfinite(ax)]
    assert exp["overflow_count"][0] == int((ax > info.max).sum())
    assert exp["underflow_count"][0] == int(((ax > 0) & (ax <= sub / 2)).sum())
    assert exp["subnormal_count"][0] == int(((ax > sub / 2) & (ax < info.smallest_normal - sub / 2)).sum())


def test_torch_dtype_as_format(device):
    ts = mixed_list(device, 3, None)
    a = adaptive_amp.tensor_stats(ts, fmt=torch.float8_e4m3fn).to_dict()
    b = adaptive_amp.tensor_stats(ts, fmt="float8_e4m3fn").to_dict()
    assert repr(a) == repr(b)


def test_long_list_spans_several_launches(device):
    """5000 tensors: more than one tensor table on CUDA."""
    g = torch.Generator().manual_seed(9)
    sizes = torch.randint(0, 40, (5000,), generator=g).tolist()
    ts = [make(n, DTYPES[i % 3], i, specials="all" if i % 7 == 0 else None, device=device)
          for i, n in enumerate(sizes)]
    s = torch.exp2(torch.randint(-4, 5, (5000,), generator=g).float()).to(device)
    got = adaptive_amp.tensor_stats(ts, fmt="float16", scale=s).to_dict()
    assert_stats_match(got, reference.tensor_stats(ts, fmt="float16", scale=s), "5000 tensors")


def test_deterministic(device):
    ts = mixed_list(device, 4) + [make(300000, torch.float32, 77, device=device)]
    a = adaptive_amp.tensor_stats(ts, fmt="float8_e5m2", scale=4.0).raw.cpu().clone()
    b = adaptive_amp.tensor_stats(ts, fmt="float8_e5m2", scale=4.0).raw.cpu().clone()
    assert torch.equal(a.view(torch.int64), b.view(torch.int64))


def test_accuracy_of_mean_and_std_on_2e7_elements(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000_000, generator=g).mul_(2.0).add_(3.0).to(device)
    got = adaptive_amp.tensor_stats([x]).to_dict()
    x64 = x.double()
    mean, std = float(x64.mean()), float(x64.std())
    del x64
    assert abs(got["mean"][0] - mean) <= 1e-6 * abs(mean)
    assert abs(got["std"][0] - std) <= 1e-6 * std
    # |mean| >> std: the shifted sums keep std accurate.
    y = (1000.0 + 0.01 * torch.randn(2_000_000, generator=g)).to(device)
    got = adaptive_amp.tensor_stats([y]).to_dict()
    y64 = y.double()
    assert abs(got["std"][0] - float(y64.std())) <= 1e-6 * float(y64.std())
    assert abs(got["mean"][0] - float(y64.mean())) <= 1e-9 * float(y64.mean())


def test_accuracy_when_the_first_chunks_are_not_finite_or_an_outlier(device):
    # Per tensor, chunks are summed against one reference: the mean of the
    # first chunk with a finite element. Leading chunks without one, chunks
    # that start with a NaN, and a first counted chunk that is a lone outlier
    # must not cost accuracy.
    g = torch.Generator().manual_seed(5)
    # |mean| >> std after three chunks of NaN, and a NaN first in every
    # chunk and block: no pivot of 0 may be used for such data.
    a = torch.cat([torch.full((3 * CHUNK + 11,), NAN), 1000.0 + 1e-3 * torch.randn(5 * CHUNK, generator=g)])
    a[::1024] = NAN
    b = torch.cat([torch.full((CHUNK,), INF), torch.randn(4 * CHUNK + 7, generator=g)])
    b[CHUNK // 2] = 1e8
    c = torch.cat([torch.full((CHUNK - 1,), NAN), torch.tensor([-3e4]), torch.randn(6 * CHUNK, generator=g)])
    ts = [t.to(device) for t in (a, b, c)]
    got = adaptive_amp.tensor_stats(ts).to_dict()
    for i, t in enumerate(ts):
        f = t[torch.isfinite(t)].double().cpu()
        mean, std = float(f.mean()), float(f.std())
        assert abs(got["mean"][i] - mean) <= 1e-9 * (abs(mean) + std), i
        assert got["std"][i] == pytest.approx(std, rel=1e-6), i
        assert got["l2_norm"][i] == pytest.approx(float(f.norm()), rel=1e-6), i


@pytest.mark.parametrize("n", [20 * CHUNK + 7, 4_000_000])  # CUDA: finished by a warp, by a block
def test_accuracy_when_the_first_counted_chunk_is_a_lone_outlier(device, n):
    # The merge reference is then the outlier, far from the mean: ss - s^2/n
    # cancels a factor ~n, and the merge is redone against the mean.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g)
    x[:CHUNK] = NAN
    x[CHUNK - 1] = 1e5
    f = x[torch.isfinite(x)].double()
    got = adaptive_amp.tensor_stats([x.to(device)]).to_dict()
    assert got["std"][0] == pytest.approx(float(f.std()), rel=1e-10)
    assert got["l2_norm"][0] == pytest.approx(float(f.norm()), rel=1e-10)


def test_a_row_does_not_depend_on_the_rest_of_the_list(device):
    # On CUDA a list of small tensors is finished a tensor per warp, a list with a tensor of more than 32
    # chunks a tensor per block; a tensor's row is the same either way.
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3 * CHUNK + 11, generator=g).add_(1000.0)
    led_by_nan = torch.randn(5 * CHUNK, generator=g)
    led_by_nan[:CHUNK + 3] = NAN
    small, large = torch.randn(100, generator=g), torch.randn(33 * CHUNK, generator=g)
    rows = []
    for other in (small, large):
        got = adaptive_amp.tensor_stats([t.to(device) for t in (x, led_by_nan, other)], fmt="float16")
        assert_stats_match(got.to_dict(), reference.tensor_stats([x, led_by_nan, other], fmt="float16"),
                           f"with a tensor of {other.numel()} elements")
        rows.append(got.raw[:2].cpu())
    assert torch.equal(rows[0].view(torch.int64), rows[1].view(torch.int64))


def test_semantics_of_specials(device):
    x = torch.tensor([NAN, INF, -INF, 0.0, -0.0, 2.0, -4.0, 1e-30], device=device)
    d = adaptive_amp.tensor_stats([x, torch.zeros(0, device=device), torch.full((3,), NAN, device=device),
                                   torch.tensor([5.0], device=device)], fmt="float16").to_dict()
    assert d["numel"] == [8, 0, 3, 1]
    assert d["nan_count"] == [1, 0, 3, 0] and d["inf_count"] == [2, 0, 0, 0] and d["zero_count"] == [2, 0, 0, 0]
    assert d["min"][0] == -4.0 and d["max"][0] == 2.0 and d["amax"][0] == 4.0
    assert d["min_abs_nonzero"][0] == float(torch.tensor(1e-30))
    assert d["underflow_count"] == [1, 0, 0, 0]
    for key in ("min", "max", "amax", "mean", "l2_norm", "std", "min_abs_nonzero", "dynamic_range"):
        assert math.isnan(d[key][1]) and math.isnan(d[key][2]), key
    assert d["mean"][3] == 5.0 and d["l2_norm"][3] == 5.0 and math.isnan(d["std"][3])
    assert d["dynamic_range"][3] == 0.0


# ----------------------------------------------------------------------- result object


def test_lazy_result_and_table(device):
    ts = [make(100, torch.float32, 1, device=device), torch.tensor([NAN, 1.0], device=device),
          make(50, torch.float16, 2, spread=30, device=device)]
    s = adaptive_amp.tensor_stats(ts, fmt="float16", names=["a", "b", "c"])
    assert isinstance(s, adaptive_amp.TensorStats) and len(s) == 3
    assert "not read yet" in repr(s)
    raw = s.raw
    assert tuple(raw.shape) == (3, len(FIELDS)) and raw.dtype == torch.float64 and raw.device == ts[0].device
    text = s.table(sort_by="nan_count")
    lines = text.splitlines()
    assert lines[2].startswith("b ")  # the one with a NaN first
    assert "not read yet" not in repr(s)
    assert s.table(sort_by="name", descending=False).splitlines()[2].startswith("a ")
    assert s.table(names=["x", "y", "z"], limit=1, sort_by="amax").count("\n") == 2
    assert s["amax"] == s.to_dict()["amax"]
    assert [r["name"] for r in s.rows(sort_by="risk")][0] == "b"
    with pytest.raises(ValueError, match="sort_by"):
        s.table(sort_by="nope")
    with pytest.raises(KeyError, match="nope"):
        s["nope"]
    unnamed = adaptive_amp.tensor_stats(ts)
    assert unnamed.names == ["tensors[0]", "tensors[1]", "tensors[2]"]
    assert unnamed.table(sort_by="nan_count").splitlines()[2].startswith("tensors[1] ")


def test_numpy_and_dlpack_inputs():
    ts = [make(5000, torch.float32, 1, specials="all"), make(300, torch.float16, 2)]
    exp = reference.tensor_stats(ts, fmt="bfloat16", scale=8.0)
    got = adaptive_amp.tensor_stats([t.numpy() for t in ts], fmt="bfloat16", scale=8.0)
    assert isinstance(got.raw, np.ndarray)
    assert_stats_match(got.to_dict(), exp, "numpy")

    class Wrapped:
        def __init__(self, t):
            self._t = t

        def __dlpack__(self, **kwargs):
            return self._t.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self._t.__dlpack_device__()

    got = adaptive_amp.tensor_stats([Wrapped(t) for t in ts], fmt="bfloat16", scale=8.0)
    assert_stats_match(got.to_dict(), exp, "dlpack")


def test_empty_list():
    s = adaptive_amp.tensor_stats([], fmt="float16")
    assert len(s) == 0 and s.to_dict()["numel"] == []
    assert "0 tensor(s)" in s.table()


# ----------------------------------------------------------------------- bad input


def test_bad_input(device):
    good = torch.ones(4, device=device)
    with pytest.raises(TypeError, match=r"tensors\[1\].*int64"):
        adaptive_amp.tensor_stats([good, torch.ones(4, dtype=torch.int64, device=device)])
    with pytest.raises(TypeError, match=r"tensors\[0\].*float64"):
        adaptive_amp.tensor_stats([good.double()])
    with pytest.raises(ValueError, match="fmt"):
        adaptive_amp.tensor_stats([good], fmt="float8")
    with pytest.raises(ValueError, match="fmt"):
        adaptive_amp.tensor_stats([good], fmt=torch.float32)
    with pytest.raises(ValueError, match="scale.*without fmt"):
        adaptive_amp.tensor_stats([good], scale=2.0)
    with pytest.raises(ValueError, match="scale has 3 elements"):
        adaptive_amp.tensor_stats([good, good], fmt="float16", scale=torch.ones(3, device=device))
    with pytest.raises(TypeError, match="scale"):
        adaptive_amp.tensor_stats([good], fmt="float16", scale=torch.ones(1, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="names"):
        adaptive_amp.tensor_stats([good, good], names=["a"])
    with pytest.raises(TypeError, match="tensors"):
        adaptive_amp.tensor_stats(3.0)



@cuda_test
def test_device_mismatch_cuda():
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        adaptive_amp.tensor_stats([torch.ones(4, device="cuda"), torch.ones(4)])
    with pytest.raises(ValueError, match="scale"):
        adaptive_amp.tensor_stats([torch.ones(4, device="cuda")], fmt="float16", scale=torch.ones(1))


# ----------------------------------------------------------------------- CUDA specifics


@cuda_test
def test_cuda_matches_cpu_exactly_where_exact():
    ts = mixed_list("cpu", 5)
    s = _scales("per_tensor", ts, "cpu")
    cpu = adaptive_amp.tensor_stats(ts, fmt="float8_e4m3fn", scale=s).to_dict()
    gpu = adaptive_amp.tensor_stats([t.cuda() for t in ts], fmt="float8_e4m3fn", scale=s.cuda()).to_dict()
    assert_stats_match(gpu, cpu, "cuda vs cpu")


@cuda_test
def test_cuda_graph_capture_and_no_sync():
    ts = [make(100000, torch.float32, i, device="cuda") for i in range(3)]
    scale = torch.tensor([4.0], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        adaptive_amp.tensor_stats(ts, fmt="float16", scale=scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = adaptive_amp.tensor_stats(ts, fmt="float16", scale=scale)
        raw = captured.raw
    for t in ts:
        t.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    exp = reference.tensor_stats(ts, fmt="float16", scale=scale)
    got = {k: v for k, v in zip(FIELDS, raw.cpu().T.tolist())}
    got = {k: ([int(x) for x in v] if k.endswith("count") or k == "numel" else v) for k, v in got.items()}
    assert_stats_match(got, exp, "graph replay")


@cuda_test
def test_cuda_misaligned_views_and_chunk_edges():
    base = make(5 * CHUNK + 17, torch.float16, 3, specials="all", device="cuda")
    ts = [base[k:k + 2 * CHUNK + 5] for k in range(1, 9)]
    got = adaptive_amp.tensor_stats(ts, fmt="float16").to_dict()
    assert_stats_match(got, reference.tensor_stats(ts, fmt="float16"), "views")


# ----------------------------------------------------------------------- debug reports


def _model(device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    m[2].weight.data[0, :8] = 1e-4  # underflows fp8 e4m3fn, not fp16
    m(torch.randn(8, 16, device=device)).sum().backward()
    m[0].weight.grad[0, 0] = 1e6      # overflows fp16
    m[0].bias.grad[3] = float("nan")
    return m


def test_grad_report(device):
    m = _model(device)
    r = adaptive_amp.debug.grad_report(m, fmt="float16")
    rows = r.rows()
    assert [row["name"] for row in rows][:2] == ["0.bias", "0.weight"]  # NaN first, then the overflow
    assert rows[1]["overflow_count"] == 1
    assert set(r.names) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    grads = [p.grad for p in m.parameters()]
    assert_stats_match(r.to_dict(), reference.tensor_stats(grads, fmt="float16"), "grad_report")
    text = str(r)
    assert "0.bias" in text.splitlines()[2]
    m[2].bias.grad = None
    assert len(adaptive_amp.debug.grad_report(m, fmt="float16")) == 3


def test_param_report(device):
    m = _model(device)
    m[2].half()
    r = adaptive_amp.debug.param_report(m, fmt="float8_e4m3fn")
    assert r.rows()[0]["name"] == "2.weight" and r.rows()[0]["underflow_count"] >= 8
    params = [p for p in m.parameters()]
    assert_stats_match(r.to_dict(), reference.tensor_stats(params, fmt="float8_e4m3fn"), "param_report")
    m.double()
    r = adaptive_amp.debug.param_report(m, fmt="bfloat16")
    assert len(r) == 0 and len(r.skipped) == 4


# --------------------------------------------------------------------------- strided views


def _stat_views(device):
    g = torch.Generator().manual_seed(5)
    r = lambda *s: (torch.randn(*s, generator=g) * 3 + 1).to(device)  # noqa: E731
    conv = torch.nn.Conv2d(4, 6, 3).to(device).to(memory_format=torch.channels_last)
    return {
        "slice": r(300)[7::3],
        "transpose_fp16": r(20, 30).half().t(),
        "column_bf16": r(40, 9).bfloat16()[:, 2],
        "expanded": r(1, 50).expand(8, 50),
        "channels_last_activation": r(2, 4, 11, 13).contiguous(memory_format=torch.channels_last),
        "channels_last_conv_weight": conv.weight.detach(),
        "permuted": r(5, 6, 7).permute(1, 2, 0),
        "negated": torch._neg_view(r(33)),
        "conj_imag": torch.randn(40, dtype=torch.complex64, generator=g).to(device).conj().imag,
        "storage_offset": r(500)[123:401],
    }


@pytest.mark.parametrize("kind", list(_stat_views("cpu")))
def test_strided_views_match_reference(device, kind):
    view = _stat_views(device)[kind]
    assert not view.is_contiguous() or view.is_neg() or view.storage_offset()
    tensors = [torch.randn(64, device=device), view]
    got = adaptive_amp.tensor_stats(tensors, fmt="float16", scale=4.0).to_dict()
    want = reference.tensor_stats([t.resolve_neg().contiguous() for t in tensors], fmt="float16", scale=4.0)
    want = want.to_dict() if hasattr(want, "to_dict") else want
    for key, values in got.items():
        torch.testing.assert_close(torch.tensor(values, dtype=torch.float64),
                                   torch.tensor(want[key], dtype=torch.float64), rtol=1e-6, atol=1e-6,
                                   equal_nan=True, msg=key)


def test_channels_last_taken_without_a_copy():
    from adaptive_amp import _native
    x = torch.randn(2, 3, 5, 4).contiguous(memory_format=torch.channels_last)
    batch = _native.describe_many([x], "tensors", writable=False, dtypes=(_native.FLOAT32,), strided=True)
    assert batch.ptrs == [x.data_ptr()] and not batch.copies


# --------------------------------------------------------------------------- the accuracy the docs state


@pytest.mark.parametrize("kind", ["normal", "offset", "bf16_cancel", "uniform", "fp16", "two_chunks_plus"])
def test_moments_within_the_documented_bound(device, kind):
    """ops.tensor_stats documents |mean - exact| <= 1e-6 mean|x| and 1e-6 relative for std and l2_norm
    (fp32 chunk sums merged in fp64): hold it to that against fp64 torch."""
    g = torch.Generator().manual_seed(3)
    n = 1 << 19
    x = {"normal": lambda: torch.randn(n, generator=g),
         "offset": lambda: torch.randn(n, generator=g) * 0.01 + 100,
         "bf16_cancel": lambda: torch.randn(n, generator=g).bfloat16(),
         "uniform": lambda: torch.rand(n, generator=g) * 1000,
         "fp16": lambda: (torch.randn(n, generator=g) * 100).half(),
         "two_chunks_plus": lambda: torch.randn(2 * 65536 + 77, generator=g) * 5 - 2}[kind]().to(device)
    st = adaptive_amp.tensor_stats([x]).to_dict()
    d = x.double().cpu()
    assert abs(st["mean"][0] - d.mean().item()) <= 1e-6 * d.abs().mean().item()
    assert abs(st["std"][0] - d.std().item()) <= 1e-6 * d.std().item()
    assert abs(st["l2_norm"][0] - d.norm().item()) <= 1e-6 * d.norm().item()


# --------------------------------------------------------------------------- the custom op (compiled statistics)

def _op_inputs(device):
    x = make(3 * CHUNK + 5, torch.bfloat16, seed=3, specials="all", device=device)
    x[0], x[-1] = INF, NAN
    img = make(2 * 3 * 5 * 7, torch.float16, seed=4, device=device).view(2, 3, 5, 7)
    return [x, img.to(memory_format=torch.channels_last), make(40, seed=5, device=device).view(8, 5)[2:, 1:3],
            torch.empty(0, device=device)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("compiled", [False, True])
def test_custom_op_gives_tensor_stats_rows_bitwise(device, compiled):
    """adaptive_amp::tensor_stats (what a compiled statistics step calls inside its graph) is tensor_stats' raw
    rows, bitwise, eager and traced with fullgraph=True; its fake gives the rows' shape and dtype."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from adaptive_amp import stats_torch

    tensors = _op_inputs(device)
    want = adaptive_amp.tensor_stats(tensors, fmt="float16").raw
    op = stats_torch.tensor_stats_op
    if compiled:
        torch._dynamo.reset()
        op = torch.compile(lambda ts, fmt: stats_torch.tensor_stats_op(ts, fmt), fullgraph=True, backend="aot_eager")
    got = op(tensors, "float16")
    assert got.shape == (len(tensors), len(FIELDS)) and got.dtype == torch.float64 and got.device == want.device
    assert torch.equal(got.nan_to_num(1.5), want.nan_to_num(1.5)) and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(op(tensors[:1], None)[:, :FIELDS.index("overflow_count")],
                       adaptive_amp.tensor_stats(tensors[:1]).raw[:, :FIELDS.index("overflow_count")])
