"""Hostile inputs through the public API: each gets a clear error or a correct result, never a half write.

Complements the bad-input tests of test_unscale.py / test_stochastic_round.py /
test_tensor_stats.py: here the same hazards (aliasing, read-only and
grad-requiring outputs, odd shapes, wrong generators/out/random_bits) are
applied to every op and every output argument, including update_scale_'s
state arrays and stochastic_round's ``out``. "Nothing written" is checked
bitwise on every array the call could have touched.
"""

from __future__ import annotations

import os
import re
import subprocess
import textwrap

import numpy as np
import pytest
import torch

import adaptive_amp
from adaptive_amp import reference
from conftest import assert_bitwise_equal, requires_cuda

INF, NAN = float("inf"), float("nan")


def cuda_test(fn):
    return pytest.mark.cuda(requires_cuda(fn))


def scalar(v, device="cpu"):
    return torch.tensor([v], dtype=torch.float32, device=device)


def data(n, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 100).to(dtype).to(device)


def snapshot(*arrays):
    return [a.detach().clone() if isinstance(a, torch.Tensor) else np.array(a, copy=True) for a in arrays]


def unchanged(before, *arrays):
    for i, (b, a) in enumerate(zip(before, arrays)):
        if isinstance(a, torch.Tensor):
            if a.dtype in (torch.int32, torch.int64):
                assert torch.equal(a, b), f"array {i} was written: {a} != {b}"
            else:
                assert_bitwise_equal(a.detach(), b, f"array {i} was written")
        else:
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), f"array {i} written"


# --------------------------------------------------------------------------- the same memory twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("where", ["adjacent", "far_apart", "last"])
def test_unscale_same_tensor_twice_refused_then_check_only_fine(dtype, where):
    a, b, c = data(33, dtype, 1), data(7, torch.float32, 2), data(1000, torch.float16, 3)
    lists = {"adjacent": [b, a, a, c], "far_apart": [a, b, c, a], "last": [b, c, a, a]}
    tensors = lists[where]
    a[5] = INF
    before = snapshot(a, b, c)
    f = scalar(0.0)
    with pytest.raises(ValueError, match="shares memory"):
        adaptive_amp.unscale_and_check_(tensors, f, scalar(0.5), return_stats=True)
    unchanged(before, a, b, c)
    assert float(f) == 0.0
    # Read-only use is harmless and correct, stats included (one entry per list slot).
    sumsq, amax = adaptive_amp.unscale_and_check_(tensors, f, scalar(0.5), check_only=True, return_stats=True)
    unchanged(before, a, b, c)
    assert float(f) == 1.0
    ref_f = scalar(0.0)
    _, ref_amax = reference.unscale_and_check_([t.clone() for t in tensors], ref_f, scalar(0.5), check_only=True,
                                               return_stats=True)
    assert_bitwise_equal(amax, ref_amax)


def test_unscale_numpy_same_array_twice_refused():
    a = np.arange(10, dtype=np.float32)
    before = a.copy()
    f = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="shares memory"):
        adaptive_amp.unscale_and_check_([a, a], f, np.array([0.5], np.float32))
    assert np.array_equal(a, before) and f[0] == 0.0
    adaptive_amp.unscale_and_check_([a, a], f, np.array([0.5], np.float32), check_only=True)
    assert np.array_equal(a, before)


@pytest.mark.parametrize("check_only", [False, True])
def test_unscale_found_inf_aliasing_a_gradient_refused(check_only):
    # check_only writes found_inf too: the same alias checks as the writing path.
    t = torch.tensor([1.0, INF, 3.0])
    before = t.clone()
    with pytest.raises(ValueError, match="found_inf"):
        adaptive_amp.unscale_and_check_([t], t[0:1], scalar(0.5), check_only=check_only)
    assert_bitwise_equal(t, before)
    a = np.array([1.0, np.inf, 3.0], np.float32)
    with pytest.raises(ValueError, match="found_inf"):
        adaptive_amp.unscale_and_check_([a], a[0:1], np.array([0.5], np.float32), check_only=check_only)
    assert a[0] == 1.0


@pytest.mark.parametrize("kind", ["inv_scale_is_scale", "growth_tracker_in_counters"])
def test_update_scale_overlapping_outputs_refused(kind):
    scale = scalar(4.0)
    counters = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
    gt = torch.zeros(1, dtype=torch.int32)
    kw = {}
    if kind == "inv_scale_is_scale":
        kw["inv_scale"] = scale
        found = scalar(0.0)
    else:
        gt = counters[1:2]
        found = scalar(1.0)
    before = snapshot(scale, counters, gt)
    with pytest.raises(ValueError):
        adaptive_amp.update_scale_(scale, gt, found, 2.0, 0.5, 1, counters=counters, **kw)
    unchanged(before, scale, counters, gt)


def test_tensor_stats_same_tensor_twice_is_fine():
    a = data(100, torch.bfloat16, 4)
    a[3] = NAN
    got = adaptive_amp.tensor_stats([a, a, a[10:20], a]).to_dict()
    exp = reference.tensor_stats([a, a, a[10:20], a])
    for key in ("numel", "nan_count", "min", "max", "amax"):
        assert [g if g == g else "nan" for g in got[key]] == [e if e == e else "nan" for e in exp[key]], key


def test_stochastic_round_out_aliasing_x_refused():
    x = data(64, torch.float16, 5)
    before = x.clone()
    with pytest.raises(ValueError, match="out"):
        adaptive_amp.stochastic_round(x, torch.float16, seed=1, out=x)
    assert_bitwise_equal(x, before)
    # Partial overlap (a view of x's bytes as the target dtype).
    xf = data(64, torch.float32, 6)
    before = xf.clone()
    with pytest.raises(ValueError, match="out"):
        adaptive_amp.stochastic_round(xf, torch.bfloat16, seed=1, out=xf.view(torch.bfloat16)[32:96])
    assert_bitwise_equal(xf, before)


# --------------------------------------------------------------------------- read-only and grad-requiring outputs


def test_unscale_read_only_numpy_late_in_list_writes_nothing():
    arrays = [np.full(5, 2.0, np.float32) for _ in range(6)]
    ro = np.full(5, 2.0, np.float32)
    ro.flags.writeable = False
    arrays.insert(4, ro)
    f = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match=re.escape("tensors[4]")):
        adaptive_amp.unscale_and_check_(arrays, f, np.array([0.5], np.float32))
    assert all((a == 2.0).all() for a in arrays) and f[0] == 0.0


@pytest.mark.parametrize("arg", ["scale", "growth_tracker", "counters", "amax_history", "inv_scale"])
def test_update_scale_read_only_numpy_state_refused(arg):
    st = dict(scale=np.array([8.0], np.float32), growth_tracker=np.zeros(1, np.int32),
              counters=np.array([1, 0, 0, 0], np.int32), amax_history=np.zeros(4, np.float32),
              inv_scale=np.zeros(1, np.float32))
    st[arg].flags.writeable = False
    before = snapshot(*st.values())
    with pytest.raises(ValueError, match=f"{arg} is read-only"):
        adaptive_amp.update_scale_(st["scale"], st["growth_tracker"], np.zeros(1, np.float32), 2.0, 0.5, 1,
                                   counters=st["counters"], amax_history=st["amax_history"],
                                   step_amax=np.array([3.0], np.float32), inv_scale=st["inv_scale"])
    unchanged(before, *st.values())


def test_update_scale_read_only_numpy_inputs_accepted():
    found = np.zeros(1, np.float32)
    found.flags.writeable = False
    amax = np.array([3.0], np.float32)
    amax.flags.writeable = False
    scale, gt = np.array([8.0], np.float32), np.zeros(1, np.int32)
    counters, hist = np.array([1, 0, 0, 0], np.int32), np.zeros(4, np.float32)
    adaptive_amp.update_scale_(scale, gt, found, 2.0, 0.5, 1, counters=counters, amax_history=hist, step_amax=amax)
    r_scale, r_hist = scalar(8.0), torch.zeros(4)
    reference.update_scale_(r_scale, torch.zeros(1, dtype=torch.int32), scalar(0.0), 2.0, 0.5, 1,
                            counters=torch.tensor([1, 0, 0, 0], dtype=torch.int32), amax_history=r_hist,
                            step_amax=scalar(3.0))
    assert scale[0] == float(r_scale) and hist[0] == 3.0 and gt[0] == 0


@pytest.mark.parametrize("arg", ["scale", "inv_scale"])
def test_update_scale_leaf_requiring_grad_refused(arg):
    scale, inv = scalar(8.0), scalar(0.0)
    target = scale if arg == "scale" else inv
    target.requires_grad_(True)
    gt = torch.zeros(1, dtype=torch.int32)
    before = snapshot(scale, inv, gt)
    with pytest.raises(ValueError, match=f"{arg} is a leaf tensor that requires grad"):
        adaptive_amp.update_scale_(scale, gt, scalar(1.0), 2.0, 0.5, 1, inv_scale=inv)
    unchanged(before, scale, inv, gt)


def test_unscale_leaf_requiring_grad_last_in_list_writes_nothing():
    ts = [data(50, torch.float16, i) for i in range(5)] + [data(8, seed=9).requires_grad_(True)]
    before = snapshot(*ts)
    f = scalar(0.0)
    with pytest.raises(ValueError, match=re.escape("tensors[5]")):
        adaptive_amp.unscale_and_check_(ts, f, scalar(0.25))
    unchanged(before, *ts)
    assert float(f) == 0.0


def test_unscale_non_leaf_requiring_grad_is_written_and_version_bumped():
    leaf = data(8, seed=2).requires_grad_(True)
    y = leaf * 2.0  # non-leaf
    version = y._version
    adaptive_amp.unscale_and_check_([y], scalar(0.0), scalar(0.5))
    assert_bitwise_equal(y.detach(), leaf.detach())
    assert y._version > version


def test_stochastic_round_out_leaf_requiring_grad_refused():
    x = data(16, seed=3)
    out = torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="out"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1, out=out)
    assert bool((out.detach() == 0).all())


def _strided_leaf_calls():
    """(op, argument name, the strided leaf it writes, the call, other arrays it must leave as they were). Each
    leaf is a parameter made from a strided view (a transposed weight, every other element)."""
    f, inv = scalar(0.0), scalar(0.5)
    weight_t = torch.nn.Parameter(data(12, seed=5).reshape(4, 3).t())
    yield ("unscale_and_check_", "tensors[1]", weight_t,
           lambda: adaptive_amp.unscale_and_check_([data(8), weight_t], f, inv), (f,))
    yield ("UnscalePlan", "tensors[1]", weight_t,
           lambda: adaptive_amp.UnscalePlan([data(8), weight_t]).unscale_and_check_(f, inv), (f,))
    scale, gt = scalar(8.0), torch.zeros(1, dtype=torch.int32)
    counters = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
    history = torch.nn.Parameter(torch.zeros(8)[::2])
    yield ("update_scale_", "amax_history", history,
           lambda: adaptive_amp.update_scale_(scale, gt, scalar(0.0), 2.0, 0.5, 10, counters=counters,
                                              step_amax=scalar(3.0), amax_history=history),
           (scale, gt, counters))
    out = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16).t())
    yield ("stochastic_round", "out", out,
           lambda: adaptive_amp.stochastic_round(data(12, seed=6).reshape(4, 3), torch.bfloat16, seed=1, out=out), ())


@pytest.mark.parametrize("case", list(_strided_leaf_calls()), ids=lambda c: c[0])
def test_strided_leaf_requiring_grad_is_refused_as_a_leaf_not_as_strided(case):
    """A written argument that is a strided leaf requiring grad was told "pass x.contiguous()": a copy, a new
    non-leaf tensor, so the write would never reach x. It is refused as torch refuses an in-place op on a leaf
    that requires grad, naming the argument, and nothing is written."""
    _, name, leaf, call, others = case
    assert leaf.is_leaf and leaf.requires_grad and not leaf.is_contiguous()
    before = snapshot(leaf, *others)
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert message.startswith(name) and "requires grad" in message, message
    assert "contiguous" not in message, message
    unchanged(before, leaf, *others)


def test_stochastic_round_numpy_read_only_out_refused():
    pytest.importorskip("ml_dtypes")
    out = np.zeros(4, np.float16)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        adaptive_amp.stochastic_round(np.ones(4, np.float32), "float16", seed=1, out=out)
    assert (out == 0).all()


def test_stochastic_round_read_only_numpy_input_is_fine():
    pytest.importorskip("ml_dtypes")
    x = np.linspace(-3, 3, 11, dtype=np.float32)
    x.flags.writeable = False
    got = np.asarray(adaptive_amp.stochastic_round(x, "float16", seed=5))
    exp = adaptive_amp.stochastic_round(torch.from_numpy(x.copy()), torch.float16, seed=5)
    assert np.array_equal(got.view(np.int16), exp.view(torch.int16).numpy())


# --------------------------------------------------------------------------- 0-dim and empty


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,)])
def test_stochastic_round_0dim_and_empty(target, shape):
    x = torch.full(shape, 1.3)
    bits = torch.full(shape, -1, dtype=torch.int32)
    got, amax = adaptive_amp.stochastic_round(x, target, random_bits=bits, return_amax=True)
    exp = reference.stochastic_round(x, target, random_bits=bits)
    assert got.shape == x.shape and got.dtype == target
    assert torch.equal(got.view(torch.uint8) if target.itemsize == 1 else got.view(torch.int16),
                       exp.view(torch.uint8) if target.itemsize == 1 else exp.view(torch.int16))
    assert float(amax) == (1.3 if x.numel() else 0.0) or abs(float(amax) - 1.3) < 1e-6
    out = torch.empty(shape, dtype=target)
    assert adaptive_amp.stochastic_round(x, target, seed=3, out=out) is out


def test_unscale_and_stats_on_only_0dim_and_empty_tensors():
    ts = [torch.tensor(4.0), torch.empty(0), torch.empty(0, 3, dtype=torch.float16), torch.tensor(INF).bfloat16()]
    f = scalar(0.0)
    sumsq, amax = adaptive_amp.unscale_and_check_(ts, f, scalar(0.5), return_stats=True)
    assert float(ts[0]) == 2.0 and float(f) == 1.0 and ts[0].shape == ()
    assert sumsq.shape == (4,) and float(sumsq[1]) == 0.0 and float(amax[2]) == 0.0
    st = adaptive_amp.tensor_stats(ts, fmt="float16").to_dict()
    assert st["numel"] == [1, 0, 0, 1] and st["inf_count"] == [0, 0, 0, 1]


@pytest.mark.parametrize("arg", ["scale", "growth_tracker", "found_inf"])
@pytest.mark.parametrize("numel", [0, 2])
def test_update_scale_scalars_of_the_wrong_size_refused(arg, numel):
    st = dict(scale=scalar(8.0), growth_tracker=torch.zeros(1, dtype=torch.int32), found_inf=scalar(1.0))
    st[arg] = torch.zeros(numel, dtype=st[arg].dtype)
    before = snapshot(*st.values())
    with pytest.raises(ValueError, match=arg):
        adaptive_amp.update_scale_(st["scale"], st["growth_tracker"], st["found_inf"], 2.0, 0.5, 1)
    unchanged(before, *st.values())


def test_update_scale_0dim_scalars_are_fine():
    s, g, f = torch.tensor(8.0), torch.tensor(0, dtype=torch.int32), torch.tensor(1.0)
    adaptive_amp.update_scale_(s, g, f, 2.0, 0.5, 1)
    assert s.shape == () and float(s) == 4.0 and int(g) == 0


@pytest.mark.parametrize("bad", [dict(growth_factor=1.0), dict(growth_factor=NAN), dict(backoff_factor=0.0),
                                 dict(backoff_factor=1.0), dict(backoff_factor=NAN),
                                 dict(hysteresis=0), dict(min_scale=-1.0), dict(min_scale=4.0, max_scale=2.0),
                                 dict(fmt_max=0.0), dict(counters="short"), dict(amax_history="empty"),
                                 dict(amax_history="no_step_amax")])
def test_update_scale_bad_arguments_write_nothing(bad):
    kw = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=1, hysteresis=1,
              counters=torch.tensor([1, 0, 0, 0], dtype=torch.int32))
    if "fmt_max" in bad:
        kw.update(amax_history=torch.zeros(3), step_amax=scalar(2.0))
    kw.update(bad)
    if kw["counters"] == "short" if isinstance(kw["counters"], str) else False:
        kw["counters"] = torch.zeros(3, dtype=torch.int32)
    if kw.get("amax_history") == "empty":
        kw.update(amax_history=torch.zeros(0), step_amax=scalar(2.0))
    elif kw.get("amax_history") == "no_step_amax":
        kw.update(amax_history=torch.zeros(3))
    s, g = scalar(8.0), torch.tensor([3], dtype=torch.int32)
    arrays = [s, g, kw["counters"]] + ([kw["amax_history"]] if "amax_history" in kw else [])
    before = snapshot(*arrays)
    with pytest.raises((ValueError, TypeError)) as info:
        adaptive_amp.update_scale_(s, g, scalar(0.0), kw.pop("growth_factor"), kw.pop("backoff_factor"),
                                   kw.pop("growth_interval"), **kw)
    assert isinstance(info.value, ValueError), f"expected a ValueError subclass, got {type(info.value)}"
    unchanged(before, *arrays)


# --------------------------------------------------------------------------- generators, out=, random_bits


def test_stochastic_round_generator_of_other_kinds_refused():
    x = data(8, seed=1)
    with pytest.raises(TypeError, match="generator"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, generator=np.random.default_rng(0))
    with pytest.raises(TypeError, match="generator"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, generator=1234)
    with pytest.raises(ValueError, match="generator"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, generator=torch.Generator(), seed=3)
    with pytest.raises(ValueError, match="random_bits"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, generator=torch.Generator(),
                                      random_bits=torch.zeros(8, dtype=torch.int32))


def test_stochastic_round_generator_not_advanced_on_error():
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    with pytest.raises(TypeError):
        adaptive_amp.stochastic_round(data(8), torch.bfloat16, generator=g, out=torch.empty(8, dtype=torch.float16))
    assert torch.equal(g.get_state(), state)


def test_stochastic_round_torch_generator_with_numpy_reproduces():
    pytest.importorskip("ml_dtypes")
    x = np.linspace(-2, 2, 37, dtype=np.float32)
    a = adaptive_amp.stochastic_round(x, "bfloat16", generator=torch.Generator().manual_seed(11))
    b = adaptive_amp.stochastic_round(x, "bfloat16", generator=torch.Generator().manual_seed(11))
    assert np.array_equal(np.asarray(a).view(np.int16), np.asarray(b).view(np.int16))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32, torch.float8_e5m2, torch.int16])
def test_stochastic_round_wrong_dtype_out_refused(out_dtype):
    x = data(12, seed=2)
    out = torch.zeros(12, dtype=out_dtype)
    before = out.clone()
    with pytest.raises(TypeError, match="out has dtype"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1, out=out)
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("bad", ["shape_same_numel", "shape_fewer", "shape_more", "noncontiguous", "int64", "uint32",
                                 "float32", "0dim_for_1elem"])
def test_stochastic_round_bad_random_bits_refused(bad):
    x = data(12, seed=3).reshape(3, 4)
    rb = {
        "shape_same_numel": lambda: torch.zeros(4, 3, dtype=torch.int32),
        "shape_fewer": lambda: torch.zeros(3, 3, dtype=torch.int32),
        "shape_more": lambda: torch.zeros(3, 5, dtype=torch.int32),
        "noncontiguous": lambda: torch.zeros(4, 3, dtype=torch.int32).t(),
        "int64": lambda: torch.zeros(3, 4, dtype=torch.int64),
        "uint32": lambda: torch.zeros(3, 4, dtype=torch.uint32),
        "float32": lambda: torch.zeros(3, 4),
        "0dim_for_1elem": None,
    }[bad]
    if bad == "0dim_for_1elem":
        x, rb = data(1, seed=3), torch.tensor(0, dtype=torch.int32)
    else:
        rb = rb()
    out = torch.zeros(x.shape, dtype=torch.bfloat16)
    with pytest.raises((ValueError, TypeError), match="random_bits"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, random_bits=rb, out=out)
    assert bool((out == 0).all())


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "7"])
def test_stochastic_round_seed_and_offset_out_of_range_refused(bad):
    x = data(4)
    with pytest.raises((ValueError, TypeError), match="seed"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, seed=bad)
    with pytest.raises((ValueError, TypeError), match="offset"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1, offset=bad)


# --------------------------------------------------------------------------- GPU-only hazards (run on a GPU)


@cuda_test
def test_cuda_generator_on_the_wrong_device_refused():
    x = data(8, device="cuda")
    with pytest.raises(ValueError, match="generator"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, generator=torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        adaptive_amp.stochastic_round(data(8), torch.bfloat16, generator=torch.Generator(device="cuda"))


@cuda_test
def test_cuda_out_and_random_bits_on_the_wrong_device_refused():
    x = data(8, device="cuda")
    with pytest.raises(ValueError, match="out"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1, out=torch.empty(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="random_bits"):
        adaptive_amp.stochastic_round(x, torch.bfloat16, random_bits=torch.zeros(8, dtype=torch.int32))


@cuda_test
def test_cuda_side_stream_inputs_ordered_for_every_op():
    """Inputs produced on a side stream, op called on that stream: results match the CPU."""
    side = torch.cuda.Stream()
    x_cpu = data(1 << 20, seed=4)
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000)
        x = x_cpu.to("cuda", non_blocking=True) * 1.0
        r = adaptive_amp.stochastic_round(x, torch.bfloat16, seed=9)
        st = adaptive_amp.tensor_stats([x])
        g = x.clone()
        f = scalar(0.0, "cuda")
        adaptive_amp.unscale_and_check_([g], f, scalar(0.5, "cuda"))
    side.synchronize()
    assert torch.equal(r.cpu().view(torch.int16),
                       adaptive_amp.stochastic_round(x_cpu, torch.bfloat16, seed=9).view(torch.int16))
    assert st.to_dict()["amax"][0] == float(x_cpu.abs().max())
    assert_bitwise_equal(g, x_cpu * 0.5)
    assert float(f) == 0.0


@cuda_test
def test_cuda_ops_on_a_non_current_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x_cpu = data(5000, seed=5)
    x = x_cpu.to("cuda:1")
    assert torch.equal(adaptive_amp.stochastic_round(x, torch.float16, seed=2).cpu(),
                       adaptive_amp.stochastic_round(x_cpu, torch.float16, seed=2))
    assert adaptive_amp.tensor_stats([x]).to_dict()["amax"][0] == float(x_cpu.abs().max())
    s, gt, f = scalar(8.0, "cuda:1"), torch.zeros(1, dtype=torch.int32, device="cuda:1"), scalar(1.0, "cuda:1")
    adaptive_amp.update_scale_(s, gt, f, 2.0, 0.5, 1)
    assert float(s) == 4.0


# --------------------------------------------------------------------------- another thread frees what a call uses
#
# Python code runs between describing arrays and launching (and torch's own
# methods may release the GIL there). Every call must hold its own
# references to what it touches. The deterministic tests free the caller's
# references at the worst moment (right before the launch, through a hook on
# the stream lookup every op does last) and put a same-sized sentinel where
# the freed memory was likely to be reused: a kernel using a stale pointer
# changes the sentinel or reads garbage. The threaded tests loop calls against
# a mutating thread: no crash, and results right or a clear error.

import threading  # noqa: E402
import time  # noqa: E402

from adaptive_amp import _native, optim as aoptim  # noqa: E402

_BIG = 1 << 18  # 1 MiB of float32: the allocator hands a freed block of this size to the next request


def _hook(monkeypatch, module, name, action):
    original = getattr(module, name)

    def hooked(*args, **kwargs):
        action()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, hooked)


def _sentinels(count, dtype=torch.float32):
    return [torch.full((_BIG,), 7.0, dtype=dtype) for _ in range(count)]


def test_unscale_list_cleared_before_launch_keeps_its_tensors(monkeypatch):
    tensors = [torch.full((_BIG,), 2.0) for _ in range(4)]
    kept = []
    _hook(monkeypatch, _native, "current_stream", lambda: (tensors.clear(), kept.extend(_sentinels(4))))
    f = scalar(0.0)
    adaptive_amp.unscale_and_check_(tensors, f, scalar(0.5))
    for s in kept:
        assert torch.all(s == 7.0), "the kernel wrote through a pointer of a freed tensor"
    assert float(f) == 0.0


def test_tensor_stats_list_cleared_before_launch_keeps_its_tensors(monkeypatch):
    tensors = [torch.full((_BIG,), 2.0) for _ in range(3)]
    kept = []
    _hook(monkeypatch, _native, "current_stream", lambda: (tensors.clear(), kept.extend(_sentinels(3))))
    stats = adaptive_amp.tensor_stats(tensors)
    assert stats["max"] == [2.0, 2.0, 2.0] and stats["min"] == [2.0, 2.0, 2.0]


def _model_with_grads(value=1.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    return model


@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
@pytest.mark.parametrize("planned", [False, True])
def test_optimizer_grads_dropped_before_launch_are_kept(monkeypatch, cls, planned):
    model = _model_with_grads()
    twin = _model_with_grads()
    kw = dict(lr=0.1, stochastic_rounding=False, **({"momentum": 0.9} if cls == "SGD" else {}))
    opt, ref = getattr(aoptim, cls)(model.parameters(), **kw), getattr(aoptim, cls)(twin.parameters(), **kw)
    if planned:  # one step builds the plan; the next one reuses it
        opt.step(), ref.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad, q.grad = torch.full_like(p, 1.0), torch.full_like(q, 1.0)
    kept = []

    def drop():
        if not kept:
            opt.zero_grad(set_to_none=True)
            kept.extend(torch.full_like(p, 1e30) for p in model.parameters())
    _hook(monkeypatch, aoptim, "_stream", drop)
    opt.step()
    monkeypatch.undo()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q), "the step read a freed gradient"


def test_functional_optimizer_lists_cleared_before_launch(monkeypatch):
    ps = [torch.zeros(_BIG) for _ in range(2)]
    gs = [torch.full((_BIG,), 1.0) for _ in range(2)]
    ms = [torch.zeros(_BIG) for _ in range(2)]
    kept = []
    _hook(monkeypatch, aoptim, "_stream", lambda: (gs.clear(), kept.extend(_sentinels(2))))
    aoptim.sgd_step_(ps, gs, ms, [True, True], lr=1.0, momentum=0.9, stochastic_rounding=False)
    for p in ps:
        assert torch.all(p == -1.0)
    for s in kept:
        assert torch.all(s == 7.0)


def _scaler_planned_with_new_grads():
    """A CPU GradScaler whose plan was built by an earlier step, and new gradients (4.0) for the next one."""
    model = _model_with_grads(4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = adaptive_amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)  # builds the plan
    scaler.update()
    for p in model.parameters():
        p.grad = torch.full_like(p, 4.0)
    scaler.scale(torch.ones(()))
    return model, opt, scaler


def test_grad_scaler_grads_dropped_before_launch_are_kept(monkeypatch):
    from adaptive_amp import scaler as scaler_mod
    model, opt, scaler = _scaler_planned_with_new_grads()
    kept = []

    def drop():
        if not kept:
            opt.zero_grad(set_to_none=True)
            kept.extend(torch.full_like(p, 7.0) for p in model.parameters())
    _hook(monkeypatch, scaler_mod._DeviceGroup, "stream", lambda *a: drop())
    scaler.unscale_(opt)
    for s in kept:
        assert torch.all(s == 7.0), "unscale_ wrote through a pointer of a freed gradient"


def _race(call, mutate, seconds=0.5):
    """Loops call() while another thread loops mutate(); returns the exceptions call() raised."""
    stop = threading.Event()
    failures = []

    def mutator():
        try:
            while not stop.is_set():
                mutate()
        except BaseException as e:  # pragma: no cover - reported below
            failures.append(e)
    thread = threading.Thread(target=mutator, daemon=True)
    errors = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, also in the middle of our Python code
    thread.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                call()
            except (ValueError, TypeError, AssertionError, RuntimeError) as e:
                errors.append(e)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(old)
    assert not failures, failures
    return errors


import sys  # noqa: E402


def _clear_errors(errors):
    for e in errors:  # a clear error that names an argument, never a crash
        # (A step that finds every gradient gone: torch's scaler says "No inf checks were recorded".)
        assert re.search(r"tensors|grads|params|found_inf|expected|pass|inf checks|non-empty TensorList", str(e)), e


def test_thread_clearing_the_list_during_unscale_and_stats():
    shared = []

    def mutate():
        shared.clear()
        shared.extend(torch.full((_BIG // 4,), 2.0) for _ in range(4))

    mutate()
    f = scalar(0.0)

    def call():
        adaptive_amp.unscale_and_check_(shared, f, scalar(1.0))
        st = adaptive_amp.tensor_stats(shared) if shared else None
        if st is not None and len(st):
            assert set(st["max"]) == {2.0}

    _clear_errors(_race(call, mutate))
    assert float(f) == 0.0


# --------------------------------------------------------------------------- another thread frees memory a call uses
#
# A reference to a tensor or to its storage does not keep its memory: x.resize_(), set_() and
# x.untyped_storage().resize_(0) free it (FSDP frees parameters that way). So native work runs with the GIL
# held (no Python thread can free anything until it returns), and a plan checks its tensors in the same
# native call that launches.

_FREED_DURING_THE_CALL = textwrap.dedent("""
    import sys, threading, torch, adaptive_amp
    from adaptive_amp import _native, optim, scaler as scaler_mod, sround_torch
    sys.setswitchinterval(1.0)  # the other thread runs where a call releases the GIL, not at a timer's whim
    N = 1 << 24  # 64 MiB of float32: freed with munmap, so a kernel still on it faults

    def run(name, x, call, module, attr):
        go = threading.Event()

        def free_it():
            go.wait()
            x.untyped_storage().resize_(0)
        thread = threading.Thread(target=free_it)
        thread.start()
        original = getattr(module, attr)

        def hooked(*args, **kwargs):  # the stream lookup every native path does right before the launch
            go.set()
            return original(*args, **kwargs)
        setattr(module, attr, hooked)
        try:
            print(name, flush=True)
            call()
        except RuntimeError as e:  # the thread ran before the launch: refused, nothing touched
            if "was given new memory" not in str(e):
                raise
        finally:
            setattr(module, attr, original)
            thread.join()

    f, inv = torch.zeros(1), torch.full((1,), 0.5)
    x = torch.full((N,), 2.0)
    run("unscale_and_check_", x, lambda: adaptive_amp.unscale_and_check_([x], f, inv), _native, "current_stream")
    x = torch.full((N,), 2.0)
    plan = adaptive_amp.UnscalePlan([x])
    run("UnscalePlan", x, lambda: plan.unscale_and_check_(f, inv), _native, "current_stream")
    x = torch.full((N,), 2.0)
    run("tensor_stats", x, lambda: adaptive_amp.tensor_stats([x]), _native, "current_stream")
    x = torch.full((N,), 2.0)
    run("stochastic_round", x, lambda: adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1), sround_torch,
        "_stream")
    p, g, m = torch.zeros(N), torch.full((N,), 1.0), torch.zeros(N)
    run("sgd_step_", g, lambda: optim.sgd_step_([p], [g], [m], [True], lr=1.0, momentum=0.9,
                                                 stochastic_rounding=False), optim, "_stream")
    w = torch.nn.Parameter(torch.zeros(N))
    opt = optim.AdamW([w], lr=0.1, stochastic_rounding=False)
    w.grad = torch.ones(N)
    opt.step()  # builds the plan
    w.grad = torch.ones(N)
    run("AdamW (planned)", w.grad, opt.step, optim, "_stream")
    w.grad = torch.full((N,), 4.0)
    sgd = torch.optim.SGD([w], lr=0.1)
    scaler = adaptive_amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(sgd)  # builds the plan
    scaler.update()
    w.grad = torch.full((N,), 4.0)
    scaler.scale(torch.ones(()))
    run("GradScaler.unscale_", w.grad, lambda: scaler.unscale_(sgd), scaler_mod._DeviceGroup, "stream")
    print("ok")
""")


def test_memory_freed_by_another_thread_during_a_native_call_is_not_touched():
    """Every native path, with a thread that frees (storage resize_(0)) the 64 MiB tensor it works on as soon as
    it can, from the stream lookup right before the launch on: with the GIL released during the kernel the
    process died (SIGSEGV) at the first path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _FREED_DURING_THE_CALL], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), (
        f"exit code {proc.returncode} in {proc.stdout.split()[-1:]}: {proc.stderr[-2000:]}")


@pytest.mark.parametrize("how", ["set_", "resize_"])
def test_unscale_plan_tensor_replaced_after_the_python_side_before_the_launch(monkeypatch, how):
    """The plan checked its tensors, then ran Python code (describing found_inf, the stream lookup: thread switch
    points) before launching: a tensor another thread gave new memory there was unscaled at its old address
    (set_: memory the plan's storage still held; resize_: freed memory, where sentinels now lie)."""
    ts = [torch.full((_BIG,), 4.0) for _ in range(2)]
    plan = adaptive_amp.UnscalePlan(ts)
    kept = []

    def replace():
        if kept:
            return
        if how == "set_":
            ts[0].set_(torch.full((_BIG,), 4.0))
        else:
            ts[0].resize_(2 * _BIG)  # new memory; the planned block is freed
            ts[0][_BIG:] = 4.0
        kept.extend(_sentinels(2))
    _hook(monkeypatch, _native, "current_stream", replace)
    f = scalar(0.0)
    plan.unscale_and_check_(f, scalar(0.5))
    monkeypatch.undo()
    for s in kept:
        assert torch.all(s == 7.0), "the kernel wrote through a pointer of freed memory"
    for t in ts:
        assert torch.all(t == 2.0), "a tensor was not unscaled where it is now"
    assert float(f) == 0.0


@pytest.mark.parametrize("how", ["set_", "resize_"])
def test_grad_scaler_gradient_given_new_memory_after_collect_is_refused(monkeypatch, how):
    """Between the plan's collect() (which read the gradients' pointers) and its launch, the scaler allocates
    the statistics with torch, which releases the GIL: another thread that gives a gradient new memory there
    had its old (freed) memory unscaled. The launch reads the pointers again and refuses, naming the gradient,
    with nothing written."""
    from adaptive_amp import scaler as scaler_mod

    model, opt, scaler = _scaler_planned_with_new_grads()
    weight = model[0].weight
    kept = []
    original = scaler_mod.GradScaler._launch_plan

    def launch(group, found, inv, check_only):
        if not kept:
            if how == "set_":
                weight.grad.set_(torch.full_like(weight, 4.0))
            else:
                weight.grad.resize_(2 * weight.numel())  # new memory first: the planned block is freed after
                weight.grad.fill_(4.0)
            kept.extend(_sentinels(2))
        return original(group, found, inv, check_only)
    monkeypatch.setattr(scaler_mod.GradScaler, "_launch_plan", staticmethod(launch))
    with pytest.raises(RuntimeError, match=re.escape("param_groups[0]['params'][0].grad was given new memory")):
        scaler.unscale_(opt)
    for s in kept:
        assert torch.all(s == 7.0), "unscale_ wrote through a pointer of freed memory"
    for p in model.parameters():
        assert torch.all(p.grad == 4.0), "a gradient was written"


@pytest.mark.parametrize("what", ["params", "grads", "exp_avg"])
def test_planned_optimizer_tensor_given_new_memory_after_collect_is_refused(monkeypatch, what):
    """The optimizer plan reads the pointers in collect(); torch calls before its launch (grad_scale's move,
    the random draws) release the GIL, and another thread that gave a tensor new memory there had its old
    (freed) memory stepped. The launch reads every pointer again and refuses, naming it, with nothing written."""
    model = _model_with_grads()
    opt = aoptim.AdamW(model.parameters(), lr=0.1, stochastic_rounding=False)
    opt.step()  # builds the plan
    for p in model.parameters():
        p.grad = torch.full_like(p, 1.0)
    weight = model[0].weight
    tensor = {"params": weight, "grads": weight.grad, "exp_avg": opt.state[weight]["exp_avg"]}[what]
    kept = []

    def replace():
        if not kept:
            with torch.no_grad():
                tensor.set_(tensor.clone())  # new memory; the planned block is freed
            kept.extend(torch.full_like(p, 7.0) for p in model.parameters())
    _hook(monkeypatch, aoptim, "_stream", replace)
    before = snapshot(*model.parameters(), *(p.grad for p in model.parameters()),
                      *(v for p in model.parameters() for v in opt.state[p].values()))
    with pytest.raises(RuntimeError, match=re.escape(f"{'state of params' if what == 'exp_avg' else what}[0] was "
                                                     "given new memory")):
        opt.step()
    monkeypatch.undo()
    for s in kept:
        assert torch.all(s == 7.0), "the step wrote through a pointer of freed memory"
    unchanged(before, *model.parameters(), *(p.grad for p in model.parameters()),
              *(v for p in model.parameters() for v in opt.state[p].values()))


# A one-shot op reads its tensors' pointers when it describes them, then runs Python (output and workspace
# allocations, the stream lookup): thread switch points, where another thread may give a tensor new memory
# (set_, resize_, untyped_storage().resize_(0)) and free the old. The launching native call reads every
# torch tensor's pointer again, with the GIL held to the end of the launch, and refuses by name. The hook on
# the last Python call before the launch stands in for the other thread.

def _window_case(op, device):
    """(call, every tensor the op may touch, {argument name: tensor}, (module, the last Python call before the
    launch)) for one op."""
    from adaptive_amp import sround_torch

    full = lambda v, n=_BIG, dtype=torch.float32: torch.full((n,), v, dtype=dtype, device=device)  # noqa: E731
    scalar = lambda v: torch.tensor([v], dtype=torch.float32, device=device)  # noqa: E731
    if op == "unscale_and_check_":
        ts, f, inv = [full(4.0), full(4.0)], scalar(0.0), scalar(0.5)
        return (lambda: adaptive_amp.unscale_and_check_(ts, f, inv, return_stats=True), [*ts, f, inv],
                {"tensors[1]": ts[1], "found_inf": f, "inv_scale": inv}, (_native, "current_stream"))
    if op == "tensor_stats":
        ts, s = [full(4.0), full(4.0)], scalar(2.0)
        return (lambda: adaptive_amp.tensor_stats(ts, fmt="float16", scale=s), [*ts, s],
                {"tensors[1]": ts[1], "scale": s}, (_native, "current_stream"))
    if op == "stochastic_round":
        x, out, s = data(_BIG, device=device), full(0.0, dtype=torch.bfloat16), scalar(2.0)
        bits = torch.randint(0, 1 << 30, (_BIG,), dtype=torch.int32, device=device)
        return (lambda: adaptive_amp.stochastic_round(x, torch.bfloat16, out=out, random_bits=bits, scale=s),
                [x, out, bits, s], {"x": x, "out": out, "random_bits": bits, "scale": s},
                (sround_torch, "_stream"))
    if op == "sgd_step_":
        ps, gs, ms = [full(1.0), full(1.0)], [full(0.5), full(0.5)], [full(0.0), full(0.0)]
        gscale, found = scalar(1.0), scalar(0.0)
        return (lambda: aoptim.sgd_step_(ps, gs, ms, [True, True], lr=0.1, momentum=0.9, stochastic_rounding=False,
                                          grad_scale=gscale, found_inf=found),
                [*ps, *gs, *ms, gscale, found],
                {"params[1]": ps[1], "grads[0]": gs[0], "momentum_buffers[1]": ms[1], "grad_scale": gscale,
                 "found_inf": found}, (aoptim, "_stream"))
    if op == "adamw_step_":
        ps = [full(1.0, dtype=torch.bfloat16), full(1.0, dtype=torch.bfloat16)]
        gs = [full(0.5, dtype=torch.bfloat16), full(0.5, dtype=torch.bfloat16)]
        ms, vs = [full(0.0), full(0.0)], [full(0.0), full(0.0)]
        steps = [scalar(0.0), scalar(0.0)]
        return (lambda: aoptim.adamw_step_(ps, gs, ms, vs, steps, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                                            weight_decay=0.0, seed=1),
                [*ps, *gs, *ms, *vs, *steps],
                {"params[0]": ps[0], "exp_avgs[1]": ms[1], "exp_avg_sqs[0]": vs[0], "steps[1]": steps[1]},
                (aoptim, "_stream"))
    if op == "UnscalePlan":  # the plan re-checks its tensors itself; the scalars come with each call
        ts, f, inv = [full(4.0), full(4.0)], scalar(0.0), scalar(0.5)
        plan = adaptive_amp.UnscalePlan(ts)
        return (lambda: plan.unscale_and_check_(f, inv, return_stats=True), [*ts, f, inv],
                {"found_inf": f, "inv_scale": inv}, (_native, "current_stream"))
    if op == "AdamW (planned)":  # grad_scale and found_inf as torch's GradScaler hands them to the optimizer
        model = _model_with_grads().to(device)
        opt = aoptim.AdamW(model.parameters(), lr=0.1, stochastic_rounding=False)
        opt.step()  # builds the plan
        opt.grad_scale, opt.found_inf = scalar(1.0), scalar(0.0)
        tensors = [*model.parameters(), *(p.grad for p in model.parameters()),
                   *(v for p in model.parameters() for v in opt.state[p].values()), opt.grad_scale, opt.found_inf]
        return (opt.step, tensors, {"grad_scale": opt.grad_scale, "found_inf": opt.found_inf}, (aoptim, "_stream"))
    assert op == "update_scale_"
    sc, gt, found = scalar(1024.0), torch.zeros(1, dtype=torch.int32, device=device), scalar(1.0)
    counters, inv = torch.tensor([1, 0, 0, 0], dtype=torch.int32, device=device), scalar(0.0)
    return (lambda: adaptive_amp.update_scale_(sc, gt, found, 2.0, 0.5, 2000, counters=counters, inv_scale=inv),
            [sc, gt, found, counters, inv],
            {"scale": sc, "growth_tracker": gt, "found_inf": found, "counters": counters, "inv_scale": inv},
            (_native, "current_stream"))


_WINDOW_CASES = [(op, name) for op, names in {
    "unscale_and_check_": ["tensors[1]", "found_inf", "inv_scale"],
    "tensor_stats": ["tensors[1]", "scale"],
    "stochastic_round": ["x", "out", "random_bits", "scale"],
    "sgd_step_": ["params[1]", "grads[0]", "momentum_buffers[1]", "grad_scale", "found_inf"],
    "adamw_step_": ["params[0]", "exp_avgs[1]", "exp_avg_sqs[0]", "steps[1]"],
    "update_scale_": ["scale", "growth_tracker", "found_inf", "counters", "inv_scale"],
    "UnscalePlan": ["found_inf", "inv_scale"],
    "AdamW (planned)": ["grad_scale", "found_inf"],
}.items() for name in names]


@pytest.mark.parametrize("op, name", _WINDOW_CASES, ids=[f"{op}-{name}" for op, name in _WINDOW_CASES])
def test_op_tensor_given_new_memory_before_the_launch_is_refused(monkeypatch, op, name, device):
    """Before the launch re-read the pointers, the kernel used the victim's old memory, here kept alive by
    another view of it (freed, the process crashed: the subprocess test below), and raised nothing."""
    call, tensors, victims, (module, attr) = _window_case(op, device)
    assert sorted(victims) == sorted(n for o, n in _WINDOW_CASES if o == op)
    victim = victims[name]
    before = snapshot(*tensors)
    old = []

    def replace():
        if not old:
            old.append(victim.detach())  # the described memory, still referenced by this view
            with torch.no_grad():
                victim.set_(victim.clone())  # new memory with the same values
    _hook(monkeypatch, module, attr, replace)
    with pytest.raises(RuntimeError, match=re.escape(f"{name} was given new memory") + ".*nothing was written"):
        call()
    monkeypatch.undo()
    unchanged(before, *tensors)
    unchanged([before[next(i for i, t in enumerate(tensors) if t is victim)]], old[0])
    call()  # the next call, with nothing changing under it, runs


_FREED_BEFORE_THE_LAUNCH = textwrap.dedent("""
    import torch, adaptive_amp
    from adaptive_amp import _native, optim, sround_torch
    N = 1 << 24  # 64 MiB of float32: freed with munmap, so a kernel still on it faults

    def run(op, victim, call, module, attr):
        original = getattr(module, attr)

        def hooked(*args, **kwargs):  # as another thread could, between the description and the launch
            victim.untyped_storage().resize_(0)
            return original(*args, **kwargs)
        setattr(module, attr, hooked)
        try:
            print(op, end=": ", flush=True)
            call()
            print("not refused", flush=True)
        except RuntimeError as e:
            print(str(e).split(" was given new memory")[0], flush=True)
        finally:
            setattr(module, attr, original)

    big = lambda v=2.0: torch.full((N,), v)
    f, inv = torch.zeros(1), torch.full((1,), 0.5)
    ts = [big(), big()]
    run("unscale_and_check_", ts[1], lambda: adaptive_amp.unscale_and_check_(ts, f, inv), _native, "current_stream")
    ts = [big(), big()]
    run("tensor_stats", ts[0], lambda: adaptive_amp.tensor_stats(ts), _native, "current_stream")
    x = big()
    run("stochastic_round", x, lambda: adaptive_amp.stochastic_round(x, torch.bfloat16, seed=1), sround_torch,
        "_stream")
    p, g, m = big(0.0), big(1.0), big(0.0)
    run("sgd_step_", m, lambda: optim.sgd_step_([p], [g], [m], [True], lr=1.0, momentum=0.9,
                                                stochastic_rounding=False), optim, "_stream")
    p, g, m, v = big(0.0), big(1.0), big(0.0), big(0.0)
    run("adamw_step_", g, lambda: optim.adamw_step_([p], [g], [m], [v], [torch.zeros(1)], lr=0.1, beta1=0.9,
                                                    beta2=0.999, eps=1e-8, weight_decay=0.0), optim, "_stream")
""")


def test_one_shot_op_memory_freed_before_the_launch_is_refused_not_touched():
    """The same window with the memory unmapped (untyped_storage().resize_(0) of 64 MiB): before the launch
    re-read the pointers, the subprocess died (SIGSEGV) at the first op."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _FREED_BEFORE_THE_LAUNCH], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, f"exit code {proc.returncode} after {proc.stdout!r}: {proc.stderr[-2000:]}"
    assert proc.stdout.splitlines() == ["unscale_and_check_: tensors[1]", "tensor_stats: tensors[0]",
                                        "stochastic_round: x", "sgd_step_: momentum_buffers[0]",
                                        "adamw_step_: grads[0]"], proc.stdout


# No threaded test sets p.grad: with torch 2.13 on the CPU, one thread reading p.grad while another assigns
# it (p.grad = None, then a new tensor) segfaults inside torch with no adaptive_amp code involved (a loop of
# torch.optim.SGD.step, or of `p.grad.is_sparse`, against such a thread). The deterministic tests above
# drop the gradients at the worst moment instead.


# --------------------------------------------------------------------------- numpy byte order
#
# Every numpy entry point, every array argument, both byte orders: the kernels
# read the host's order, so an array in the other order is either handled
# (read or written through a copy in the host's order: the same result as the
# native array) or refused by name, with nothing written.

_SWAPPED = ">" if sys.byteorder == "little" else "<"


def _order(a, order):
    return a.astype(a.dtype.newbyteorder(order)) if order != "=" else a


def _unscale_case(which, order):
    grads = [np.array([1.0, 2.0, np.inf], np.float32), np.array([4.0, 8.0], np.float16)]
    found, inv = np.zeros(1, np.float32), np.array([0.5], np.float32)
    args = dict(grads=grads, found=found, inv=inv)
    if which == "grads":
        args["grads"] = [_order(g, order) for g in grads]
    else:
        args[which] = _order(args[which], order)

    def run():
        adaptive_amp.unscale_and_check_(args["grads"], args["found"], args["inv"])
        return [np.asarray(g, dtype=np.float32) for g in args["grads"]] + [np.asarray(args["found"], np.float32)]
    return run, list(args["grads"]) + [args["found"], args["inv"]]


def _update_case(which, order):
    arrays = dict(scale=np.array([1024.0], np.float32), growth_tracker=np.array([3], np.int32),
                  found_inf=np.array([0.0], np.float32), counters=np.array([2, 0, 0, 0], np.int32),
                  amax_history=np.array([1.0, 2.0, 0.5], np.float32), step_amax=np.array([3.0], np.float32),
                  inv_scale=np.zeros(1, np.float32))
    arrays[which] = _order(arrays[which], order)

    def run():
        a = arrays
        adaptive_amp.update_scale_(a["scale"], a["growth_tracker"], a["found_inf"], 2.0, 0.5, 4,
                                   counters=a["counters"], hysteresis=2, amax_history=a["amax_history"],
                                   step_amax=a["step_amax"], inv_scale=a["inv_scale"])
        return [np.asarray(v, dtype=np.float64) for v in a.values()]
    return run, list(arrays.values())


def _sround_case(which, order):
    x = np.linspace(-3, 3, 37, dtype=np.float32)
    arrays = dict(x=x, random_bits=np.arange(37, dtype=np.int32) * 99991, scale=np.array([2.0], np.float32),
                  out=np.zeros(37, np.float16))
    arrays[which] = _order(arrays[which], order)

    def run():
        a = arrays
        got = adaptive_amp.stochastic_round(a["x"], "float16", random_bits=a["random_bits"], scale=a["scale"],
                                            out=a["out"])
        return [np.asarray(got, dtype=np.float32)]
    return run, list(arrays.values())


def _stats_case(which, order):
    tensors = [np.array([1.0, -2.0, 3.0, np.nan], np.float32), np.array([0.5, 70000.0], np.float32)]
    scale = np.array([2.0], np.float32)
    if which == "tensors":
        tensors = [_order(t, order) for t in tensors]
    else:
        scale = _order(scale, order)

    def run():
        st = adaptive_amp.tensor_stats(tensors, fmt="float16", scale=scale).to_dict()
        return [np.asarray(st[k], dtype=np.float64) for k in sorted(st)]
    return run, tensors + [scale]


_BYTE_ORDER_CASES = ([(_unscale_case, w) for w in ("grads", "found", "inv")]
                     + [(_update_case, w) for w in ("scale", "growth_tracker", "found_inf", "counters",
                                                    "amax_history", "step_amax", "inv_scale")]
                     + [(_sround_case, w) for w in ("x", "random_bits", "scale", "out")]
                     + [(_stats_case, w) for w in ("tensors", "scale")])


@pytest.mark.parametrize("case,which", _BYTE_ORDER_CASES,
                         ids=[f"{c.__name__[1:-5]}-{w}" for c, w in _BYTE_ORDER_CASES])
def test_numpy_byte_order_handled_or_refused_in_every_entry_point(case, which):
    run, _ = case(which, "=")
    want = run()
    run, arrays = case(which, _SWAPPED)
    before = [np.array(a, copy=True) for a in arrays]
    try:
        got = run()
    except ValueError as e:
        assert "byte order" in str(e) and re.search(r"\w", str(e).split(" ")[0]), e
        for a, b in zip(arrays, before):  # refused: nothing written, in any argument
            assert a.tobytes() == b.tobytes()
        return
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# --------------------------------------------------------------------------- every plan, state resized under it
#
# Each cached plan (GradScaler's per-optimizer GradPlan, the optimizers'
# OptimPlan, UnscalePlan) is built, then a buffer it described is resized in
# place (same object, and when shrunk the same pointer). The next call must
# see it: the result of a fresh computation, or a clear error, never the old
# size.


@pytest.mark.parametrize("plan", ["grad_scaler", "adamw_moment", "sgd_momentum", "unscale_plan"])
def test_every_plan_notices_a_buffer_resized_in_place(plan):
    torch.manual_seed(0)
    if plan == "unscale_plan":
        ts = [torch.full((1000,), 2.0), torch.full((10,), 2.0)]
        p = adaptive_amp.UnscalePlan(ts)
        p.unscale_and_check_(scalar(0.0), scalar(0.5))
        ts[0].resize_(3)
        ts[0].fill_(8.0)
        p.unscale_and_check_(scalar(0.0), scalar(0.5))
        assert ts[0].tolist() == [4.0] * 3 and ts[1].tolist() == [0.5] * 10
        return
    if plan == "grad_scaler":
        model = _model_with_grads(4.0)
        twin = _model_with_grads(4.0)
        opt, opt_t = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
        ours, theirs = adaptive_amp.GradScaler("cpu", init_scale=2.0), torch.amp.GradScaler("cpu", init_scale=2.0)
        for scaler, o, m in ((ours, opt, model), (theirs, opt_t, twin)):
            scaler.scale(torch.ones(()))
            scaler.unscale_(o)  # (ours builds its plan here)
            scaler.update()
            for q in m.parameters():
                q.grad = torch.full_like(q, 4.0)
            m[0].weight.grad.resize_(7)  # the planned numel no longer holds; the pointer does
            scaler.scale(torch.ones(()))
            scaler.unscale_(o)
        for q, r in zip(model.parameters(), twin.parameters()):
            assert torch.equal(q.grad, r.grad)
        return
    key = "exp_avg" if plan == "adamw_moment" else "momentum_buffer"
    model = _model_with_grads()
    opt = aoptim.AdamW(model.parameters(), lr=0.1) if plan == "adamw_moment" else \
        aoptim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    opt.state[model[1].weight][key].resize_(5)
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(ValueError, match=rf"state\['{key}'\] of params\[2\] has 5 elements"):
        opt.step()
    for q, b in zip(model.parameters(), before):
        assert torch.equal(q, b)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_fused_optimizer_on_a_strided_parameter_is_not_told_to_pass_a_copy(kind):
    """A transposed parameter (a strided leaf that requires grad) was told "pass x.contiguous()": a copy, not
    the parameter the model uses. The error names it and says how to give the parameter contiguous memory;
    the parameter and its gradient are left as they were."""
    w = torch.nn.Parameter(data(12, seed=7).reshape(4, 3).t())
    w.grad = data(12, seed=8).reshape(3, 4)
    opt = aoptim.AdamW([w], lr=0.1) if kind == "AdamW" else aoptim.SGD([w], lr=0.1, momentum=0.9)
    before = snapshot(w, w.grad)
    with pytest.raises(ValueError, match=re.escape("params[0] is not dense in memory")) as info:
        opt.step()
    assert "where the model is built" in str(info.value) and "x.contiguous()" not in str(info.value)
    unchanged(before, w, w.grad)
