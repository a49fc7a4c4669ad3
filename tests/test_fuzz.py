"""Property-based fuzzing of every native op against its pure-torch twin in ``reference.py``.

Random shapes (0-dim and empty included), mixed fp32/fp16/bf16 lists, views
with storage offsets, special values (NaN, +-inf, -0.0, subnormals, the
formats' max/min) planted at random places, lists longer than one launch's
pointer table, and scales/inv_scales including 0, inf and subnormals.

Bounded for CI. For a long run set ``AAMP_FUZZ_EXAMPLES`` (examples per
test, e.g. 2000); ``AAMP_FUZZ_LONG_LISTS`` likewise for the slow
long-list test (default: a tenth of it, at least 3).

Oracles: adamw_step_ / sgd_step_ bitwise on every list (NaN as a class);
unscale_and_check_ values and found_inf bitwise (NaN as a class),
its stats within the tolerance of tests/test_unscale.py; stochastic_round
bitwise for every target; tensor_stats counts/extrema exact, mean/std/norm
within the tolerance of tests/test_tensor_stats.py; update_scale_ bitwise on
every state array after every step of a random sequence.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import adaptive_amp
from adaptive_amp import optim, reference
from conftest import assert_bitwise_equal, assert_stats_match, requires_cuda

N_EXAMPLES = int(os.environ.get("AAMP_FUZZ_EXAMPLES", "40"))
N_LONG = int(os.environ.get("AAMP_FUZZ_LONG_LISTS", str(max(3, N_EXAMPLES // 10))))

FUZZ = settings(max_examples=N_EXAMPLES, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
FUZZ_LONG = settings(FUZZ, max_examples=N_LONG)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TARGETS = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
FORMATS = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
INF, NAN = float("inf"), float("nan")
F32_MAX = 3.4028234663852886e38
F32_TINY = 2.0**-149

# Values that sit on the interesting edges of every source and target format.
SPECIALS = [
    NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0,
    F32_MAX, -F32_MAX, 1.1754943508222875e-38, F32_TINY, -F32_TINY, 1e-40,      # fp32 max, min normal, subnormals
    65504.0, -65504.0, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 3 * 2.0**-26,     # fp16 edges
    3.3895313892515355e38, 9.183549615799121e-41,                              # bf16 max, subnormal
    448.0, 464.0, -480.0, 2.0**-6, 2.0**-9, 2.0**-10,                          # e4m3fn edges
    57344.0, 61440.0, 2.0**-16, 2.0**-17,                                      # e5m2 edges
]

# Scales / inv_scales: 0, +-inf-free and with inf, subnormal, huge, ordinary, non-powers of two.
SCALES = [0.0, -0.0, 1.0, INF, F32_TINY, 1e-40, 2.0**-126, 2.0**-24, 2.0**-16, 0.5, 3.0, 1.0 / 3.0, 7.0,
          2.0**16, 65536.0 * 3, 2.0**100, F32_MAX]


def cuda_test(fn):
    return pytest.mark.cuda(requires_cuda(fn))


# --------------------------------------------------------------------------- strategies

shapes = st.one_of(
    st.just(()),                                                          # 0-dim
    st.lists(st.integers(0, 6), min_size=1, max_size=3).map(tuple),       # small, empties included
    st.integers(0, 300).map(lambda n: (n,)),                              # 1-D around vector widths
)


@st.composite
def tensors_(draw, dtype=None, shape=None, specials=True):
    """One tensor: random data over many binades, specials at random places, maybe a view at an offset."""
    dtype = draw(st.sampled_from(DTYPES)) if dtype is None else dtype
    shape = draw(shapes) if shape is None else shape
    n = math.prod(shape)
    seed = draw(st.integers(0, 2**31 - 1))
    offset = draw(st.integers(0, 9))
    g = torch.Generator().manual_seed(seed)
    spread = draw(st.sampled_from([0, 8, 40, 140]))
    total = n + offset + draw(st.integers(0, 3))
    base = torch.randn(total, generator=g) * torch.exp2(
        torch.randint(-spread, spread + 1, (total,), generator=g).float())
    if specials and n:
        picks = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIALS)), max_size=min(n, 8)))
        for i, v in picks:
            base[offset + i] = v
    base = base.to(dtype)
    view = base[offset:offset + n].view(shape)
    assert view.is_contiguous() and view.storage_offset() == offset
    return view


tensor_lists = st.lists(tensors_(), min_size=1, max_size=8)


def clone_keep_offset(t, device="cpu"):
    """A copy of t that is again a view at t's storage offset (so alignment paths stay the same)."""
    off = t.storage_offset()
    base = torch.empty(off + t.numel() + 1, dtype=t.dtype, device=device)
    view = base[off:off + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def scalar(v):
    return torch.tensor([v], dtype=torch.float32)


def bits_equal(actual, expected, msg=""):
    """Bitwise equality for any float dtype, fp8 included; NaNs compared as a class."""
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype.itemsize != 1:
        return assert_bitwise_equal(actual, expected, msg)
    a_nan, e_nan = torch.isnan(actual.float()), torch.isnan(expected.float())
    assert torch.equal(a_nan, e_nan), f"{msg}: NaN positions differ"
    a, e = actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
    diff = (a != e) & ~a_nan.reshape(-1)
    if bool(diff.any()):
        idx = torch.nonzero(diff).flatten()[:5].tolist()
        shown = ", ".join(f"[{i}] 0x{int(a[i]):02x} != 0x{int(e[i]):02x}" for i in idx)
        raise AssertionError(f"{msg}: {int(diff.sum())} element(s) differ: {shown}")


# --------------------------------------------------------------------------- unscale_and_check_


def _sumsq_ok(got, tensors, inv, msg):
    for i, t in enumerate(tensors):
        y = torch.where(torch.tensor(inv == 1.0), t.float(), t.float() * torch.tensor(inv, dtype=torch.float32))
        exp = float(y.double().square().sum())
        exp32 = float(torch.tensor(exp, dtype=torch.float64).float())
        g = float(got[i])
        where = f"{msg} sumsq[{i}] ({t.dtype}, numel {t.numel()}, inv {inv!r})"
        if math.isnan(exp):
            assert math.isnan(g), f"{where}: {g} != nan"
        elif math.isinf(exp32):
            # fp32 rounding of a sum near FLT_MAX may land either side.
            assert g == exp32 or (math.isfinite(g) and abs(g - exp) <= 5e-5 * exp), f"{where}: {g} != {exp32}"
        else:
            tol = 5e-5 * abs(exp) + t.numel() * F32_TINY
            assert math.isfinite(g) and abs(g - exp) <= tol, f"{where}: {g} vs {exp}"


@FUZZ
@given(tensors=tensor_lists, inv=st.sampled_from(SCALES), found0=st.sampled_from([0.0, 1.0, 0.25]),
       check_only=st.booleans(), return_stats=st.booleans())
def test_unscale_matches_reference(tensors, inv, found0, check_only, return_stats):
    ours = [clone_keep_offset(t) for t in tensors]
    refs = [t.clone() for t in tensors]
    f, f_ref = scalar(found0), scalar(found0)
    got = adaptive_amp.unscale_and_check_(ours, f, scalar(inv), check_only=check_only, return_stats=return_stats)
    exp = reference.unscale_and_check_(refs, f_ref, scalar(inv), check_only=check_only, return_stats=return_stats)
    for i, (a, e) in enumerate(zip(ours, refs)):
        assert_bitwise_equal(a, e, f"tensors[{i}] inv={inv!r} check_only={check_only}")
    assert_bitwise_equal(f, f_ref, "found_inf")
    if check_only:
        for i, (a, t) in enumerate(zip(ours, tensors)):
            assert_bitwise_equal(a, t, f"check_only wrote tensors[{i}]")
    if return_stats:
        sumsq, amax = got
        assert sumsq.shape == amax.shape == (len(tensors),)
        assert_bitwise_equal(amax, exp[1], f"amax inv={inv!r}")
        _sumsq_ok(sumsq, tensors, inv, "fuzz")
    else:
        assert got is None


@FUZZ_LONG
@given(count=st.integers(2001, 4500), seed=st.integers(0, 2**31 - 1), inv=st.sampled_from(SCALES),
       plant=st.sampled_from([None, "first", "last", "random"]), special=st.sampled_from([NAN, INF, -INF]))
def test_unscale_long_lists_match_reference(count, seed, inv, plant, special):
    """Lists beyond one launch's pointer table: tiny mixed tensors, one special at a chosen place."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 4, (count,), generator=g).tolist()
    kinds = torch.randint(0, 3, (count,), generator=g).tolist()
    tensors = [(torch.randn(n, generator=g) * 1000).to(DTYPES[k]) for n, k in zip(sizes, kinds)]
    nonempty = [i for i, t in enumerate(tensors) if t.numel()]
    if plant and nonempty:
        where = {"first": nonempty[0], "last": nonempty[-1]}.get(plant)
        if where is None:
            where = nonempty[int(torch.randint(0, len(nonempty), (1,), generator=g))]
        tensors[where][0] = special
    ours = [t.clone() for t in tensors]
    refs = [t.clone() for t in tensors]
    f, f_ref = scalar(0.0), scalar(0.0)
    sumsq, amax = adaptive_amp.unscale_and_check_(ours, f, scalar(inv), return_stats=True)
    _, amax_ref = reference.unscale_and_check_(refs, f_ref, scalar(inv), return_stats=True)
    for i, (a, e) in enumerate(zip(ours, refs)):
        assert_bitwise_equal(a, e, f"tensors[{i}] of {count}")
    assert_bitwise_equal(f, f_ref, "found_inf")
    assert_bitwise_equal(amax, amax_ref, "amax")
    _sumsq_ok(sumsq, tensors, inv, "long list")


# --------------------------------------------------------------------------- stochastic_round


@FUZZ
@given(data=st.data(), target=st.sampled_from(TARGETS), saturate=st.booleans(),
       scale=st.one_of(st.none(), st.sampled_from(SCALES), st.sampled_from([-2.0, -1e-40, -INF])),
       scale_as_tensor=st.booleans(), return_amax=st.booleans(), use_out=st.booleans())
def test_stochastic_round_random_bits_match_reference(data, target, saturate, scale, scale_as_tensor, return_amax,
                                                      use_out):
    x = data.draw(tensors_())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    bits = torch.randint(-2**31, 2**31, x.shape, dtype=torch.int64, generator=g).to(torch.int32)
    # Bits at the extremes decide the rounding edges: plant a few.
    if x.numel():
        flat = bits.view(-1)
        for i, v in data.draw(st.lists(st.tuples(st.integers(0, x.numel() - 1),
                                                 st.sampled_from([0, -1, 2**31 - 1, -2**31, 1])), max_size=4)):
            flat[i] = v
    s = None if scale is None else (scalar(scale) if scale_as_tensor else scale)
    x_before = x.clone()
    kw = dict(random_bits=bits, scale=s, saturate=saturate, return_amax=return_amax)
    if use_out:
        out = torch.full(x.shape, 3.0).to(target)
        got = adaptive_amp.stochastic_round(x, target, out=out, **kw)
        res = got[0] if return_amax else got
        assert res is out
    else:
        got = adaptive_amp.stochastic_round(x, target, **kw)
        res = got[0] if return_amax else got
    exp = reference.stochastic_round(x, target, random_bits=bits, scale=s, saturate=saturate)
    bits_equal(res, exp, f"{x.dtype}->{target} scale={scale!r} saturate={saturate}")
    assert_bitwise_equal(x, x_before, "x was modified")
    if return_amax:
        amax = got[1]
        assert amax.dtype == torch.float32 and amax.numel() == 1
        xf = x.float().reshape(-1)
        if xf.numel() == 0:
            assert float(amax) == 0.0
        elif bool(torch.isnan(xf).any()):
            assert math.isnan(float(amax))
        else:
            assert float(amax) == float(xf.abs().max())


@FUZZ
@given(x=tensors_(), target=st.sampled_from(TARGETS), saturate=st.booleans(),
       seed=st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1])),
       offset=st.one_of(st.none(), st.integers(0, 2**64 - 1),
                        st.sampled_from([0, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64 - 2])))
def test_stochastic_round_philox_matches_reference(x, target, saturate, seed, offset):
    """Seeded Philox: every key and counter word, carries across the 32-bit halves of offset."""
    got = adaptive_amp.stochastic_round(x, target, seed=seed, offset=offset, saturate=saturate)
    exp = reference.stochastic_round(x, target, seed=seed, offset=offset, saturate=saturate)
    bits_equal(got, exp, f"seed={seed} offset={offset} {x.dtype}->{target}")
    again = adaptive_amp.stochastic_round(x, target, seed=seed, offset=offset, saturate=saturate)
    bits_equal(again, got, "not deterministic")


@FUZZ
@given(x=tensors_(specials=False), target=st.sampled_from(TARGETS), seed=st.integers(0, 2**64 - 1))
def test_stochastic_round_numpy_matches_torch(x, target, seed):
    """The numpy path gives the torch path's bits (fp32/fp16 sources: numpy has no bf16)."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("ml_dtypes")
    assume(x.dtype != torch.bfloat16)
    got = adaptive_amp.stochastic_round(x.numpy(), str(target).replace("torch.", ""), seed=seed)
    exp = adaptive_amp.stochastic_round(x, target, seed=seed)
    arr = np.asarray(got)
    assert arr.shape == tuple(x.shape)
    raw = torch.from_numpy(arr.view(np.uint8 if exp.dtype.itemsize == 1 else np.int16).copy())
    exp_raw = exp.view(torch.uint8 if exp.dtype.itemsize == 1 else torch.int16)
    nan = torch.isnan(exp.float())
    assert torch.equal(raw[~nan], exp_raw[~nan])


# --------------------------------------------------------------------------- tensor_stats

@FUZZ
@given(data=st.data(), tensors=tensor_lists, fmt=st.one_of(st.none(), st.sampled_from(FORMATS)),
       scale_kind=st.sampled_from(["none", "number", "tensor1", "per_tensor"]))
def test_tensor_stats_match_reference(data, tensors, fmt, scale_kind):
    scale = None
    if fmt is not None and scale_kind == "number":
        scale = data.draw(st.sampled_from(SCALES))
    elif fmt is not None and scale_kind == "tensor1":
        scale = scalar(data.draw(st.sampled_from(SCALES)))
    elif fmt is not None and scale_kind == "per_tensor":
        scale = torch.tensor(data.draw(st.lists(st.sampled_from(SCALES), min_size=len(tensors),
                                                max_size=len(tensors))), dtype=torch.float32)
        if len(tensors) == 1:
            scale = scale.reshape(1)
    before = [t.clone() for t in tensors]
    got = adaptive_amp.tensor_stats(tensors, fmt=fmt, scale=scale).to_dict()
    exp = reference.tensor_stats(tensors, fmt=fmt, scale=scale)
    assert_stats_match(got, exp, f"fmt={fmt} scale={scale!r}")
    for i, (a, b) in enumerate(zip(tensors, before)):
        assert_bitwise_equal(a, b, f"tensor_stats modified tensors[{i}]")


@FUZZ_LONG
@given(count=st.integers(2001, 4500), seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from([None, *FORMATS]))
def test_tensor_stats_long_lists_match_reference(count, seed, fmt):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 4, (count,), generator=g).tolist()
    kinds = torch.randint(0, 3, (count,), generator=g).tolist()
    tensors = [(torch.randn(n, generator=g) * 300).to(DTYPES[k]) for n, k in zip(sizes, kinds)]
    got = adaptive_amp.tensor_stats(tensors, fmt=fmt).to_dict()
    exp = reference.tensor_stats(tensors, fmt=fmt)
    assert_stats_match(got, exp, f"{count} tensors fmt={fmt}")


# --------------------------------------------------------------------------- update_scale_

_SCALE_START = [1.0, 2.0**16, 3.0, 1e-40, F32_TINY, F32_MAX, 2.0**127, 0.0, INF]
_FACTORS_UP = [2.0, 1.5, 1.1, 3.0, 1.0000001, 1e30]  # the op requires > 1
_FACTORS_DOWN = [0.5, 0.25, 0.1, 1.0 / 3.0, 0.9, 1e-30, 0.9999999]  # in (0, 1)


@st.composite
def scale_configs(draw):
    predictive = draw(st.booleans())
    hysteresis = draw(st.integers(1, 3))
    cfg = dict(
        growth_factor=draw(st.one_of(st.sampled_from(_FACTORS_UP), st.floats(1.0, 4.0, exclude_min=True))),
        backoff_factor=draw(st.one_of(st.sampled_from(_FACTORS_DOWN), st.floats(0.01, 1.0, exclude_max=True))),
        growth_interval=draw(st.integers(1, 5)),
        hysteresis=hysteresis,
        min_scale=draw(st.sampled_from([0.0, 1.0, 2.0**-10, F32_TINY])),
        max_scale=draw(st.sampled_from([None, 2.0**24, 65536.0 * 3, 1.0])),
    )
    if predictive:
        cfg.update(margin=draw(st.integers(0, 6)), fmt_max=draw(st.sampled_from([65504.0, 448.0, 57344.0])))
    start = draw(st.sampled_from(_SCALE_START))
    steps = draw(st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.0, 1.0, 2.0, NAN, -1.0]),
                                    st.sampled_from([0.0, 1.0, 3.5, 1e-30, 1e30, INF, NAN, 65504.0, 1e-45])),
                          min_size=1, max_size=25))
    history = draw(st.integers(1, 5)) if predictive else 0
    return cfg, start, steps, history


@FUZZ
@given(config=scale_configs(), with_inv=st.booleans())
def test_update_scale_sequences_match_reference(config, with_inv):
    cfg, start, steps, history = config
    state = {}
    for who in ("ours", "ref"):
        state[who] = dict(scale=scalar(start), growth_tracker=torch.zeros(1, dtype=torch.int32),
                          counters=torch.tensor([cfg["hysteresis"], 0, 0, 0], dtype=torch.int32),
                          amax_history=torch.zeros(history) if history else None,
                          inv_scale=scalar(-7.0) if with_inv else None)
    for step, (found, amax) in enumerate(steps):
        for who, fn in (("ours", adaptive_amp.update_scale_), ("ref", reference.update_scale_)):
            s = state[who]
            extra = {}
            if history:
                extra = dict(amax_history=s["amax_history"], step_amax=scalar(amax))
            fn(s["scale"], s["growth_tracker"], scalar(found), counters=s["counters"], inv_scale=s["inv_scale"],
               **extra, **cfg)
        a, e = state["ours"], state["ref"]
        where = f"step {step} (found_inf={found}, amax={amax}) cfg={cfg} start={start}"
        assert_bitwise_equal(a["scale"], e["scale"], f"scale at {where}")
        assert torch.equal(a["growth_tracker"], e["growth_tracker"]), f"growth_tracker at {where}"
        assert torch.equal(a["counters"], e["counters"]), f"counters at {where}: {a['counters']} {e['counters']}"
        if history:
            assert_bitwise_equal(a["amax_history"], e["amax_history"], f"amax_history at {where}")
        if with_inv:
            assert_bitwise_equal(a["inv_scale"], e["inv_scale"], f"inv_scale at {where}")


@FUZZ
@given(start=st.sampled_from(_SCALE_START), growth=st.sampled_from(_FACTORS_UP),
       backoff=st.sampled_from(_FACTORS_DOWN), interval=st.integers(1, 4),
       founds=st.lists(st.sampled_from([0.0, 1.0, NAN]), min_size=1, max_size=20))
def test_update_scale_without_counters_matches_torch_and_reference(start, growth, backoff, interval, founds):
    """The torch-compatible call (no counters) against the reference and torch._amp_update_scale_."""
    ours, ref, th = scalar(start), scalar(start), scalar(start)
    g_ours, g_ref, g_th = (torch.zeros(1, dtype=torch.int32) for _ in range(3))
    for i, found in enumerate(founds):
        adaptive_amp.update_scale_(ours, g_ours, scalar(found), growth, backoff, interval)
        reference.update_scale_(ref, g_ref, scalar(found), growth, backoff, interval)
        torch._amp_update_scale_(th, g_th, scalar(found), growth, backoff, interval)
        assert_bitwise_equal(ours, ref, f"vs reference at step {i}")
        assert_bitwise_equal(ours, th, f"vs torch at step {i}")
        assert torch.equal(g_ours, g_ref) and torch.equal(g_ours, g_th), f"growth_tracker at step {i}"


# --------------------------------------------------------------------------- CUDA twins (run on a GPU machine)


@cuda_test
@FUZZ
@given(tensors=tensor_lists, inv=st.sampled_from(SCALES))
def test_cuda_unscale_matches_cpu(tensors, inv):
    cpu = [clone_keep_offset(t) for t in tensors]
    gpu = [clone_keep_offset(t, "cuda") for t in tensors]
    f_cpu, f_gpu = scalar(0.0), scalar(0.0).cuda()
    s_cpu = adaptive_amp.unscale_and_check_(cpu, f_cpu, scalar(inv), return_stats=True)
    s_gpu = adaptive_amp.unscale_and_check_(gpu, f_gpu, scalar(inv).cuda(), return_stats=True)
    for i, (a, b) in enumerate(zip(gpu, cpu)):
        assert_bitwise_equal(a, b, f"tensors[{i}]")
    assert_bitwise_equal(f_gpu, f_cpu, "found_inf")
    assert_bitwise_equal(s_gpu[1], s_cpu[1], "amax")


@cuda_test
@FUZZ
@given(x=tensors_(), target=st.sampled_from(TARGETS), seed=st.integers(0, 2**64 - 1),
       offset=st.integers(0, 2**64 - 1), saturate=st.booleans())
def test_cuda_stochastic_round_matches_cpu(x, target, seed, offset, saturate):
    cpu = adaptive_amp.stochastic_round(x, target, seed=seed, offset=offset, saturate=saturate)
    gpu = adaptive_amp.stochastic_round(x.cuda(), target, seed=seed, offset=offset, saturate=saturate)
    bits_equal(gpu.cpu(), cpu, "cuda vs cpu")


@cuda_test
@FUZZ
@given(tensors=tensor_lists, fmt=st.one_of(st.none(), st.sampled_from(FORMATS)))
def test_cuda_tensor_stats_match_reference(tensors, fmt):
    gpu = [t.cuda() for t in tensors]
    got = adaptive_amp.tensor_stats(gpu, fmt=fmt).to_dict()
    exp = reference.tensor_stats(tensors, fmt=fmt)
    assert_stats_match(got, exp, f"cuda fmt={fmt}")


# --------------------------------------------------------------------------- adamw_step_ / sgd_step_
#
# Native (adaptive_amp.optim) against reference.adamw_step_ / sgd_step_ with
# the same seed and offset, bitwise (NaN as a class) on params, moments and
# untouched steps: random list lengths, shapes (empty and 0-dim included),
# views at storage offsets, bf16/fp32 params, fp32/bf16 moments, special
# values in the grads, grad_scale and found_inf.

PARAM_DTYPES = [torch.float32, torch.bfloat16]
LRS = [0.0, 1e-4, 1e-3, 0.1, 1.0, 3.0]
GRAD_SCALES = [None, 1.0, 0.5, 3.0, 65536.0, 2.0**-20, 0.0, INF]


@st.composite
def optim_lists(draw, with_steps=True):
    """(params, grads, exp_avgs, exp_avg_sqs, steps) of random length, per-tensor param dtypes, one moment
    dtype for both moment lists."""
    n = draw(st.integers(1, 8))

    mdt = sdt = draw(st.sampled_from(PARAM_DTYPES))  # the kernels take exp_avg_sq of exp_avg's dtype
    ps, gs, ms, vs, steps = [], [], [], [], []
    for _ in range(n):
        shape = draw(shapes)
        pdt = draw(st.sampled_from(PARAM_DTYPES))
        ps.append(draw(tensors_(dtype=pdt, shape=shape, specials=False)))
        gs.append(draw(tensors_(dtype=pdt, shape=shape, specials=True)))
        ms.append(draw(tensors_(dtype=mdt, shape=shape, specials=False)))
        v = draw(tensors_(dtype=sdt, shape=shape, specials=False))
        v.abs_()
        vs.append(v)
        if with_steps:
            steps.append(torch.tensor(float(draw(st.sampled_from([0, 1, 2, 9, 1000, 2**20])))))
    return ps, gs, ms, vs, steps


def _optim_scalars(draw):
    gs = draw(st.sampled_from(GRAD_SCALES))
    fi = draw(st.sampled_from([None, 0.0, 0.0, 1.0]))
    seed = draw(st.integers(0, 2**64 - 1))
    offset = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**64 - 1, 2**64 - 3, 2**32 - 1])))
    return (None if gs is None else scalar(gs)), (None if fi is None else scalar(fi)), seed, offset


def _copies(lists, device="cpu"):
    return [[clone_keep_offset(t, device) for t in xs] for xs in lists]


def _assert_optim_lists(got, exp, names):
    for xs, ys, name in zip(got, exp, names):
        for i, (x, y) in enumerate(zip(xs, ys)):
            assert_bitwise_equal(x.cpu(), y.cpu(), f"{name}[{i}]")


def _run_adamw(data, lists, device="cpu"):
    grad_scale, found_inf, seed, offset = _optim_scalars(data.draw)
    kw = dict(lr=data.draw(st.sampled_from(LRS)), beta1=data.draw(st.sampled_from([0.0, 0.5, 0.9, 0.99])),
              beta2=data.draw(st.sampled_from([0.0, 0.9, 0.999, 0.9999])),
              eps=data.draw(st.sampled_from([0.0, 1e-8, 1e-6, 1e-30])),
              weight_decay=data.draw(st.sampled_from([0.0, 0.01, 0.1, 1.0])), maximize=data.draw(st.booleans()),
              stochastic_rounding=data.draw(st.booleans()), seed=seed, offset=offset)
    on = (lambda t: None if t is None else t.to(device))
    native, ref = _copies(lists, device), _copies(lists)
    optim.adamw_step_(*native, grad_scale=on(grad_scale), found_inf=on(found_inf), **kw)
    reference.adamw_step_(*ref, grad_scale=grad_scale, found_inf=found_inf, **kw)
    _assert_optim_lists(native, ref, ["params", "grads", "exp_avgs", "exp_avg_sqs", "steps"])


def _run_sgd(data, lists, device="cpu"):
    ps, gs, ms = lists[:3]
    grad_scale, found_inf, seed, offset = _optim_scalars(data.draw)
    momentum = data.draw(st.sampled_from([0.0, 0.5, 0.9, 0.99]))
    nesterov = momentum > 0 and data.draw(st.booleans())
    kw = dict(lr=data.draw(st.sampled_from(LRS)), momentum=momentum,
              dampening=0.0 if nesterov else data.draw(st.sampled_from([0.0, 0.1, 1.0])), nesterov=nesterov,
              weight_decay=data.draw(st.sampled_from([0.0, 0.01, 0.1])), maximize=data.draw(st.booleans()),
              stochastic_rounding=data.draw(st.booleans()), seed=seed, offset=offset)
    bufs = ms if momentum else []
    first = [data.draw(st.booleans()) for _ in ps] if momentum else []
    on = (lambda t: None if t is None else t.to(device))
    native, ref = _copies([ps, gs, bufs], device), _copies([ps, gs, bufs])
    optim.sgd_step_(*native, first, grad_scale=on(grad_scale), found_inf=on(found_inf), **kw)
    reference.sgd_step_(*ref, first, grad_scale=grad_scale, found_inf=found_inf, **kw)
    _assert_optim_lists(native, ref, ["params", "grads", "momentum_buffers"])


@FUZZ
@given(data=st.data(), lists=optim_lists())
def test_adamw_step_matches_reference(data, lists):
    _run_adamw(data, lists)


@FUZZ
@given(data=st.data(), lists=optim_lists(with_steps=False))
def test_sgd_step_matches_reference(data, lists):
    _run_sgd(data, lists)


def long_optim_lists(count, seed):
    """count tensors of 0-6 elements at storage offsets 0-3, from a seed (too many for hypothesis draws)."""
    g = torch.Generator().manual_seed(seed)
    mdt = PARAM_DTYPES[int(torch.randint(2, (), generator=g))]
    specials = torch.tensor([NAN, INF, -INF, 0.0, -0.0, F32_TINY, F32_MAX])

    def view(n, dtype, positive=False, special=False):
        off = int(torch.randint(4, (), generator=g))
        base = torch.randn(off + n + 1, generator=g)
        if special and n and float(torch.rand((), generator=g)) < 0.05:
            base[off + int(torch.randint(n, (), generator=g))] = specials[int(torch.randint(7, (), generator=g))]
        base = (base.abs() if positive else base).to(dtype)
        return base[off:off + n]

    lists = [[], [], [], [], []]
    for _ in range(count):
        n = int(torch.randint(7, (), generator=g))
        pdt = PARAM_DTYPES[int(torch.randint(2, (), generator=g))]
        for xs, t in zip(lists, (view(n, pdt), view(n, pdt, special=True), view(n, mdt), view(n, mdt, True),
                                 torch.tensor(float(torch.randint(0, 50, (), generator=g))))):
            xs.append(t)
    return lists


@FUZZ_LONG
@given(data=st.data(), count=st.integers(561, 1200), seed=st.integers(0, 2**31 - 1), adam=st.booleans())
def test_optim_long_lists_match_reference(data, count, seed, adam):
    """Lists longer than one CUDA launch table (560 tensors): the Philox index k runs over the whole list."""
    lists = long_optim_lists(count, seed)
    _run_adamw(data, lists) if adam else _run_sgd(data, lists)


@cuda_test
@FUZZ
@given(data=st.data(), lists=optim_lists(), adam=st.booleans())
def test_cuda_optim_steps_match_reference(data, lists, adam):
    _run_adamw(data, lists, "cuda") if adam else _run_sgd(data, lists, "cuda")


@cuda_test
@FUZZ_LONG
@given(data=st.data(), count=st.integers(561, 1200), adam=st.booleans())
def test_cuda_optim_long_lists_match_reference(data, count, adam):
    lists = long_optim_lists(count, data.draw(st.integers(0, 2**31 - 1)))
    _run_adamw(data, lists, "cuda") if adam else _run_sgd(data, lists, "cuda")


# --------------------------------------------------------------------------- strided views and plans
#
# Every view kind torch's own ops take (slices with steps, transposes,
# permutes, channels_last, storage offsets, lazily negated views; expanded
# ones for reads), mixed with contiguous tensors: the result must be the
# reference's on contiguous copies, written back into the caller's views.


@st.composite
def strided_views(draw, allow_expand=False):
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["step", "transpose", "permute", "channels_last", "negated", "column"]
                                + (["expand"] if allow_expand else [])))
    base = (torch.randn(5, 6, 4, 3, generator=g) * 2.0 ** draw(st.integers(-20, 20))).to(dtype)
    if draw(st.booleans()):
        base.view(-1)[draw(st.integers(0, base.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    if kind == "step":
        return base.view(-1)[draw(st.integers(0, 5))::draw(st.integers(2, 7))]
    if kind == "transpose":
        return base[draw(st.integers(0, 4))].reshape(6, 12).t()
    if kind == "permute":
        return base.permute(*draw(st.permutations([0, 1, 2, 3])))
    if kind == "channels_last":
        return base.contiguous(memory_format=torch.channels_last)
    if kind == "negated":
        return torch._neg_view(base[draw(st.integers(0, 4))])
    if kind == "column":
        return base.reshape(30, 12)[:, draw(st.integers(0, 11))]
    return base[0, 0, :1].expand(7, 3)


def _twin(v):
    """A copy of view v in its own storage with v's geometry and negation flag."""
    t = torch.empty(0, dtype=v.dtype).set_(v.untyped_storage().clone(), v.storage_offset(), v.shape, v.stride())
    return torch._neg_view(t) if v.is_neg() else t


def _dense(t):
    return t.resolve_neg().contiguous().clone()


@FUZZ
@given(views=st.lists(st.one_of(strided_views(), tensors_()), min_size=1, max_size=6),
       inv=st.sampled_from(SCALES), check_only=st.booleans(), planned=st.booleans())
def test_unscale_strided_views_match_reference(views, inv, check_only, planned):
    ours = [_twin(v) for v in views]
    assert all(o.stride() == v.stride() and o.is_neg() == v.is_neg() for o, v in zip(ours, views))
    refs = [_dense(v) for v in views]
    f, f_ref = scalar(0.0), scalar(0.0)
    if planned:
        adaptive_amp.UnscalePlan(ours).unscale_and_check_(f, scalar(inv), check_only=check_only)
    else:
        adaptive_amp.unscale_and_check_(ours, f, scalar(inv), check_only=check_only)
    reference.unscale_and_check_(refs, f_ref, scalar(inv), check_only=check_only)
    assert_bitwise_equal(f, f_ref, "found_inf")
    for i, (a, e) in enumerate(zip(ours, refs)):
        assert_bitwise_equal(_dense(a), e, f"tensors[{i}] ({tuple(a.stride())}, neg={a.is_neg()})")


@FUZZ
@given(views=st.lists(st.one_of(strided_views(allow_expand=True), tensors_()), min_size=1, max_size=6),
       fmt=st.one_of(st.none(), st.sampled_from(FORMATS)))
def test_tensor_stats_strided_views_match_reference(views, fmt):
    got = adaptive_amp.tensor_stats(views, fmt=fmt).to_dict()
    exp = reference.tensor_stats([_dense(v) for v in views], fmt=fmt)
    assert_stats_match(got, exp, f"fmt={fmt}")
