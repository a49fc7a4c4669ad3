"""adaptive_amp.GradScaler: drop-in parity with torch.amp.GradScaler, and what it adds.

Oracles: torch's own ``torch.amp.GradScaler`` (errors, state_dict, scale
trajectory and parameters bit for bit in mode "dynamic"), ``torch._amp_update_scale_``
and ``adaptive_amp.reference.update_scale_`` (the native update rule),
``torch.nn.utils.clip_grad_norm_`` (clipping), hand-computed trajectories for
hysteresis, min/max and predictive mode (csrc/scale_update.h), and eager runs
for CUDA-graph replays. Distributed tests start two gloo processes.

Every test uses fixed seeds and data that is never all zero.
"""

from __future__ import annotations

import copy
import math
import os
import json
import pickle
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import adaptive_amp
from adaptive_amp import GradScaler, reference
from conftest import assert_bitwise_equal, requires_cuda

TorchScaler = torch.amp.GradScaler
INF = float("inf")
NAN = float("nan")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(adaptive_amp.__file__)))


def cuda_test(fn):
    """CUDA-only: the `cuda` marker plus a clean skip without a GPU."""
    return pytest.mark.cuda(requires_cuda(fn))


# =========================================================================== helpers


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def make_mlp(seed=0, device="cpu", dtype=torch.float32, width=32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, width), torch.nn.Tanh(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    )
    return model.to(device=device, dtype=dtype)


def make_opt(kind, params, **extra):
    params = list(params)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, **extra)
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-3, foreach=True, **extra)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True, **extra)
    raise ValueError(kind)


def batches(n, seed, device="cpu", bs=8, accum=1):
    """n steps of `accum` micro-batches (x, y), generated on the CPU from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        micro = []
        for _ in range(accum):
            x = torch.randn(bs, 16, generator=gen)
            y = torch.randn(bs, 4, generator=gen)
            micro.append((x.to(device), y.to(device)))
        out.append(micro)
    return out


def inject_kind(step):
    """The injection schedule of the parity runs: loss * inf, loss * nan, or an inf in a gradient."""
    if step % 23 == 12:
        return "loss_inf"
    if step % 31 == 17:
        return "loss_nan"
    if step % 37 == 29:
        return "grad_inf"
    return None


def train(scaler, model, opt, data, *, recipe="plain", max_norm=0.5, inject=True, autocast=None,
          device="cpu", on_step=None, start=0):
    """The torch.amp recipe; returns (scale after each update, step return values)."""
    scales, rets = [], []
    clip = "clip" in recipe
    for k, micro in enumerate(data):
        i = start + k
        opt.zero_grad(set_to_none=True)
        kind = inject_kind(i) if inject else None
        for a, (x, y) in enumerate(micro):
            if autocast is not None:
                with torch.autocast(device_type=torch.device(device).type, dtype=autocast):
                    out = model(x)
                    loss = F.mse_loss(out.float(), y)
            else:
                loss = F.mse_loss(model(x), y)
            loss = loss / len(micro)
            if a == 0 and kind == "loss_inf":
                loss = loss * INF
            if a == 0 and kind == "loss_nan":
                loss = loss * NAN
            scaler.scale(loss).backward()
        if kind == "grad_inf":
            with torch.no_grad():
                params = [p for p in model.parameters() if p.grad is not None]
                params[len(params) // 2].grad.view(-1)[3] = INF
        if clip:  # torch's recipe, for both scalers
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        rets.append(scaler.step(opt))
        scaler.update()
        scales.append(scaler.get_scale())
        if on_step is not None:
            on_step(i, scaler)
    return scales, rets


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(a, b, msg=""):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bitwise_equal(x, y, f"{msg} param[{i}]")


def assert_opt_state_equal(opt_a, opt_b):
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    assert sa["state"], "the optimizer never stepped"
    for pid in sa["state"]:
        ea, eb = sa["state"][pid], sb["state"][pid]
        assert ea.keys() == eb.keys(), pid
        for key in ea:
            if isinstance(ea[key], torch.Tensor):
                assert torch.equal(ea[key], eb[key]), f"optimizer state[{pid}][{key!r}] differs"
                if ea[key].is_floating_point():
                    assert_bitwise_equal(ea[key], eb[key], f"state[{pid}][{key!r}]")
            else:
                assert ea[key] == eb[key], (pid, key)


def assert_interesting_trajectory(scales, init):
    """The run must exercise growth and back-off, or the parity check proves little."""
    seq = [init, *scales]
    assert any(b > a for a, b in zip(seq, seq[1:])), f"the scale never grew: {scales[:40]}"
    assert any(b < a for a, b in zip(seq, seq[1:])), f"the scale never backed off: {scales[:40]}"


def rets_as_bools(rets):
    out = []
    for r in rets:
        if isinstance(r, torch.Tensor):
            out.append(bool(r.item()))
        else:
            out.append(r)
    return out


def pair(kind, device="cpu", dtype=torch.float32, seed=0, opt_extra=None):
    """Two identical (model, optimizer) pairs."""
    opt_extra = opt_extra or {}
    m1, m2 = make_mlp(seed, device, dtype), make_mlp(seed, device, dtype)
    return (m1, make_opt(kind, m1.parameters(), **opt_extra)), (m2, make_opt(kind, m2.parameters(), **opt_extra))


# ======================================================================== 1. drop-in API


def test_constructor_defaults_and_getters_match_torch():
    ours, theirs = GradScaler("cpu"), TorchScaler("cpu")
    for name in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled"):
        a, b = getattr(ours, name)(), getattr(theirs, name)()
        assert a == b and type(a) is type(b), name
    assert ours.get_scale() == 2.0**16
    assert ours.get_growth_factor() == 2.0 and ours.get_backoff_factor() == 0.5
    assert ours.get_growth_interval() == 2000 and ours.is_enabled()
    assert ours.state_dict().keys() - {"adaptive_amp"} == theirs.state_dict().keys()


def test_positional_constructor_arguments():
    s = GradScaler("cpu", 8.0, 3.0, 0.25, 5, True)
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval(),
            s.is_enabled()) == (8.0, 3.0, 0.25, 5, True)


def test_setters_change_behaviour_like_torch():
    """set_* mid-run and update(new_scale=...) (float and tensor) give torch's trajectory."""
    (m1, o1), (m2, o2) = pair("sgd")
    data = batches(60, seed=5)
    s1 = TorchScaler("cpu", init_scale=2.0**10, growth_interval=7)
    s2 = GradScaler("cpu", init_scale=2.0**10, growth_interval=7)

    def tweak(i, s):
        if i == 20:
            s.set_growth_factor(3.0)
            s.set_backoff_factor(0.3)
            s.set_growth_interval(3)
            assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.3, 3)
        if i == 35:
            s.update(new_scale=1000.0)
        if i == 45:
            s.update(new_scale=torch.tensor(24.5))

    a = train(s1, m1, o1, data, on_step=tweak)
    b = train(s2, m2, o2, data, on_step=tweak)
    assert a[0] == b[0]
    assert any(math.frexp(v)[0] != 0.5 for v in a[0][21:35]), "the non-power-of-2 factors had no effect"
    assert a[0][36] in (1000.0, 3000.0, 300.0) and a[0][46] in (24.5, 73.5, float(torch.tensor(24.5 * 0.3)))
    assert_params_equal(params_of(m1), params_of(m2))
    assert s1._get_growth_tracker() == s2._get_growth_tracker()


def test_new_scale_is_used_for_unscaling():
    """After update(new_scale) the next unscale_ divides by the new scale."""
    w = torch.nn.Parameter(torch.tensor([1.5, -2.0, 3.25]))
    opt = torch.optim.SGD([w], lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    s.scale((w * 2.0).sum()).backward()
    s.step(opt)
    s.update(new_scale=16.0)
    assert s.get_scale() == 16.0
    opt.zero_grad()
    s.scale((w * torch.tensor([1.0, 2.0, 3.0])).sum()).backward()
    assert torch.equal(w.grad, torch.tensor([16.0, 32.0, 48.0]))
    s.unscale_(opt)
    assert torch.equal(w.grad, torch.tensor([1.0, 2.0, 3.0]))


def _scenario_errors():
    def fwd(m, s):
        s.scale(m(torch.linspace(-1, 1, 8).reshape(2, 4)).sum()).backward()

    return {
        "unscale_twice": lambda m, o, s: (fwd(m, s), s.unscale_(o), s.unscale_(o)),
        "unscale_after_step": lambda m, o, s: (fwd(m, s), s.step(o), s.unscale_(o)),
        "step_twice": lambda m, o, s: (fwd(m, s), s.step(o), s.step(o)),
        "closure": lambda m, o, s: (fwd(m, s), s.step(o, closure=lambda: 0.0)),
        "unscale_before_scale": lambda m, o, s: s.unscale_(o),
        "step_before_scale": lambda m, o, s: s.step(o),
        "update_before_scale": lambda m, o, s: s.update(),
        "update_without_step": lambda m, o, s: (fwd(m, s), s.update()),
        "pickle_mid_iteration": lambda m, o, s: (fwd(m, s), s.unscale_(o), pickle.dumps(s)),
        "pickle_after_step": lambda m, o, s: (fwd(m, s), s.step(o), pickle.dumps(s)),
        "load_empty_state": lambda m, o, s: s.load_state_dict({}),
        "new_scale_wrong_device": lambda m, o, s: (fwd(m, s), s.step(o), s.update(torch.ones((), device="meta"))),
        "new_scale_two_elements": lambda m, o, s: (fwd(m, s), s.step(o), s.update(torch.ones(2))),
        "new_scale_requires_grad": lambda m, o, s: (fwd(m, s), s.step(o),
                                                    s.update(torch.ones(1, requires_grad=True))),
        "scale_non_tensor": lambda m, o, s: s.scale([torch.ones(2), 3]),
        "step_without_any_grad": lambda m, o, s: (s.scale(torch.ones(())), s.step(o)),
        "fp16_grads_step": lambda m, o, s: (m.half(), s.scale(m(torch.ones(2, 4).half()).float().sum()).backward(),
                                            s.step(o)),
        "fp16_grads_unscale": lambda m, o, s: (m.half(), s.scale(m(torch.ones(2, 4).half()).float().sum()).backward(),
                                               s.unscale_(o)),
    }


@pytest.mark.parametrize("name", sorted(_scenario_errors()))
def test_errors_match_torch(name):
    scenario = _scenario_errors()[name]

    def outcome(cls):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        s = cls("cpu", init_scale=4.0)
        try:
            scenario(m, o, s)
        except Exception as exc:  # noqa: BLE001 - the point is to compare them
            grads = [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()]
            return (type(exc), str(exc)), grads
        return None, None

    theirs, t_grads = outcome(TorchScaler)
    ours, o_grads = outcome(GradScaler)
    assert theirs is not None, "the scenario should raise in torch"
    assert ours == theirs
    # Nothing written before refusing (fp16 refusal): the gradients are those torch left.
    for a, b in zip(o_grads, t_grads):
        if a is not None or b is not None:
            assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("kw", [{"growth_factor": 1.0}, {"growth_factor": 0.5}, {"backoff_factor": 1.0},
                                {"backoff_factor": 1.5}])
def test_constructor_errors_match_torch(kw):
    with pytest.raises(AssertionError) as theirs:
        TorchScaler("cpu", **kw)
    with pytest.raises(AssertionError) as ours:
        GradScaler("cpu", **kw)
    assert str(ours.value) == str(theirs.value)
    # Disabled: no validation, as torch.
    assert not GradScaler("cpu", enabled=False, **kw).is_enabled()


@pytest.mark.parametrize("kw", [{"mode": "static"}, {"hysteresis": 0}, {"min_scale": 4.0, "max_scale": 2.0},
                                {"history": 0}])
def test_constructor_rejects_bad_extensions(kw):
    with pytest.raises(ValueError):
        GradScaler("cpu", **kw)


def test_scale_of_nested_outputs_matches_torch():
    gen = torch.Generator().manual_seed(3)
    t = lambda *shape, dtype=torch.float32: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    outputs = [t(3), (t(2, 2), [t(4, dtype=torch.float16), t(())]), (t(5, dtype=torch.bfloat16),)]
    ours = GradScaler("cpu", init_scale=3.0).scale(outputs)
    theirs = TorchScaler("cpu", init_scale=3.0).scale(outputs)

    def walk(a, b):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(a, b)
            assert a.dtype == b.dtype
        else:
            assert len(a) == len(b)
            for x, y in zip(a, b):
                walk(x, y)

    walk(ours, theirs)
    assert_bitwise_equal(ours[0], outputs[0] * 3.0)
    # A generator comes back as an iterator, as torch's does.
    it = GradScaler("cpu", init_scale=3.0).scale(x for x in [outputs[0], outputs[1][0]])
    assert not isinstance(it, (list, tuple))
    got = list(it)
    assert_bitwise_equal(got[0], outputs[0] * 3.0)
    assert_bitwise_equal(got[1], outputs[1][0] * 3.0)


def test_scale_single_tensor_keeps_dtype_and_grad():
    s, ts = GradScaler("cpu", init_scale=2.0**10), TorchScaler("cpu", init_scale=2.0**10)
    x = torch.tensor([1.5, -2.0, 60.0], dtype=torch.float16, requires_grad=True)
    a, b = s.scale(x), ts.scale(x)
    assert a.dtype == b.dtype == torch.float16
    assert_bitwise_equal(a, b)
    assert a.requires_grad
    assert s.get_scale() == 2.0**10


def _run_plain(scaler, steps=6, seed=0):
    model = make_mlp(seed)
    opt = make_opt("sgd", model.parameters())
    rets = []
    data = batches(steps, seed=1)
    for micro in data:
        opt.zero_grad()
        (x, y), = micro
        out = scaler.scale(F.mse_loss(model(x), y))
        out.backward()
        scaler.unscale_(opt)
        rets.append(scaler.step(opt))
        scaler.update()
    return model, rets


def test_disabled_is_a_no_op():
    s = GradScaler("cpu", init_scale=2.0**10, enabled=False)
    assert not s.is_enabled()
    x = torch.randn(3)
    assert s.scale(x) is x
    nested = [x, (x,)]
    assert s.scale(nested) is nested
    model, rets = _run_plain(s)
    # Plain training without any scaler.
    ref = make_mlp(0)
    opt = make_opt("sgd", ref.parameters())
    for micro in batches(6, seed=1):
        opt.zero_grad()
        (xx, yy), = micro
        F.mse_loss(ref(xx), yy).backward()
        opt.step()
    assert_params_equal(params_of(model), params_of(ref))
    assert rets == [None] * 6, "disabled step() returns optimizer.step()'s value, as torch"
    assert s.get_scale() == 1.0
    assert s.state_dict() == {} == TorchScaler("cpu", enabled=False).state_dict()
    s.load_state_dict({})  # no-op, no error
    s.load_state_dict({"scale": 5.0})
    assert s.get_scale() == 1.0
    assert s.skipped_steps == 0
    # Pickles, as torch's disabled scaler does.
    assert not pickle.loads(pickle.dumps(s)).is_enabled()


def test_disabled_clip_grad_norm_falls_back_to_torch():
    torch.manual_seed(0)
    m1, m2 = make_mlp(0), make_mlp(0)
    o1 = make_opt("sgd", m1.parameters())
    (x, y), = batches(1, seed=2)[0]
    F.mse_loss(m1(x), y).backward()
    F.mse_loss(m2(x), y).backward()
    s = GradScaler("cpu", enabled=False)
    norm = s.clip_grad_norm_(o1, 0.1)
    ref = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.1)
    assert_bitwise_equal(norm, ref)
    assert_params_equal([p.grad for p in m1.parameters()], [p.grad for p in m2.parameters()])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_cuda_scaler_without_cuda_warns_and_disables_like_torch():
    with pytest.warns(UserWarning) as theirs:
        t = TorchScaler("cuda")
    with pytest.warns(UserWarning) as ours:
        o = GradScaler("cuda")
    assert not t.is_enabled() and not o.is_enabled()
    assert len(ours) == len(theirs) == 1
    # Ours names itself and the fix (torch's names torch.cuda.amp.GradScaler, which the user did not make).
    message = str(ours[0].message)
    assert "adaptive_amp.GradScaler(device='cuda')" in message and "device='cpu'" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sparse_gradients_match_torch(dtype):
    """nn.Embedding(sparse=True) with SGD: same trajectory and params; fp16 refused as torch does."""

    def run(cls):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 5, sparse=True).to(dtype)
        lin = torch.nn.Linear(5, 2)
        params = list(emb.parameters()) + list(lin.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        s = cls("cpu", init_scale=2.0**10, growth_interval=3)
        gen = torch.Generator().manual_seed(2)
        scales, rets = [], []
        for i in range(24):
            opt.zero_grad()
            idx = torch.randint(0, 20, (8,), generator=gen)
            loss = lin(emb(idx).float()).pow(2).mean()
            if i in (5, 11):
                loss = loss * INF
            s.scale(loss).backward()
            assert emb.weight.grad.is_sparse
            if i == 17:
                with torch.no_grad():
                    emb.weight.grad._values().view(-1)[2] = NAN
            try:
                rets.append(s.step(opt))
            except ValueError as exc:
                return ("raised", str(exc))
            s.update()
            scales.append(s.get_scale())
        return scales, [p.detach().clone() for p in params], rets

    theirs, ours = run(TorchScaler), run(GradScaler)
    if dtype == torch.float16:
        assert theirs == ("raised", "Attempting to unscale FP16 gradients.")
        assert ours == theirs
        return
    assert ours[0] == theirs[0]
    assert_interesting_trajectory(theirs[0], 2.0**10)
    assert_params_equal(ours[1], theirs[1])
    skipped = [i for i, r in enumerate(ours[2]) if r is False]
    assert skipped == [5, 11, 17]


def test_none_noncontiguous_grads_and_two_optimizers_match_torch():
    """Unused parameters (grad None), non-contiguous gradients, two optimizers with one update()."""

    def run(cls):
        torch.manual_seed(0)
        l1, l2, unused = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3), torch.nn.Linear(2, 2)
        o1 = torch.optim.SGD(list(l1.parameters()) + list(unused.parameters()), lr=0.1, momentum=0.9)
        o2 = torch.optim.Adam(l2.parameters(), lr=1e-2)
        s = cls("cpu", init_scale=2.0**10, growth_interval=3)
        gen = torch.Generator().manual_seed(3)
        scales, rets = [], []
        for i in range(25):
            o1.zero_grad()
            o2.zero_grad()
            x = torch.randn(5, 4, generator=gen)
            s.scale(l2(torch.relu(l1(x))).pow(2).mean()).backward()
            l1.weight.grad = l1.weight.grad.t().contiguous().t()
            assert not l1.weight.grad.is_contiguous()
            if i in (4, 9):
                l2.weight.grad[1, 2] = INF
            if i == 13:
                l1.bias.grad[0] = NAN
            rets.append((s.step(o1), s.step(o2)))
            s.update()
            scales.append(s.get_scale())
        return scales, [p.detach().clone() for p in [*l1.parameters(), *l2.parameters(), *unused.parameters()]], rets

    theirs, ours = run(TorchScaler), run(GradScaler)
    assert ours[0] == theirs[0]
    assert_interesting_trajectory(theirs[0], 2.0**10)
    assert_params_equal(ours[1], theirs[1])
    # Each optimizer skips only for its own gradients, as torch.
    assert ours[2][4] == (True, False) and ours[2][13] == (False, True)


def test_fused_optimizer_receives_grad_scale_and_found_inf():
    """The _step_supports_amp_scaling path: grad_scale and found_inf are set on the optimizer, then removed."""

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            self.seen.append((self.grad_scale if self.grad_scale is None else self.grad_scale.clone(),
                              self.found_inf.clone()))
            return super().step(closure)

    def run(cls, explicit_unscale):
        model = make_mlp(0)
        opt = Recording(model.parameters(), lr=1e-3, fused=True)
        opt.seen = []
        assert opt._step_supports_amp_scaling
        s = cls("cpu", init_scale=2.0**10, growth_interval=2)
        rets = []
        for i, micro in enumerate(batches(6, seed=4)):
            opt.zero_grad()
            (x, y), = micro
            loss = F.mse_loss(model(x), y)
            s.scale(loss * (INF if i == 3 else 1.0)).backward()
            if explicit_unscale:
                s.unscale_(opt)
            rets.append(s.step(opt))
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            s.update()
        return opt.seen, params_of(model), rets

    for explicit in (False, True):
        theirs, ours = run(TorchScaler, explicit), run(GradScaler, explicit)
        assert len(ours[0]) == len(theirs[0]) == 6, "step() reaches the fused optimizer even on overflow"
        for (gs_o, fi_o), (gs_t, fi_t) in zip(ours[0], theirs[0]):
            if explicit:
                assert gs_o is None and gs_t is None
            else:
                assert_bitwise_equal(gs_o, gs_t)
            assert bool(fi_o != 0) == bool(fi_t != 0)
        assert [bool(fi != 0) for _, fi in ours[0]] == [False, False, False, True, False, False]
        assert_params_equal(ours[1], theirs[1])


def test_legacy_grad_scaler_kwarg_optimizer_like_torch():
    """An amp-aware optimizer whose step takes grad_scaler= gets the scaler itself, with a FutureWarning."""

    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.got = grad_scaler
            return "stepped"

    for cls in (TorchScaler, GradScaler):
        w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        opt = Legacy([w], lr=0.1)
        s = cls("cpu", init_scale=2.0)
        s.scale((w * 3).sum()).backward()
        with pytest.warns(FutureWarning, match="stop passing itself"):
            assert s.step(opt) == "stepped"
        assert opt.got is s


def test_fp16_params_with_fused_adamw_match_torch():
    """Fused optimizers unscale by themselves: fp16 gradients are allowed there, as in torch."""

    def run(cls):
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4).half()
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
        s = cls("cpu", init_scale=2.0**10, growth_interval=2)
        gen = torch.Generator().manual_seed(0)
        scales = []
        for i in range(30):
            o.zero_grad()
            loss = m(torch.randn(4, 8, generator=gen).half()).float().pow(2).mean()
            s.scale(loss).backward()
            s.step(o)
            s.update()
            scales.append(s.get_scale())
        return scales, params_of(m), o

    theirs, ours = run(TorchScaler), run(GradScaler)
    assert ours[0] == theirs[0]
    assert any(b < a for a, b in zip(theirs[0], theirs[0][1:])), "fp16 gradients should overflow at some point"
    assert_params_equal(ours[1], theirs[1])
    assert_opt_state_equal(ours[2], theirs[2])


# --------------------------------------------------------------------- state_dict / pickle


def test_state_dict_has_torchs_format():
    (m1, o1), (m2, o2) = pair("sgd")
    data = batches(31, seed=6)
    s1 = TorchScaler("cpu", init_scale=2.0**10, growth_interval=7)
    s2 = GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    train(s1, m1, o1, data)
    train(s2, m2, o2, data)
    theirs, ours = s1.state_dict(), s2.state_dict()
    assert "adaptive_amp" in ours
    stripped = {k: v for k, v in ours.items() if k != "adaptive_amp"}
    assert stripped == theirs
    assert {k: type(v) for k, v in stripped.items()} == {k: type(v) for k, v in theirs.items()}
    assert theirs["_growth_tracker"] != 0, "pick a step count that leaves a nonzero tracker"
    # A fresh (never used) scaler too.
    fresh = GradScaler("cpu", init_scale=8.0).state_dict()
    assert {k: v for k, v in fresh.items() if k != "adaptive_amp"} == TorchScaler("cpu", init_scale=8.0).state_dict()


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_checkpoint_loads_in_the_other(tmp_path, direction):
    """Save after 30 steps, torch.save/torch.load(weights_only=True), load into the other class, train on."""
    src_cls, dst_cls = (GradScaler, TorchScaler) if direction == "ours_to_torch" else (TorchScaler, GradScaler)
    model, opt = make_mlp(0), None
    opt = make_opt("sgd", model.parameters())
    data = batches(60, seed=7)
    src = src_cls("cpu", init_scale=2.0**10, growth_interval=7)
    train(src, model, opt, data[:30])
    path = tmp_path / "ckpt.pt"
    torch.save({"scaler": src.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, path)
    ckpt = torch.load(path, weights_only=True)

    def resume(cls):
        # A private copy: Optimizer.load_state_dict keeps the loaded tensors, which steps then mutate.
        c = copy.deepcopy(ckpt)
        m = make_mlp(99)
        m.load_state_dict(c["model"])
        o = make_opt("sgd", m.parameters())
        o.load_state_dict(c["opt"])
        s = cls("cpu", init_scale=1.0, growth_factor=5.0, backoff_factor=0.1, growth_interval=100)
        s.load_state_dict(c["scaler"])
        scales, _ = train(s, m, o, data[30:], start=30)
        return scales, params_of(m)

    a = resume(dst_cls)
    b = resume(src_cls)
    assert a[0] == b[0]
    assert_interesting_trajectory(a[0], ckpt["scaler"]["scale"])
    assert_params_equal(a[1], b[1])


def test_pickle_round_trip_at_start_of_iteration():
    """A scaler pickled after update() (hysteresis state included) continues exactly like the original."""
    model = make_mlp(0)
    opt = make_opt("sgd", model.parameters())
    data = batches(40, seed=8)
    s = GradScaler("cpu", init_scale=2.0**10, growth_interval=50, hysteresis=3)
    overflow_at = {5, 15, 25}

    def run(scaler, m, o, part, start):
        scales = []
        for k, micro in enumerate(part):
            i = start + k
            o.zero_grad()
            (x, y), = micro
            loss = F.mse_loss(m(x), y)
            scaler.scale(loss * (INF if i in overflow_at else 1.0)).backward()
            scaler.step(o)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    run(s, model, opt, data[:20], 0)
    blob = pickle.dumps(s)
    s2 = pickle.loads(blob)
    m2 = copy.deepcopy(model)
    o2 = make_opt("sgd", m2.parameters())
    o2.load_state_dict(copy.deepcopy(opt.state_dict()))
    a = run(s, model, opt, data[20:], 20)
    b = run(s2, m2, o2, data[20:], 20)
    assert a == b
    assert a[5] == a[4] / 2, "the third overflow since growth (step 25) backs off: hysteresis state was kept"
    assert s.skipped_steps == s2.skipped_steps == 3
    assert_params_equal(params_of(model), params_of(m2))
    # Before any use, and torch's pickled scaler still pickles too.
    assert pickle.loads(pickle.dumps(GradScaler("cpu", init_scale=3.0))).get_scale() == 3.0


@pytest.mark.parametrize("mode", ["dynamic", "predictive"])
def test_state_dict_resume_is_bitwise_identical(mode):
    """Train 20, save; train 20 more; vs load into fresh objects and train the same 20."""
    kw = dict(init_scale=2.0**10, growth_interval=50, hysteresis=3, mode=mode, history=8, margin=2,
              min_scale=1.0, max_scale=2.0**20)
    overflow_at = {5, 15, 25}
    data = batches(40, seed=9)

    def run(scaler, m, o, part, start):
        scales = []
        for k, micro in enumerate(part):
            i = start + k
            o.zero_grad()
            (x, y), = micro
            x = x * (100.0 if 14 <= i < 20 else 1.0)
            loss = F.mse_loss(m(x), y)
            scaler.scale(loss * (INF if i in overflow_at else 1.0)).backward()
            scaler.step(o)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    model = make_mlp(0)
    opt = make_opt("adam_foreach", model.parameters())
    s = GradScaler("cpu", **kw)
    run(s, model, opt, data[:20], 0)
    ckpt = copy.deepcopy({"scaler": s.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()})
    cont = run(s, model, opt, data[20:], 20)

    def resumed(scaler_state):
        c = copy.deepcopy(ckpt)  # steps mutate the loaded optimizer state in place
        m = make_mlp(1)
        m.load_state_dict(c["model"])
        o = make_opt("adam_foreach", m.parameters())
        o.load_state_dict(c["opt"])
        s2 = GradScaler("cpu", **kw)
        s2.load_state_dict(scaler_state)
        return run(s2, m, o, data[20:], 20), params_of(m), s2

    scales, params, s2 = resumed(ckpt["scaler"])
    assert scales == cont
    assert_params_equal(params, params_of(model))
    assert s2.skipped_steps == s.skipped_steps == 3
    # The extra state matters: without it (a torch-format checkpoint) the run differs.
    torch_only = {k: v for k, v in ckpt["scaler"].items() if k != "adaptive_amp"}
    assert resumed(torch_only)[0] != cont


def test_load_state_dict_rejects_foreign_dicts():
    s = GradScaler("cpu")
    with pytest.raises(KeyError):
        s.load_state_dict({"scale": 2.0})
    good = GradScaler("cpu").state_dict()
    good["adaptive_amp"]["counters"] = [1, 2]
    with pytest.raises(ValueError):
        s.load_state_dict(good)


# ============================================================= 2. bitwise parity, mode "dynamic"

PARITY_OPTS = ["sgd", "adam_foreach", "adamw_fused"]
PARITY_RECIPES = [("plain", 1), ("clip", 1), ("accum", 3), ("clip_accum", 2)]


def _parity(kind, recipe, accum, device="cpu", autocast=None, steps=200):
    (m1, o1), (m2, o2) = pair(kind, device)
    data = batches(steps, seed=11, device=device, accum=accum)
    s1 = TorchScaler(torch.device(device).type, init_scale=2.0**10, growth_interval=7)
    s2 = GradScaler(torch.device(device).type, init_scale=2.0**10, growth_interval=7)
    theirs = train(s1, m1, o1, data, recipe=recipe, autocast=autocast, device=device)
    ours = train(s2, m2, o2, data, recipe=recipe, autocast=autocast, device=device)
    assert ours[0] == theirs[0], "scale histories differ"
    assert_interesting_trajectory(theirs[0], 2.0**10)
    assert_params_equal(params_of(m2), params_of(m1), f"{kind}/{recipe}")
    assert_opt_state_equal(o2, o1)
    # Skips agree (torch returns None for plain optimizers; we return the decision).
    skipped_t = [i for i, v in enumerate(theirs[0]) if i and v < theirs[0][i - 1]]
    skipped_o = [i for i, r in enumerate(rets_as_bools(ours[1])) if r is False]
    assert set(skipped_t) <= set(skipped_o)
    assert s2.skipped_steps == len(skipped_o)
    return skipped_o


@pytest.mark.parametrize("recipe,accum", PARITY_RECIPES, ids=[r for r, _ in PARITY_RECIPES])
@pytest.mark.parametrize("kind", PARITY_OPTS)
def test_bitwise_parity_with_torch_cpu(kind, recipe, accum):
    skipped = _parity(kind, recipe, accum)
    assert skipped == [i for i in range(200) if inject_kind(i) is not None]


def test_bitwise_parity_with_torch_cpu_bf16_autocast():
    _parity("sgd", "clip", 1, autocast=torch.bfloat16)


@cuda_test
@pytest.mark.parametrize("autocast", [None, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("recipe,accum", [("plain", 1), ("clip_accum", 2)], ids=["plain", "clip_accum"])
@pytest.mark.parametrize("kind", PARITY_OPTS)
def test_bitwise_parity_with_torch_cuda(kind, recipe, accum, autocast):
    _parity(kind, recipe, accum, device="cuda", autocast=autocast)


@cuda_test
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_gradients_on_two_cuda_devices_match_torch(kind):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)

    def run(cls):
        torch.manual_seed(0)
        a = torch.nn.Linear(16, 32).to(d0)
        b = torch.nn.Linear(32, 4).to(d1)
        params = [*a.parameters(), *b.parameters()]
        opt = make_opt(kind, params)
        s = cls("cuda", init_scale=2.0**10, growth_interval=3)
        scales, rets = [], []
        for i, micro in enumerate(batches(40, seed=12)):
            opt.zero_grad()
            (x, y), = micro
            loss = F.mse_loss(b(torch.tanh(a(x.to(d0))).to(d1)), y.to(d1))
            s.scale(loss).backward()
            if i in (4, 17):  # an inf on one device only
                a.weight.grad[0, 1] = INF
            if i == 9:
                b.bias.grad[2] = NAN
            rets.append(s.step(opt))
            s.update()
            scales.append(s.get_scale())
        return scales, [p.detach().cpu() for p in params], rets

    theirs, ours = run(TorchScaler), run(GradScaler)
    assert ours[0] == theirs[0]
    assert_interesting_trajectory(theirs[0], 2.0**10)
    assert_params_equal(ours[1], theirs[1])
    assert [i for i, r in enumerate(rets_as_bools(ours[2])) if r is False] == [4, 9, 17]


# ================================================================== 3. beyond torch: clipping


def _clip_run(kind, device, ours, max_norm, norm_type=2.0, steps=8, opt_extra=None):
    model = make_mlp(0, device)
    opt = make_opt(kind, model.parameters(), **(opt_extra or {}))
    cls = GradScaler if ours else TorchScaler
    s = cls(device, init_scale=2.0**12, growth_interval=3)
    norms, grads_before = [], []
    for i, micro in enumerate(batches(steps, seed=13, device=device)):
        opt.zero_grad()
        (x, y), = micro
        loss = F.mse_loss(model(x) * 4.0, y)
        s.scale(loss * (INF if i == 5 else 1.0)).backward()
        if ours:
            before = [p.grad.clone() for p in model.parameters()]
            norm = s.clip_grad_norm_(opt, max_norm, norm_type=norm_type)
            grads_before.append((before, [p.grad.clone() for p in model.parameters()]))
        else:
            s.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        norms.append(norm)
        s.step(opt)
        s.update()
    return norms, params_of(model), s, grads_before


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "linf"])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_clip_grad_norm_matches_torch_recipe(device, kind, norm_type):
    opt_extra = {"eps": 1e-2} if kind == "adamw_fused" else {}  # a large eps makes Adam feel the clipping
    max_norm = 0.05
    t_norms, t_params, t_s, _ = _clip_run(kind, device, False, max_norm, norm_type, opt_extra=opt_extra)
    o_norms, o_params, o_s, grads = _clip_run(kind, device, True, max_norm, norm_type, opt_extra=opt_extra)
    for i, (a, b) in enumerate(zip(o_norms, t_norms)):
        assert isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == torch.device(device).type
        if i == 5:
            assert not math.isfinite(float(a)) and not math.isfinite(float(b))
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=0)
            assert float(b) > 4 * max_norm, "the test must actually clip"
    assert t_s.get_scale() == o_s.get_scale()
    for a, b in zip(o_params, t_params):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Clipping had a visible effect (the comparison above is not vacuous).
    _, free_params, _, _ = _clip_run(kind, device, True, 1e9, norm_type, opt_extra=opt_extra)
    assert max(float((a - b).abs().max()) for a, b in zip(free_params, t_params)) > 1e-4
    if kind == "adamw_fused":
        # Folded into grad_scale: the gradients are not rewritten.
        for before, after in grads:
            for x, y in zip(before, after):
                assert_bitwise_equal(y, x)
    else:
        before, after = grads[0]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in after]),
                                         norm_type)
        assert float(total) == pytest.approx(max_norm, rel=1e-4)


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("norm_type", [1.0, 3.0])
def test_clip_grad_norm_other_norm_types_fall_back(kind, norm_type):
    t_norms, t_params, _, _ = _clip_run(kind, "cpu", False, 0.05, norm_type)
    o_norms, o_params, _, _ = _clip_run(kind, "cpu", True, 0.05, norm_type)
    for i, (a, b) in enumerate(zip(o_norms, t_norms)):
        if i != 5:
            assert_bitwise_equal(a, b)
    assert_params_equal(o_params, t_params)


def test_clip_grad_norm_errors(device):
    model = make_mlp(0, device)
    opt = make_opt("sgd", model.parameters())
    s = GradScaler(device, init_scale=2.0**10)
    (x, y), = batches(1, seed=14, device=device)[0]
    s.scale(F.mse_loss(model(x), y) * INF).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        s.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)
    s.step(opt)
    with pytest.raises(RuntimeError):
        s.clip_grad_norm_(opt, 1.0)


def test_last_grad_norm_and_found_inf_are_device_tensors(device):
    for kind in ("sgd", "adamw_fused"):
        model = make_mlp(0, device)
        opt = make_opt(kind, model.parameters())
        s = GradScaler(device, init_scale=2.0**8, growth_interval=100)
        assert s.found_inf is None and s.last_grad_norm is None
        for i, micro in enumerate(batches(3, seed=15, device=device)):
            opt.zero_grad()
            (x, y), = micro
            s.scale(F.mse_loss(model(x), y) * (INF if i == 1 else 1.0)).backward()
            scale = s.get_scale()
            grads = [p.grad.detach().double() / scale for p in model.parameters()]  # exact: power of 2
            s.step(opt)
            s.update()
            fi, norm = s.found_inf, s.last_grad_norm
            for t in (fi, norm):
                assert isinstance(t, torch.Tensor) and t.numel() == 1
                assert t.device.type == torch.device(device).type
            assert (float(fi) != 0) == (i == 1)
            if i != 1:
                ref = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
                assert float(norm) == pytest.approx(float(ref), rel=1e-5)
                assert float(norm) > 0


def test_clip_grad_norm_with_sparse_gradient_is_right_or_refused():
    """torch.nn.utils.clip_grad_norm_ raises on sparse gradients; silently wrong is the one bad outcome."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    idx = torch.tensor([1, 1, 2, 1])  # duplicate indices: an uncoalesced gradient
    s.scale(emb(idx).sum()).backward()
    true_norm = float((emb.weight.grad.to_dense() / 4.0).norm())  # sqrt(3 * 3^2 + 3 * 1^2) = sqrt(30)
    assert true_norm == pytest.approx(math.sqrt(30.0))
    try:
        norm = s.clip_grad_norm_(opt, 0.1)
    except (NotImplementedError, RuntimeError, ValueError):
        return  # refusing, as torch does, is fine
    assert float(norm) == pytest.approx(true_norm, rel=1e-5)
    assert float(emb.weight.grad.to_dense().norm()) == pytest.approx(0.1, rel=1e-4)


# ================================================================ 3. beyond torch: the rule


class Probe:
    """One parameter whose scaled gradient is exactly c * scale (power-of-two scales)."""

    def __init__(self, device, kind="sgd"):
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 0.25, 2.0, -0.125], device=device))
        self.opt = torch.optim.SGD([self.w], lr=0.01) if kind == "sgd" else \
            torch.optim.AdamW([self.w], lr=0.01, fused=True)
        self.device = device

    def step(self, s, c, overflow=False):
        self.opt.zero_grad()
        c = torch.tensor(c, dtype=torch.float32, device=self.device)
        s.scale((self.w * c).sum()).backward()
        if overflow:
            self.w.grad[1] = INF
        before = self.w.detach().clone()
        ret = s.step(self.opt)
        s.update()
        moved = not torch.equal(before, self.w.detach())
        return ret, moved


def test_hysteresis_counts_overflows_since_last_growth(device):
    s = GradScaler(device, init_scale=1024.0, growth_interval=3, hysteresis=3)
    probe = Probe(device)
    events = "OOOOCCCOCOCCOCCC"
    expected = [1024, 1024, 512, 256, 256, 256, 512, 512, 512, 512, 512, 512, 256, 256, 256, 512]
    scales = []
    for i, e in enumerate(events):
        ret, moved = probe.step(s, [1.0, 2.0, 3.0, 4.0, 5.0], overflow=(e == "O"))
        assert ret is (e == "C") and moved is (e == "C"), f"event {i} ({e}): every overflow is skipped"
        scales.append(s.get_scale())
    assert scales == expected
    assert s.skipped_steps == events.count("O")
    assert int(s.skipped_steps_tensor) == events.count("O")


def test_min_and_max_scale_bound_the_scale(device):
    s = GradScaler(device, init_scale=8.0, growth_interval=1, min_scale=2.0, max_scale=32.0)
    probe = Probe(device)
    scales = []
    for e in "CCCOOOOOC":
        probe.step(s, [1.0, 1.0, 1.0, 1.0, 1.0], overflow=(e == "O"))
        scales.append(s.get_scale())
    assert scales == [16, 32, 32, 16, 8, 4, 2, 2, 4]
    s = GradScaler(device, init_scale=8.0, growth_factor=3.0, growth_interval=1, max_scale=32.0)
    probe = Probe(device)
    for _ in range(3):
        probe.step(s, [1.0] * 5)
    assert s.get_scale() == 32.0


def _predictive_target(amax, margin, extra, fmt_max=65504.0):
    e = math.frexp(fmt_max / amax)[1] - 1  # floor(log2), exact
    return 2.0 ** (e - margin - extra)


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_predictive_mode_sets_power_of_two_from_amax_history(device, kind):
    s = GradScaler(device, init_scale=2.0**16, growth_interval=3, mode="predictive", margin=4, history=4)
    assert s.mode == "predictive"
    probe = Probe(device, kind)
    big = [0.5, -3.0, 1.25, 0.1, 2.0]  # amax 3.0
    small = [0.01, -0.004, 0.0025, 0.001, 0.003]  # amax 0.01
    amax_big = 3.0
    amax_small = float(torch.tensor(0.01, dtype=torch.float32))
    hi, lo = _predictive_target(amax_big, 4, 0), _predictive_target(amax_small, 4, 0)
    assert (hi, lo) == (2.0**10, 2.0**18)
    plan = [  # (c, overflow, expected scale after update, stepped)
        (big, False, hi, True),
        (small, False, hi, True),
        (small, False, hi, True),  # tracker reaches 3: extra margin stays 0
        (small, False, hi, True),
        (small, False, lo, True),  # the 3.0 left the 4-entry history
        (small, True, lo / 2, False),  # real overflow: back off, skip, extra margin 1
        (small, False, _predictive_target(amax_small, 4, 1), True),
        (small, False, _predictive_target(amax_small, 4, 1), True),
        (small, False, lo, True),  # growth_interval clean steps: extra margin back to 0
    ]
    for i, (c, overflow, want, stepped) in enumerate(plan):
        ret, moved = probe.step(s, c, overflow)
        assert bool(ret) is stepped and moved is stepped, i
        assert s.get_scale() == want, f"step {i}: {s.get_scale()} != {want}"
    assert s.skipped_steps == 1


def test_predictive_respects_bounds():
    s = GradScaler("cpu", init_scale=2.0**16, mode="predictive", margin=4, history=2, max_scale=2.0**12,
                   min_scale=2.0**5)
    probe = Probe("cpu")
    probe.step(s, [0.01, 0.0, 0.0, 0.0, 0.001])
    assert s.get_scale() == 2.0**12
    probe.step(s, [3000.0, 1.0, 1.0, 1.0, 1.0])  # target 2^(4-4) = 1 -> min
    assert s.get_scale() == 2.0**5


def test_step_return_values(device):
    for kind in ("sgd", "adamw_fused"):
        probe = Probe(device, kind)
        s = GradScaler(device, init_scale=4.0)
        rets = [probe.step(s, [1.0, 2.0, 3.0, 4.0, 5.0], overflow=o)[0] for o in (False, True, False)]
        if kind == "sgd":
            assert all(type(r) is bool for r in rets)
            assert rets == [True, False, True]
        else:
            for r, want in zip(rets, (True, False, True)):
                assert isinstance(r, torch.Tensor) and r.dim() == 0 and r.dtype == torch.bool
                assert r.device.type == torch.device(device).type
                assert bool(r) is want
        assert s.skipped_steps == 1


# ================================================================== native update vs oracles


FACTORS = [(2.0, 0.5), (1.7, 0.3), (3.0, 0.25), (1.0001, 0.9999), (65536.0, 2.0**-20), (1.1, 0.7)]
START_SCALES = [2.0**16, 3.0e38, 1.0e-38, 1.0, 0.1, 1.4e-45]


@pytest.mark.parametrize("gf,bf", FACTORS)
def test_update_scale_op_matches_torch_amp_update_scale(device, gf, bf):
    rng = random.Random(int(gf * 1000) ^ int(bf * 1000))
    for start in START_SCALES:
        interval = rng.choice([1, 2, 3, 7])
        sa = torch.tensor([start], device=device)
        sb = sa.clone()
        ga = torch.zeros(1, dtype=torch.int32, device=device)
        gb = ga.clone()
        inv = torch.zeros(1, device=device)
        values = []
        for step in range(120):
            f = rng.choice([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, NAN]) if step % 40 < 30 else 0.0
            found = torch.tensor([f], device=device)
            adaptive_amp.update_scale_(sa, ga, found, gf, bf, interval, inv_scale=inv)
            torch._amp_update_scale_(sb, gb, found, gf, bf, interval)
            assert_bitwise_equal(sa, sb, f"start={start} step={step}")
            assert int(ga) == int(gb), f"start={start} step={step}"
            assert_bitwise_equal(inv, sb.double().reciprocal().float())
            values.append(float(sa))
        assert len(set(values)) > 2 or start == 1.4e-45, "the sequence must move the scale"


def test_update_scale_op_growth_only_to_finite_values(device):
    for gf, grows in ((2.0, False), (1.5, False), (1.1, True)):
        s = torch.tensor([3.0e38], device=device)
        g = torch.zeros(1, dtype=torch.int32, device=device)
        t_s, t_g = s.clone(), g.clone()
        found = torch.zeros(1, device=device)
        adaptive_amp.update_scale_(s, g, found, gf, 0.5, 1)
        torch._amp_update_scale_(t_s, t_g, found, gf, 0.5, 1)
        assert_bitwise_equal(s, t_s)
        assert torch.equal(g, t_g) and int(g) == 0
        assert math.isfinite(float(s))
        assert (float(s) != float(torch.tensor(3.0e38))) is grows


@pytest.mark.parametrize("seed", range(6))
def test_update_scale_op_matches_reference_with_extensions(device, seed):
    rng = random.Random(seed)
    predictive = seed % 2 == 1
    hysteresis = rng.choice([1, 2, 3, 5])
    min_scale = rng.choice([0.0, 1.0, 0.25, 128.0])
    max_scale = rng.choice([None, 2.0**20, 2.0**24, 3.0e38])
    gf, bf = rng.choice(FACTORS)
    interval = rng.choice([1, 2, 4, 9])
    margin = rng.choice([0, 2, 4])
    fmt_max = rng.choice([65504.0, 448.0, 57344.0])
    history = rng.choice([1, 3, 8])
    start = rng.choice([2.0**16, 1000.0, 7.0])

    def state():
        return dict(
            scale=torch.tensor([start], device=device),
            growth_tracker=torch.zeros(1, dtype=torch.int32, device=device),
            counters=torch.tensor([hysteresis, 0, 0, 0], dtype=torch.int32, device=device),
            amax_history=torch.zeros(history, device=device) if predictive else None,
            inv_scale=torch.zeros(1, device=device),
        )

    a, b = state(), state()
    amaxes = [0.0, INF, NAN, 1e-45, 3.0e-8, 1e-3, 0.37, 1.0, 5.5, 100.0, 7.0e4, 3.0e38]
    for step in range(300):
        f = 1.0 if rng.random() < 0.25 else 0.0
        found = torch.tensor([f], device=device)
        step_amax = torch.tensor([rng.choice(amaxes) * rng.uniform(0.5, 2.0)], device=device) if predictive else None
        kw = dict(hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale, margin=margin, fmt_max=fmt_max)
        adaptive_amp.update_scale_(a["scale"], a["growth_tracker"], found, gf, bf, interval,
                                   counters=a["counters"], step_amax=step_amax, amax_history=a["amax_history"],
                                   inv_scale=a["inv_scale"], **kw)
        reference.update_scale_(b["scale"], b["growth_tracker"], found, gf, bf, interval,
                                counters=b["counters"], step_amax=step_amax, amax_history=b["amax_history"],
                                inv_scale=b["inv_scale"], **kw)
        where = f"seed={seed} step={step}"
        assert_bitwise_equal(a["scale"], b["scale"], where)
        assert_bitwise_equal(a["inv_scale"], b["inv_scale"], where)
        assert torch.equal(a["growth_tracker"], b["growth_tracker"]), where
        assert torch.equal(a["counters"], b["counters"]), where
        if predictive:
            assert_bitwise_equal(a["amax_history"], b["amax_history"], where)
    assert int(a["counters"][1]) > 10, "skipped steps are counted"


@pytest.mark.parametrize("interval", [0, -3, 2**31 - 1])
def test_update_scale_op_takes_any_growth_interval_like_torch(device, interval):
    """torch._amp_update_scale_ grows when the clean-step count equals growth_interval: 0 or a negative
    value never grows (GradScaler maps intervals beyond int32 to 0)."""
    s, t_s = torch.tensor([8.0], device=device), torch.tensor([8.0], device=device)
    g, t_g = torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    for found in (0.0, 0.0, 1.0, 0.0, 0.0, 0.0):
        f = torch.tensor([found], device=device)
        adaptive_amp.update_scale_(s, g, f, 2.0, 0.5, interval)
        torch._amp_update_scale_(t_s, t_g, f, 2.0, 0.5, interval)
        assert_bitwise_equal(s, t_s)
        assert torch.equal(g, t_g)
    assert float(s) == 4.0


def test_update_scale_op_argument_errors():
    s = torch.tensor([4.0])
    g = torch.zeros(1, dtype=torch.int32)
    f = torch.zeros(1)
    with pytest.raises(ValueError):
        adaptive_amp.update_scale_(s, g, f, 2.0, 0.5, 1, hysteresis=2)  # needs counters
    with pytest.raises(Exception):
        adaptive_amp.update_scale_(s, g, f, 1.0, 0.5, 1)
    with pytest.raises(Exception):
        adaptive_amp.update_scale_(s, g, f, 2.0, 1.0, 1)
    assert float(s) == 4.0 and int(g) == 0, "nothing written on error"


# ============================================================== adaptive_amp-only corner cases


_HALF_AFTER_FIRST_STEP = textwrap.dedent("""
    import torch
    from adaptive_amp import GradScaler
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    s.scale(m(torch.ones(2, 4)).sum()).backward(); s.step(o); s.update(); o.zero_grad()
    m.half()
    s.scale(m(torch.ones(2, 4).half()).float().sum()).backward()
    try:
        s.step(o)
    except ValueError as exc:
        assert str(exc) == "Attempting to unscale FP16 gradients.", exc
        print("OK")
""")


def _one_sgd_step_then():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 3)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    s.scale(m(torch.ones(2, 4)).sum()).backward()
    s.step(o)
    s.update()
    o.zero_grad()
    return m, o, s


def test_model_half_after_first_step_is_refused_like_torch():
    """torch raises 'Attempting to unscale FP16 gradients.'; a subprocess, since ours corrupts memory."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _HALF_AFTER_FIRST_STEP], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", (proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_parameter_resized_after_first_step_is_fully_unscaled():
    m, o, s = _one_sgd_step_then()
    with torch.no_grad():
        m.weight.data = torch.randn(300, 4)
        m.bias.data = torch.randn(300)
    s.scale(m(torch.ones(2, 4)).sum()).backward()
    assert torch.equal(m.weight.grad, torch.full((300, 4), 8.0))
    s.unscale_(o)
    assert torch.equal(m.weight.grad, torch.full((300, 4), 2.0)), m.weight.grad.unique()


def test_parameter_replaced_in_param_group_is_unscaled():
    m, o, s = _one_sgd_step_then()
    newp = torch.nn.Parameter(torch.randn(3, 4))
    o.param_groups[0]["params"][0] = newp
    s.scale((newp * torch.full((3, 4), 1.5)).sum() + m.bias.sum()).backward()
    s.unscale_(o)
    assert torch.equal(newp.grad, torch.full((3, 4), 1.5)), newp.grad


# ======================================================================== 4. CUDA graphs


@cuda_test
def test_cuda_graph_whole_step_matches_eager():
    dev = torch.device("cuda")
    warm, steps = 3, 14
    inf_at = {4, 9}
    data = [m[0] for m in batches(warm + steps, seed=16, device=dev)]
    for i in inf_at:
        x, y = data[warm + i]
        x = x.clone()
        x[0, 0] = INF
        data[warm + i] = (x, y)

    def build():
        model = make_mlp(0, dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
        s = GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
        return model, opt, s

    def one_step(model, opt, s, x, y):
        loss = F.mse_loss(model(x), y)
        s.scale(loss).backward()
        ret = s.step(opt)
        s.update()
        return ret

    # Eager.
    me, oe, se = build()
    eager_scales, eager_rets = [], []
    for i, (x, y) in enumerate(data):
        oe.zero_grad(set_to_none=True)
        r = one_step(me, oe, se, x, y)
        if i >= warm:
            eager_scales.append(se.get_scale())
            eager_rets.append(bool(r))
    assert_interesting_trajectory(eager_scales, 2.0**10)

    # Captured: warm up on a side stream, then capture the whole step and replay.
    mg, og, sg = build()
    static_x = data[0][0].clone()
    static_y = data[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warm):
            og.zero_grad(set_to_none=True)
            static_x.copy_(data[i][0])
            static_y.copy_(data[i][1])
            one_step(mg, og, sg, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    og.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_ret = one_step(mg, og, sg, static_x, static_y)
    graph_scales, graph_rets = [], []
    for i in range(steps):
        static_x.copy_(data[warm + i][0])
        static_y.copy_(data[warm + i][1])
        graph.replay()
        graph_scales.append(sg.get_scale())
        graph_rets.append(bool(static_ret))
    torch.cuda.synchronize()
    assert graph_scales == eager_scales
    assert graph_rets == eager_rets
    assert [i for i, r in enumerate(graph_rets) if not r] == sorted(inf_at)
    assert sg.skipped_steps == se.skipped_steps == len(inf_at)
    for a, b in zip(params_of(mg), params_of(me)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(params_of(mg), params_of(make_mlp(0, dev)))) > 0


# ========================================================================= 5. distributed

_WORKER = r'''
import os, sys, traceback
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datetime import timedelta
from adaptive_amp import GradScaler
from adaptive_amp.bench._dist_exit import finish

rank, init_file, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

def skip_sync():
    # (a) no DDP: each rank its own data; an inf in rank 1's gradients only.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    s = GradScaler("cpu", init_scale=2.0**10, growth_interval=3, process_group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(100 + rank)
    scales, rets, moved, found = [], [], [], []
    for i in range(10):
        opt.zero_grad()
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        s.scale(F.mse_loss(model(x), y)).backward()
        if rank == 1 and i in (3, 7):
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        rets.append(s.step(opt))
        s.update()
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
        scales.append(s.get_scale())
        found.append(float(s.found_inf))
    return {"scales": scales, "rets": rets, "moved": moved, "found": found}

def ddp_run():
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    s = GradScaler("cpu", init_scale=2.0**10, growth_interval=4, process_group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(123)
    scales, rets = [], []
    for i in range(20):
        X, Y = torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)
        if i == 6:
            X[12, 3] = float("inf")  # in rank 1's half
        x, y = X[rank * 8:(rank + 1) * 8], Y[rank * 8:(rank + 1) * 8]
        opt.zero_grad()
        s.scale(F.mse_loss(model(x), y)).backward()
        rets.append(s.step(opt))
        s.update()
        scales.append(s.get_scale())
    return {"scales": scales, "rets": rets, "params": [p.detach().clone() for p in model.module.parameters()]}

try:
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2,
                            timeout=timedelta(seconds=45))
    result = {"skip_sync": skip_sync(), "ddp": ddp_run()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
except BaseException:
    traceback.print_exc()
    sys.exit(1)
finish(0)  # barrier, destroy_process_group, no interpreter shutdown: gloo's workers can abort it (see there)
'''


def _single_process_ddp_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    s = GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    gen = torch.Generator().manual_seed(123)
    scales, rets = [], []
    for i in range(20):
        X, Y = torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)
        if i == 6:
            X[12, 3] = INF
        opt.zero_grad()
        s.scale(F.mse_loss(model(X), Y)).backward()
        rets.append(s.step(opt))
        s.update()
        scales.append(s.get_scale())
    return {"scales": scales, "rets": rets, "params": params_of(model)}


_dist_ok = torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run the 2-process gloo worker once; both distributed tests read its results."""
    if not _dist_ok:
        pytest.skip("torch.distributed with gloo is not available")
    tmp = tmp_path_factory.mktemp("dist")
    worker = tmp / "worker.py"
    worker.write_text(_WORKER)
    init_file = tmp / "init"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(init_file), str(tmp)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            err = "TIMEOUT after 60 s\n" + err
        logs.append((p.returncode, out, err[-3000:]))
    results = []
    for r in range(2):
        path = tmp / f"rank{r}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return {"logs": logs, "results": results}


def _check_ranks(two_ranks):
    assert all(rc == 0 for rc, _, _ in two_ranks["logs"]), two_ranks["logs"]
    assert all(r is not None for r in two_ranks["results"]), two_ranks["logs"]
    return two_ranks["results"]


@pytest.mark.skipif(not _dist_ok, reason="torch.distributed with gloo is not available")
def test_process_group_makes_all_ranks_skip_together(two_ranks):
    r0, r1 = (r["skip_sync"] for r in _check_ranks(two_ranks))
    assert r0["scales"] == r1["scales"]
    assert r0["rets"] == r1["rets"]
    skipped = [i for i, r in enumerate(r0["rets"]) if r is False]
    assert skipped == [3, 7], r0["rets"]
    # Rank 0's gradients were finite, yet it skipped: found_inf came over the group.
    assert r0["moved"] == [i not in (3, 7) for i in range(10)]
    assert [f != 0 for f in r0["found"]] == [i in (3, 7) for i in range(10)]
    assert r0["scales"][3] == r0["scales"][2] / 2 and r0["scales"][7] == r0["scales"][6] / 2
    assert max(r0["scales"]) > 2.0**10


@pytest.mark.skipif(not _dist_ok, reason="torch.distributed with gloo is not available")
def test_ddp_run_matches_single_process(two_ranks):
    r0, r1 = (r["ddp"] for r in _check_ranks(two_ranks))
    ref = _single_process_ddp_reference()
    assert r0["scales"] == r1["scales"] == ref["scales"]
    assert r0["rets"] == r1["rets"] == ref["rets"]
    assert ref["rets"][6] is False and sum(r is False for r in ref["rets"]) == 1
    assert_params_equal(r0["params"], r1["params"], "rank0 vs rank1")
    for a, b in zip(r0["params"], ref["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    assert max(float((a - b).abs().max()) for a, b in zip(ref["params"], params_of(init))) > 1e-3


# ============================================================== robustness and fidelity
# Each of these failed before its fix.


def _sgd_pair_run(scaler_a, scaler_b, steps, dtype=torch.float32, model_fn=None, before_step=None, seed=0,
                  after_update=None):
    """The same steps under two scalers; returns (params_a, params_b, scales_a, scales_b)."""
    out = []
    for scaler in (scaler_a, scaler_b):
        torch.manual_seed(seed)
        model = (model_fn or (lambda: make_mlp(seed, dtype=dtype)))()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(seed + 1)
        scales = []
        for i in range(steps):
            x = torch.randn(8, 16, generator=gen).to(dtype)
            y = torch.randn(8, 4, generator=gen).to(dtype)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if before_step is not None:
                before_step(i, scaler, model, opt)
            scaler.step(opt)
            scaler.update()
            if after_update is not None:
                after_update(i, scaler)
            scales.append(scaler.get_scale())
        out.append((params_of(model), scales))
    (pa, sa), (pb, sb) = out
    return pa, pb, sa, sb


# ---- plans must not keep optimizers (and their parameters) alive


def test_plan_cache_does_not_keep_dead_optimizers_alive():
    import gc
    import weakref

    s = GradScaler("cpu", init_scale=4.0)
    refs = []
    for k in range(12):
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s.scale(model(torch.ones(2, 8)).sum()).backward()
        s.step(opt)
        s.update()
        refs.append([weakref.ref(opt)] + [weakref.ref(p) for p in model.parameters()])
        del model, opt
    gc.collect()
    alive = sum(r() is not None for group in refs for r in group)
    assert alive == 0, f"{alive} optimizers/parameters of dead optimizers are still alive"
    assert len(s._plans) == 0


def test_new_optimizer_reusing_a_dead_ones_id_gets_its_own_plan():
    """CPython reuses ids of freed objects: a new optimizer with a dead one's id must never use its plan."""
    s = GradScaler("cpu", init_scale=8.0)
    seen_ids = set()
    reused = 0
    for k in range(40):
        w = torch.nn.Parameter(torch.full((k % 5 + 1,), float(k + 1)))
        opt = torch.optim.SGD([w], lr=0.0)
        reused += id(opt) in seen_ids
        seen_ids.add(id(opt))
        s.scale((w * w).sum()).backward()
        expected = (2 * w.detach() * 8.0) / 8.0
        s.unscale_(opt)
        assert torch.equal(w.grad, expected), k
        s.step(opt)
        s.update()
        del opt, w
    assert reused > 0, "no id was reused: the test proved nothing (CPython normally reuses them)"


# ---- a NaN scale stays NaN (torch skips every step), clamps do not eat it


@pytest.mark.parametrize("how", ["init_scale", "new_scale", "new_scale_tensor"])
@pytest.mark.parametrize("bounds", [{}, {"min_scale": 1.0, "max_scale": 2.0**20}])
def test_nan_scale_stays_nan_and_skips_like_torch(how, bounds):
    def make(cls, **kw):
        return cls("cpu", init_scale=NAN if how == "init_scale" else 2.0**8, growth_interval=2, **kw)

    def poke(i, scaler):  # at the end of an iteration, where torch documents update(new_scale)
        if i == 0 and how == "new_scale":
            scaler.update(new_scale=NAN)
        if i == 0 and how == "new_scale_tensor":
            scaler.update(new_scale=torch.tensor(NAN))

    ours, theirs = make(GradScaler, **bounds), make(TorchScaler)
    pa, pb, sa, sb = _sgd_pair_run(ours, theirs, 6, after_update=poke)
    first_nan = 0
    assert all(math.isnan(v) for v in sa[first_nan:]), sa
    assert all(math.isnan(v) for v in sb[first_nan:]), sb
    assert_params_equal(pa, pb, "NaN scale")
    assert all(torch.isfinite(p).all() for p in pa), "a NaN scale turned gradients into NaN without a skip"
    assert ours.skipped_steps == (6 if how == "init_scale" else 5)


def test_nan_scale_backoff_in_the_native_rule_and_its_twin():
    for ref in (False, True):
        fn = reference.update_scale_ if ref else adaptive_amp.update_scale_
        s = torch.tensor([NAN])
        g = torch.zeros(1, dtype=torch.int32)
        c = torch.tensor([1, 0, 0, 0], dtype=torch.int32)
        inv = torch.zeros(1)
        fn(s, g, torch.ones(1), 2.0, 0.5, 3, counters=c, min_scale=1.0, max_scale=8.0, inv_scale=inv)
        assert math.isnan(float(s)) and math.isnan(float(inv)), f"reference={ref}"
        fn(s, g, torch.zeros(1), 2.0, 0.5, 1, counters=c, min_scale=1.0, max_scale=8.0, inv_scale=inv)
        assert math.isnan(float(s)), "growth of NaN is not finite: no growth, as torch"


# ---- clip_grad_norm_ never returns a stale norm


def _torch_norm(model, norm_type=2.0):
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()], norm_type)


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_clip_twice_returns_the_current_norm(norm_type):
    model = make_mlp(3)
    opt = make_opt("sgd", model.parameters())
    s = GradScaler("cpu", init_scale=2.0**10)
    s.scale(F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)) * 50).backward()
    first = s.clip_grad_norm_(opt, 0.5, norm_type)
    expected_second = _torch_norm(model, norm_type)
    assert float(expected_second) < float(first) - 1e-3, "the first clip must have clipped"
    second = s.clip_grad_norm_(opt, 0.5, norm_type)
    torch.testing.assert_close(second, expected_second, rtol=1e-6, atol=0)


@pytest.mark.parametrize("edit", ["mul_", "replace", "zero_"])
def test_clip_after_gradients_edited_since_unscale(edit):
    model = make_mlp(4)
    opt = make_opt("sgd", model.parameters())
    s = GradScaler("cpu", init_scale=2.0**10)
    s.scale(F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4))).backward()
    s.unscale_(opt)
    p = list(model.parameters())[2]
    if edit == "mul_":
        p.grad.mul_(7.0)
    elif edit == "replace":
        p.grad = p.grad * 7.0
    else:
        p.grad.zero_()
    expected = _torch_norm(model)
    got = s.clip_grad_norm_(opt, 1e9)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_clip_reuses_the_unscale_pass_only_while_gradients_are_unchanged(monkeypatch):
    """unscale_ then clip, step after step: from the second step on the norm comes from the unscale pass
    (no second read), and is right; an edit in between is still seen."""
    model = make_mlp(5)
    opt = make_opt("sgd", model.parameters())
    s = GradScaler("cpu", init_scale=2.0**10)
    remeasured = []
    orig = s._measure_again
    monkeypatch.setattr(s, "_measure_again", lambda *a, **k: remeasured.append(1) or orig(*a, **k))
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        opt.zero_grad()
        s.scale(F.mse_loss(model(torch.randn(8, 16, generator=gen)), torch.randn(8, 4, generator=gen))).backward()
        s.unscale_(opt)
        if i == 3:
            list(model.parameters())[0].grad.add_(1.0)
        expected = _torch_norm(model)
        torch.testing.assert_close(s.clip_grad_norm_(opt, 1e9), expected, rtol=1e-6, atol=0)
        s.step(opt)
        s.update()
    assert remeasured == [1, 1], "measured again on the first step (no snapshot yet) and after the edit only"


def test_clip_twice_with_a_fused_optimizer_matches_torchs_recipe():
    """Folded coefficients compose: the second norm is the norm after the first clip, as torch's."""
    (m1, o1), (m2, o2) = pair("adamw_fused")
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    ours, theirs = GradScaler("cpu", init_scale=2.0**10), TorchScaler("cpu", init_scale=2.0**10)
    ours.scale(F.mse_loss(m1(x), y) * 50).backward()
    theirs.scale(F.mse_loss(m2(x), y) * 50).backward()
    a1, a2 = ours.clip_grad_norm_(o1, 0.5), ours.clip_grad_norm_(o1, 0.2)
    theirs.unscale_(o2)
    b1 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.5)
    b2 = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.2)
    torch.testing.assert_close(a1, b1, rtol=1e-6, atol=0)
    torch.testing.assert_close(a2, b2, rtol=1e-5, atol=0)
    ours.step(o1)
    theirs.step(o2)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


class _HookedScaler(GradScaler):
    """A subclass overriding torch's private unscale hook (unscale_ then goes through it)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


@pytest.mark.parametrize("then", ["unscale_", "clip_l1"])
@pytest.mark.parametrize("scaler_type", [GradScaler, _HookedScaler])
def test_unscale_after_a_folded_clip_applies_the_clip_like_torchs_recipe(scaler_type, then):
    """With a fused optimizer the clip coefficient waits for the step; an unscale_ between the clip and the
    step (the user's, or a clip by a norm the statistics do not give) must apply it to the gradients it
    unscales (it was dropped: the step ran unclipped). torch's recipe for the same steps: unscale_,
    clip_grad_norm_ (twice for clip_l1), step."""
    (m1, o1), (m2, o2) = pair("adamw_fused", opt_extra={"eps": 1e-2})  # a large eps makes Adam feel the clip
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)), torch.randn(8, 4)
    ours, theirs = scaler_type("cpu", init_scale=2.0**10), TorchScaler("cpu", init_scale=2.0**10)
    ours.scale(F.mse_loss(m1(x), y) * 50).backward()
    theirs.scale(F.mse_loss(m2(x), y) * 50).backward()
    a = ours.clip_grad_norm_(o1, 0.05)
    theirs.unscale_(o2)
    b = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.05)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert float(b) > 4 * 0.05, "the test must actually clip"
    if then == "unscale_":
        ours.unscale_(o1)
    else:
        a = ours.clip_grad_norm_(o1, 0.01, norm_type=1.0)
        b = torch.nn.utils.clip_grad_norm_(m2.parameters(), 0.01, norm_type=1.0)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    for p, q in zip(m1.parameters(), m2.parameters()):  # the gradients the user sees are torch's
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9)
    ours.step(o1)
    theirs.step(o2)
    ours.update()
    theirs.update()
    assert ours.get_scale() == theirs.get_scale()
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="already been called"):  # as torch: one unscale_ per step
        ours.clip_grad_norm_(o1, 0.05)
        ours.unscale_(o1)
        ours.unscale_(o1)


# ---- fmt_max and the native update cannot hang


@pytest.mark.parametrize("fmt_max", [INF, -INF, NAN, 1e39, 0.0, -1.0, 1e-50])
def test_predictive_fmt_max_is_validated_at_construction(fmt_max):
    with pytest.raises(ValueError, match="fmt_max"):
        GradScaler("cpu", mode="predictive", fmt_max=fmt_max)


_HANG_PRONE = textwrap.dedent("""
    import sys, torch, adaptive_amp
    from adaptive_amp import reference
    torch.set_default_device(sys.argv[1])
    s = torch.tensor([8.0]); g = torch.zeros(1, dtype=torch.int32); f = torch.zeros(1)
    for fmt in (float("inf"), 1e39):
        try:
            adaptive_amp.update_scale_(s, g, f, 2.0, 0.5, 5, counters=torch.tensor([1, 0, 0, 0], dtype=torch.int32),
                                       step_amax=torch.tensor([1.0]), amax_history=torch.zeros(4), fmt_max=fmt)
        except ValueError as exc:
            assert "fmt_max" in str(exc), exc
        else:
            raise AssertionError("fmt_max=%r accepted" % fmt)
    # Hostile device-side state: an inf in the history, a huge margin, a ring position out of range.
    for hist, margin, pos in (([float("inf"), 2.0], 4, 0), ([0.5, 0.0], -2**31, 1), ([1.0, 3.0], 2**31 - 1, 0),
                              ([1.0, 3.0], 0, 7), ([1.0, 3.0], 0, -3)):
        out = []
        for fn in (adaptive_amp.update_scale_, reference.update_scale_):
            s = torch.tensor([8.0]); g = torch.zeros(1, dtype=torch.int32)
            c = torch.tensor([1, 0, pos, 0], dtype=torch.int32); h = torch.tensor(hist)
            fn(s, g, torch.zeros(1), 2.0, 0.5, 5, counters=c, step_amax=torch.tensor([0.25]), amax_history=h,
               margin=margin)
            out.append((s.item(), c.tolist(), h.tolist()))
        assert out[0] == out[1], (hist, margin, pos, out)
    print("OK")
""")


def test_native_update_cannot_hang_or_write_out_of_range(device):
    """fmt_max beyond float32 looped forever; an inf in the history too; a bad ring position wrote out of
    bounds. Run in a subprocess with a timeout, so a regression fails instead of hanging the suite."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _HANG_PRONE, device], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-2000:]


# ---- constructor arguments checked (and bounds applied) at construction


@pytest.mark.parametrize("growth_interval", [0, -3, 2**31, sys.maxsize])
def test_never_growing_intervals_are_accepted_like_torch(growth_interval):
    ours = GradScaler("cpu", init_scale=2.0**8, growth_interval=growth_interval)
    theirs = TorchScaler("cpu", init_scale=2.0**8, growth_interval=growth_interval)

    def overflow(i, scaler, model, opt):
        if i == 4:
            next(model.parameters()).grad.view(-1)[0] = INF

    pa, pb, sa, sb = _sgd_pair_run(ours, theirs, 8, before_step=overflow)
    assert sa == sb == [2.0**8] * 4 + [2.0**7] * 4
    assert_params_equal(pa, pb)
    assert ours._get_growth_tracker() == theirs._get_growth_tracker()
    s = GradScaler("cpu", init_scale=2.0**8)
    s.set_growth_interval(growth_interval)  # the setter too, not only the constructor
    _sgd_pair_run(s, GradScaler("cpu"), 2)


BAD_CONSTRUCTOR_ARGS = [
    ({"min_scale": NAN}, ValueError, "min_scale"), ({"min_scale": INF}, ValueError, "min_scale"),
    ({"min_scale": -1.0}, ValueError, "min_scale"), ({"min_scale": 1e39}, ValueError, "min_scale"),
    ({"min_scale": "1"}, TypeError, "min_scale"),
    ({"max_scale": NAN}, ValueError, "max_scale"), ({"max_scale": INF}, ValueError, "max_scale"),
    ({"max_scale": 0.0}, ValueError, "max_scale"), ({"max_scale": 1e-50}, ValueError, "max_scale"),
    ({"max_scale": -2.0}, ValueError, "max_scale"),
    ({"growth_interval": 2.5}, TypeError, "growth_interval"), ({"growth_interval": "10"}, TypeError, "growth_interval"),
    ({"growth_factor": NAN}, ValueError, "growth_factor"),
    ({"backoff_factor": 0.0}, ValueError, "backoff_factor"), ({"backoff_factor": -0.5}, ValueError, "backoff_factor"),
    ({"backoff_factor": NAN}, ValueError, "backoff_factor"),
    ({"init_scale": "big"}, TypeError, "init_scale"),
    ({"hysteresis": 2**31}, ValueError, "hysteresis"), ({"hysteresis": 1.5}, TypeError, "hysteresis"),
    ({"margin": 2**40}, ValueError, "margin"), ({"history": True}, TypeError, "history"),
    ({"fmt_max": "65504"}, TypeError, "fmt_max"),
]


@pytest.mark.parametrize("kw,exc,name", BAD_CONSTRUCTOR_ARGS, ids=[repr(k) for k, _, _ in BAD_CONSTRUCTOR_ARGS])
def test_bad_constructor_arguments_fail_at_construction(kw, exc, name):
    with pytest.raises(exc, match=name):
        GradScaler("cpu", **kw)


@pytest.mark.parametrize("setter,value", [("set_growth_factor", 0.5), ("set_growth_factor", NAN),
                                          ("set_backoff_factor", 0.0), ("set_backoff_factor", 1.5),
                                          ("set_growth_interval", 3.0)])
def test_bad_setter_values_fail_at_the_setter(setter, value):
    s = GradScaler("cpu")
    before = (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval())
    with pytest.raises((ValueError, TypeError)):
        getattr(s, setter)(value)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == before


def test_bounds_apply_to_init_scale_at_construction():
    s = GradScaler("cpu", init_scale=2.0**16, max_scale=2.0**10)
    assert s.get_scale() == 2.0**10
    assert torch.equal(s.scale(torch.tensor(1.0)), torch.tensor(2.0**10))
    s = GradScaler("cpu", init_scale=1.0, min_scale=2.0**4)
    assert s.get_scale() == 2.0**4
    assert s.state_dict()["scale"] == 2.0**4
    assert GradScaler("cpu", init_scale=3.0, min_scale=1.0, max_scale=8.0).get_scale() == 3.0
    assert math.isnan(GradScaler("cpu", init_scale=NAN, min_scale=1.0).get_scale())


def test_growth_factor_inf_is_accepted_like_torch():
    """torch accepts growth_factor=inf (the grown scale is never finite: no growth)."""
    ours = GradScaler("cpu", init_scale=2.0**8, growth_factor=INF, growth_interval=1)
    theirs = TorchScaler("cpu", init_scale=2.0**8, growth_factor=INF, growth_interval=1)
    pa, pb, sa, sb = _sgd_pair_run(ours, theirs, 4)
    assert sa == sb == [2.0**8] * 4
    assert_params_equal(pa, pb)


# ---- float64 gradients work as in torch's scaler; errors name the parameter


def _f64_head_model():
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body
            self.head = torch.nn.Linear(16, 4).double()

        def forward(self, x):
            return self.head(self.body(x.float()).double()).to(x.dtype)

    return Net()


@pytest.mark.parametrize("which", ["double_model", "float64_head"])
def test_float64_gradients_match_torch(which):
    def poison(i, scaler, model, opt):
        if i in (3, 7):
            list(model.parameters())[-1].grad.view(-1)[0] = INF

    kw = dict(model_fn=_f64_head_model) if which == "float64_head" else dict(dtype=torch.float64)
    ours, theirs = GradScaler("cpu", init_scale=2.0**10, growth_interval=3), \
        TorchScaler("cpu", init_scale=2.0**10, growth_interval=3)
    pa, pb, sa, sb = _sgd_pair_run(ours, theirs, 10, before_step=poison, **kw)
    assert sa == sb
    assert_interesting_trajectory(sa, 2.0**10)
    assert_params_equal(pa, pb, which)
    assert ours.skipped_steps == 2


@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_float64_gradients_clip_and_fused_check(norm_type):
    model = _f64_head_model()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = GradScaler("cpu", init_scale=2.0**6)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    s.scale(F.mse_loss(model(x), y)).backward()
    F.mse_loss(twin(x), y).backward()
    got = s.clip_grad_norm_(opt, 0.05, norm_type)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05, norm_type)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9)
    assert s.step(opt) is True
    s.update()
    # A fused optimizer over float64 parameters: the read-only check and the folded clip.
    fm = torch.nn.Linear(4, 3).double()
    fo = torch.optim.AdamW(fm.parameters(), lr=1e-2, fused=True)
    s.scale(fm(torch.randn(2, 4, dtype=torch.float64)).sum().float()).backward()
    norm = s.clip_grad_norm_(fo, 1e9, norm_type)
    scaled = torch.nn.utils.get_total_norm([p.grad for p in fm.parameters()], norm_type) / s.get_scale()
    torch.testing.assert_close(norm.double(), scaled.double(), rtol=1e-5, atol=0)
    assert bool(s.step(fo))


def test_gradient_dtype_no_scaler_takes_is_refused_naming_the_parameter():
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [extra]}], lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    s.scale(model(torch.ones(1, 3)).sum() + extra.abs().sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['params'\]\[0\]\.grad has dtype torch\.complex64"):
        s.step(opt)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g), "nothing unscaled before refusing"


@pytest.mark.parametrize("frozen", [False, True], ids=["adjacent", "after_a_skipped_one"])
def test_kernel_errors_name_the_parameter_not_a_list_index(frozen):
    """Two parameters sharing one gradient tensor: the overlap is refused with the parameters' names. The
    kernel's list positions count only the gradients found, so a parameter without one between them (frozen)
    must not shift the name."""
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3 if frozen else 2)]
    a, b = params[0], params[-1]
    opt = torch.optim.SGD(params, lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    s.scale((a * 3).sum()).backward()
    b.grad = a.grad
    with pytest.raises(ValueError) as info:
        s.unscale_(opt)
    msg = str(info.value)
    if frozen:
        assert "param_groups[0]['params'][2].grad" in msg and "['params'][1]" not in msg, msg
    else:
        assert "param_groups[0]['params'][1].grad" in msg and "tensors[" not in msg, msg
    assert torch.equal(a.grad, torch.full((4,), 12.0)), "nothing written"


# ---- the native plan with parameters that have no gradient, and with parameters that change dtype


@pytest.fixture
def slow_path_calls(monkeypatch):
    """Names of the parameter groups that went through the per-parameter Python path, one entry per call."""
    calls = []
    collect = GradScaler._collect_slow

    def spy(group, allow_fp16):
        calls.append(list(group.names))
        return collect(group, allow_fp16)

    monkeypatch.setattr(GradScaler, "_collect_slow", staticmethod(spy))
    return calls


class _FineTuneNet(torch.nn.Module):
    """A frozen body (requires_grad=False), an embedding never used (grad None), a branch used on some steps."""

    def __init__(self, dtype=torch.float32, device="cpu"):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(12, 8)
        self.unused = torch.nn.Embedding(6, 8)
        self.body = torch.nn.Linear(8, 16)
        self.branch = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)
        self.body.requires_grad_(False)
        self.to(device=device, dtype=dtype)

    def forward(self, idx, use_branch):
        h = torch.tanh(self.body(self.emb(idx).mean(1)))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def _fine_tune_steps(scaler, model, opt, steps, branch_steps, poison=(), on_step=None):
    gen = torch.Generator().manual_seed(1)
    weight = model.head.weight
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        idx = torch.randint(0, 12, (4, 3), generator=gen).to(weight.device)
        y = torch.randn(4, 4, generator=gen, dtype=weight.dtype).to(weight.device)
        scaler.scale(F.mse_loss(model(idx, i in branch_steps), y)).backward()
        if i in poison:
            model.head.weight.grad.view(-1)[1] = INF
        ret = scaler.step(opt)
        scaler.update()
        if on_step is not None:
            on_step(i, ret)


@pytest.mark.parametrize("kind", ["sgd", "adam_foreach", "adamw_fused"])
def test_frozen_and_unused_parameters_stay_on_the_native_path(kind, device, slow_path_calls):
    """Gradients that are None (frozen, unused, a branch used on steps 3-4 only) are skipped natively.

    Every step is bitwise torch's, and no step takes the per-parameter path:
    before, one missing gradient sent its whole device group there.
    """
    ours_model, torch_model = _FineTuneNet(device=device), _FineTuneNet(device=device)
    ours_opt, torch_opt = make_opt(kind, ours_model.parameters()), make_opt(kind, torch_model.parameters())
    ours = GradScaler(device, init_scale=2.0**10, growth_interval=2)
    theirs = TorchScaler(device, init_scale=2.0**10, growth_interval=2)
    log = {"ours": [], "torch": []}
    _fine_tune_steps(theirs, torch_model, torch_opt, 9, {3, 4}, poison={6},
                     on_step=lambda i, r: log["torch"].append((r, theirs.get_scale(), params_of(torch_model))))
    live = []

    def ours_step(i, r):
        log["ours"].append((r, ours.get_scale(), params_of(ours_model)))
        assert slow_path_calls == [], f"step {i} collected gradients one by one: {slow_path_calls}"
        live.append([g.native.collected_count for g in ours._plan(ours_opt).groups])

    _fine_tune_steps(ours, ours_model, ours_opt, 9, {3, 4}, poison={6}, on_step=ours_step)
    for i, (a, b) in enumerate(zip(log["ours"], log["torch"])):
        assert a[1] == b[1], f"step {i}: scale {a[1]} != torch's {b[1]}"
        assert_params_equal(a[2], b[2], f"step {i}")
    assert ours.skipped_steps == 1
    assert slow_path_calls == []
    # emb, head (2) and, on steps 3-4, branch (2) have gradients; body (2) and unused never do.
    assert live == [[3]] * 3 + [[5]] * 2 + [[3]] * 4


def test_missing_gradients_leave_no_stale_pointer_and_no_replan(slow_path_calls):
    """A gradient dropped between steps is not written through the pointer of the last step that had it."""
    model = _FineTuneNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = GradScaler("cpu", init_scale=4.0)
    kept = {}

    def on_step(i, ret):
        if i == 4:
            kept["grad"] = model.branch.weight.grad
            kept["value"] = model.branch.weight.grad.clone()

    _fine_tune_steps(s, model, opt, 5, {3, 4}, on_step=on_step)
    plan = s._plan(opt)
    _fine_tune_steps(s, model, opt, 2, set(), on_step=None)  # branch.weight.grad is None again
    assert model.branch.weight.grad is None
    assert torch.equal(kept["grad"], kept["value"]), "the plan wrote through a gradient the model dropped"
    assert s._plan(opt) is plan, "a gradient appearing or vanishing is no reason to rebuild the plan"
    assert slow_path_calls == []


@pytest.mark.parametrize("kind,edit", [("sgd", False), ("sgd", True), ("adamw_fused", False)])
def test_last_grad_norm_after_a_clip_is_the_steps_norm_before_clipping(kind, edit):
    """A clip that rewrites the gradients drops its reusable record; last_grad_norm (and predictive mode's
    amax) must still come from the step's measurement before the clip, not vanish (it was None after
    clip_grad_norm_ with a non-fused optimizer). An edit after unscale_ is measured again and counts."""
    model = make_mlp(6)
    opt = make_opt(kind, model.parameters())
    s = GradScaler("cpu", init_scale=2.0**10)
    s.scale(F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)) * 50).backward()
    if edit:
        s.unscale_(opt)
        list(model.parameters())[0].grad.mul_(3.0)
        before = _torch_norm(model)
    else:
        before = _torch_norm(model) / s.get_scale()  # exact: the scale is a power of 2
    torch.testing.assert_close(s.clip_grad_norm_(opt, 0.5), before, rtol=1e-5, atol=0)
    s.clip_grad_norm_(opt, 0.1)  # measures the clipped gradients: not the step's norm
    s.step(opt)
    s.update()
    assert s.last_grad_norm is not None
    torch.testing.assert_close(s.last_grad_norm, before, rtol=1e-5, atol=0)


def test_clip_and_last_norm_skip_missing_gradients():
    model, twin = _FineTuneNet(), _FineTuneNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = GradScaler("cpu", init_scale=2.0**6)
    idx = torch.randint(0, 12, (4, 3), generator=torch.Generator().manual_seed(0))
    y = torch.randn(4, 4)
    s.scale(F.mse_loss(model(idx, False), y)).backward()
    F.mse_loss(twin(idx, False), y).backward()
    got = s.clip_grad_norm_(opt, 0.01)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_no_gradient_at_all_is_refused_like_torch():
    for cls in (TorchScaler, GradScaler):
        model = _FineTuneNet()
        opt = torch.optim.SGD(model.unused.parameters(), lr=0.1)
        s = cls("cpu")
        s.scale(model(torch.zeros(1, 3, dtype=torch.long), False).sum()).backward()
        with pytest.raises(AssertionError, match="No inf checks were recorded"):
            s.step(opt)


def test_float64_model_converted_back_to_float32_returns_to_the_native_path(slow_path_calls):
    """model.double() then model.float(), same optimizer: the plan follows the gradients' dtype both ways."""
    ours_model, torch_model = _FineTuneNet(), _FineTuneNet()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.1)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    theirs = TorchScaler("cpu", init_scale=2.0**10, growth_interval=2)
    calls_at = []
    for phase, dtype in enumerate((torch.float32, torch.float64, torch.float32)):
        ours_model.to(dtype)
        torch_model.to(dtype)
        for scaler, model, opt in ((ours, ours_model, ours_opt), (theirs, torch_model, torch_opt)):
            _fine_tune_steps(scaler, model, opt, 3, {1}, poison={2} if phase == 1 else ())
        assert ours.get_scale() == theirs.get_scale()
        assert_params_equal(params_of(ours_model), params_of(torch_model), f"phase {phase}")
        calls_at.append(len(slow_path_calls))
        assert [g.native is not None for g in ours._plan(ours_opt).groups] == [dtype != torch.float64]
    # float64 goes through torch's kernel, one slow collect per step; back in float32 only the
    # first step collects slowly (and sees the new dtype), the next ones are native again.
    assert calls_at == [0, 3, 4], calls_at
    assert ours.skipped_steps == 1


def test_bench_scaler_on_the_cpu_freezes_the_asked_fraction(tmp_path, capsys):
    """`python -m adaptive_amp bench --device cpu --scaler --scaler-frozen ...`: the fine-tuning measurement runs."""
    from adaptive_amp.bench.cli import main

    out = tmp_path / "calls.json"
    main(["--device", "cpu", "--no-unscale", "--scaler", "--scaler-frozen", "0", "0.3", "--json", str(out)])
    rows = json.loads(out.read_text())["scaler_calls_cpu"]
    assert [(r["frozen"], r["params"], r["frozen_params"]) for r in rows] == [(0.0, 148, 0), (0.3, 148, 44)]
    assert all(r["torch_us"] > 0 and r["ours_us"] > 0 for r in rows)
    assert "unscale_ + step + update" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--no-unscale", "--scaler", "--scaler-frozen", "1.0"])


# =========================================================================== an optimizer without gradients


def _no_grad_step(scaler_cls, make):
    """Two models as in a GAN step: only the second got gradients; both optimizers go through the scaler.
    Returns (what step returned for the idle one as a bool or None, its params unchanged, the scale
    trajectory, the busy model's params)."""
    idle, busy = make_mlp(seed=1), make_mlp(seed=2)
    opt_idle, opt_busy = make(idle.parameters()), make(busy.parameters())
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
    before = [p.detach().clone() for p in idle.parameters()]
    scales = []
    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i))
        scaler.scale(busy(x).square().mean()).backward()
        got = scaler.step(opt_idle)
        scaler.step(opt_busy)
        scaler.update()
        opt_busy.zero_grad()
        scales.append(scaler.get_scale())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, idle.parameters()))
    got = None if got is None else bool(got)
    return got, unchanged, scales, [p.detach().clone() for p in busy.parameters()]


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
                                  lambda ps: adaptive_amp.optim.AdamW(ps, lr=1e-2, stochastic_rounding=False),
                                  lambda ps: adaptive_amp.optim.SGD(ps, lr=1e-2, momentum=0.9)],
                         ids=["torch_fused_adamw", "adaptive_amp_adamw", "adaptive_amp_sgd"])
def test_step_of_a_fused_optimizer_without_gradients_is_a_no_op_as_in_torch(make):
    ours = _no_grad_step(GradScaler, make)
    theirs = _no_grad_step(TorchScaler, make)
    assert ours[1] and theirs[1], "the optimizer without gradients changed nothing"
    assert ours[0] in (None, True)  # (torch returns the optimizer's None; ours says the step was not skipped)
    assert ours[2] == theirs[2]
    for a, b in zip(ours[3], theirs[3]):
        assert_bitwise_equal(a, b)
    # With no gradient anywhere, both refuse the update the same way.
    for cls in (GradScaler, TorchScaler):
        model = make_mlp()
        opt = make(model.parameters())
        scaler = cls("cpu")
        scaler.scale(torch.ones((), requires_grad=True))
        scaler.step(opt)
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            scaler.update()
