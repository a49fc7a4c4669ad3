"""Checkpoint safety of adaptive_amp.GradScaler.

* A rejected state dict (empty, partial, wrongly typed, out of range,
  corrupted extras, another mode) raises a clear error naming the key, and
  leaves the scaler exactly as it was: its state_dict() and its next training
  step equal those of an untouched twin.
* Mid-training save/resume through torch.save/torch.load of scaler, model,
  optimizer and torch's RNG state continues bitwise, in both modes.

Round trips and torch<->ours loading proper are in test_scaler.py.
"""

from __future__ import annotations

import copy
import io
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from adaptive_amp import GradScaler

INF = float("inf")
NAN = float("nan")
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
EXTRA_KEYS = ("mode", "hysteresis", "min_scale", "max_scale", "margin", "counters", "amax_history")
SCALER_KW = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2, history=4, margin=2)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# =========================================================================== helpers


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.25),
                               torch.nn.Linear(16, 4))


def train_step(scaler, model, opt, i, overflow_at=()):
    """One step; the batch comes from torch's global RNG (as does dropout), so resuming needs its state."""
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt.zero_grad()
    loss = F.mse_loss(model(x), y) * (INF if i in overflow_at else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def trained(mode, overflow_at=(2, 5), steps=8):
    """Scaler, model, optimizer after a few steps: counters, tracker, history all non-trivial."""
    torch.manual_seed(123)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    s = GradScaler("cpu", mode=mode, **SCALER_KW)
    for i in range(steps):
        train_step(s, model, opt, i, overflow_at)
    return s, model, opt


def donor_state(mode):
    """A valid state dict that differs from trained(mode)'s in every field it can."""
    torch.manual_seed(7)
    model = make_model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    s = GradScaler("cpu", mode=mode, **{**SCALER_KW, "init_scale": 2.0**5})
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(5)
    for i in range(9):
        train_step(s, model, opt, i, overflow_at=(1, 3, 4))
    return s.state_dict()


def with_value(sd, path, value):
    sd = copy.deepcopy(sd)
    d = sd
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return sd


def without(sd, path):
    sd = copy.deepcopy(sd)
    d = sd
    for k in path[:-1]:
        d = d[k]
    del d[path[-1]]
    return sd


def assert_untouched(mode, bad, exc, match=None):
    """Loading `bad` raises `exc`; the scaler then equals an untouched twin, now and after one more step."""
    s, model, opt = trained(mode)
    twin, twin_model, twin_opt = trained(mode)
    before = s.state_dict()
    with pytest.raises(exc, match=match) as info:
        s.load_state_dict(bad)
    assert s.state_dict() == before == twin.state_dict()
    assert s.skipped_steps == twin.skipped_steps
    torch.manual_seed(99)
    a = train_step(s, model, opt, 100, overflow_at=())
    torch.manual_seed(99)
    b = train_step(twin, twin_model, twin_opt, 100, overflow_at=())
    assert a == b
    assert s.state_dict() == twin.state_dict()
    assert_params_equal(params_of(model), params_of(twin_model))
    # A fresh (lazily initialised) scaler is left alone too.
    fresh = GradScaler("cpu", mode=mode, **SCALER_KW)
    with pytest.raises(exc):
        fresh.load_state_dict(bad)
    assert fresh.state_dict() == GradScaler("cpu", mode=mode, **SCALER_KW).state_dict()
    return str(info.value)


def test_donor_differs_from_target():
    for mode in ("dynamic", "predictive"):
        target, donor = trained(mode)[0].state_dict(), donor_state(mode)
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval"):
            assert donor[key] != target[key], key
        assert donor["adaptive_amp"]["counters"] != target["adaptive_amp"]["counters"]
        if mode == "predictive":
            assert donor["adaptive_amp"]["amax_history"] != target["adaptive_amp"]["amax_history"]
        # and the donor itself loads (so every rejection below is due to the one corrupted field)
        s = trained(mode)[0]
        s.load_state_dict(donor)
        assert s.state_dict() == donor


# ====================================================================== rejections


@pytest.mark.parametrize("mode", ["dynamic", "predictive"])
def test_empty_dict_keeps_torchs_error(mode):
    msg = assert_untouched(mode, {}, RuntimeError)
    theirs = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError) as info:
        theirs.load_state_dict({})
    assert msg == str(info.value)


@pytest.mark.parametrize("bad", [None, [], [("scale", 1.0)], "scale"])
def test_not_a_dict(bad):
    assert_untouched("dynamic", bad, TypeError, match="expects a dict")


@pytest.mark.parametrize("key", TORCH_KEYS)
def test_missing_torch_key(key):
    msg = assert_untouched("predictive", without(donor_state("predictive"), [key]), KeyError)
    assert repr(key) in msg


@pytest.mark.parametrize("key", EXTRA_KEYS)
def test_missing_extra_key(key):
    msg = assert_untouched("predictive", without(donor_state("predictive"), ["adaptive_amp", key]), KeyError)
    assert repr(key) in msg and "adaptive_amp" in msg


BAD_TORCH_VALUES = [
    ("scale", NAN, ValueError), ("scale", INF, ValueError), ("scale", -INF, ValueError),
    ("scale", -1.0, ValueError), ("scale", 0.0, ValueError), ("scale", 1e39, ValueError),  # inf as float32
    ("scale", 1e-50, ValueError),  # 0 as float32
    ("scale", 10**400, ValueError),  # no float at all
    ("scale", "65536.0", TypeError), ("scale", None, TypeError), ("scale", True, TypeError),
    ("scale", torch.tensor(2.0), TypeError), ("scale", [2.0], TypeError),
    ("growth_factor", 1.0, ValueError), ("growth_factor", 0.5, ValueError), ("growth_factor", NAN, ValueError),
    ("growth_factor", INF, ValueError), ("growth_factor", "2.0", TypeError), ("growth_factor", None, TypeError),
    ("backoff_factor", 1.0, ValueError), ("backoff_factor", 0.0, ValueError), ("backoff_factor", -0.5, ValueError),
    ("backoff_factor", 1.5, ValueError), ("backoff_factor", NAN, ValueError), ("backoff_factor", None, TypeError),
    ("backoff_factor", "0.5", TypeError),
    ("growth_interval", 2000.0, TypeError), ("growth_interval", "2000", TypeError),
    ("growth_interval", None, TypeError), ("growth_interval", True, TypeError),
    ("_growth_tracker", -1, ValueError), ("_growth_tracker", 2**31, ValueError), ("_growth_tracker", 1.0, TypeError),
    ("_growth_tracker", None, TypeError), ("_growth_tracker", "0", TypeError),
]


@pytest.mark.parametrize("key,value,exc", BAD_TORCH_VALUES,
                         ids=[f"{k}={v!r}" for k, v, _ in BAD_TORCH_VALUES])
def test_bad_torch_value(key, value, exc):
    msg = assert_untouched("predictive", with_value(donor_state("predictive"), [key], value), exc)
    assert f"['{key}']" in msg


C = ["adaptive_amp", "counters"]
H = ["adaptive_amp", "amax_history"]
BAD_EXTRA_VALUES = [
    (["adaptive_amp"], None, TypeError, "adaptive_amp"),
    (["adaptive_amp"], [1, 2, 3], TypeError, "adaptive_amp"),
    (["adaptive_amp", "mode"], "static", ValueError, "mode"),
    (["adaptive_amp", "mode"], None, TypeError, "mode"),
    (["adaptive_amp", "mode"], 1, TypeError, "mode"),
    (["adaptive_amp", "hysteresis"], 0, ValueError, "hysteresis"),
    (["adaptive_amp", "hysteresis"], 2.0, TypeError, "hysteresis"),
    (["adaptive_amp", "hysteresis"], None, TypeError, "hysteresis"),
    (["adaptive_amp", "min_scale"], NAN, ValueError, "min_scale"),
    (["adaptive_amp", "min_scale"], None, TypeError, "min_scale"),
    (["adaptive_amp", "max_scale"], 0.0, ValueError, "max_scale"),
    (["adaptive_amp", "max_scale"], NAN, ValueError, "max_scale"),
    (["adaptive_amp", "max_scale"], "big", TypeError, "max_scale"),
    (["adaptive_amp", "margin"], 2.5, TypeError, "margin"),
    (["adaptive_amp", "margin"], None, TypeError, "margin"),
    (C, None, TypeError, "counters"),
    (C, "1,0,0,0", TypeError, "counters"),
    (C, [1, 2], ValueError, "counters"),
    (C, [1, 2, 0, 0, 0], ValueError, "counters"),
    (C, [], ValueError, "counters"),
    (C, [1, 0, 0, 0.0], TypeError, r"\[3\]"),
    (C, [None, 0, 0, 0], TypeError, r"\[0\]"),
    (C, [1, "0", 0, 0], TypeError, r"\[1\]"),
    (C, [3, 0, 0, 0], ValueError, "hysteresis_left"),  # more than the saved hysteresis (2)
    (C, [-(2**31) - 1, 0, 0, 0], ValueError, "hysteresis_left"),
    (C, [1, -1, 0, 0], ValueError, "skipped"),
    (C, [1, 2**31, 0, 0], ValueError, "skipped"),
    (C, [1, 0, 4, 0], ValueError, "history_position"),  # history has 4 slots
    (C, [1, 0, -1, 0], ValueError, "history_position"),
    (C, [1, 0, 0, -1], ValueError, "extra_margin"),
    (H, "0.5", TypeError, "amax_history"),
    (H, 0.5, TypeError, "amax_history"),
    (H, [], ValueError, "amax_history"),
    (H, [1.0, NAN, 0.0, 0.0], ValueError, r"amax_history'\]\[1\]"),
    (H, [1.0, 0.0, INF, 0.0], ValueError, r"amax_history'\]\[2\]"),
    (H, [1.0, 0.0, 0.0, 1e39], ValueError, r"amax_history'\]\[3\]"),
    (H, [-1.0, 0.0, 0.0, 0.0], ValueError, r"amax_history'\]\[0\]"),
    (H, [1.0, None, 0.0, 0.0], TypeError, r"amax_history'\]\[1\]"),
    (H, [1.0, "2", 0.0, 0.0], TypeError, r"amax_history'\]\[1\]"),
]


@pytest.mark.parametrize("path,value,exc,match", BAD_EXTRA_VALUES,
                         ids=[f"{'.'.join(map(str, p[1:] or p))}={v!r}" for p, v, _, _ in BAD_EXTRA_VALUES])
def test_bad_extra_value(path, value, exc, match):
    assert_untouched("predictive", with_value(donor_state("predictive"), path, value), exc, match=match)


@pytest.mark.parametrize("path,value,match", [
    (H, [1.0, 2.0, 0.0, 0.0], "amax_history"),  # dynamic mode keeps no history
    (C, [1, 0, 1, 0], "history_position"),
    (C, [1, 0, 0, 1], "extra_margin"),
])
def test_bad_extra_value_dynamic(path, value, match):
    assert_untouched("dynamic", with_value(donor_state("dynamic"), path, value), ValueError, match=match)


@pytest.mark.parametrize("saved,ours", [("dynamic", "predictive"), ("predictive", "dynamic")])
def test_mode_mismatch_is_an_error_naming_both_modes(saved, ours):
    msg = assert_untouched(ours, donor_state(saved), ValueError)
    assert repr(saved) in msg and repr(ours) in msg and "drop state_dict['adaptive_amp']" in msg
    # The advertised way out: torch's fields alone load into the other mode.
    s = trained(ours)[0]
    torch_only = {k: v for k, v in donor_state(saved).items() if k != "adaptive_amp"}
    s.load_state_dict(torch_only)
    assert {k: s.state_dict()[k] for k in TORCH_KEYS} == torch_only


def test_a_late_error_writes_nothing_early():
    """The last thing checked is bad, everything before it good and different from the scaler's state."""
    bad = with_value(donor_state("predictive"), C + [3], -7)
    assert_untouched("predictive", bad, ValueError, match="extra_margin")


# ======================================================================== accepted


@pytest.mark.parametrize("mode", ["dynamic", "predictive"])
def test_torch_state_dict_loads_into_a_used_scaler(mode):
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_factor=4.0, backoff_factor=0.125,
                                  growth_interval=11)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(13):
        train_step(theirs, model, opt, i, overflow_at=(4,))
    sd = theirs.state_dict()
    s = trained(mode)[0]
    extra_before = s.state_dict()["adaptive_amp"]
    s.load_state_dict(sd)
    ours = s.state_dict()
    assert {k: ours[k] for k in TORCH_KEYS} == sd
    assert ours["adaptive_amp"] == extra_before, "a torch checkpoint carries no extras: ours are kept"


@pytest.mark.parametrize("growth_interval", [0, -5, 2**31, sys.maxsize])
def test_never_growing_torch_checkpoint_loads_and_runs_like_torch(growth_interval):
    """torch accepts any int growth_interval (0, negative, beyond int32: the scale never grows); so do we."""
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**7, growth_interval=growth_interval)
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_growth_interval() == growth_interval
    model_a, model_b = make_model(0), make_model(0)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.01)
    torch.manual_seed(5)
    a = [train_step(theirs, model_a, opt_a, i, overflow_at=(3,)) for i in range(6)]
    torch.manual_seed(5)
    b = [train_step(ours, model_b, opt_b, i, overflow_at=(3,)) for i in range(6)]
    assert a == b == [2.0**7] * 3 + [2.0**6] * 3
    assert_params_equal(params_of(model_a), params_of(model_b))
    assert ours.state_dict()["growth_interval"] == growth_interval
    assert ours._get_growth_tracker() == theirs._get_growth_tracker()


def test_checkpoint_scale_is_clamped_to_the_bounds():
    """min_scale/max_scale hold from the load on, not only after the next growth or back-off."""
    sd = torch.amp.GradScaler("cpu", init_scale=2.0**16).state_dict()
    s = GradScaler("cpu", max_scale=2.0**10)
    s.load_state_dict(sd)
    assert s.get_scale() == 2.0**10
    s = GradScaler("cpu", min_scale=2.0**20)
    s.scale(torch.ones(()))
    s.load_state_dict(sd)
    assert s.get_scale() == 2.0**20 and s._inv_scale.item() == 2.0**-20


def test_unknown_keys_are_ignored():
    donor = donor_state("predictive")
    sd = copy.deepcopy(donor)
    sd["future_key"] = object()
    sd["adaptive_amp"]["future_extra"] = [1, 2, 3]
    s = trained("predictive")[0]
    s.load_state_dict(sd)
    assert s.state_dict() == donor


def test_disabled_scaler_ignores_anything():
    s = GradScaler("cpu", enabled=False)
    for bad in ({}, {"scale": NAN}, None):
        s.load_state_dict(bad)
    assert s.state_dict() == {}


def test_numbers_in_other_python_types_load():
    """An int scale, float history entries given as ints and a tuple of counters are fine."""
    s = GradScaler("cpu", mode="predictive", **SCALER_KW)
    sd = s.state_dict()
    sd.update(scale=512, growth_factor=2, backoff_factor=0.5)
    sd["adaptive_amp"]["counters"] = (1, 3, 2, 1)
    sd["adaptive_amp"]["amax_history"] = [1, 0, 2, 0]
    s.load_state_dict(sd)
    out = s.state_dict()
    assert out["scale"] == 512.0 and out["adaptive_amp"]["counters"] == [1, 3, 2, 1]
    assert out["adaptive_amp"]["amax_history"] == [1.0, 0.0, 2.0, 0.0]
    assert s.skipped_steps == 3


def test_hysteresis_left_is_capped_at_this_scalers_hysteresis():
    src = GradScaler("cpu", init_scale=8.0, hysteresis=5).state_dict()
    assert src["adaptive_amp"]["counters"][0] == 5
    s = GradScaler("cpu", init_scale=8.0, hysteresis=2)
    s.load_state_dict(src)
    assert s.state_dict()["adaptive_amp"]["counters"][0] == 2
    # and what it saves loads again (saved hysteresis 2, hysteresis_left 2)
    GradScaler("cpu", hysteresis=2).load_state_dict(s.state_dict())


def test_fresh_predictive_checkpoint_resets_a_used_history():
    fresh = GradScaler("cpu", mode="predictive", **SCALER_KW).state_dict()
    assert fresh["adaptive_amp"]["amax_history"] is None
    s = trained("predictive")[0]
    assert any(s.state_dict()["adaptive_amp"]["amax_history"])
    s.load_state_dict(fresh)
    out = s.state_dict()
    assert out["adaptive_amp"]["amax_history"] == [0.0] * SCALER_KW["history"]
    assert out["adaptive_amp"]["counters"] == fresh["adaptive_amp"]["counters"]
    assert out["scale"] == fresh["scale"]


@pytest.mark.parametrize("used", [False, True])
def test_state_dict_returns_copies(used):
    s = trained("predictive")[0] if used else GradScaler("cpu", mode="predictive", **SCALER_KW)
    if not used:
        s.load_state_dict(donor_state("predictive"))  # sets the lazily applied lists
    before = copy.deepcopy(s.state_dict())
    sd = s.state_dict()
    sd["adaptive_amp"]["counters"][1] = 12345
    sd["adaptive_amp"]["amax_history"][0] = 7.0
    assert s.state_dict() == before
    # and a loaded dict edited afterwards does not reach the scaler either
    src = donor_state("predictive")
    s.load_state_dict(src)
    src["adaptive_amp"]["counters"][1] = 999
    src["adaptive_amp"]["amax_history"][0] = 9.0
    assert s.state_dict() == donor_state("predictive")


# ========================================================= bitwise mid-training resume


@pytest.mark.parametrize("mode", ["dynamic", "predictive"])
def test_save_resume_through_torch_save_is_bitwise(mode):
    """20 steps, torch.save(scaler, model, optimizer, RNG) to a BytesIO, load into fresh objects, 20 more
    steps: scales, parameters, optimizer state and scaler state equal the uninterrupted run's bit for bit."""
    overflow_at = {3, 9, 10, 17, 24, 31, 32}
    kw = dict(init_scale=2.0**12, growth_interval=4, hysteresis=2, mode=mode, history=6, margin=1,
              min_scale=1.0, max_scale=2.0**20)

    def objects(seed):
        model = make_model(seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return GradScaler("cpu", **kw), model, opt

    torch.manual_seed(2024)
    s, model, opt = objects(0)
    for i in range(20):
        train_step(s, model, opt, i, overflow_at)
    buf = io.BytesIO()
    torch.save({"scaler": s.state_dict(), "model": model.state_dict(), "opt": opt.state_dict(),
                "rng": torch.get_rng_state()}, buf)
    cont = [train_step(s, model, opt, i, overflow_at) for i in range(20, 40)]

    torch.manual_seed(555)  # another RNG state, seeds and objects: the checkpoint must restore it all
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    s2, m2, o2 = objects(1)
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["scaler"])
    torch.set_rng_state(ckpt["rng"])
    resumed = [train_step(s2, m2, o2, i, overflow_at) for i in range(20, 40)]

    assert resumed == cont
    assert len(set(cont)) >= 2, "the scale should move after the resume"
    assert_params_equal(params_of(m2), params_of(model))
    assert s2.state_dict() == s.state_dict()
    assert s2.skipped_steps == s.skipped_steps == len(overflow_at)
    sa, sb = o2.state_dict()["state"], opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)
    assert math.isfinite(cont[-1])
