"""The gradient statistics of the fused optimizers' step (grad_sumsq, ``track_grad_norm``): the sums of squares
of the gradients the step read, measured in the same pass. Parity with the reference, the update unchanged,
specials, skipped steps, bad sizes, and the optimizers' ``last_grad_norm``."""

from __future__ import annotations

import pytest
import torch

from adaptive_amp import GradScaler, optim, reference
from conftest import assert_bitwise_equal, requires_cuda
from test_optim import _assert_lists, _clone

# Empty, one piece, several CPU blocks, several CUDA chunks (32768 elements), odd tails.
SHAPES = [(37,), (0,), (5, 9), (4096 * 3 + 5,), (2 * 32768 + 5,), (8,)]
ADAM_KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SGD_KW = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)


def _lists(shapes, pdts, mdts, device, seed=0):
    """params, grads, moments, second moments, steps; dtypes per tensor (cycled)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda s: torch.randn(s, generator=g)  # noqa: E731
    pick = lambda ds, k: ds[k % len(ds)]  # noqa: E731
    ps = [r(s).to(device, pick(pdts, k)) for k, s in enumerate(shapes)]
    gs = [(3 * r(s)).to(device, pick(pdts, k)) for k, s in enumerate(shapes)]
    ms = [(0.1 * r(s)).to(device, pick(mdts, k)) for k, s in enumerate(shapes)]
    vs = [(0.01 * r(s).abs()).to(device, pick(mdts, k)) for k, s in enumerate(shapes)]
    steps = [torch.tensor(float(k + 1), device=device) for k in range(len(shapes))]
    return ps, gs, ms, vs, steps


def _step(kind, lists, op=optim, **kw):
    if kind == "adamw":
        return op.adamw_step_(*lists, **ADAM_KW, seed=7, offset=3, **kw)
    ps, gs, ms = lists[:3]
    return op.sgd_step_(ps, gs, ms, [k % 2 == 0 for k in range(len(ps))], **SGD_KW, seed=7, offset=3, **kw)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("maximize", [False, True])
def test_grad_sumsq_matches_reference_and_leaves_the_update_unchanged(device, kind, pdt, maximize):
    lists = _lists(SHAPES, [pdt], [torch.float32, torch.bfloat16], device)
    plain, measured, twin = _clone(lists), _clone(lists), _clone(lists)
    kw = dict(maximize=maximize, grad_scale=torch.tensor([4.0], device=device))
    assert _step(kind, plain, **kw) is None
    sumsq = _step(kind, measured, grad_sumsq=True, **kw)
    expected = _step(kind, twin, op=reference, grad_sumsq=True, **kw)
    _assert_lists(measured, plain, "with statistics vs without")
    _assert_lists(measured, twin, "vs the reference")
    assert sumsq.dtype == torch.float32 and sumsq.device == lists[0][0].device and sumsq.shape == (len(SHAPES),)
    assert float(sumsq[1]) == 0.0  # the empty tensor
    # (After grad_scale: the gradients were drawn 3 * N(0, 1), so each element adds about 9 / 16.)
    torch.testing.assert_close(sumsq.cpu(), expected.cpu(), rtol=1e-5, atol=0)
    again = _step(kind, _clone(lists), grad_sumsq=True, **kw)
    assert_bitwise_equal(again, sumsq, "deterministic")


def test_grad_sumsq_sees_nonfinite_first_and_last_elements(device):
    lists = _lists([(4096 * 2 + 3,), (33,), (2 * 32768 + 1,)], [torch.bfloat16], [torch.float32], device)
    lists[1][0][0] = float("inf")
    lists[1][1][-1] = float("nan")
    sumsq = optim.adamw_step_(*lists, **ADAM_KW, seed=1, grad_sumsq=True).cpu()
    assert sumsq[0] == float("inf") and torch.isnan(sumsq[1]) and torch.isfinite(sumsq[2])


def test_skipped_step_gives_nan_and_writes_nothing_else(device):
    lists = _lists(SHAPES, [torch.bfloat16], [torch.float32], device)
    before = _clone(lists)
    found_inf = torch.ones(1, device=device)
    for kind in ("adamw", "sgd"):
        sumsq = _step(kind, lists, grad_sumsq=True, found_inf=found_inf)
        assert torch.isnan(sumsq).all() and sumsq.numel() == len(SHAPES)
        assert torch.isnan(_step(kind, _clone(lists), op=reference, grad_sumsq=True, found_inf=found_inf)).all()
        _assert_lists(lists, before)


def test_grad_sumsq_of_views_with_storage_offsets(device):
    base = torch.randn(2 * 40001 + 3, device=device).bfloat16()
    gbase = torch.randn(2 * 40001 + 3, device=device).bfloat16()
    views = lambda t: [t[1:40002], t[40003:80004]]  # noqa: E731 (not 16-byte aligned: the scalar path)
    lists = [views(base), views(gbase), [torch.zeros(40001, device=device) for _ in range(2)],
             [torch.zeros(40001, device=device) for _ in range(2)], [torch.zeros((), device=device)] * 2]
    lists[4] = [torch.zeros((), device=device), torch.zeros((), device=device)]
    contiguous = _clone(lists)
    a = optim.adamw_step_(*lists, **ADAM_KW, seed=2, grad_sumsq=True)
    b = optim.adamw_step_(*contiguous, **ADAM_KW, seed=2, grad_sumsq=True)
    _assert_lists(lists, contiguous)  # the update is bitwise the same whatever the alignment
    # The sums are not (CUDA's scalar path adds in another order than its vector path), but both are right.
    exact = torch.stack([g.double().square().sum() for g in views(gbase)]).float().cpu()
    torch.testing.assert_close(a.cpu(), exact, rtol=1e-5, atol=0)
    torch.testing.assert_close(b.cpu(), exact, rtol=1e-5, atol=0)


def _bad_buffers(case, device):
    """A replacement for optim._stats_buffers handing the core a wrong output or workspace."""
    real = optim._stats_buffers

    def buffers(numels, dev, workspace_bytes=None):
        sumsq, workspace = real(numels, dev, workspace_bytes)
        if case == "short output":
            return sumsq[:-1], workspace
        if case == "small workspace":
            return sumsq, workspace[:-4]
        return buffers.alias, workspace  # "output inside a param"
    return buffers


@pytest.mark.parametrize("case,match", [
    ("short output", r"grad_sumsq: holds 5 floats; params has 6"),
    ("output inside a param", r"shares memory"),
    ("small workspace", r"workspace: holds \d+ bytes; \d+ are needed"),
])
def test_wrong_statistics_buffers_are_refused_before_any_write(device, case, match, monkeypatch):
    if case == "small workspace" and device == "cpu":
        pytest.skip("the CPU step needs no workspace")
    lists = _lists(SHAPES, [torch.float32], [torch.float32], device)
    buffers = _bad_buffers(case, device)
    buffers.alias = lists[0][3][:len(SHAPES)]  # the first floats of params[3]
    monkeypatch.setattr(optim, "_stats_buffers", buffers)
    before = _clone(lists)
    with pytest.raises(ValueError, match=match):
        optim.adamw_step_(*lists, **ADAM_KW, seed=1, grad_sumsq=True)
    _assert_lists(lists, before)


def _model(device, seed=0, bf16=True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 200),
                                torch.nn.Linear(200, 3)).to(device)
    if bf16:
        model[0].to(torch.bfloat16)
        model[2].to(torch.bfloat16)
    return model


def _groups(model):
    # Two groups (decay / no decay, as transformers builds them), and a param that gets no gradient.
    model[3].weight.requires_grad_(False)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}, {"params": [
        model[3].weight]}]


def _backward(model, seed, scaler=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 64, generator=g).to(next(model.parameters()).device)
    h = model[1](model[0](x.to(model[0].weight.dtype)).float())
    out = model[3](model[2](h.to(model[2].weight.dtype)).float())
    loss = out.square().mean()
    (loss if scaler is None else scaler.scale(loss)).backward()


def _exact_norm(model):
    return float(torch.stack([p.grad.double().norm() for p in model.parameters() if p.grad is not None]).norm())


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
def test_track_grad_norm_is_the_norm_of_every_gradient_the_step_used(device, cls):
    a, b = _model(device), _model(device)
    kw = dict(lr=1e-3) if cls is optim.AdamW else dict(lr=1e-2, momentum=0.9)
    tracked = cls(_groups(a), **kw, track_grad_norm=True, generator=torch.Generator(device).manual_seed(1))
    plain = cls(_groups(b), **kw, generator=torch.Generator(device).manual_seed(1))
    assert plain.last_grad_norm is None and not plain.track_grad_norm
    for step in range(3):
        for model in (a, b):
            model.zero_grad(set_to_none=True)
            _backward(model, step)
        expected = _exact_norm(a)
        tracked.step()
        plain.step()
        norm = tracked.last_grad_norm
        assert norm.dim() == 0 and norm.dtype == torch.float32 and norm.device == a[0].weight.device
        assert float(norm) == pytest.approx(expected, rel=1e-5)
        for p, q in zip(a.parameters(), b.parameters()):
            assert_bitwise_equal(p, q, f"step {step}")  # measuring changes nothing
    assert plain.last_grad_norm is None
    for p in a.parameters():  # no gradient anywhere: no norm
        p.grad = None
    tracked.step()
    assert tracked.last_grad_norm is None


def test_track_grad_norm_on_the_functional_path(device):
    # A channels_last conv weight with a contiguous gradient is stepped through the functional op.
    conv = torch.nn.Conv2d(3, 8, 3).to(device).to(memory_format=torch.channels_last)
    opt = optim.AdamW(conv.parameters(), lr=1e-3, track_grad_norm=True)
    conv.weight.grad = torch.randn(conv.weight.shape, device=device)
    conv.bias.grad = torch.randn(8, device=device)
    expected = float(torch.stack([conv.weight.grad.double().norm(), conv.bias.grad.double().norm()]).norm())
    opt.step()
    assert float(opt.last_grad_norm) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("scaler_kind", ["adaptive_amp", "torch"])
def test_track_grad_norm_under_a_grad_scaler_is_unscaled_and_nan_when_skipped(device, scaler_kind):
    model = _model(device, bf16=scaler_kind == "adaptive_amp")  # (torch's CUDA unscale refuses bf16 gradients)
    opt = optim.AdamW(model.parameters(), lr=1e-3, track_grad_norm=True)
    make = GradScaler if scaler_kind == "adaptive_amp" else torch.amp.GradScaler
    scaler = make(device, init_scale=1024.0)
    _backward(model, 0, scaler)
    expected = _exact_norm(model) / 1024.0
    scaler.step(opt)
    scaler.update()
    assert float(opt.last_grad_norm) == pytest.approx(expected, rel=1e-5)
    model.zero_grad(set_to_none=True)
    _backward(model, 1, scaler)
    with torch.no_grad():
        model[0].weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert torch.isnan(opt.last_grad_norm)
    for p, q in zip(model.parameters(), before):
        assert_bitwise_equal(p, q)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_cpu_and_cuda_agree_with_kinds_interleaved(kind):
    # bf16 and fp32 params, fp32 and bf16 moments, in an order that alternates (bf16-weights: matmul weights
    # and norms); the CUDA step groups the tensors by kind, and each must keep its own random words.
    shapes = SHAPES + [(100003,), (3, 5), (70000,)]
    lists = _lists(shapes, [torch.bfloat16, torch.float32, torch.bfloat16], [torch.float32, torch.bfloat16],
                   "cpu")
    cpu, gpu = _clone(lists), [[x.cuda() for x in xs] for xs in lists]
    s_cpu = _step(kind, cpu, grad_sumsq=True)
    s_gpu = _step(kind, gpu, grad_sumsq=True)
    _assert_lists(cpu, gpu, kind)
    torch.testing.assert_close(s_gpu.cpu(), s_cpu, rtol=1e-5, atol=0)
    ref = _step(kind, _clone(lists), op=reference, grad_sumsq=True)
    torch.testing.assert_close(s_gpu.cpu(), ref, rtol=1e-6, atol=0)
