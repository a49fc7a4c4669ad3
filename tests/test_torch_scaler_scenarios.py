"""PyTorch's own GradScaler scenarios, run with adaptive_amp.GradScaler.

The scenarios of ``test_grad_scaling_*`` in PyTorch's test/test_torch.py, the
scaler tests of test/test_cuda.py and test_grad_scaling_autocast_fused_optimizers
of test/test_optim.py, written anew for our scaler (not copied): the private
hooks third-party code calls (``_unscale_grads_`` with torch's signature and
result, ``_maybe_opt_step``, ``_check_inf_per_device``, the per-optimizer
state and torch's ``OptState``), ``isinstance`` against ``torch.amp.GradScaler``,
a scale changed by hand, and the training recipes (skipped step, clipping
before and after a separate unscale_, gradient penalty, accumulation, two
models and optimizers, pickling mid-run, foreach and fused optimizers), each
against a control run without scaling. Oracles: the control run, and torch's
own scaler where an exact comparison is possible. CPU in CI; the same
scenarios on CUDA are marked ``cuda``.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch.amp.grad_scaler import OptState as TorchOptState

import adaptive_amp
from adaptive_amp import GradScaler
from conftest import assert_bitwise_equal

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

INF = float("inf")
NAN = float("nan")


# =========================================================================== identity and hooks


def test_is_a_torch_grad_scaler_with_torchs_opt_state():
    s = GradScaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    assert adaptive_amp.scaler.OptState is TorchOptState
    # Disabled instances too (Lightning and accelerate type-check the scaler they get).
    assert isinstance(GradScaler("cpu", enabled=False), torch.amp.GradScaler)


def _tiny(seed=0, device="cpu"):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(device)
    return m, torch.optim.SGD(m.parameters(), lr=0.5)


def _backward(scaler, m, device="cpu", poison=False):
    loss = m(torch.linspace(-1, 1, 12, device=device).reshape(2, 6)).square().sum()
    if poison:
        loss = loss * INF
    scaler.scale(loss).backward()


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, GradScaler])
def test_per_optimizer_state_keys_and_stages_are_torchs(cls):
    """After unscale_ and after step the state dict holds exactly torch's keys, with torch's enum."""
    m, o = _tiny()
    s = cls("cpu", init_scale=4.0)
    _backward(s, m)
    s.unscale_(o)
    st = s._per_optimizer_states[id(o)]
    assert set(st) == {"stage", "found_inf_per_device"}
    assert st["stage"] is TorchOptState.UNSCALED
    assert list(st["found_inf_per_device"]) == [torch.device("cpu")]
    s.step(o)
    assert set(st) == {"stage", "found_inf_per_device"} and st["stage"] is TorchOptState.STEPPED
    s.update()
    assert len(s._per_optimizer_states) == 0


@pytest.mark.parametrize("poison", [False, True])
def test_maybe_opt_step_has_torchs_semantics(poison):
    """_maybe_opt_step(optimizer, state, *args) steps unless a found_inf is set, and returns the step's value."""
    results = []
    for cls in (torch.amp.GradScaler, GradScaler):
        m, o = _tiny()
        calls = []

        def step(*args, _orig=o.step, **kwargs):
            calls.append((args, kwargs))
            _orig()
            return 7.5

        o.step = step
        s = cls("cpu", init_scale=4.0)
        _backward(s, m, poison=poison)
        s.unscale_(o)
        ret = s._maybe_opt_step(o, s._per_optimizer_states[id(o)], "a", k=1)
        results.append((ret, calls, [p.detach().clone() for p in m.parameters()]))
    (r_t, c_t, p_t), (r_o, c_o, p_o) = results
    assert r_o == r_t == (None if poison else 7.5)
    assert c_o == c_t == ([] if poison else [(("a",), {"k": 1})])
    for a, b in zip(p_o, p_t):
        assert_bitwise_equal(a, b)


def test_overridden_maybe_opt_step_is_used_by_step():
    """A subclass that changes how steps are taken (as torch_xla's scaler does) is honoured."""
    seen = []

    class Recording(GradScaler):
        def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
            seen.append(sorted(optimizer_state))
            return "custom"

    m, o = _tiny()
    s = Recording("cpu", init_scale=4.0)
    _backward(s, m)
    assert s.step(o) == "custom"
    assert seen == [["found_inf_per_device", "stage"]]


# =========================================================================== _unscale_grads_


def _storm_grads(g, inject):
    """Gradients of mixed dtypes and layouts (a non-contiguous view among them), one poisoned when inject >= 0."""
    grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16), g.clone().t()]
    if inject >= 0:
        grads[inject][2, 2] = INF
    return grads


def test_unscale_grads_hook_torch_call_mixed_dtypes_and_layouts(device):
    """torch-style call: (optimizer, inv_scale, found_inf, allow_fp16) -> {device: found_inf}, with any
    grads torch's scaler takes (fp16 next to fp32, views, shapes unlike the parameters'), before scale()."""
    g = torch.full((20, 20), 4.0, device=device)
    inv_scale = torch.full((1,), 0.25, device=device)
    params = [torch.empty_like(x) for x in _storm_grads(g, -1)]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = GradScaler(torch.device(device).type)
    for inject in range(-1, len(params)):
        found_inf = torch.full((1,), 0.0, device=device)
        grads = _storm_grads(g, inject)
        for p, gr in zip(params, grads):
            p.grad = gr
        out = scaler._unscale_grads_(opt, inv_scale, found_inf, True)
        assert isinstance(out, dict) and list(out) == [torch.device(device, 0) if device == "cuda"
                                                       else torch.device("cpu")]
        (found,) = out.values()
        assert found is not found_inf, "each device gets its own copy, as torch's"
        assert found_inf.item() == 0.0
        assert found.shape == found_inf.shape
        if inject < 0:
            assert found.item() == 0.0
            for gr in grads:
                assert torch.equal(gr, torch.ones_like(gr))
        else:
            assert found.item() == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_unscale_grads_hook_two_gpus():
    """Gradients on two GPUs: one found_inf per device, each found where its device's inf is."""
    g = torch.full((20, 20), 4.0, device="cuda:0")
    inv_scale = torch.full((1,), 0.25, device="cuda:0")
    grads0 = _storm_grads(g, -1)
    grads = grads0 + [x.to("cuda:1") for x in grads0]
    params = [torch.empty_like(x) for x in grads]
    opt = torch.optim.SGD(params, lr=1.0)
    scaler = GradScaler("cuda")
    for inject in range(-1, len(params)):
        storm = [x.clone() for x in grads]
        if inject >= 0:
            storm[inject][2, 2] = INF
        for p, gr in zip(params, storm):
            p.grad = gr
        out = scaler._unscale_grads_(opt, inv_scale, torch.zeros((1,), device="cuda:0"), True)
        assert set(out) == {torch.device("cuda", 0), torch.device("cuda", 1)}
        assert all(f.device == d for d, f in out.items())
        found = {d.index: f.item() for d, f in out.items()}
        if inject < 0:
            assert found == {0: 0.0, 1: 0.0}
            assert all(torch.equal(x, torch.ones_like(x)) for x in storm)
        else:
            on = storm[inject].device.index
            assert found == {on: 1.0, 1 - on: 0.0}


def test_unscale_grads_hook_fp32_grads_are_unscaled_not_only_checked():
    """The reported case: a torch-style call on fp32 gradients must unscale them, as torch's does."""
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.tensor([8.0, -16.0, 2.0])
    opt = torch.optim.SGD([w], lr=1.0)
    out = GradScaler("cpu")._unscale_grads_(opt, torch.full((), 0.5), torch.zeros(()), False)
    assert torch.equal(w.grad, torch.tensor([4.0, -8.0, 1.0]))
    assert out[torch.device("cpu")].item() == 0.0


def test_unscale_grads_hook_keeps_the_initial_found_inf_and_refuses_fp16():
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    w.grad = torch.full((3,), 2.0, dtype=torch.float16)
    opt = torch.optim.SGD([w], lr=1.0)
    s = GradScaler("cpu")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        s._unscale_grads_(opt, torch.full((), 0.5), torch.zeros(()), False)
    assert torch.equal(w.grad, torch.full((3,), 2.0, dtype=torch.float16)), "nothing written before refusing"
    out = s._unscale_grads_(opt, torch.full((), 0.5), torch.ones(()), True)
    assert out[torch.device("cpu")].item() == 1.0, "found_inf starts from the value passed in"


def test_unscale_grads_hook_sparse(device):
    """Sparse parameters and gradients: values unscaled, inf/NaN found, fp16 checked after coalescing."""
    scaler = GradScaler(torch.device(device).type)
    inv_scale = torch.full((1,), 0.25, device=device)
    found_inf = torch.zeros((1,), device=device)
    dev = found_inf.device
    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device=device)
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0], device=device), (2, 3))
    p = s.clone()
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf, False)[dev].item() == 0.0
    assert torch.equal(p.grad.to_dense(), (s / 4).to_dense())
    for bad in (INF, NAN):
        p.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, bad], device=device), (2, 3))
        assert scaler._unscale_grads_(opt, inv_scale, found_inf, False)[dev].item() == 1.0

    ph = s.clone().half()
    opt = torch.optim.SGD([ph], lr=1.0)
    ph.grad = s.clone().half()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf, True)[dev].item() == 0.0
    assert torch.equal(ph.grad.to_dense(), (s.half() / 4).to_dense())
    # Duplicated indices: each value fits fp16, their sum (the coalesced value) does not.
    dup = torch.tensor([[0, 1, 0], [2, 0, 2]], device=device)
    ph.grad = torch.sparse_coo_tensor(dup, torch.tensor([64000.0, 32.0, 64000.0], device=device), (2, 3),
                                      dtype=torch.float16)
    assert scaler._unscale_grads_(opt, inv_scale, found_inf, True)[dev].item() == 1.0


def test_subclass_hook_is_called_by_unscale_and_fused_check():
    """Overriding _unscale_grads_ (as torch's ShardedGradScaler does) catches every unscale and check."""
    calls = []

    class Hooked(GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            out = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            calls.append((inv_scale.item(), allow_fp16, sorted(str(d) for d in out)))
            return out

    m, o = _tiny()
    s = Hooked("cpu", init_scale=4.0)
    _backward(s, m)
    before = [p.grad.clone() for p in m.parameters()]
    s.unscale_(o)
    for p, b in zip(m.parameters(), before):
        assert torch.equal(p.grad, b / 4)
    assert s.clip_grad_norm_(o, 1e9).item() == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]).item(), rel=1e-6)
    s.step(o)
    s.update()
    assert calls == [(0.25, False, ["cpu"])]

    fm = torch.nn.Linear(4, 2)
    fo = torch.optim.AdamW(fm.parameters(), lr=1e-3, fused=True)
    s.scale(fm(torch.ones(2, 4)).sum()).backward()
    s.step(fo)  # the read-only check before a fused step: torch's call, inv_scale 1, fp16 allowed
    s.update()
    assert calls[-1] == (1.0, True, ["cpu"])


# =========================================================================== scale changed by hand


@pytest.mark.parametrize("how", ["fill_", "assign", "copy_"])
def test_scale_changed_by_hand_is_used_by_unscale(how):
    """User code clamps the scale with scaler._scale.fill_(...) or replaces it; unscale_ must divide by it."""
    out = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        m, o = _tiny()
        s = cls("cpu", init_scale=2.0**10)
        for step in range(3):
            o.zero_grad()
            _backward(s, m)
            if step == 1:
                if how == "fill_":
                    s._scale.fill_(48.0)
                elif how == "assign":
                    s._scale = torch.full((), 48.0)
                else:
                    s._scale.copy_(torch.tensor(48.0))
            grads_before = [p.grad.clone() for p in m.parameters()]
            s.unscale_(o)
            if step == 1:
                ratio = [p.grad / b for p, b in zip(m.parameters(), grads_before)]
            s.step(o)
            s.update()
        out[cls] = ([p.detach().clone() for p in m.parameters()], s.get_scale(), ratio)
    (p_t, sc_t, r_t), (p_o, sc_o, r_o) = out.values()
    assert sc_o == sc_t
    for a, b in zip(r_o, r_t):
        assert_bitwise_equal(a, b)
    for a, b in zip(p_o, p_t):
        assert_bitwise_equal(a, b)


def test_scale_replaced_with_a_wrong_tensor_is_refused_before_writing():
    m, o = _tiny()
    s = GradScaler("cpu", init_scale=8.0)
    _backward(s, m)
    s._scale = torch.full((2,), 8.0, dtype=torch.float64)
    grads = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(TypeError, match=r"scaler\._scale must be a 1-element torch.float32 tensor"):
        s.unscale_(o)
    for p, g in zip(m.parameters(), grads):
        assert torch.equal(p.grad, g)


# =========================================================================== state dict


@pytest.mark.parametrize("lazy_init", [True, False])
def test_state_dict_load_overrides_everything(lazy_init):
    s0 = GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7
    if lazy_init:
        s1.scale(torch.full((1,), 4.0))
        assert s1._scale.dtype == torch.float32 and s1._scale.device.type == "cpu"
    s1.load_state_dict(s0.state_dict())
    assert (s1.get_scale(), s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval(),
            s1._init_growth_tracker) == (3.0, 4.0, 0.5, 2, 0)


def test_scale_will_not_overflow_to_inf(device):
    """A huge scale times a huge growth factor is not finite: the scale stays finite, and where torch's does."""
    torch.manual_seed(0)
    m0 = torch.nn.Linear(5, 1).to(device)
    x = torch.randn(1, 5, device=device)
    y = 1e-30 * torch.randn(1, 1, device=device)
    scales = []
    for cls in (GradScaler, torch.amp.GradScaler):  # whether the gradients overflow depends on the draw
        s = cls(torch.device(device).type, growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
        m = copy.deepcopy(m0)
        o = torch.optim.Adam(m.parameters())
        s.scale(((m(x) - y) ** 2).mean()).backward()
        s.step(o)
        s.update()
        scales.append(s.get_scale())
    assert math.isfinite(scales[0]) and scales[0] == scales[1]


# =========================================================================== the training recipes

SKIP_ITER = 2


def _control_step(loss, model, optimizer, scaler, i, max_norm=None):
    """The unscaled control run's step: backward, torch's clip if asked, and the step the scaled run skips
    (SKIP_ITER, when scaling is on) left out."""
    loss.backward()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not scaler.is_enabled() or i != SKIP_ITER:
        optimizer.step()


def _scaling_case(device, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, seed=0):
    """Two identical two-layer models with optimizers, 4 batches, and the loss."""
    optimizer_kwargs = optimizer_kwargs or {}
    optimizer_kwargs.setdefault("lr", 1.0)
    torch.manual_seed(seed)
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    scaling = copy.deepcopy(control)
    data = [(torch.randn(8, 8, device=device), torch.randn(8, 8, device=device)) for _ in range(4)]
    return (control, scaling, optimizer_ctor(control.parameters(), **optimizer_kwargs),
            optimizer_ctor(scaling.parameters(), **optimizer_kwargs), data, torch.nn.MSELoss())


def _poison(model):
    with torch.no_grad():
        model[1].weight.grad.fill_(INF)


def _assert_runs_match(control, scaling, opt_c, opt_s, atol, rtol=1e-5):
    for c, s in zip(control.parameters(), scaling.parameters()):
        torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=rtol)
        for k, v in opt_c.state[c].items():
            torch.testing.assert_close(opt_s.state[s][k], v, atol=atol, rtol=rtol, msg=k)
        torch.testing.assert_close(s, c, atol=atol, rtol=rtol)


def _run_scaling_case(device, run, unskipped, skipped, atol=1e-7, **case_kw):
    """run(...) trains the control (no scaling) and the scaled twin; both must end alike."""
    for enabled in (True, False):
        control, scaling, opt_c, opt_s, data, loss_fn = _scaling_case(device, **case_kw)
        scaler = GradScaler(torch.device(device).type, init_scale=128.0, growth_factor=2.0, enabled=enabled,
                            growth_interval=1)
        run(device, data, control, opt_c, scaler, loss_fn, False)
        scaler = run(device, data, scaling, opt_s, scaler, loss_fn, True) or scaler
        if enabled:
            assert scaler.get_scale() == 128.0 * scaler.get_growth_factor() ** unskipped \
                * scaler.get_backoff_factor() ** skipped
        else:
            assert scaler.get_scale() == 1.0
        _assert_runs_match(control, scaling, opt_c, opt_s, atol)


def _plain_run(try_pickle=False, autocast_dtype=None):
    def run(device, data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast(torch.device(device).type, dtype=autocast_dtype or torch.float32,
                                enabled=scaled and autocast_dtype is not None):
                loss = loss_fn(model(x).float(), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == SKIP_ITER and scaler.is_enabled():
                    _poison(model)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                _control_step(loss, model, optimizer, scaler, i)
        return scaler
    return run


OPTIMIZERS = [(torch.optim.SGD, {}), (torch.optim.Adam, {}), (torch.optim.AdamW, {}),
              (torch.optim.SGD, {"foreach": True}), (torch.optim.Adam, {"foreach": True}),
              (torch.optim.AdamW, {"foreach": True}),
              (torch.optim.SGD, {"fused": True}), (torch.optim.Adam, {"fused": True}),
              (torch.optim.AdamW, {"fused": True})]


@pytest.mark.parametrize("ctor,kw", OPTIMIZERS, ids=[f"{c.__name__}-{'-'.join(k) or 'forloop'}" for c, k in OPTIMIZERS])
@pytest.mark.parametrize("try_pickle", [False, True], ids=["", "pickled"])
def test_skipped_step_recipe(device, ctor, kw, try_pickle):
    """One poisoned step is skipped and the run otherwise equals the unscaled one (Adam: lr 1 is harsh, so
    the scaled and control runs agree to 1e-5 as in torch's own test)."""
    atol = 1e-7 if ctor is torch.optim.SGD else 1e-5
    _run_scaling_case(device, _plain_run(try_pickle), unskipped=3, skipped=1, atol=atol,
                      optimizer_ctor=ctor, optimizer_kwargs=dict(kw))


def test_skipped_step_recipe_under_autocast():
    """bf16 autocast on the CPU for the scaled run; the control is pure fp32 (hence the loose tolerance)."""
    _run_scaling_case("cpu", _plain_run(autocast_dtype=torch.bfloat16), unskipped=3, skipped=1, atol=5e-2)


def test_clipping_before_unscale_recipe(device):
    """Clip the scaled gradients to max_norm * scale (torch's clip), then step."""
    max_norm = 0.2

    def run(device, data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == SKIP_ITER and scaler.is_enabled():
                    _poison(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                _control_step(loss, model, optimizer, scaler, i, max_norm)

    _run_scaling_case(device, run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("clip", ["torch", "scaler"])
def test_clipping_after_separate_unscale_recipe(device, clip):
    """unscale_, clip (torch's or the scaler's own), then step; the poisoned step is still skipped."""
    max_norm = 0.2

    def run(device, data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == SKIP_ITER and scaler.is_enabled():
                    _poison(model)
                scaler.unscale_(optimizer)
                if clip == "torch":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                else:
                    scaler.clip_grad_norm_(optimizer, max_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                _control_step(loss, model, optimizer, scaler, i, max_norm)

    _run_scaling_case(device, run, unskipped=3, skipped=1, atol=1e-5)


def test_gradient_penalty_recipe(device):
    """autograd.grad of the scaled loss (create_graph), unscaled by hand, as a penalty term."""
    def run(device, data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            params = list(model.parameters())
            if scaled:
                grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
                inv = 1.0 / scaler.get_scale()
                grads = [g * inv for g in grads]
            else:
                grads = torch.autograd.grad(loss, params, create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
            if scaled:
                scaler.scale(loss).backward()
                if i == SKIP_ITER and scaler.is_enabled():
                    _poison(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                _control_step(loss, model, optimizer, scaler, i)

    _run_scaling_case(device, run, unskipped=3, skipped=1, atol=1e-6)


def test_gradient_accumulation_recipe(device):
    def run(device, data, model, optimizer, scaler, loss_fn, scaled):
        every = 2
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / every
            if scaled:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % every == 0:
                if scaled:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    _run_scaling_case(device, run, unskipped=2, skipped=0)


def test_two_models_two_optimizers_one_scaler(device):
    """Two losses backward through one scaler, one optimizer unscaled separately, one poisoned model:
    its optimizer skips that step (the other's gradients were clean), the scale backs off once, and
    both runs equal their controls."""
    for enabled in (True, False):
        c0, s0, oc0, os0, data, loss_fn = _scaling_case(device, seed=1)
        c1, s1, oc1, os1, _, _ = _scaling_case(device, seed=2)
        scaler = GradScaler(torch.device(device).type, init_scale=128.0, growth_interval=1, enabled=enabled)

        def run(m0, m1, o0, o1, scaled):
            for i, (x, y) in enumerate(data):
                o0.zero_grad()
                o1.zero_grad()
                out0, out1 = m0(x), m1(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                if scaled:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == SKIP_ITER and scaler.is_enabled():
                        _poison(m1)
                    scaler.unscale_(o0)
                    scaler.step(o0)
                    scaler.step(o1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    o0.step()  # its own gradients were clean: it steps even on the poisoned iteration
                    if not scaler.is_enabled() or i != SKIP_ITER:
                        o1.step()

        run(c0, c1, oc0, oc1, False)
        run(s0, s1, os0, os1, True)
        expected = 128.0 * 2.0**3 * 0.5 if enabled else 1.0
        assert scaler.get_scale() == expected
        _assert_runs_match(c0, s0, oc0, os0, atol=1e-6)
        _assert_runs_match(c1, s1, oc1, os1, atol=1e-6)


@pytest.mark.parametrize("ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("separate_unscale", [False, True])
def test_fused_optimizer_against_torchs_scaler(device, ctor, separate_unscale):
    """A fused optimizer under our scaler (read-only check, or a separate unscale_) against the same
    optimizer, unfused, under torch's scaler: same losses, gradients, parameters and state."""
    kw = {"lr": 1e-2} if ctor is not torch.optim.SGD else {"lr": 1e-2, "momentum": 0.9}
    _, fused_model, _, fused_opt, data, loss_fn = _scaling_case(device, ctor, {**kw, "fused": True}, seed=20)
    ctrl_model = copy.deepcopy(fused_model)
    ctrl_opt = ctor(ctrl_model.parameters(), **kw, fused=False)
    dev_type = torch.device(device).type
    ours, theirs = GradScaler(dev_type, init_scale=128.0), torch.amp.GradScaler(dev_type, init_scale=128.0)
    for i, (x, y) in enumerate(data * 2):
        ctrl_opt.zero_grad()
        loss_c = loss_fn(ctrl_model(x), y)
        theirs.scale(loss_c).backward()
        theirs.step(ctrl_opt)
        theirs.update()

        fused_opt.zero_grad()
        loss_f = loss_fn(fused_model(x), y)
        ours.scale(loss_f).backward()
        if separate_unscale:
            ours.unscale_(fused_opt)
        ours.step(fused_opt)
        ours.update()

        torch.testing.assert_close(loss_f, loss_c)
        assert ours.get_scale() == theirs.get_scale()
        for pc, pf in zip(ctrl_model.parameters(), fused_model.parameters()):
            torch.testing.assert_close(pf.grad, pc.grad, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(pf, pc, atol=2e-5, rtol=2e-5)
            for k, v in ctrl_opt.state[pc].items():
                got = fused_opt.state[pf][k]
                # A fused or capturable step keeps "step" on the params' device; torch's plain one on the CPU.
                got = got.squeeze().to(v.device) if k == "step" else got
                torch.testing.assert_close(got, v, atol=2e-5, rtol=2e-5)


def test_optimizer_taking_grad_scaler_kwarg_and_one_taking_attributes(device):
    """torch's two contracts with optimizers that handle scaling themselves."""
    seen = {}

    class Base(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class TakesScaler(Base):
        def step(self, closure=None, *, grad_scaler=None):
            seen["kwarg"] = (isinstance(grad_scaler, torch.amp.GradScaler), hasattr(self, "grad_scale"),
                             hasattr(self, "found_inf"))

    class TakesAttributes(Base):
        def step(self, closure=None):
            seen["attrs"] = (isinstance(self.grad_scale, torch.Tensor), isinstance(self.found_inf, torch.Tensor),
                             self.grad_scale.item(), self.found_inf.item())

    m = torch.nn.Linear(4, 1).to(device)
    o1, o2 = TakesScaler(m.parameters()), TakesAttributes(m.parameters())
    s = GradScaler(torch.device(device).type, init_scale=2.0)
    s.scale(m(torch.randn(4, 4, device=device)).mean()).backward()
    with pytest.warns(FutureWarning):
        s.step(o1)
    s.step(o2)
    s.update()
    assert seen == {"kwarg": (True, False, False), "attrs": (True, True, 2.0, 0.0)}
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


def test_preset_grad_scale_after_in_place_unscale(device):
    """unscale_ divides in place; a grad_scale the user set on a fused optimizer is then passed on alone."""
    out = []
    for cls in (torch.amp.GradScaler, GradScaler):
        w = torch.ones((5, 5), device=device, requires_grad=True)
        w.grad = torch.full_like(w, 15.0)
        opt = torch.optim.SGD([w], lr=0.1, fused=True)
        s = cls(torch.device(device).type, init_scale=5.0)
        s.scale(torch.ones(5, device=device))
        s.unscale_(opt)
        after_unscale = w.grad.clone()
        opt.grad_scale = torch.tensor([3.0], device=device)
        s.step(opt)
        out.append((after_unscale, w.grad.clone(), w.detach().clone()))
    (u_t, g_t, w_t), (u_o, g_o, w_o) = out
    assert torch.equal(u_o, torch.full_like(u_o, 3.0)) and torch.equal(u_o, u_t)
    assert_bitwise_equal(g_o, g_t)
    assert_bitwise_equal(w_o, w_t)
