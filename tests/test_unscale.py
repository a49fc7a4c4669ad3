"""adaptive_amp.unscale_and_check_: parity, properties, adapters, bad input, CUDA specifics.

Oracles: ``adaptive_amp.reference.unscale_and_check_`` (plain torch) and
torch's own ``torch._amp_foreach_non_finite_check_and_unscale_``. Values and
found_inf are compared bit for bit (NaN as a class: any payload); sumsq
against a float64 computation; amax exactly.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import adaptive_amp
from adaptive_amp import reference
from conftest import assert_bitwise_equal, assert_lists_bitwise_equal, requires_cuda

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CHUNK = adaptive_amp.UNSCALE_CHUNK
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
INF = float("inf")
NAN = float("nan")

INV_SCALES = [0.5, 2.0**-16, 1.0, 3.0, 0.0, 1e-40, INF, NAN]
INV_IDS = ["half", "2^-16", "one", "three", "zero", "subnormal", "inf", "nan"]



def cuda_test(fn):
    """Mark a test as CUDA-only: the `cuda` marker plus a clean skip without a GPU."""
    return pytest.mark.cuda(requires_cuda(fn))


# --------------------------------------------------------------------------- data

# Values every dtype can hold (after rounding), beyond what randn gives.
_SPECIALS = {
    torch.float32: [NAN, INF, -INF, 0.0, -0.0, 3.4028234663852886e38, -3.4028234663852886e38,
                    1.1754943508222875e-38, 1e-40, -1.401298464324817e-45, 65504.0, 65520.0, 1.0, -1.0],
    torch.float16: [NAN, INF, -INF, 0.0, -0.0, 65504.0, -65504.0, 6.103515625e-05, 5.960464477539063e-08,
                    -5.960464477539063e-08, 3.0517578125e-05, 1.0, -1.0],
    torch.bfloat16: [NAN, INF, -INF, 0.0, -0.0, 3.3895313892515355e38, -3.3895313892515355e38,
                     1.1754943508222875e-38, 9.183549615799121e-41, -9.183549615799121e-41, 1.0, -1.0],
}
_FINITE_SPECIALS = {k: [v for v in vs if math.isfinite(v)] for k, vs in _SPECIALS.items()}


def make(n, dtype=torch.float32, seed=0, *, specials=None, device="cpu", shape=None):
    """Random, never all-zero data with magnitudes spread over a few binades.

    specials: None, "finite" (zeros, extremes, subnormals) or "all" (also NaN and +-inf),
    planted at random positions.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    spread = 8 if dtype == torch.float16 else 20
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).float())
    if specials and n:
        values = _SPECIALS[dtype] if specials == "all" else _FINITE_SPECIALS[dtype]
        k = min(n, len(values))
        idx = torch.randperm(n, generator=g)[:k]
        x[idx] = torch.tensor(values[:k], dtype=torch.float32)
    x = x.to(dtype)
    if shape is not None:
        x = x.reshape(shape)
    return x.to(device)


def scalar(value, device):
    return torch.tensor([value], dtype=torch.float32, device=device)


def clones(tensors):
    return [t.detach().clone() for t in tensors]


def torch_unscale_(tensors, found_inf, inv_scale):
    """torch's own op, called per dtype group as GradScaler does.

    torch has no CUDA bf16 kernel for it: bf16 CUDA groups run torch's CPU
    kernel on a host copy (torch's semantics are the same on both).
    """
    groups = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    for dtype, group in groups.items():
        if group[0].is_cuda and dtype == torch.bfloat16:
            host = [t.cpu() for t in group]
            found_host = found_inf.cpu()
            torch._amp_foreach_non_finite_check_and_unscale_(host, found_host, inv_scale.cpu())
            for t, h in zip(group, host):
                t.copy_(h)
            found_inf.copy_(found_host)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)


def unscaled_f32(t, inv):
    """The fp32 values y the contract defines (before rounding back), computed in torch."""
    x = t.detach().float().cpu().reshape(-1)
    inv_t = torch.tensor(inv, dtype=torch.float32)
    return x if inv == 1.0 else x * inv_t


def expected_sumsq64(t, inv):
    y = unscaled_f32(t, inv)
    return float(y.double().square().sum())


SUMSQ_RTOL = 1e-5
# The CPU kernel sums a chunk's fp16 squares in fp32 with less parallelism than
# its fp32/bf16 loops: on 16K-element chunks of spread-out data its sumsq comes
# out up to ~2.5e-5 low (measured; see the test report). fp32/bf16 on the CPU
# and every dtype on CUDA meet SUMSQ_RTOL.
SUMSQ_RTOL_CPU_FP16 = 5e-5
_F32_MIN_SUBNORMAL = 2.0**-149


def assert_sumsq_close(got, tensors, inv, rtol=None, msg=""):
    """sumsq against float64 sums of the fp32 products y (rounded to fp32 at the end).

    Relative tolerance SUMSQ_RTOL, plus the absolute error that fp32 squares
    of tiny y can have (each y*y may round in the subnormal range).
    """
    on_cpu = not (isinstance(got, torch.Tensor) and got.is_cuda) and not type(got).__module__.startswith("cupy")
    got = got.detach().cpu() if isinstance(got, torch.Tensor) else torch.from_numpy(np.asarray(got))
    assert got.dtype == torch.float32 and got.shape == (len(tensors),), (got.dtype, got.shape)
    for i, t in enumerate(tensors):
        tol = rtol
        if tol is None:
            tol = SUMSQ_RTOL_CPU_FP16 if (on_cpu and t.dtype == torch.float16) else SUMSQ_RTOL
        exp = expected_sumsq64(t, inv)
        exp32 = float(torch.tensor(exp, dtype=torch.float64).float())  # fp32 rounding of the fp64 value
        g = float(got[i])
        where = f"{msg} sumsq[{i}] (numel {t.numel()}, {t.dtype}, inv {inv})"
        if math.isnan(exp):
            assert math.isnan(g), f"{where}: {g} != nan"
        elif math.isinf(exp32):
            assert g == exp32, f"{where}: {g} != {exp32} (float64 sum {exp})"
        else:
            atol = t.numel() * _F32_MIN_SUBNORMAL
            assert math.isfinite(g) and abs(g - exp) <= tol * abs(exp) + atol, \
                f"{where}: {g} vs float64 {exp} (rel. error {(g - exp) / exp if exp else g:.3g}, rtol {tol})"


def run_ours(tensors, inv, device, *, found=0.0, **kwargs):
    ts = clones(tensors)
    f = scalar(found, device)
    i = scalar(inv, device)
    out = adaptive_amp.unscale_and_check_(ts, f, i, **kwargs)
    assert_bitwise_equal(i, scalar(inv, device), "inv_scale was modified")
    return ts, f, out


def run_reference(tensors, inv, device, *, found=0.0, **kwargs):
    ts = clones(tensors)
    f = scalar(found, device)
    out = reference.unscale_and_check_(ts, f, scalar(inv, device), **kwargs)
    return ts, f, out


def run_torch(tensors, inv, device, *, found=0.0):
    ts = clones(tensors)
    f = scalar(found, device)
    torch_unscale_(ts, f, scalar(inv, device))
    return ts, f


def mixed_list(seed, device, specials=None, sizes=(2 * CHUNK + 3, 777, 1, 0, CHUNK)):
    dtypes = [DTYPES[i % 3] for i in range(len(sizes))]
    return [make(n, dt, seed + i, specials=specials, device=device) for i, (n, dt) in enumerate(zip(sizes, dtypes))]


def case_list(case, seed, device, specials):
    if case == "mixed":
        return mixed_list(seed, device, specials)
    dtype = DTYPES[DTYPE_IDS.index(case)]
    sizes = (2 * CHUNK + 3, 777, 1, 0, CHUNK)
    return [make(n, dtype, seed + i, specials=specials, device=device) for i, n in enumerate(sizes)]


CASES = DTYPE_IDS + ["mixed"]


# ----------------------------------------------------------------------- parity


@pytest.mark.parametrize("specials", [None, "finite", "all"])
@pytest.mark.parametrize("inv", INV_SCALES, ids=INV_IDS)
@pytest.mark.parametrize("case", CASES)
def test_parity_with_reference_and_torch(device, case, inv, specials):
    tensors = case_list(case, 100, device, specials)
    ours, f_ours, out = run_ours(tensors, inv, device)
    assert out is None
    refs, f_ref, _ = run_reference(tensors, inv, device)
    tts, f_torch = run_torch(tensors, inv, device)
    assert_lists_bitwise_equal(ours, refs, "vs reference")
    assert_lists_bitwise_equal(ours, tts, "vs torch")
    assert_bitwise_equal(f_ours, f_ref, "found_inf vs reference")
    assert_bitwise_equal(f_ours, f_torch, "found_inf vs torch")
    assert float(f_ours) == (1.0 if specials == "all" else 0.0)


@pytest.mark.parametrize("inv", [0.5, 3.0, 1.0], ids=["half", "three", "one"])
@pytest.mark.parametrize("case", CASES)
def test_found_inf_already_set_stays_set(device, case, inv):
    tensors = case_list(case, 7, device, "finite")
    ours, f, _ = run_ours(tensors, inv, device, found=1.0)
    assert float(f) == 1.0
    refs, _, _ = run_reference(tensors, inv, device)
    assert_lists_bitwise_equal(ours, refs)


@pytest.mark.parametrize("initial", [0.25, -3.0, 1.0])
def test_found_inf_other_values_left_alone_without_inf(device, initial):
    tensors = mixed_list(5, device, "finite")
    _, f, _ = run_ours(tensors, 0.5, device, found=initial)
    assert_bitwise_equal(f, scalar(initial, device))
    bad = mixed_list(5, device, "all")
    _, f, _ = run_ours(bad, 0.5, device, found=initial)
    assert float(f) == 1.0


@pytest.mark.parametrize("specials", [None, "all"])
@pytest.mark.parametrize("inv", [0.5, 3.0, 1.0, 2.0**-16], ids=["half", "three", "one", "2^-16"])
@pytest.mark.parametrize("case", CASES)
def test_check_only_writes_nothing_but_sets_found_inf(device, case, inv, specials):
    tensors = case_list(case, 11, device, specials)
    before = clones(tensors)
    f = scalar(0.0, device)
    sumsq, amax = adaptive_amp.unscale_and_check_(tensors, f, scalar(inv, device), check_only=True,
                                                  return_stats=True)
    assert_lists_bitwise_equal(tensors, before, "check_only wrote")
    assert float(f) == (1.0 if specials == "all" else 0.0)
    _, f_ref, (_, amax_ref) = run_reference(before, inv, device, check_only=True, return_stats=True)
    assert_bitwise_equal(f, f_ref)
    assert_bitwise_equal(amax, amax_ref, "amax")
    assert_sumsq_close(sumsq, before, inv)


@pytest.mark.parametrize("specials", [None, "finite", "all"])
@pytest.mark.parametrize("inv", INV_SCALES, ids=INV_IDS)
@pytest.mark.parametrize("case", CASES)
def test_stats_match_reference(device, case, inv, specials):
    tensors = case_list(case, 23, device, specials)
    ours, f, (sumsq, amax) = run_ours(tensors, inv, device, return_stats=True)
    refs, f_ref, (sumsq_ref, amax_ref) = run_reference(tensors, inv, device, return_stats=True)
    for out in (sumsq, amax):
        assert isinstance(out, torch.Tensor)
        assert out.dtype == torch.float32 and out.shape == (len(tensors),)
        assert out.device == tensors[0].device
    assert_lists_bitwise_equal(ours, refs)
    assert_bitwise_equal(f, f_ref)
    assert_bitwise_equal(amax, amax_ref, "amax vs reference")
    assert_sumsq_close(sumsq, tensors, inv)
    # The reference's own sumsq (float64 accumulation) passes the same check.
    assert_sumsq_close(sumsq_ref, tensors, inv, rtol=1e-6)


def test_stats_of_empty_tensor_are_zero(device):
    tensors = [torch.empty(0, device=device), make(5, torch.float16, 1, device=device),
               torch.empty(0, 7, dtype=torch.bfloat16, device=device)]
    _, _, (sumsq, amax) = run_ours(tensors, 0.5, device, return_stats=True)
    assert float(sumsq[0]) == 0.0 and float(amax[0]) == 0.0
    assert float(sumsq[2]) == 0.0 and float(amax[2]) == 0.0
    assert float(amax[1]) > 0.0


@pytest.mark.parametrize("check_only", [False, True])
def test_stats_deterministic(device, check_only):
    # Several chunks per tensor and > 64K elements in all, so the CPU runs threads.
    sizes = (5 * CHUNK + 7, 3 * CHUNK, 12345, 1, 0, 2 * CHUNK - 1)
    tensors = [make(n, DTYPES[i % 3], 300 + i, specials="finite", device=device) for i, n in enumerate(sizes)]
    runs = []
    for _ in range(3):
        ts, f, (sumsq, amax) = run_ours(tensors, 3.0, device, return_stats=True, check_only=check_only)
        runs.append((ts, f, sumsq, amax))
    for ts, f, sumsq, amax in runs[1:]:
        assert_lists_bitwise_equal(ts, runs[0][0])
        assert_bitwise_equal(f, runs[0][1])
        assert_bitwise_equal(sumsq, runs[0][2], "sumsq differs between runs")
        assert_bitwise_equal(amax, runs[0][3], "amax differs between runs")


def test_single_tensor_not_in_a_list(device):
    t = make(1000, torch.float16, 3, device=device)
    expected = clones([t])
    reference.unscale_and_check_(expected, scalar(0.0, device), scalar(0.5, device))
    f = scalar(0.0, device)
    adaptive_amp.unscale_and_check_(t, f, scalar(0.5, device))
    assert_bitwise_equal(t, expected[0])
    assert float(f) == 0.0


def test_tuple_of_tensors(device):
    tensors = tuple(mixed_list(8, device, "all", sizes=(100, 200, 300)))
    expected, f_ref, _ = run_reference(list(tensors), 0.25, device)
    f = scalar(0.0, device)
    adaptive_amp.unscale_and_check_(tensors, f, scalar(0.25, device))
    assert_lists_bitwise_equal(list(tensors), expected)
    assert_bitwise_equal(f, f_ref)


def test_empty_list(device):
    f = scalar(0.0, device)
    assert adaptive_amp.unscale_and_check_([], f, scalar(0.5, device)) is None
    sumsq, amax = adaptive_amp.unscale_and_check_([], f, scalar(0.5, device), return_stats=True)
    assert sumsq.shape == (0,) and amax.shape == (0,)
    assert sumsq.dtype == torch.float32 and amax.dtype == torch.float32
    assert float(f) == 0.0


# --------------------------------------------------- exhaustive 16-bit formats


@pytest.mark.parametrize("inv", [0.5, 3.0, 2.0**-16, 2.0**10, 0.1, 1e-40, 1.0, 2.0**-24, 65504.0 / 3.0],
                         ids=lambda v: f"{v:g}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_16bit_pattern(device, dtype, inv):
    """All 65536 bit patterns (normals, subnormals, +-0, +-inf, NaNs) round exactly like torch."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).to(device)
    ours, f, (_, amax) = run_ours([x], inv, device, return_stats=True)
    refs, f_ref, (_, amax_ref) = run_reference([x], inv, device, return_stats=True)
    tts, f_torch = run_torch([x], inv, device)
    assert_bitwise_equal(ours[0], refs[0], "vs reference")
    assert_bitwise_equal(ours[0], tts[0], "vs torch")
    assert float(f) == 1.0 and float(f_ref) == 1.0 and float(f_torch) == 1.0
    assert_bitwise_equal(amax, amax_ref)

    # The same patterns without NaN/inf: found_inf stays 0 and amax is finite.
    finite = x[torch.isfinite(x)].contiguous()
    ours, f, (_, amax) = run_ours([finite], inv, device, return_stats=True)
    refs, _, (_, amax_ref) = run_reference([finite], inv, device, return_stats=True)
    assert_bitwise_equal(ours[0], refs[0])
    assert float(f) == 0.0
    assert_bitwise_equal(amax, amax_ref)


@pytest.mark.parametrize("inv", [0.5, 3.0, 2.0**-16, 2.0**20, 0.1, 1e-40, 1.0], ids=lambda v: f"{v:g}")
def test_random_fp32_bit_patterns(device, inv):
    """Random fp32 bit patterns cover every exponent, subnormals and NaN payloads."""
    g = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31, (3 * CHUNK + 11,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).to(device)
    ours, f, (_, amax) = run_ours([x], inv, device, return_stats=True)
    refs, f_ref, (_, amax_ref) = run_reference([x], inv, device, return_stats=True)
    tts, f_torch = run_torch([x], inv, device)
    assert_bitwise_equal(ours[0], refs[0], "vs reference")
    assert_bitwise_equal(ours[0], tts[0], "vs torch")
    assert_bitwise_equal(f, f_ref)
    assert_bitwise_equal(f, f_torch)
    assert_bitwise_equal(amax, amax_ref)


def test_fp32_subnormals_exact(device):
    tiny = 1.401298464324817e-45  # smallest fp32 subnormal
    values = [tiny, -tiny, 2 * tiny, 3 * tiny, -3 * tiny, 5 * tiny, 1e-40, -1e-40, 1.1754942106924411e-38,
              1.1754943508222875e-38, 2.350988701644575e-38, 1e-45, 7e-45]
    x = torch.tensor(values * 37, dtype=torch.float32)
    x = x * torch.linspace(1, 3, x.numel())  # vary mantissas; stays tiny
    x = x.to(device)
    for inv in (0.5, 0.75, 3.0, 2.0**20, 2.0**-3, 1e-40, 2.0**100):
        ours, _, _ = run_ours([x], inv, device)
        refs, _, _ = run_reference([x], inv, device)
        tts, _ = run_torch([x], inv, device)
        assert_bitwise_equal(ours[0], refs[0], f"inv {inv}")
        assert_bitwise_equal(ours[0], tts[0], f"inv {inv} vs torch")
    # Ties at the bottom: tiny * 0.5 rounds to +0 (even), 3 * tiny * 0.5 to 2 * tiny.
    t = torch.tensor([tiny, 3 * tiny, -tiny], dtype=torch.float32, device=device)
    adaptive_amp.unscale_and_check_([t], scalar(0.0, device), scalar(0.5, device))
    assert t.cpu().view(torch.int32).tolist() == [0, 2, -(2**31)]


def test_fp16_subnormal_results(device):
    # Normal fp16 values scaled into the subnormal range, and subnormals scaled up.
    x = (torch.linspace(2.0**-14, 2.0**-10, 4001) * torch.tensor([1.0, -1.0]).repeat(2001)[:4001]).half()
    sub = torch.arange(1, 1024, dtype=torch.int16).view(torch.float16)
    for inv in (2.0**-4, 0.3, 0.5, 2.0**-10):
        ours, _, _ = run_ours([x.to(device)], inv, device)
        refs, _, _ = run_reference([x.to(device)], inv, device)
        assert_bitwise_equal(ours[0], refs[0], f"inv {inv}")
        assert (ours[0].cpu().view(torch.int16) & 0x7C00).eq(0).any(), "test should produce subnormals"
    for inv in (2.0, 3.0, 2.0**10, 0.7):
        ours, _, _ = run_ours([sub.to(device)], inv, device)
        refs, _, _ = run_reference([sub.to(device)], inv, device)
        assert_bitwise_equal(ours[0], refs[0], f"inv {inv}")


# ------------------------------------------------------------------ properties


SPECIAL_POSITIONS = [0, CHUNK - 1, CHUNK, 2 * CHUNK - 1, 3 * CHUNK + 4]
POSITION_IDS = ["first", "chunk_end", "chunk2_start", "chunk2_end", "last"]


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("pos", SPECIAL_POSITIONS, ids=POSITION_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_special_at_edges(device, dtype, pos, value):
    n = 3 * CHUNK + 5
    x = make(n, dtype, pos, device=device)
    x[pos] = value
    other = make(CHUNK + 1, torch.float32, 9, device=device)  # a clean neighbour in the list
    tensors = [other, x]

    # check_only: flags it, writes nothing
    ts = clones(tensors)
    f = scalar(0.0, device)
    _, amax = adaptive_amp.unscale_and_check_(ts, f, scalar(0.5, device), check_only=True, return_stats=True)
    assert float(f) == 1.0
    assert_lists_bitwise_equal(ts, tensors)
    assert math.isnan(float(amax[1])) if math.isnan(value) else float(amax[1]) == INF
    assert math.isfinite(float(amax[0]))

    ours, f, (_, amax) = run_ours(tensors, 0.5, device, return_stats=True)
    refs, f_ref, (_, amax_ref) = run_reference(tensors, 0.5, device, return_stats=True)
    assert float(f) == 1.0
    assert_lists_bitwise_equal(ours, refs)
    assert_bitwise_equal(amax, amax_ref)
    got = float(ours[1][pos])
    assert math.isnan(got) if math.isnan(value) else got == value
    # Its neighbours were scaled normally.
    for j in (pos - 1, pos + 1):
        if 0 <= j < n:
            assert_bitwise_equal(ours[1][j], refs[1][j])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_special_in_a_later_tensor_sets_found_inf(device, dtype):
    tensors = [make(CHUNK * 2, torch.float32, 1, device=device), make(10, dtype, 2, device=device),
               make(0, dtype, 3, device=device), make(CHUNK + 3, dtype, 4, device=device)]
    tensors[-1][-1] = INF
    _, f, _ = run_ours(tensors, 0.5, device)
    assert float(f) == 1.0
    tensors[-1][-1] = 1.0
    _, f, _ = run_ours(tensors, 0.5, device)
    assert float(f) == 0.0


@pytest.mark.parametrize("inv", [0.5, 3.0, 1.0, 0.0, 2.0**-16], ids=["half", "three", "one", "zero", "2^-16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_negative_zero_stays_negative_zero(device, dtype, inv):
    x = make(4 * 257, dtype, 5, device=device)
    x[::4] = -0.0
    x[1::4] = 0.0
    ours, _, _ = run_ours([x], inv, device)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    bits = ours[0].cpu().view(int_dtype)
    neg_zero = torch.tensor(-0.0, dtype=dtype).view(int_dtype)
    assert torch.all(bits[::4] == neg_zero), "-0.0 lost its sign"
    assert torch.all(bits[1::4] == 0), "+0.0 changed"
    refs, _, _ = run_reference([x], inv, device)
    assert_bitwise_equal(ours[0], refs[0])


def test_zero_dim_and_one_element_tensors(device):
    tensors = [
        torch.tensor(3.0, device=device),
        torch.tensor(-1.5, dtype=torch.float16, device=device),
        torch.tensor([7.0], dtype=torch.bfloat16, device=device),
        torch.tensor([[5.0]], dtype=torch.float32, device=device),
        torch.empty(0, dtype=torch.float16, device=device),
        torch.empty(3, 0, 2, device=device),
    ]
    ours, f, (sumsq, amax) = run_ours(tensors, 0.5, device, return_stats=True)
    refs, _, (_, amax_ref) = run_reference(tensors, 0.5, device, return_stats=True)
    assert_lists_bitwise_equal(ours, refs)
    assert [t.shape for t in ours] == [t.shape for t in tensors]
    assert float(ours[0]) == 1.5 and float(ours[1]) == -0.75 and float(ours[2][0]) == 3.5
    assert float(f) == 0.0
    assert_bitwise_equal(amax, amax_ref)
    assert amax.cpu().tolist() == [1.5, 0.75, 3.5, 2.5, 0.0, 0.0]
    assert sumsq.cpu().tolist() == [2.25, 0.5625, 12.25, 6.25, 0.0, 0.0]
    zero_dim_inf = [torch.tensor(INF, dtype=torch.bfloat16, device=device)]
    _, f, _ = run_ours(zero_dim_inf, 0.5, device)
    assert float(f) == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("window", [(1, None), (3, 1003), (5, 5 + 2 * CHUNK + 3), (0, 1000), (7, 8)],
                         ids=["[1:]", "[3:1003]", "[5:2chunks+8]", "[0:1000]", "[7:8]"])
def test_views_with_storage_offsets(device, dtype, window):
    start, stop = window
    base = make(3 * CHUNK, dtype, 42, specials="finite", device=device)
    base_before = base.clone()
    view = base[start:stop]
    assert view.is_contiguous()
    if start % (16 // base.element_size()):
        assert view.data_ptr() % 16 != 0  # the scalar (unaligned) path
    view_before = view.clone()
    expected = [view.clone()]
    _, amax_ref = reference.unscale_and_check_(expected, scalar(0.0, device), scalar(3.0, device), return_stats=True)
    f = scalar(0.0, device)
    _, amax = adaptive_amp.unscale_and_check_([view], f, scalar(3.0, device), return_stats=True)
    assert_bitwise_equal(view, expected[0])
    assert not torch.equal(view, view_before)
    # Outside the view nothing moved.
    stop_ = base.numel() if stop is None else stop
    assert_bitwise_equal(base[:start], base_before[:start], "before the view")
    assert_bitwise_equal(base[stop_:], base_before[stop_:], "after the view")
    assert_bitwise_equal(amax, amax_ref)
    assert float(f) == 0.0


def test_unaligned_and_aligned_views_in_one_list(device):
    b32 = make(5000, torch.float32, 1, device=device)
    b16 = make(5000, torch.float16, 2, device=device)
    bb = make(5000, torch.bfloat16, 3, device=device)
    views = [b32[1:2001], b16[3:3001], bb[8:4008], b32[2001:4999], b16[3001:]]
    before_b = [b32.clone(), b16.clone(), bb.clone()]
    views[3][17] = -INF
    expected, f_ref, _ = run_reference(views, 0.125, device)
    f = scalar(0.0, device)
    adaptive_amp.unscale_and_check_(views, f, scalar(0.125, device))
    assert_lists_bitwise_equal(views, expected)
    assert float(f) == 1.0
    assert_bitwise_equal(b32[0], before_b[0][0])
    assert_bitwise_equal(b32[4999], before_b[0][4999])
    assert_bitwise_equal(b16[:3], before_b[1][:3])
    assert_bitwise_equal(bb[:8], before_b[2][:8])
    assert_bitwise_equal(bb[4008:], before_b[2][4008:])


def test_adjacent_views_do_not_overlap(device):
    base = make(3000, torch.float32, 4, device=device)
    a, b, c = base[0:1000], base[1000:2000], base[2000:]
    expected, _, _ = run_reference([a, b, c], 0.5, device)
    adaptive_amp.unscale_and_check_([a, b, c], scalar(0.0, device), scalar(0.5, device))
    assert_lists_bitwise_equal([a, b, c], expected)


def test_list_of_one(device):
    x = make(2 * CHUNK + 1, torch.bfloat16, 77, specials="finite", device=device)
    ours, f, (sumsq, amax) = run_ours([x], 2.0**-7, device, return_stats=True)
    refs, _, (_, amax_ref) = run_reference([x], 2.0**-7, device, return_stats=True)
    assert_bitwise_equal(ours[0], refs[0])
    assert sumsq.shape == (1,) and amax.shape == (1,)
    assert_bitwise_equal(amax, amax_ref)


def _many_small(count, seed, device, plant_inf):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 301, (count,), generator=g).tolist()
    kinds = torch.randint(0, 3, (count,), generator=g).tolist()
    g2 = torch.Generator().manual_seed(seed + 1)
    total = sum(sizes)
    # fp16-safe magnitudes (every tensor is cut from this and cast to its dtype)
    data = torch.randn(total, generator=g2) * torch.exp2(torch.randint(-8, 9, (total,), generator=g2).float())
    tensors, at = [], 0
    for n, k in zip(sizes, kinds):
        tensors.append(data[at:at + n].to(DTYPES[k]).to(device))
        at += n
    victim = None
    if plant_inf:
        nonempty = [i for i, n in enumerate(sizes) if n > 0]
        victim = nonempty[int(torch.randint(0, len(nonempty), (1,), generator=g))]
        pos = int(torch.randint(0, sizes[victim], (1,), generator=g))
        tensors[victim][pos] = INF
    return tensors, victim


@pytest.mark.parametrize("plant_inf", [True, False], ids=["inf", "clean"])
def test_list_of_5000_small_tensors(device, plant_inf):
    tensors, victim = _many_small(5000, 2024, device, plant_inf)
    ours, f, (sumsq, amax) = run_ours(tensors, 0.5, device, return_stats=True)
    refs, f_ref, (_, amax_ref) = run_reference(tensors, 0.5, device, return_stats=True)
    assert_lists_bitwise_equal(ours, refs)
    assert float(f) == (1.0 if plant_inf else 0.0)
    assert_bitwise_equal(f, f_ref)
    assert_bitwise_equal(amax, amax_ref)
    if plant_inf:
        assert float(amax[victim]) == INF
        assert int(torch.isinf(amax).sum()) == 1
    assert_sumsq_close(sumsq, tensors, 0.5)


def _pattern_dtype(pattern, i):
    if pattern == "mixed":
        return DTYPES[i % 3]
    if pattern == "fp32":
        return torch.float32
    if pattern == "fp32_then_mixed":  # the first (large) table holds fp32 only, later ones a mix
        return torch.float32 if i < 1984 else DTYPES[i % 3]
    return DTYPES[i % 3] if i < 1984 else torch.float32  # "mixed_then_fp32"


_LENGTHS = [191, 192, 193, 1984, 1985, 2176, 2177, 4161]
_LENGTH_CASES = [(n, p) for n in _LENGTHS for p in ("mixed", "fp32")] + \
    [(n, p) for n in _LENGTHS if n > 1984 for p in ("fp32_then_mixed", "mixed_then_fp32")]


@pytest.mark.parametrize("count,pattern", _LENGTH_CASES, ids=[f"{n}-{p}" for n, p in _LENGTH_CASES])
def test_list_lengths_around_launch_table_sizes(device, count, pattern):
    """On CUDA long lists are cut into several launches (tables of 192 or 1984
    tensors, fp32-only tables with their own kernel); per-tensor outputs must line up."""
    g = torch.Generator().manual_seed(count)
    sizes = torch.randint(0, 40, (count,), generator=g).tolist()
    sizes[-1] = 5
    tensors = [make(n, _pattern_dtype(pattern, i), i, device=device) for i, n in enumerate(sizes)]
    tensors[-1][4] = NAN  # in the very last tensor, i.e. the last launch
    ours, f, (sumsq, amax) = run_ours(tensors, 0.25, device, return_stats=True)
    refs, _, (_, amax_ref) = run_reference(tensors, 0.25, device, return_stats=True)
    assert float(f) == 1.0
    assert_lists_bitwise_equal(ours, refs)
    assert_bitwise_equal(amax, amax_ref)
    assert math.isnan(float(amax[-1]))
    assert not torch.isnan(amax[:-1]).any()
    assert_sumsq_close(sumsq, tensors, 0.25)
    # Without the NaN nothing is flagged.
    tensors[-1][4] = 1.0
    _, f, _ = run_ours(tensors, 0.25, device)
    assert float(f) == 0.0


def test_autograd_version_bumped_for_grad_tensors(device):
    w = torch.randn(100, device=device, requires_grad=True)
    g = w * 3.0  # a non-leaf that requires grad: accepted, and written in place
    v = g._version
    adaptive_amp.unscale_and_check_([g], scalar(0.0, device), scalar(0.5, device))
    assert g._version > v


# -------------------------------------------------------------- hypothesis


@st.composite
def _cases(draw):
    count = draw(st.integers(1, 5))
    specs = []
    for _ in range(count):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.one_of(
            st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
            st.integers(0, 3 * CHUNK + 17).map(lambda n: (n,)),
            st.sampled_from([(CHUNK - 1,), (CHUNK,), (CHUNK + 1,), (2 * CHUNK,), (2, CHUNK + 1)]),
        ))
        n_special = draw(st.integers(0, 2))
        specs.append((dtype, shape, n_special))
    inv = draw(st.sampled_from([0.5, 2.0**-16, 1.0, 3.0, 0.0, 1e-40, INF, 0.1, 2.0**24]))
    seed = draw(st.integers(0, 2**31 - 1))
    check_only = draw(st.booleans())
    return specs, inv, seed, check_only


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(case=_cases())
def test_random_shapes_match_reference(device, case):
    specs, inv, seed, check_only = case
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for i, (dtype, shape, n_special) in enumerate(specs):
        n = math.prod(shape)
        t = make(n, dtype, seed + i)
        for _ in range(n_special if n else 0):
            pos = int(torch.randint(0, n, (1,), generator=g))
            t[pos] = [NAN, INF, -INF, -0.0][int(torch.randint(0, 4, (1,), generator=g))]
        tensors.append(t.reshape(shape).to(device))
    ours, f, (sumsq, amax) = run_ours(tensors, inv, device, return_stats=True, check_only=check_only)
    refs, f_ref, (_, amax_ref) = run_reference(tensors, inv, device, return_stats=True, check_only=check_only)
    assert_lists_bitwise_equal(ours, refs)
    if check_only:
        assert_lists_bitwise_equal(ours, tensors)
    assert_bitwise_equal(f, f_ref)
    assert_bitwise_equal(amax, amax_ref)
    assert_sumsq_close(sumsq, tensors, inv)


# ---------------------------------------------------------------- numpy / DLPack


def _np_bf16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return ml_dtypes.bfloat16


def to_numpy(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(_np_bf16())
    return t.numpy().copy()


@pytest.mark.parametrize("inv", [0.5, 3.0, 2.0**-16, 1.0], ids=["half", "three", "2^-16", "one"])
@pytest.mark.parametrize("specials", [None, "all"])
def test_numpy_arrays_match_torch(specials, inv):
    tensors = mixed_list(31, "cpu", specials, sizes=(2 * CHUNK + 3, 1000, 17, 0, CHUNK, 1))
    arrays = [to_numpy(t) for t in tensors]
    assert [a.dtype.name for a in arrays[:3]] == ["float32", "float16", "bfloat16"]
    found = np.zeros(1, np.float32)
    inv_np = np.array([inv], np.float32)
    sumsq, amax = adaptive_amp.unscale_and_check_(arrays, found, inv_np, return_stats=True)
    ours, f, (sumsq_t, amax_t) = run_ours(tensors, inv, "cpu", return_stats=True)
    for a, t in zip(arrays, ours):
        assert_bitwise_equal(a, t)
    assert found[0] == float(f)
    assert found[0] == (1.0 if specials else 0.0)
    assert inv_np[0] == np.float32(inv)
    assert isinstance(sumsq, np.ndarray) and isinstance(amax, np.ndarray)
    assert sumsq.dtype == np.float32 and amax.dtype == np.float32
    assert sumsq.shape == (len(arrays),) and amax.shape == (len(arrays),)
    assert_bitwise_equal(sumsq, sumsq_t)
    assert_bitwise_equal(amax, amax_t)


def test_numpy_2d_and_0d_arrays():
    a = to_numpy(make(60, torch.float16, 1)).reshape(6, 10)
    b = np.array(2.5, dtype=np.float32)
    expected_a = (a.astype(np.float32) * np.float32(0.5)).astype(np.float16)
    found = np.zeros(1, np.float32)
    adaptive_amp.unscale_and_check_([a, b], found, np.array([0.5], np.float32))
    assert np.array_equal(a.view(np.int16), expected_a.view(np.int16))
    assert b == 1.25 and b.shape == ()
    assert found[0] == 0.0


def test_numpy_empty_list_stats_are_numpy():
    found = np.zeros(1, np.float32)
    sumsq, amax = adaptive_amp.unscale_and_check_([], found, np.array([0.5], np.float32), return_stats=True)
    assert isinstance(sumsq, np.ndarray) and sumsq.shape == (0,)
    assert isinstance(amax, np.ndarray) and amax.shape == (0,)


def test_numpy_read_only_refused_unless_check_only():
    a = to_numpy(make(1000, torch.float32, 5))
    a[10] = np.inf
    a.setflags(write=False)
    before = a.copy()
    found = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match=re.escape("tensors[0]")):
        adaptive_amp.unscale_and_check_([a], found, np.array([0.5], np.float32))
    assert found[0] == 0.0
    assert np.array_equal(a.view(np.int32), before.view(np.int32))
    sumsq, amax = adaptive_amp.unscale_and_check_([a], found, np.array([0.5], np.float32), check_only=True,
                                                  return_stats=True)
    assert found[0] == 1.0
    assert amax[0] == np.inf
    assert np.array_equal(a.view(np.int32), before.view(np.int32))


def test_numpy_read_only_found_inf_refused():
    a = to_numpy(make(100, torch.float32, 5))
    a[3] = np.nan
    before = a.copy()
    found = np.zeros(1, np.float32)
    found.setflags(write=False)
    with pytest.raises(ValueError, match="found_inf"):
        adaptive_amp.unscale_and_check_([a], found, np.array([0.5], np.float32))
    assert found[0] == 0.0
    assert np.array_equal(a.view(np.int32), before.view(np.int32))


def test_numpy_read_only_inv_scale_accepted():
    a = to_numpy(make(100, torch.float32, 5))
    expected = a * np.float32(0.5)
    inv = np.array([0.5], np.float32)
    inv.setflags(write=False)
    adaptive_amp.unscale_and_check_([a], np.zeros(1, np.float32), inv)
    assert np.array_equal(a, expected)


class DLPackOnly:
    """Exposes nothing but the DLPack protocol of the wrapped array."""

    def __init__(self, inner):
        self._inner = inner

    def __dlpack__(self, **kwargs):
        return self._inner.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._inner.__dlpack_device__()


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_dlpack_wrapper_in_place(source):
    tensors = mixed_list(61, "cpu", None, sizes=(CHUNK + 9, 500, 33, 1))
    tensors[1][7] = -INF
    if source == "numpy":  # numpy cannot export ml_dtypes' bfloat16 through DLPack
        tensors = [t for t in tensors if t.dtype != torch.bfloat16]
    expected, f_ref, (_, amax_ref) = run_reference(tensors, 0.5, "cpu", return_stats=True)
    if source == "numpy":
        inners = [to_numpy(t) for t in tensors]
    else:
        inners = clones(tensors)
    wrapped = [DLPackOnly(x) for x in inners]
    assert not hasattr(wrapped[0], "__array_interface__")
    f = np.zeros(1, np.float32) if source == "numpy" else torch.zeros(1)
    inv = np.array([0.5], np.float32) if source == "numpy" else torch.tensor([0.5])
    out = adaptive_amp.unscale_and_check_(wrapped, DLPackOnly(f), DLPackOnly(inv), return_stats=True)
    for inner, e in zip(inners, expected):
        assert_bitwise_equal(inner, e)
    assert float(f[0]) == 1.0
    sumsq, amax = out
    assert_bitwise_equal(np.asarray(amax), amax_ref)


def test_dlpack_wrapper_check_only_writes_nothing():
    a = to_numpy(make(3000, torch.float16, 9))
    a[2999] = np.inf
    before = a.copy()
    found = np.zeros(1, np.float32)
    adaptive_amp.unscale_and_check_([DLPackOnly(a)], found, np.array([0.5], np.float32), check_only=True)
    assert found[0] == 1.0
    assert np.array_equal(a.view(np.int16), before.view(np.int16))


# ------------------------------------------------------------------ bad input


def _good0(device):
    """tensors[0] of every bad-input case: valid fp32 with an inf (would set found_inf)."""
    t = make(3 * CHUNK + 1, torch.float32, 99, device=device)
    t[5] = INF
    return t


def _bad(kind, device):
    """-> (tensors[1] or None, found_inf, inv_scale, kwargs, error type, text in message)."""
    f = scalar(0.0, device)
    inv = scalar(0.5, device)
    x = make(64, torch.float32, 3, device=device)
    if kind == "int32":
        return x.to(torch.int32) + 1, f, inv, {}, TypeError, "tensors[1]"
    if kind == "int64":
        return x.to(torch.int64) + 1, f, inv, {}, TypeError, "tensors[1]"
    if kind == "float64":
        return x.double(), f, inv, {}, TypeError, "tensors[1]"
    if kind == "expanded":  # overlapping elements: torch's in-place ops refuse them too
        return x[:1].expand(64), f, inv, {}, ValueError, "tensors[1]"
    if kind == "found_inf_float64":
        return x, torch.zeros(1, dtype=torch.float64, device=device), inv, {}, TypeError, "found_inf"
    if kind == "found_inf_int":
        return x, torch.zeros(1, dtype=torch.int32, device=device), inv, {}, TypeError, "found_inf"
    if kind == "found_inf_2_elements":
        return x, torch.zeros(2, device=device), inv, {}, ValueError, "found_inf"
    if kind == "found_inf_python_float":
        return x, 0.0, inv, {}, TypeError, "found_inf"
    if kind == "inv_scale_float64":
        return x, f, torch.tensor([0.5], dtype=torch.float64, device=device), {}, TypeError, "inv_scale"
    if kind == "inv_scale_float16":
        return x, f, torch.tensor([0.5], dtype=torch.float16, device=device), {}, TypeError, "inv_scale"
    if kind == "inv_scale_2_elements":
        return x, f, torch.full((2,), 0.5, device=device), {}, ValueError, "inv_scale"
    if kind == "inv_scale_empty":
        return x, f, torch.empty(0, device=device), {}, ValueError, "inv_scale"
    if kind == "inv_scale_python_float":
        return x, f, 0.5, {}, TypeError, "inv_scale"
    if kind == "requires_grad_leaf":
        return x.clone().requires_grad_(True), f, inv, {}, ValueError, "tensors[1]"
    if kind == "sparse":
        return x.to_sparse(), f, inv, {}, ValueError, "tensors[1]"
    if kind == "python_list":
        return [1.0, 2.0, 3.0], f, inv, {}, TypeError, "tensors[1]"
    if kind == "python_float":
        return 1.5, f, inv, {}, TypeError, "tensors[1]"
    if kind == "none":
        return None, f, inv, {}, TypeError, "tensors[1]"
    raise AssertionError(kind)


BAD_KINDS = ["int32", "int64", "float64", "expanded", "found_inf_float64", "found_inf_int",
             "found_inf_2_elements", "found_inf_python_float", "inv_scale_float64", "inv_scale_float16",
             "inv_scale_2_elements", "inv_scale_empty", "inv_scale_python_float", "requires_grad_leaf", "sparse",
             "python_list", "python_float", "none"]


def _snapshot(objs):
    return [o.detach().clone() if isinstance(o, torch.Tensor) and o.layout == torch.strided else
            (o.detach().to_dense().clone() if isinstance(o, torch.Tensor) else None) for o in objs]


def _assert_unchanged(objs, snaps):
    for i, (o, s) in enumerate(zip(objs, snaps)):
        if s is None:
            continue
        now = o.detach() if o.layout == torch.strided else o.detach().to_dense()
        if now.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            assert_bitwise_equal(now, s, f"object {i} was modified")
        else:
            assert torch.equal(now, s), f"object {i} was modified"


# check_only accepts leaves that require grad (tested separately).
_BAD_CASES = [(k, m) for k in BAD_KINDS for m in ("plain", "stats", "check_only")
              if not (k in ("requires_grad_leaf", "expanded") and m == "check_only")]


@pytest.mark.parametrize("kind,mode", _BAD_CASES, ids=[f"{k}-{m}" for k, m in _BAD_CASES])
def test_bad_input_is_refused_before_any_write(device, kind, mode):
    good = _good0(device)
    bad, f, inv, kwargs, exc, name = _bad(kind, device)
    tensors = [good, bad]
    watched = [good, bad, f, inv]
    snaps = _snapshot(watched)
    kwargs = dict(kwargs, return_stats=mode == "stats", check_only=mode == "check_only")
    with pytest.raises(exc, match=re.escape(name)):
        adaptive_amp.unscale_and_check_(tensors, f, inv, **kwargs)
    _assert_unchanged(watched, snaps)
    if isinstance(f, torch.Tensor) and f.numel() >= 1:
        assert float(f.reshape(-1)[0]) == 0.0


def test_requires_grad_leaf_accepted_with_check_only(device):
    good = _good0(device)
    leaf = make(64, torch.float32, 3, device=device).requires_grad_(True)
    before = leaf.detach().clone()
    f = scalar(0.0, device)
    adaptive_amp.unscale_and_check_([good, leaf], f, scalar(0.5, device), check_only=True)
    assert float(f) == 1.0
    assert_bitwise_equal(leaf.detach(), before)
    assert leaf.grad is None


@pytest.mark.parametrize("kind", ["same_tensor", "overlapping_views", "contained_view", "dtype_alias"])
def test_shared_memory_refused(device, kind):
    good = _good0(device)
    if kind == "same_tensor":
        tensors = [good, good]
    elif kind == "overlapping_views":
        tensors = [good[0:1000], good[500:1500]]
    elif kind == "contained_view":
        tensors = [good, good[100:200]]
    else:  # the same bytes seen as another dtype
        tensors = [good[:2000], good[1000:3000].view(torch.float16)]
    before = good.clone()
    f = scalar(0.0, device)
    with pytest.raises(ValueError, match=re.escape("tensors[1]")) as info:
        adaptive_amp.unscale_and_check_(tensors, f, scalar(0.5, device))
    assert "shares memory" in str(info.value)
    assert_bitwise_equal(good, before)
    assert float(f) == 0.0
    # Reading twice is harmless: check_only accepts it.
    adaptive_amp.unscale_and_check_(tensors, f, scalar(0.5, device), check_only=True)
    assert float(f) == 1.0
    assert_bitwise_equal(good, before)


def test_shared_memory_names_the_later_duplicate(device):
    a = make(100, torch.float32, 1, device=device)
    b = make(100, torch.float16, 2, device=device)
    with pytest.raises(ValueError, match=re.escape("tensors[2]")) as info:
        adaptive_amp.unscale_and_check_([a, b, a], scalar(0.0, device), scalar(0.5, device))
    assert "tensors[0]" in str(info.value)


def test_bad_input_later_in_long_list(device):
    tensors = [make(10, torch.float16, i, device=device) for i in range(300)]
    tensors[0][0] = INF
    tensors[257] = tensors[257].double()
    snaps = clones(tensors)
    f = scalar(0.0, device)
    with pytest.raises(TypeError, match=re.escape("tensors[257]")):
        adaptive_amp.unscale_and_check_(tensors, f, scalar(0.5, device))
    for t, s in zip(tensors, snaps):
        assert_bitwise_equal(t, s)
    assert float(f) == 0.0


def test_not_a_list_refused():
    with pytest.raises(TypeError, match="tensors"):
        adaptive_amp.unscale_and_check_(3.0, torch.zeros(1), torch.tensor([0.5]))
    with pytest.raises(TypeError, match="tensors"):
        adaptive_amp.unscale_and_check_({"a": torch.ones(3)}, torch.zeros(1), torch.tensor([0.5]))


def test_misaligned_numpy_array_refused():
    good = _good0("cpu")
    raw = np.frombuffer(np.random.default_rng(0).bytes(4002), dtype=np.uint8).copy()
    odd = raw[1:4001].view(np.float16)  # an address that is not a multiple of 2
    assert odd.__array_interface__["data"][0] % 2 == 1
    before_raw = raw.copy()
    before_good = good.clone()
    f = torch.zeros(1)
    with pytest.raises(ValueError, match=re.escape("tensors[1]")):
        adaptive_amp.unscale_and_check_([good, odd], f, torch.tensor([0.5]))
    assert np.array_equal(raw, before_raw)
    assert_bitwise_equal(good, before_good)
    assert float(f) == 0.0


def test_numpy_bad_dtype_refused():
    good = to_numpy(_good0("cpu"))
    before = good.copy()
    found = np.zeros(1, np.float32)
    read_only = np.ones((4, 4), np.float32)[:, ::2]  # strided views are fine (a copy), read-only ones are not
    read_only.flags.writeable = False
    for bad, exc in ((np.arange(10, dtype=np.float64), TypeError), (np.arange(10, dtype=np.int32), TypeError),
                     (read_only, ValueError)):
        with pytest.raises(exc, match=re.escape("tensors[1]")):
            adaptive_amp.unscale_and_check_([good, bad], found, np.array([0.5], np.float32))
        assert found[0] == 0.0
        assert np.array_equal(good.view(np.int32), before.view(np.int32))


# ----------------------------------------------------------------- CUDA only


@cuda_test
def test_cuda_tensors_on_two_devices_refused():
    good = _good0("cpu")
    other = make(64, torch.float32, 2, device="cuda")
    snaps = _snapshot([good, other])
    f = torch.zeros(1)
    with pytest.raises(ValueError, match=re.escape("tensors[1]")):
        adaptive_amp.unscale_and_check_([good, other], f, torch.tensor([0.5]))
    _assert_unchanged([good, other], snaps)
    assert float(f) == 0.0
    # and the other way round
    good_cuda = _good0("cuda")
    cpu_t = make(64, torch.float32, 2)
    f = torch.zeros(1, device="cuda")
    with pytest.raises(ValueError, match=re.escape("tensors[1]")):
        adaptive_amp.unscale_and_check_([good_cuda, cpu_t], f, torch.tensor([0.5], device="cuda"))
    assert float(f) == 0.0


@cuda_test
@pytest.mark.parametrize("which", ["found_inf", "inv_scale"])
def test_cuda_scalars_on_the_wrong_device_refused(which):
    good = _good0("cuda")
    before = good.clone()
    f = torch.zeros(1, device="cpu" if which == "found_inf" else "cuda")
    inv = torch.tensor([0.5], device="cpu" if which == "inv_scale" else "cuda")
    with pytest.raises(ValueError, match=which):
        adaptive_amp.unscale_and_check_([good], f, inv)
    assert_bitwise_equal(good, before)
    assert float(f) == 0.0


@cuda_test
def test_cuda_results_ordered_on_current_stream():
    n = 1 << 22
    host = make(n, torch.float16, 5).pin_memory()
    host32 = make(CHUNK * 3, torch.float32, 6).pin_memory()
    expected = [host.clone(), host32.clone()]
    expected[0][n - 1] = INF
    f_ref = torch.zeros(1)
    expected_stats = reference.unscale_and_check_(expected, f_ref, torch.tensor([0.5]), return_stats=True)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(50_000_000)  # keep s busy: a launch on another stream would race ahead
        x = host.to("cuda", non_blocking=True)
        y = host32.to("cuda", non_blocking=True)
        x[n - 1] = INF
        f = torch.zeros(1, device="cuda")
        inv = torch.full((1,), 0.5, device="cuda")
        sumsq, amax = adaptive_amp.unscale_and_check_([x, y], f, inv, return_stats=True)
        # Work queued after the op on s sees its results.
        x_after = x.clone()
        f_after = f.clone()
    torch.cuda.synchronize()
    assert_bitwise_equal(x, expected[0])
    assert_bitwise_equal(y, expected[1])
    assert_bitwise_equal(x_after, expected[0])
    assert float(f_after) == 1.0 and float(f) == 1.0
    assert_bitwise_equal(amax, expected_stats[1])


@cuda_test
def test_cuda_tensor_on_non_current_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    tensors = mixed_list(3, "cuda:1", "all", sizes=(CHUNK * 2 + 1, 100, 0))
    expected, f_ref, (_, amax_ref) = run_reference([t.cpu() for t in tensors], 0.5, "cpu", return_stats=True)
    with torch.cuda.device(0):
        f = torch.zeros(1, device="cuda:1")
        inv = torch.full((1,), 0.5, device="cuda:1")
        sumsq, amax = adaptive_amp.unscale_and_check_(tensors, f, inv, return_stats=True)
        assert torch.cuda.current_device() == 0
        torch.cuda.synchronize(1)
    assert sumsq.device == torch.device("cuda:1") and amax.device == torch.device("cuda:1")
    assert_lists_bitwise_equal(tensors, expected)
    assert float(f) == 1.0
    assert_bitwise_equal(amax, amax_ref)


@cuda_test
def test_cuda_list_of_5000_tensors_several_launches():
    tensors, victim = _many_small(5000, 77, "cuda", True)
    host = [t.cpu() for t in tensors]
    ours, f, (sumsq, amax) = run_ours(tensors, 3.0, "cuda", return_stats=True)
    refs, f_ref, (_, amax_ref) = run_reference(host, 3.0, "cpu", return_stats=True)
    assert_lists_bitwise_equal(ours, refs)
    assert float(f) == 1.0
    assert_bitwise_equal(amax, amax_ref)
    assert float(amax[victim]) == INF


@cuda_test
def test_cuda_huge_fp16_tensor_64bit_indexing():
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip(f"needs 16 GB of free GPU memory, {free / 2**30:.1f} GB free")
    n = 2**31 + 17
    x = torch.empty(n, dtype=torch.float16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x.uniform_(-4.0, 4.0, generator=g)
    head = make(8, torch.float16, 1, device="cuda")
    mid = make(8, torch.float16, 2, device="cuda")  # straddles element 2**31
    tail = make(8, torch.float16, 3, device="cuda")
    x[:8] = head
    x[2**31 - 4:2**31 + 4] = mid
    x[n - 9:n - 1] = tail
    x[n - 1] = INF
    inv = 0.5
    exp = {k: (v.float() * inv).half() for k, v in (("head", head), ("mid", mid), ("tail", tail))}
    f = torch.zeros(1, device="cuda")
    sumsq, amax = adaptive_amp.unscale_and_check_([x], f, scalar(inv, "cuda"), return_stats=True)
    torch.cuda.synchronize()
    assert float(f) == 1.0
    assert float(amax[0]) == INF
    assert_bitwise_equal(x[:8], exp["head"])
    assert_bitwise_equal(x[2**31 - 4:2**31 + 4], exp["mid"])
    assert_bitwise_equal(x[n - 9:n - 1], exp["tail"])
    assert float(x[n - 1]) == INF

    # A finite, unmistakable maximum in the very last element: read through 64-bit offsets.
    x[n - 1] = 1000.0
    lo, hi = torch.aminmax(x[: n - 1])
    f = torch.zeros(1, device="cuda")
    sumsq, amax = adaptive_amp.unscale_and_check_([x], f, scalar(0.25, "cuda"), check_only=True,
                                                  return_stats=True)
    torch.cuda.synchronize()
    assert float(f) == 0.0
    assert float(amax[0]) == 250.0
    assert max(-float(lo), float(hi)) * 0.25 < 250.0
    assert math.isfinite(float(sumsq[0])) and float(sumsq[0]) > 250.0**2
    assert float(x[n - 1]) == 1000.0  # check_only
    del x
    torch.cuda.empty_cache()


@cuda_test
def test_cupy_arrays_match_torch():
    cupy = pytest.importorskip("cupy")
    tensors = mixed_list(13, "cpu", "all", sizes=(2 * CHUNK + 5, 999, 0, 3))
    tensors = [t for t in tensors if t.dtype != torch.bfloat16]  # cupy has no bfloat16
    arrays = [cupy.asarray(t.numpy()) for t in tensors]
    found = cupy.zeros(1, dtype=cupy.float32)
    inv = cupy.asarray(np.array([0.5], np.float32))
    sumsq, amax = adaptive_amp.unscale_and_check_(arrays, found, inv, return_stats=True)
    assert isinstance(sumsq, cupy.ndarray) and isinstance(amax, cupy.ndarray)
    ours, f, (sumsq_t, amax_t) = run_ours([t.cuda() for t in tensors], 0.5, "cuda", return_stats=True)
    cupy.cuda.get_current_stream().synchronize()
    for a, t in zip(arrays, ours):
        assert_bitwise_equal(cupy.asnumpy(a), t)
    assert float(cupy.asnumpy(found)[0]) == float(f) == 1.0
    assert_bitwise_equal(cupy.asnumpy(amax), amax_t)
    assert_bitwise_equal(cupy.asnumpy(sumsq), sumsq_t)


@cuda_test
def test_cupy_on_a_non_default_stream():
    cupy = pytest.importorskip("cupy")
    data = to_numpy(make(CHUNK * 4 + 3, torch.float32, 4))
    data[-1] = np.nan
    expected = data * np.float32(0.5)
    with cupy.cuda.Stream(non_blocking=True):
        a = cupy.asarray(data)
        found = cupy.zeros(1, dtype=cupy.float32)
        adaptive_amp.unscale_and_check_([a], found, cupy.asarray(np.array([0.5], np.float32)))
        got = cupy.asnumpy(a)  # ordered on the same stream
        got_found = cupy.asnumpy(found)
    np.testing.assert_array_equal(got, expected)
    assert got_found[0] == 1.0


@cuda_test
@pytest.mark.parametrize("inv", [0.5, 3.0, 2.0**-16, 1.0, 0.0, 1e-40, INF], ids=lambda v: f"{v:g}")
def test_cpu_and_cuda_bitwise_identical(inv):
    host = mixed_list(57, "cpu", "all", sizes=(3 * CHUNK + 5, 1001, 0, 1, CHUNK, 17, 2 * CHUNK))
    host += [torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dt) for dt in
             (torch.float16, torch.bfloat16)]
    cpu_out, f_cpu, (sumsq_cpu, amax_cpu) = run_ours(host, inv, "cpu", return_stats=True)
    gpu_out, f_gpu, (sumsq_gpu, amax_gpu) = run_ours([t.cuda() for t in host], inv, "cuda", return_stats=True)
    assert_lists_bitwise_equal(gpu_out, cpu_out)
    assert_bitwise_equal(f_gpu, f_cpu)
    assert_bitwise_equal(amax_gpu, amax_cpu)
    assert_sumsq_close(sumsq_gpu, host, inv)
    assert_sumsq_close(sumsq_cpu, host, inv)


@cuda_test
def test_cuda_graph_capture_and_replay():
    srcs = mixed_list(71, "cuda", None, sizes=(2 * CHUNK + 5, 4000, 0, 1))
    srcs_inf = clones(srcs)
    srcs_inf[1][123] = -INF
    static = clones(srcs)
    found = torch.zeros(1, device="cuda")
    inv = torch.full((1,), 0.5, device="cuda")

    # Warm up outside capture with the same kind of call (loads the kernels).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = clones(srcs)
        adaptive_amp.unscale_and_check_(warm, torch.zeros(1, device="cuda"), inv, return_stats=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sumsq, amax = adaptive_amp.unscale_and_check_(static, found, inv, return_stats=True)
    torch.cuda.synchronize()
    assert_lists_bitwise_equal(static, srcs, "capture must not run the op")

    for data, inv_value in ((srcs, 0.5), (srcs_inf, 3.0), (srcs, 2.0**-10)):
        for t, src in zip(static, data):
            t.copy_(src)
        found.zero_()
        inv.fill_(inv_value)  # changed in place between replays: read on the device
        graph.replay()
        torch.cuda.synchronize()
        expected, f_ref, (_, amax_ref) = run_reference(data, inv_value, "cuda", return_stats=True)
        assert_lists_bitwise_equal(static, expected, f"replay with inv {inv_value}")
        assert_bitwise_equal(found, f_ref)
        assert_bitwise_equal(amax, amax_ref)
        assert_sumsq_close(sumsq, data, inv_value)
    assert float(found) == 0.0  # the last replay had no inf


# --------------------------------------------------------------------------- strided views
#
# Whatever torch's own unscale takes, ours takes: contiguous and channels_last
# tensors in place, every other view through a copy that is written back.


def _views(device):
    g = torch.Generator().manual_seed(11)

    def base(*shape, dtype=torch.float32):
        x = (torch.randn(*shape, generator=g) * 1000).to(dtype)
        x.view(-1)[3] = INF if dtype != torch.float32 else x.view(-1)[3]
        return x.to(device)

    conv = torch.nn.Conv2d(3, 8, 3).to(device).to(memory_format=torch.channels_last)
    act = base(2, 3, 9, 7).to(memory_format=torch.channels_last)
    out = {
        "slice": base(40)[1::3],
        "transpose": base(6, 10, dtype=torch.float16).t(),
        "storage_offset": base(100)[37:81],
        "column": base(12, 9, dtype=torch.bfloat16)[:, 4],
        "channels_last_activation": act,
        "channels_last_conv_weight": conv.weight.detach() * 1000,
        "channels_last_3d": base(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
        "permuted": base(3, 4, 5).permute(2, 0, 1),
        "negated": torch._neg_view(base(17)) if hasattr(torch, "_neg_view") else base(17).conj().imag,
        "conj_imag": torch.randn(9, dtype=torch.complex64, generator=g).to(device).conj().imag,
        "compiled_like_transpose_view": base(4, 6).t()[1:],
    }
    return out


VIEW_KINDS = list(_views("cpu"))


@pytest.mark.parametrize("kind", VIEW_KINDS)
@pytest.mark.parametrize("mode", ["plain", "stats", "check_only"])
def test_strided_views_match_reference_and_write_back(device, kind, mode):
    view = _views(device)[kind]
    contiguous_sibling = make(50, torch.float16, 4, device=device)
    ours = [contiguous_sibling.clone(), view.clone() if kind not in ("negated", "conj_imag") else view]
    if kind in ("negated", "conj_imag"):
        ours = [contiguous_sibling.clone(), view]
        theirs = [contiguous_sibling.clone(), view.resolve_neg().clone()]
        before = view.resolve_neg().clone()
    else:
        ours = [contiguous_sibling.clone(), _same_view(view)]
        theirs = [contiguous_sibling.clone(), _same_view(view)]
        before = view.clone()
    assert not ours[1].is_contiguous() or ours[1].is_neg() or ours[1].storage_offset()
    strides = ours[1].stride()
    f1, f2 = scalar(0.0, device), scalar(0.0, device)
    kw = dict(check_only=mode == "check_only", return_stats=mode == "stats")
    got = adaptive_amp.unscale_and_check_(ours, f1, scalar(0.25, device), **kw)
    want = reference.unscale_and_check_(theirs, f2, scalar(0.25, device), **kw)
    assert float(f1) == float(f2)
    assert ours[1].stride() == strides  # still the caller's view
    assert_bitwise_equal(ours[0], theirs[0])
    assert_bitwise_equal(ours[1].resolve_neg() if ours[1].is_neg() else ours[1], theirs[1])
    if mode == "check_only":
        assert_bitwise_equal(ours[1].resolve_neg() if ours[1].is_neg() else ours[1], before)
    if mode == "stats":
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)


def _same_view(view):
    """A copy of view in its own storage with the same size, strides and storage offset."""
    storage = torch.empty(view.untyped_storage().nbytes() // view.element_size(), dtype=view.dtype,
                          device=view.device)
    storage.copy_(torch.empty(0, dtype=view.dtype, device=view.device).set_(view.untyped_storage()))
    return storage.as_strided(view.shape, view.stride(), view.storage_offset())


def test_strided_view_written_back_into_its_base_and_version_bumped():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[1:, ::2].t()  # storage offset, steps, transposed
    v0 = base._version
    adaptive_amp.unscale_and_check_([view], scalar(0.0, "cpu"), scalar(0.5, "cpu"))
    want = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    want[1:, ::2] *= 0.5
    assert torch.equal(base, want)
    assert base._version > v0


def test_strided_view_of_a_non_leaf_requiring_grad_is_written_without_a_graph():
    leaf = torch.ones(8, requires_grad=True)
    y = leaf * 2
    view = y[::2]
    adaptive_amp.unscale_and_check_([view], scalar(0.0, "cpu"), scalar(0.5, "cpu"))
    assert torch.equal(y.detach(), torch.tensor([1.0, 2.0] * 4))


def test_strided_views_sharing_memory_with_others_refused():
    base = torch.arange(20, dtype=torch.float32)
    before = base.clone()
    f = scalar(0.0, "cpu")
    with pytest.raises(ValueError, match="shares memory"):
        adaptive_amp.unscale_and_check_([base[2:12], base[::3]], f, scalar(0.5, "cpu"))
    with pytest.raises(ValueError, match="found_inf"):
        adaptive_amp.unscale_and_check_([base[::2]], base[5:6], scalar(0.5, "cpu"), check_only=True)
    assert torch.equal(base, before) and float(f) == 0.0
    # Reading only, the same memory twice is fine.
    adaptive_amp.unscale_and_check_([base[2:12], base[::3]], f, scalar(0.5, "cpu"), check_only=True)


def test_numpy_strided_and_fortran_arrays_written_back():
    a = np.arange(30, dtype=np.float32).reshape(5, 6)
    views = [a[:, 1], a.T, np.asfortranarray(np.arange(6, dtype=np.float16).reshape(2, 3))]
    wants = [v.astype(np.float32) * 0.5 for v in views]
    f = np.zeros(1, np.float32)
    adaptive_amp.unscale_and_check_(views[1:], f, np.array([0.5], np.float32))
    assert np.array_equal(a.T, wants[1]) and np.array_equal(views[2].astype(np.float32), wants[2])
    assert f[0] == 0.0
