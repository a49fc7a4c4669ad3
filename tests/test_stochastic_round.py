"""adaptive_amp.stochastic_round: rule, statistics, specials, reproducibility, adapters, torch integration, bad input.

Oracles: ``adaptive_amp.reference.stochastic_round`` (plain torch, float64,
written from the definition) and ``reference.philox4x32_10`` (checked
against Random123's known answers). Results are compared bit for bit, NaN as
a class.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import adaptive_amp
from adaptive_amp import reference
from conftest import CUDA_OK, NO_CUDA_REASON, assert_bitwise_equal

cuda_test = lambda fn: pytest.mark.cuda(pytest.mark.skipif(not CUDA_OK, reason=NO_CUDA_REASON)(fn))  # noqa: E731

SR = adaptive_amp.stochastic_round
TARGETS = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
TARGET_IDS = ["bf16", "fp16", "e4m3", "e5m2"]
SOURCES = [torch.float32, torch.float16, torch.bfloat16]
SOURCE_IDS = ["fp32", "fp16", "bf16"]
# (mantissa bits, smallest normal exponent, largest finite, has inf)
FMT = {
    torch.bfloat16: (7, -126, 3.3895313892515355e38, True),
    torch.float16: (10, -14, 65504.0, True),
    torch.float8_e4m3fn: (3, -6, 448.0, False),
    torch.float8_e5m2: (2, -14, 57344.0, True),
}
INF, NAN = float("inf"), float("nan")


def bits_of(t):
    """Integer bit patterns (int64) of a float tensor of any width."""
    t = t.detach().cpu().reshape(-1)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    b = t.view(view).to(torch.int64)
    return b & ((1 << (8 * t.element_size())) - 1)


def assert_same(a, b, msg=""):
    """Bitwise equality, every NaN equal to every NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{msg}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    na, nb = torch.isnan(a.detach().cpu().float()).reshape(-1), torch.isnan(b.detach().cpu().float()).reshape(-1)
    assert torch.equal(na, nb), f"{msg}: NaN positions differ"
    diff = (bits_of(a) != bits_of(b)) & ~na
    if diff.any():
        i = torch.nonzero(diff).flatten()[:5].tolist()
        fa, fb = a.detach().cpu().float().reshape(-1), b.detach().cpu().float().reshape(-1)
        raise AssertionError(f"{msg}: {int(diff.sum())} differ, e.g. " +
                             ", ".join(f"[{j}] {fa[j].item()!r} != {fb[j].item()!r}" for j in i))


def spread(n, seed=0, lo=-40, hi=20):
    """Random values over many binades (target subnormals included), never all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    return x * torch.exp2(torch.randint(lo, hi, (n,), generator=g).float())


def specials(target):
    mant, emin, fmax, _ = FMT[target]
    tiny = 2.0 ** (emin - mant)
    return torch.tensor([NAN, -NAN, INF, -INF, 0.0, -0.0, fmax, -fmax, fmax * 1.01, -fmax * 1.01, 3e38, -3e38,
                         tiny, -tiny, tiny / 3, tiny * 0.75, 2.0**emin * 0.999, 1e-45, -1e-45, 1.0, 1.0 + 2.0**-20])


def ints(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)


def rz_ra(x, target, **kw):
    """Round toward zero (r = 0) and away from zero wherever inexact (r = 2**32 - 1)."""
    n = x.numel()
    zeros = torch.zeros(x.shape, dtype=torch.int32)
    ones = torch.full(x.shape, -1, dtype=torch.int32)
    del n
    return SR(x, target, random_bits=zeros, **kw), SR(x, target, random_bits=ones, **kw)


# --------------------------------------------------------------------------- Philox and parity


def test_philox_known_answers():
    cases = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, expected in cases:
        got = reference.philox4x32_10(*[torch.tensor([c]) for c in counter], *key)
        assert [int(w) for w in got] == expected


@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_native_matches_reference_with_random_bits(source, target):
    x = torch.cat([spread(20000, 1), specials(target)]).to(source)
    r = ints(x.numel(), 2)
    for kw in ({}, {"scale": 3.0}, {"scale": torch.tensor([-0.25])}, {"saturate": True}):
        assert_same(SR(x, target, random_bits=r, **kw), reference.stochastic_round(x, target, random_bits=r, **kw),
                    f"{source}->{target} {kw}")


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_native_philox_matches_reference(target):
    x = spread(4099, 3)
    for seed, offset in ((0, 0), (7, 1), (2**64 - 1, 2**63 + 5)):
        bits = reference.philox_random_bits(x.shape, seed, offset)
        got = SR(x, target, seed=seed, offset=offset)
        assert_same(got, SR(x, target, random_bits=bits), f"seed {seed}")
        assert_same(got, reference.stochastic_round(x, target, seed=seed, offset=offset), f"seed {seed}")


def test_every_bf16_and_fp16_pattern_to_fp8():
    """Every finite and special 16-bit input towards fp8, against the reference."""
    for source in (torch.float16, torch.bfloat16):
        x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(source)
        r = ints(x.numel(), 4)
        for target in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16):
            assert_same(SR(x, target, random_bits=r), reference.stochastic_round(x, target, random_bits=r),
                        f"{source}->{target}")


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_result_is_a_neighbour_and_representable_inputs_stay(target):
    x = torch.cat([spread(30000, 5), specials(target)])
    lo, hi = rz_ra(x, target)
    got = SR(x, target, seed=11)
    ok = (bits_of(got) == bits_of(lo)) | (bits_of(got) == bits_of(hi)) | torch.isnan(got.float())
    assert bool(ok.all())
    # |RZ| <= |x| <= |RA| (finite part), RZ toward zero.
    mant, emin, fmax, _ = FMT[target]
    fin = torch.isfinite(x) & (x.abs() <= fmax)
    assert bool((lo.float()[fin].abs() <= x[fin].abs()).all())
    # (Below 2**-32 of the smallest subnormal spacing f truncates to 0: see test_fraction_beyond_32_bits.)
    fin &= x.abs() >= 2.0 ** (emin - mant - 32)
    assert bool((hi.float()[fin].abs() >= x[fin].abs()).all())
    # Representable values never move, whatever the bits.
    rep = lo.float()
    rep = rep[torch.isfinite(rep)]
    for r in (0, -1, 12345):
        assert_same(SR(rep, target, random_bits=torch.full(rep.shape, r, dtype=torch.int32)), rep.to(target))


def _away_probability_cases(target):
    """(value, exact P(away)) pairs: normal, subnormal, near the largest finite, with dyadic fractions."""
    mant, emin, fmax, has_inf = FMT[target]
    cases = []
    for e, frac in ((0, 0.5), (3, 0.25), (-2, 0.1), (emin - 1, 0.3), (emin - mant, 0.7), (emin - 1, 0.9)):
        ulp = 2.0 ** (max(e, emin) - mant)
        base = 2.0**e if e >= emin else 0.0
        v = float(np.float32(base + (3 * ulp if e >= emin else ulp) + frac * ulp))
        k = math.floor(v / ulp)
        cases.append((v, v / ulp - k))
    top_ulp = 2.0 ** (math.floor(math.log2(fmax)) - mant)
    v = float(np.float32(fmax - top_ulp + 0.375 * top_ulp))
    cases.append((v, 0.375))
    if has_inf:  # the gap to inf counts as one more ulp
        v = float(np.float32(fmax + 0.2 * top_ulp))
        cases.append((v, (v - fmax) / top_ulp))
    return cases


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_probability_of_rounding_away_within_6_sigma(target):
    draws = 100_000
    cases = _away_probability_cases(target)
    x = torch.tensor([v for v, _ in cases], dtype=torch.float32).repeat_interleave(draws)
    x = torch.cat([x, -x])  # both signs
    got = SR(x, target, seed=1234, offset=99).float()
    lo, _ = rz_ra(x, target)
    away = (got != lo.float()).reshape(2, len(cases), draws).float().mean(dim=2)
    for i, (v, p) in enumerate(cases):
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / draws)
        for s in range(2):
            assert abs(away[s, i].item() - p) <= 6 * sigma, f"x={v}: P(away) {away[s, i].item()} vs {p}"


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_mean_is_unbiased(target):
    draws = 100_000
    mant, emin, fmax, _ = FMT[target]
    values = spread(16, 8, lo=emin - mant + 1, hi=4)
    x = values.repeat_interleave(draws)
    got = SR(x, target, seed=5).double().reshape(16, draws)
    lo, hi = rz_ra(values, target)
    ulp = (hi.double() - lo.double()).abs()
    mean = got.mean(dim=1)
    tol = 6 * ulp * 0.5 / math.sqrt(draws) + 1e-300
    assert bool(((mean - values.double()).abs() <= tol).all()), (mean - values.double()).abs() / tol


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_odd_symmetry_and_signed_zeros(target):
    x = spread(5000, 9)
    r = ints(x.numel(), 10)
    assert_same(SR(-x, target, random_bits=r), (-SR(x, target, random_bits=r).float()).to(target))
    assert_same(SR(-x, target, seed=3), (-SR(x, target, seed=3).float()).to(target))
    z = torch.tensor([0.0, -0.0] * 8)
    got = SR(z, target, seed=1)
    assert bits_of(got).tolist() == bits_of(z.to(target)).tolist()


def test_fraction_beyond_32_bits_is_truncated():
    """fp16: 2**-60 sits 36 bits below the smallest subnormal spacing: F = 0, never away."""
    x = torch.full((1000,), 2.0**-60)
    assert bool((SR(x, torch.float16, random_bits=torch.full((1000,), -1, dtype=torch.int32)) == 0).all())
    # 2**-56 is exactly 32 bits below: F = 1, away only for r = 2**32 - 1.
    y = torch.tensor([2.0**-56, 2.0**-56])
    got = SR(y, torch.float16, random_bits=torch.tensor([-2, -1], dtype=torch.int32)).float()
    assert got.tolist() == [0.0, 2.0**-24]


# --------------------------------------------------------------------------- specials and range


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_specials(target):
    _, _, fmax, has_inf = FMT[target]
    nan_payloads = torch.tensor([0x7FC00000, 0x7F800001, 0xFFFFFFFF - (1 << 32), 0x7FBFFFFF], dtype=torch.int64)
    nans = nan_payloads.to(torch.int32).view(torch.float32)
    assert bool(torch.isnan(SR(nans, target, seed=0).float()).all())
    for saturate in (False, True):
        got = SR(torch.tensor([INF, -INF]), target, seed=0, saturate=saturate).float()
        if has_inf:
            assert got.tolist() == [INF, -INF]
        else:  # e4m3fn has no inf: it saturates, as torch's CPU cast does
            assert got.tolist() == [448.0, -448.0]
            assert torch.tensor([INF, -INF]).to(target).float().tolist() == [448.0, -448.0]
    big = torch.tensor([fmax * 4 if fmax < 1e38 else 3.4e38, 3.4e38, -3.4e38, fmax * 1.001])
    got = SR(big, target, seed=2).float()
    if has_inf:
        assert got[:3].tolist() == [INF, INF, -INF]
    else:
        assert got.tolist() == [448.0, 448.0, -448.0, 448.0]
    got = SR(big, target, seed=2, saturate=True).float()
    assert got.tolist() == [fmax, fmax, -fmax, fmax]


def test_e4m3fn_never_nan_from_finite():
    x = torch.cat([spread(100000, 12, lo=-20, hi=30), torch.tensor([3.4028234e38, -3.4028234e38, 449.0, 479.9])])
    got = SR(x, torch.float8_e4m3fn, seed=4).float()
    assert not bool(torch.isnan(got).any())
    assert float(got.abs().max()) == 448.0


@pytest.mark.parametrize("scale", [1e10, 3.4e38, -1e30])
def test_e4m3fn_scaled_fp32_overflow_saturates(scale):
    """A finite x whose x * scale overflows fp32 gives +-448, not NaN (the README's promise), on every path."""
    x = torch.tensor([1e30, -1e30, 3e38, 5.0, -2.0, 0.0, float("nan")])
    want_sign = torch.sign(x * (1 if scale > 0 else -1))
    got = SR(x, torch.float8_e4m3fn, seed=3, scale=scale).float()
    ref = reference.stochastic_round(x, torch.float8_e4m3fn, seed=3, scale=scale).float()
    assert_bitwise_equal(got, ref)
    assert torch.isnan(got[-1]) and not torch.isnan(got[:-1]).any()
    assert got[:2].tolist() == [448.0 * want_sign[0].item(), 448.0 * want_sign[1].item()]
    got_t = SR(x, torch.float8_e4m3fn, seed=3, scale=torch.tensor([scale])).float()
    assert_bitwise_equal(got_t, got)
    got_np = adaptive_amp.stochastic_round(x.numpy(), "float8_e4m3fn", seed=3, scale=scale)
    assert_bitwise_equal(torch.from_numpy(got_np.astype(np.float32)), got)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_specials_at_first_and_last_element(target):
    for n in (1, 2, 5, 8, 17, 64, 4097):
        x = spread(n, n)
        x[0], x[-1] = NAN, -INF
        r = ints(n, n)
        assert_same(SR(x, target, random_bits=r), reference.stochastic_round(x, target, random_bits=r), f"n={n}")


# --------------------------------------------------------------------------- reproducibility


def test_fixed_seed_is_deterministic_and_offset_and_seed_matter():
    x = spread(10000, 13)
    a = SR(x, torch.bfloat16, seed=1, offset=2)
    assert_same(a, SR(x, torch.bfloat16, seed=1, offset=2))
    assert not torch.equal(bits_of(a), bits_of(SR(x, torch.bfloat16, seed=1, offset=3)))
    assert not torch.equal(bits_of(a), bits_of(SR(x, torch.bfloat16, seed=2, offset=2)))


def test_generator_reproduces_and_advances():
    x = spread(10000, 14)
    torch.manual_seed(0)
    a, b = SR(x, torch.float16), SR(x, torch.float16)
    assert not torch.equal(bits_of(a), bits_of(b)), "successive calls differ"
    torch.manual_seed(0)
    assert_same(a, SR(x, torch.float16))
    assert_same(b, SR(x, torch.float16))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert_same(SR(x, torch.float16, generator=g1), SR(x, torch.float16, generator=g2))
    assert not torch.equal(bits_of(SR(x, torch.float16, generator=g1)),
                           bits_of(SR(x, torch.float16, generator=torch.Generator().manual_seed(5))))


def test_independent_of_thread_count_and_of_prefix():
    x = spread(300_001, 15)
    a = SR(x, torch.float8_e5m2, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        b = SR(x, torch.float8_e5m2, seed=9)
    finally:
        torch.set_num_threads(threads)
    assert_same(a, b)
    # The bits are a function of the element index: a prefix rounds the same.
    assert_same(SR(x[:1234].clone(), torch.float8_e5m2, seed=9), a[:1234])


@pytest.mark.parametrize("shift", range(8))
def test_views_with_storage_offsets(shift):
    base = spread(5000, 16)
    x = base[shift:shift + 4093]
    r_base = ints(5000, 17)
    r = r_base[shift:shift + 4093]
    for target in TARGETS:
        assert_same(SR(x, target, seed=3), SR(x.clone(), target, seed=3), f"{target} shift {shift}")
        assert_same(SR(x, target, random_bits=r), reference.stochastic_round(x, target, random_bits=r))
        out_base = torch.zeros(4100, dtype=target)
        out = out_base[shift % 4:shift % 4 + 4093]
        SR(x, target, seed=3, out=out)
        assert_same(out, SR(x.clone(), target, seed=3))


def test_stagnation_bf16_accumulator():
    """1.0 + 1000 * 1e-3 in bf16: round-to-nearest never moves, stochastic rounding reaches about 2."""
    n = 1024
    acc_sr = torch.ones(n, dtype=torch.bfloat16)
    acc_rn = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1000):
        acc_sr = SR(acc_sr.float() + 1e-3, torch.bfloat16, seed=42, offset=step)
        acc_rn = (acc_rn.float() + 1e-3).to(torch.bfloat16)
    assert bool((acc_rn == 1.0).all())
    mean = acc_sr.float().mean().item()
    assert abs(mean - 2.0) < 0.05, mean


# --------------------------------------------------------------------------- shapes, dtypes, outputs


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7,), (3, 5, 7), (2, 1025)])
def test_shapes(shape):
    x = torch.randn(shape)
    for target in TARGETS:
        got = SR(x, target, seed=1)
        assert got.shape == x.shape and got.dtype == target
        r = ints(x.numel(), 1).reshape(shape)
        assert_same(SR(x, target, random_bits=r), reference.stochastic_round(x, target, random_bits=r))


def test_dtype_names_and_return_amax():
    x = spread(1000, 18).clamp(-100, 100)
    x[3] = -1e6
    for name, target in zip(("bfloat16", "float16", "float8_e4m3fn", "torch.float8_e5m2"), TARGETS):
        out, amax = SR(x, name, seed=1, return_amax=True, scale=0.5)
        assert out.dtype == target
        assert amax.dtype == torch.float32 and amax.shape == (1,) and amax.item() == 1e6 * 1.0  # before scaling
    x[5] = NAN
    assert math.isnan(SR(x, "bfloat16", seed=1, return_amax=True)[1].item())
    assert SR(torch.empty(0), "bfloat16", seed=1, return_amax=True)[1].tolist() == [0.0]


def test_scale_tensor_and_number_agree():
    x = spread(3000, 19)
    for s in (0.375, -2.0, 1e-30, 448.0 / 3):
        assert_same(SR(x, torch.float8_e4m3fn, seed=5, scale=s),
                    SR(x, torch.float8_e4m3fn, seed=5, scale=torch.tensor([s])))


def test_out_argument():
    x = spread(777, 20)
    out = torch.empty(777, dtype=torch.float16)
    res = SR(x, torch.float16, seed=2, out=out)
    assert res is out
    assert_same(out, SR(x, torch.float16, seed=2))
    res, amax = SR(x, torch.float16, seed=2, out=out, return_amax=True)
    assert res is out and amax.item() == x.abs().max().item()


def test_numpy_arrays_give_ml_dtypes_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = spread(1001, 21)
    for target in TARGETS:
        got = SR(x.numpy(), target, seed=3, offset=1)
        name = str(target).replace("torch.", "")
        assert isinstance(got, np.ndarray) and got.dtype == np.dtype(getattr(ml_dtypes, name, np.float16))
        expected = SR(x, target, seed=3, offset=1)
        assert bits_of(torch.from_numpy(got.view({1: np.uint8, 2: np.int16}[got.itemsize]).copy()).view(
            target)).tolist() == bits_of(expected).tolist()
    bits = ints(1001, 4).numpy()
    got, amax = SR(x.clamp(-6e4, 6e4).numpy().astype(np.float16), "float8_e5m2", random_bits=bits, return_amax=True)
    assert isinstance(amax, np.ndarray) and amax.dtype == np.float32
    # numpy arrays without a seed draw from numpy's global generator.
    np.random.seed(1)
    a = SR(x.numpy(), "bfloat16")
    np.random.seed(1)
    assert np.array_equal(a.view(np.int16), SR(x.numpy(), "bfloat16").view(np.int16))
    assert not np.array_equal(a.view(np.int16), SR(x.numpy(), "bfloat16").view(np.int16))


def test_numpy_without_ml_dtypes_says_how_to_fix(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "ml_dtypes":
            raise ImportError("no ml_dtypes")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="pip install ml_dtypes"):
        SR(np.ones(4, dtype=np.float32), "bfloat16", seed=1)
    assert SR(np.ones(4, dtype=np.float32), "float16", seed=1).dtype == np.float16  # fp16 needs nothing


def test_dlpack_array_on_the_cpu():
    class Wrapped:  # any producer with __dlpack__ only
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    pytest.importorskip("ml_dtypes")
    x = spread(100, 22).numpy()
    got = SR(Wrapped(x), "float8_e4m3fn", seed=7)
    assert np.array_equal(got.view(np.uint8), SR(x, "float8_e4m3fn", seed=7).view(np.uint8))


# --------------------------------------------------------------------------- torch integration


def test_opcheck():
    from adaptive_amp import sround_torch

    x = spread(100, 23)
    so = torch.randint(0, 2**62, (2,))
    for args in ((x, torch.bfloat16, 1, 2, None, None, None, False, None, True),
                 (x.clone().requires_grad_(), torch.bfloat16, None, None, so, torch.tensor([0.5]), None, True,
                  None, False),
                 (x, torch.float8_e4m3fn, None, None, so, torch.tensor([0.5]), None, True, None, True),
                 (x, torch.float16, None, None, None, None, 2.0, False, ints(100, 1), True)):
        torch.library.opcheck(sround_torch.stochastic_round_op, args)
    torch.library.opcheck(sround_torch.stochastic_round_out_op,
                          (x, torch.float16, 3, 0, None, None, None, False, None, False,
                           torch.empty(100, dtype=torch.float16)))


@pytest.mark.slow
def test_torch_compile_fullgraph_cpu():
    torch._dynamo.reset()
    x = spread(4096, 24)

    def fn(x, s):
        y = x * 2 + 1
        a = adaptive_amp.stochastic_round(y, torch.float8_e4m3fn, scale=s, seed=3, offset=4)
        b, amax = adaptive_amp.stochastic_round(y, "bfloat16", return_amax=True)
        return a, b, amax

    s = torch.tensor([0.5])
    compiled = torch.compile(fn, fullgraph=True)
    a, b, amax = compiled(x, s)
    ea, _, eamax = fn(x, s)
    assert_same(a, ea)
    assert amax.item() == eamax.item()
    _, b2, _ = compiled(x, s)
    assert not torch.equal(bits_of(b), bits_of(b2)), "the default generator advances under compile too"


def test_torch_compile_out_and_ste_aot_eager():
    torch._dynamo.reset()
    x = spread(256, 25)
    out = torch.empty(256, dtype=torch.float16)

    def fn(x, out):
        adaptive_amp.stochastic_round(x, torch.float16, seed=1, out=out)
        return adaptive_amp.stochastic_round_ste(x, torch.bfloat16, seed=2).float().sum()

    xr = x.clone().requires_grad_()
    torch.compile(fn, fullgraph=True, backend="aot_eager")(xr, out).backward()
    assert_same(out, SR(x, torch.float16, seed=1))
    assert torch.equal(xr.grad, torch.ones_like(x))


def test_straight_through_gradient():
    x = spread(100, 26).requires_grad_()
    y = adaptive_amp.stochastic_round_ste(x, torch.bfloat16, seed=1)
    assert y.dtype == torch.bfloat16 and y.requires_grad
    assert_same(y, SR(x.detach(), torch.bfloat16, seed=1))
    y.float().mul(3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    adaptive_amp.stochastic_round_ste(x, torch.float8_e5m2, seed=1, scale=0.25).float().sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 0.25))
    xh = spread(10, 27).half().requires_grad_()
    adaptive_amp.stochastic_round_ste(xh, torch.bfloat16, seed=1).float().sum().backward()
    assert xh.grad.dtype == torch.float16
    assert not SR(x, torch.bfloat16, seed=1).requires_grad, "plain stochastic_round is not differentiable"


def test_out_written_in_place_bumps_its_version_for_autograd():
    # A graph that saved `out` must see the in-place write, as with torch's own in-place ops.
    a = torch.ones(64, requires_grad=True)
    o = torch.zeros(64, dtype=torch.bfloat16)
    y = (a * o.float()).sum()  # saves o.float(), a copy: unaffected
    z = (a.bfloat16() * o).sum()  # saves o itself
    SR(spread(64, 31), torch.bfloat16, seed=1, out=o)
    y.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


# --------------------------------------------------------------------------- bad input


def _bad_cases():
    x = spread(64, 28)
    return [
        ("int x", lambda o: SR(torch.arange(64, dtype=torch.int32), torch.bfloat16, seed=1), TypeError, "x"),
        ("fp64 x", lambda o: SR(x.double(), torch.bfloat16, seed=1), TypeError, "x"),
        ("target fp32", lambda o: SR(x, torch.float32, seed=1), TypeError, "dtype"),
        ("target int8", lambda o: SR(x, "int8", seed=1), TypeError, "dtype"),
        ("target bad name", lambda o: SR(x, "bf16x", seed=1), TypeError, "dtype"),
        ("out dtype", lambda o: SR(x, torch.bfloat16, seed=1, out=o.view(torch.float16)), TypeError, "out"),
        ("out shape", lambda o: SR(x[:32], torch.bfloat16, seed=1, out=o), ValueError, "out"),
        ("out non-contiguous", lambda o: SR(x[:32], torch.bfloat16, seed=1, out=o[::2]), ValueError, "out"),
        ("out sparse", lambda o: SR(x, torch.bfloat16, seed=1, out=torch.zeros(64, dtype=torch.bfloat16).to_sparse()),
         ValueError, "out"),
        ("out leaf requiring grad", lambda o: SR(x, torch.bfloat16, seed=1, out=o.requires_grad_()), ValueError,
         "out"),
        ("out view requiring grad", lambda o: SR(x[:32], torch.bfloat16, seed=1, out=o.requires_grad_()[:32]),
         ValueError, "out"),
        ("bits shape", lambda o: SR(x, torch.bfloat16, random_bits=torch.zeros(63, dtype=torch.int32), out=o),
         ValueError, "random_bits"),
        ("bits dtype", lambda o: SR(x, torch.bfloat16, random_bits=torch.zeros(64, dtype=torch.int64), out=o),
         TypeError, "random_bits"),
        ("bits and seed", lambda o: SR(x, torch.bfloat16, random_bits=torch.zeros(64, dtype=torch.int32), seed=1,
                                       out=o), ValueError, "random_bits"),
        ("offset alone", lambda o: SR(x, torch.bfloat16, offset=3, out=o), ValueError, "offset"),
        ("seed negative", lambda o: SR(x, torch.bfloat16, seed=-1, out=o), ValueError, "seed"),
        ("seed too big", lambda o: SR(x, torch.bfloat16, seed=2**64, out=o), ValueError, "seed"),
        ("seed float", lambda o: SR(x, torch.bfloat16, seed=1.5, out=o), TypeError, "seed"),
        ("seed and generator", lambda o: SR(x, torch.bfloat16, seed=1, generator=torch.Generator(), out=o),
         ValueError, "generator"),
        ("generator type", lambda o: SR(x, torch.bfloat16, generator=3, out=o), TypeError, "generator"),
        ("scale shape", lambda o: SR(x, torch.bfloat16, scale=torch.ones(2), seed=1, out=o), ValueError, "scale"),
        ("scale dtype", lambda o: SR(x, torch.bfloat16, scale=torch.ones(1, dtype=torch.float64), seed=1, out=o),
         TypeError, "scale"),
        ("scale type", lambda o: SR(x, torch.bfloat16, scale="2", seed=1, out=o), TypeError, "scale"),
        ("out negated", lambda o: SR(x, torch.bfloat16, seed=1, out=torch._neg_view(o)), ValueError, "out"),
        ("out overlaps x", lambda o: SR(x, torch.bfloat16, seed=1, out=x.view(torch.bfloat16)[:64]), ValueError,
         "out"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())), ids=[c[0] for c in _bad_cases()])
def test_bad_input_names_the_argument_and_writes_nothing(case):
    _, call, exc, name = _bad_cases()[case]
    out = torch.full((64,), 7.0, dtype=torch.bfloat16)
    before = out.clone()
    with pytest.raises(exc, match=re.escape(name)):
        call(out)
    assert torch.equal(out, before)


def test_bad_numpy_input():
    pytest.importorskip("ml_dtypes")
    x = np.ones(8, dtype=np.float32)
    with pytest.raises(TypeError, match="x"):
        SR(np.ones(8, dtype=np.int32), "bfloat16", seed=1)
    with pytest.raises(ValueError, match="random_bits"):
        SR(x, "bfloat16", random_bits=np.zeros(7, dtype=np.int32))
    out = np.zeros(8, dtype=np.float16)
    with pytest.raises(TypeError, match="out"):
        SR(x, "bfloat16", seed=1, out=out)
    assert not out.any()
    with pytest.raises(TypeError, match="generator"):
        SR(x, "bfloat16", generator="g")


# --------------------------------------------------------------------------- CUDA


@cuda_test
@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_cuda_matches_cpu_bitwise(source, target):
    x = torch.cat([spread(1_000_003, 30), specials(target)]).to(source)
    for kw in ({}, {"scale": 0.75}, {"saturate": True}):
        cpu = SR(x, target, seed=123, offset=45, **kw)
        gpu = SR(x.cuda(), target, seed=123, offset=45, **kw)
        assert_same(gpu, cpu, f"{source}->{target} {kw}")
    sc = torch.tensor([-3.0])
    assert_same(SR(x.cuda(), target, seed=1, scale=sc.cuda()), SR(x, target, seed=1, scale=sc))


@cuda_test
@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_cuda_matches_reference_with_random_bits(source, target):
    x = torch.cat([spread(300_001, 31), specials(target)]).to(source).cuda()
    r = ints(x.numel(), 32).cuda()
    assert_same(SR(x, target, random_bits=r), reference.stochastic_round(x, target, random_bits=r))
    assert_same(SR(x, target, seed=5, offset=6), reference.stochastic_round(x, target, seed=5, offset=6))


@cuda_test
@pytest.mark.parametrize("shift", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [1, 3, 4, 15, 16, 17, 4095, 65537, 1_048_583])
def test_cuda_alignments_and_tails(shift, n):
    base = spread(n + 16, n).cuda()
    x = base[shift:shift + n]
    rb = ints(n + 16, 2).cuda()
    for target in (torch.bfloat16, torch.float8_e4m3fn):
        assert_same(SR(x, target, seed=7), SR(x.cpu(), target, seed=7), f"n={n} shift={shift}")
        r = rb[shift:shift + n]
        assert_same(SR(x, target, random_bits=r), SR(x.cpu(), target, random_bits=r.cpu()))
        out_base = torch.empty(n + 16, dtype=target, device="cuda")
        out = out_base[shift:shift + n]
        SR(x, target, seed=7, out=out)
        assert_same(out, SR(x.cpu(), target, seed=7))


@cuda_test
def test_cuda_amax_generator_and_stream():
    x = spread(2_000_000, 33).cuda()
    x[12345] = -7e30
    out, amax = SR(x, torch.bfloat16, return_amax=True)
    assert amax.device == x.device and amax.item() == torch.tensor(7e30).item()  # 7e30 rounded to fp32
    torch.manual_seed(0)
    a, b = SR(x, torch.float16), SR(x, torch.float16)
    torch.manual_seed(0)
    assert_same(a, SR(x, torch.float16))
    assert not torch.equal(bits_of(a), bits_of(b))
    g = torch.Generator(device="cuda").manual_seed(3)
    c = SR(x, torch.float16, generator=g)
    assert_same(c, SR(x, torch.float16, generator=torch.Generator(device="cuda").manual_seed(3)))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        d = SR(x, torch.float8_e5m2, seed=1)
    s.synchronize()
    assert_same(d, SR(x.cpu(), torch.float8_e5m2, seed=1))


@cuda_test
def test_cuda_graph_capture_draws_fresh_bits_each_replay():
    x = spread(100_000, 34).cuda()
    static = {}
    SR(x, torch.bfloat16)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static["out"] = SR(x, torch.bfloat16)
    graph.replay()
    first = static["out"].clone()
    graph.replay()
    assert not torch.equal(bits_of(first), bits_of(static["out"]))


@cuda_test
def test_cuda_torch_compile_fullgraph():
    torch._dynamo.reset()
    x = spread(1 << 20, 35).cuda()

    def fn(x):
        return adaptive_amp.stochastic_round(x * 2, torch.float8_e4m3fn, seed=3, scale=torch.ones(1, device="cuda"))

    assert_same(torch.compile(fn, fullgraph=True)(x), fn(x))


@cuda_test
def test_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    x = spread(10_001, 36)
    got = SR(cupy.asarray(x.numpy()), "bfloat16", seed=2)
    assert got.dtype == cupy.uint16  # CuPy has no bf16: the bit patterns
    assert bits_of(torch.from_numpy(got.get().view(np.int16)).view(torch.bfloat16)).tolist() == \
        bits_of(SR(x, torch.bfloat16, seed=2)).tolist()
    half = SR(cupy.asarray(x.numpy()), "float16", seed=2)
    assert half.dtype == cupy.float16


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
def test_ste_matches_its_reference_twin_forward_and_backward(target):
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(4099, generator=gen) * 3).requires_grad_(True)
    bits = torch.randint(-(2**31), 2**31, x.shape, dtype=torch.int32, generator=gen)
    ours = adaptive_amp.stochastic_round_ste(x, target, random_bits=bits, scale=0.5)
    ref = reference.stochastic_round_ste(x, target, random_bits=bits, scale=0.5)
    assert torch.equal(ours.view(torch.int16), ref.view(torch.int16))
    weights = torch.randn(x.shape, generator=gen)
    g_ours, = torch.autograd.grad((ours.float() * weights).sum(), x)
    g_ref, = torch.autograd.grad((ref.float() * weights).sum(), x)
    assert torch.equal(g_ours, g_ref)
    assert torch.equal(g_ours, (weights.to(target).to(torch.float32) * 0.5))


@pytest.mark.parametrize("kind", ["transpose", "slice", "negated", "channels_last"])
def test_strided_and_negated_inputs_round_like_their_contiguous_copy(kind):
    g = torch.Generator().manual_seed(8)
    base = torch.randn(4, 6, 5, 3, generator=g)
    x = {"transpose": base[0, 0].t(), "slice": base[:, ::2, 1:], "negated": torch._neg_view(base),
         "channels_last": base.contiguous(memory_format=torch.channels_last)}[kind]
    got = SR(x, torch.bfloat16, seed=5, offset=2)
    want = reference.stochastic_round(x.resolve_neg().contiguous(), torch.bfloat16, seed=5, offset=2)
    assert got.shape == x.shape
    assert_bitwise_equal(got, want)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out.*lazy negation"):
        SR(x, torch.bfloat16, seed=5, out=torch._neg_view(out))
