"""Fused optimizers (adaptive_amp.optim): parity with the reference, torch, the scalers, and the evidence
that stochastic rounding makes pure-bf16 training work."""

from __future__ import annotations

import pytest
import torch

from adaptive_amp import optim, reference
from conftest import CUDA_OK, assert_bitwise_equal, requires_cuda

SHAPES = [(37,), (5, 9), (0,), (4096 * 3 + 5,), (8,), (32768 + 3,)]


def _lists(shapes, pdt, mdt, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda s: torch.randn(s, generator=g)  # noqa: E731
    ps = [r(s).to(device, pdt) for s in shapes]
    gs = [r(s).to(device, pdt) for s in shapes]
    ms = [(0.1 * r(s)).to(device, mdt) for s in shapes]
    vs = [(0.01 * r(s).abs()).to(device, mdt) for s in shapes]
    steps = [torch.tensor(float(i + 2), device=device) for i in range(len(shapes))]
    return ps, gs, ms, vs, steps


def _clone(lists):
    return [[x.clone() for x in xs] for xs in lists]


def _assert_lists(a, b, msg=""):
    for i, (xs, ys) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(xs, ys)):
            assert_bitwise_equal(x, y, f"{msg} list {i} tensor {j}")


ADAM_KW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
SGD_KW = dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)


@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sr", [True, False])
@pytest.mark.parametrize("maximize", [False, True])
def test_adamw_matches_reference(device, pdt, mdt, sr, maximize):
    lists = _lists(SHAPES, pdt, mdt, device)
    a, b = _clone(lists), _clone(lists)
    kw = dict(ADAM_KW, maximize=maximize, stochastic_rounding=sr, grad_scale=torch.tensor([8.0], device=device),
              seed=123, offset=2**64 - 5)
    optim.adamw_step_(*a, **kw)
    reference.adamw_step_(*b, **kw)
    _assert_lists(a, b)


@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_reference(device, pdt, mdt, nesterov):
    ps, gs, ms, _, _ = _lists(SHAPES, pdt, mdt, device)
    first = [i % 2 == 0 for i in range(len(SHAPES))]
    kw = dict(SGD_KW, nesterov=nesterov, dampening=0.0 if nesterov else 0.1, seed=9, offset=4)
    a, b = _clone([ps, gs, ms]), _clone([ps, gs, ms])
    optim.sgd_step_(*a, first, **kw)
    reference.sgd_step_(*b, first, **kw)
    _assert_lists(a, b)
    a, b = _clone([ps, gs]), _clone([ps, gs])  # no momentum: no buffers
    optim.sgd_step_(a[0], a[1], [], lr=0.1, seed=1)
    reference.sgd_step_(b[0], b[1], [], lr=0.1, seed=1)
    _assert_lists(a, b)


def test_reference_explicit_bits_match_seed():
    ps, gs, ms, vs, st = _lists([(13,), (40,)], torch.bfloat16, torch.float32)
    bits = [reference.philox_random_bits(p.shape, 7, 11 + 3 * k) for k, p in enumerate(ps)]
    a, b = _clone([ps, gs, ms, vs, st]), _clone([ps, gs, ms, vs, st])
    reference.adamw_step_(*a, **ADAM_KW, random_bits=bits)
    optim.adamw_step_(*b, **ADAM_KW, seed=7, offset=11)
    _assert_lists(a, b)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
def test_cpu_equals_cuda(mdt):
    # Aligned tensors and views with storage offsets (the scalar path) alike.
    lists = _lists(SHAPES + [(100003,)], torch.bfloat16, mdt)
    cpu = _clone(lists)
    gpu = [[x.cuda() for x in xs] for xs in lists]
    kw = dict(ADAM_KW, grad_scale=torch.tensor([2.0]), seed=5, offset=6)
    optim.adamw_step_(*cpu, **kw)
    optim.adamw_step_(*gpu, **dict(kw, grad_scale=kw["grad_scale"].cuda()))
    _assert_lists(cpu, gpu, "adamw")
    ps, gs, ms = lists[:3]
    first = [True] * len(ps)
    cpu, gpu = _clone([ps, gs, ms]), [[x.cuda() for x in xs] for xs in (ps, gs, ms)]
    optim.sgd_step_(*cpu, first, **SGD_KW, seed=3)
    optim.sgd_step_(*gpu, first, **SGD_KW, seed=3)
    _assert_lists(cpu, gpu, "sgd")


@pytest.mark.cuda
@requires_cuda
def test_cuda_unaligned_views_equal_cpu():
    base = torch.randn(3 * 50001 + 7).bfloat16()
    views = lambda t: [t[1:50002], t[50003:100004], t[100005:150006]]  # noqa: E731
    gb, mb, vb = (torch.randn(3 * 50001 + 7) for _ in range(3))
    args_cpu = [views(base.clone()), views(gb.bfloat16()), views(mb * 0.1), views(mb.abs() * 0.01),
                [torch.tensor(4.0)] * 3]
    args_gpu = [[x.cuda() for x in xs] for xs in args_cpu]
    args_gpu[0] = views(base.clone().cuda())
    optim.adamw_step_(*args_cpu, **ADAM_KW, seed=1, offset=2)
    optim.adamw_step_(*args_gpu, **ADAM_KW, seed=1, offset=2)
    _assert_lists(args_cpu, args_gpu)


def _model(dtype, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device, dtype)


def _named_step(model, x, dtype):
    loss = model(x.to(dtype)).float().square().mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("cls,kw", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True)),
    ("SGD", dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=1e-2, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=1e-2)),
])
def test_fp32_multi_step_matches_torch(cls, kw):
    """fp32 params: within a few fp32 ulps of torch's optimizers over 20 steps.

    Not bitwise: torch's eager AdamW divides and multiplies in another order
    (lerp for exp_avg, addcdiv with the bias correction folded differently),
    and its CPU kernels may use FMA; the tolerance is a few ulps per step.
    """
    ours_m, torch_m = _model(torch.float32), _model(torch.float32)
    ours = getattr(optim, cls)(ours_m.parameters(), **kw)
    theirs = getattr(torch.optim, cls)(torch_m.parameters(), foreach=False, **kw)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(20):
        for m, o in ((ours_m, ours), (torch_m, theirs)):
            o.zero_grad()
            _named_step(m, x, torch.float32)
            o.step()
    for p, q in zip(ours_m.parameters(), torch_m.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(ours_m.parameters(), torch_m.parameters()):
        for key, value in theirs.state[q].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(ours.state[p][key].float().cpu().reshape(value.shape), value.float(),
                                           rtol=1e-5, atol=1e-7)


def _scaled_setup(dtype, device="cpu"):
    model = _model(dtype, device)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8, device=device)
    return model, opt, x


@pytest.mark.parametrize("scaler_kind", ["adaptive_amp", "torch"])
def test_found_inf_skips_with_both_scalers(scaler_kind):
    import adaptive_amp

    model, opt, x = _scaled_setup(torch.float32)
    make = (lambda: adaptive_amp.GradScaler("cpu", init_scale=1024.0)) if scaler_kind == "adaptive_amp" else \
        (lambda: torch.amp.GradScaler("cpu", init_scale=1024.0))
    scaler = make()
    # One clean step so that the state exists.
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    opt.zero_grad()
    scaler.scale(model(x).square().mean()).backward()
    next(model.parameters()).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    for k, v in model.state_dict().items():
        assert_bitwise_equal(v, before[k], k)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert_bitwise_equal(v, state_before[id(p)][k], k)
    assert float(opt.state[next(model.parameters())]["step"]) == 1.0
    assert scaler.get_scale() == 512.0


@pytest.mark.parametrize("scaler_kind", ["adaptive_amp", "torch"])
def test_grad_scale_unscales_like_unscaled_step(scaler_kind):
    """With a power-of-two scale, the scaled step equals the plain step bitwise."""
    import adaptive_amp

    m1, o1, x = _scaled_setup(torch.float32)
    m2, o2, _ = _scaled_setup(torch.float32)
    scaler = adaptive_amp.GradScaler("cpu", init_scale=256.0) if scaler_kind == "adaptive_amp" else \
        torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(3):
        o1.zero_grad()
        o2.zero_grad()
        m1(x).square().mean().backward()
        o1.step()
        scaler.scale(m2(x).square().mean()).backward()
        scaler.step(o2)
        scaler.update()
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert_bitwise_equal(p, q)


def test_found_inf_functional_leaves_everything(device):
    lists = _lists(SHAPES, torch.bfloat16, torch.float32, device)
    a = _clone(lists)
    optim.adamw_step_(*a, **ADAM_KW, found_inf=torch.ones(1, device=device))
    _assert_lists(a, lists)


def test_nan_grads_propagate_like_torch(device):
    ps, gs, ms, vs, st = _lists([(64,)], torch.bfloat16, torch.float32, device)
    gs[0][3] = float("nan")
    optim.adamw_step_(ps, gs, ms, vs, st, **ADAM_KW, seed=1)
    assert torch.isnan(ps[0][3].float()) and torch.isnan(ms[0][3])
    assert not torch.isnan(ps[0][:3].float()).any()


def test_many_tensors_beyond_one_table(device):
    shapes = [(i % 7 + 1,) for i in range(1300)]  # several launch tables on CUDA
    lists = _lists(shapes, torch.bfloat16, torch.float32, device)
    a, b = _clone(lists), _clone(lists)
    optim.adamw_step_(*a, **ADAM_KW, seed=2, offset=3)
    reference.adamw_step_(*b, **ADAM_KW, seed=2, offset=3)
    _assert_lists(a, b)


def test_empty_lists_and_params(device):
    optim.adamw_step_([], [], [], [], [], **ADAM_KW)
    model = torch.nn.Linear(2, 2).to(device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = optim.AdamW(model.parameters())
    opt.step()  # no grads: nothing to do
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    empty = torch.nn.Parameter(torch.empty(0, device=device))
    opt = optim.AdamW([empty])
    empty.grad = torch.empty(0, device=device)
    opt.step()
    assert float(opt.state[empty]["step"]) == 1.0 and opt.state[empty]["exp_avg"].numel() == 0


@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD])
def test_turning_stochastic_rounding_on_later_draws_fresh_bits_each_step(cls):
    """The plan records whether launches draw random bits: changing the group's flag rebuilds it."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096).bfloat16())
    opt = cls([p], lr=1e-3, stochastic_rounding=False)
    deltas = []
    for step in range(3):
        if step == 1:
            opt.param_groups[0]["stochastic_rounding"] = True
        before = p.detach().float().clone()
        p.grad = torch.full_like(p, 1e-3)
        opt.step()
        deltas.append(p.detach().float() - before)
    # With the same gradient every step, the same random bits would round the same way twice.
    assert not torch.equal(deltas[1], deltas[2])


def test_views_with_storage_offsets(device):
    base = torch.randn(1001, device=device).bfloat16()
    ps = [base[1:500], base[501:1001]]
    gs = [torch.randn(499, device=device).bfloat16(), torch.randn(500, device=device).bfloat16()]
    ms = [torch.zeros(499, device=device), torch.zeros(500, device=device)]
    vs = [torch.zeros(499, device=device), torch.zeros(500, device=device)]
    st = [torch.zeros((), device=device), torch.zeros((), device=device)]
    b = _clone([ps, gs, ms, vs, st])
    before0 = base[0].clone()
    optim.adamw_step_(ps, gs, ms, vs, st, **ADAM_KW, seed=4)
    reference.adamw_step_(*b, **ADAM_KW, seed=4)
    _assert_lists([ps, ms, vs], [b[0], b[2], b[3]])
    assert_bitwise_equal(base[0], before0)


@pytest.mark.parametrize("mutate,err,match", [
    (lambda L: L[1].__setitem__(0, L[1][0].float()), TypeError, r"grads\[0\]"),
    (lambda L: L[2].__setitem__(1, torch.zeros(3)), ValueError, r"exp_avgs\[1\]"),
    (lambda L: L[2].__setitem__(1, L[3][1]), ValueError, r"exp_avg_sqs\[1\]|exp_avgs\[1\]"),
    (lambda L: L[0].__setitem__(0, torch.zeros(37, dtype=torch.float16)), TypeError, r"params\[0\]"),
    (lambda L: L[0].__setitem__(1, torch.zeros(9, 5).t()), ValueError, r"params\[1\]"),
    (lambda L: L[4].pop(), ValueError, r"steps"),
    (lambda L: L[3].__setitem__(0, L[3][0].bfloat16()), TypeError, r"exp_avg_sqs\[0\].*exp_avgs\[0\]"),
])
def test_bad_inputs_name_argument_and_change_nothing(mutate, err, match):
    lists = _lists([(37,), (5, 9)], torch.bfloat16, torch.float32)
    a = _clone(lists)
    mutate(a)
    snapshot = _clone(a)
    with pytest.raises(err, match=match):
        optim.adamw_step_(*a, **ADAM_KW, seed=1)
    _assert_lists(a, snapshot)


def test_bad_hyperparameters():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="amsgrad"):
        optim.AdamW(p, amsgrad=True)
    with pytest.raises(ValueError, match="learning rate"):
        optim.AdamW(p, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        optim.AdamW(p, betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="moment_dtype"):
        optim.AdamW(p, moment_dtype=torch.float16)
    with pytest.raises(TypeError, match="lr"):
        optim.AdamW(p, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match="Nesterov"):
        optim.SGD(p, nesterov=True)
    q = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    q.grad = torch.zeros_like(q)
    with pytest.raises(TypeError, match="complex"):
        optim.AdamW([q]).step()
    s = torch.nn.Parameter(torch.zeros(3))
    s.grad = torch.zeros(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        optim.SGD([s]).step()
    with pytest.raises(ValueError, match="lr"):
        optim.sgd_step_([torch.zeros(2)], [torch.zeros(2)], [], lr=float("nan"))


@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip(mdt):
    model = _model(torch.bfloat16)
    opt = optim.AdamW(model.parameters(), lr=1e-2, moment_dtype=mdt)
    x = torch.randn(8, 8)
    for _ in range(2):
        opt.zero_grad()
        _named_step(model, x, torch.bfloat16)
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    other = optim.AdamW(model.parameters(), lr=1e-2, moment_dtype=mdt)
    other.load_state_dict(sd)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            assert_bitwise_equal(other.state[p][k], v, k)
    assert other.param_groups[0]["moment_dtype"] == mdt


def test_loads_torch_adamw_state_dict_and_continues_like_it():
    m1, m2 = _model(torch.float32), _model(torch.float32)
    theirs = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    x = torch.randn(8, 8)
    for _ in range(3):
        theirs.zero_grad()
        _named_step(m1, x, torch.float32)
        theirs.step()
    m2.load_state_dict(m1.state_dict())
    ours = optim.AdamW(m2.parameters(), lr=1e-3)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[0]["stochastic_rounding"] is True
    for p, q in zip(m2.parameters(), m1.parameters()):
        assert ours.state[p]["step"].dtype == torch.float32 and float(ours.state[p]["step"]) == 3.0
        assert_bitwise_equal(ours.state[p]["exp_avg"], theirs.state[q]["exp_avg"])
    for m, o in ((m1, theirs), (m2, ours)):
        o.zero_grad()
        _named_step(m, x, torch.float32)
        o.step()
    for p, q in zip(m2.parameters(), m1.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # bf16 params keep fp32 moments when loading (torch would cast them to bf16).
    m3 = _model(torch.bfloat16)
    ours_bf16 = optim.AdamW(m3.parameters())
    ours_bf16.load_state_dict(theirs.state_dict())
    assert all(ours_bf16.state[p]["exp_avg"].dtype == torch.float32 for p in m3.parameters())


def test_generator_reproduces_and_advances():
    def run(gen):
        model = _model(torch.bfloat16)
        opt = optim.AdamW(model.parameters(), lr=1e-3, generator=gen)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
        for _ in range(2):
            opt.zero_grad()
            _named_step(model, x, torch.bfloat16)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    a = run(torch.Generator().manual_seed(1))
    b = run(torch.Generator().manual_seed(1))
    c = run(torch.Generator().manual_seed(2))
    _assert_lists([a], [b])
    assert any(not torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.cuda
@requires_cuda
def test_cuda_graph_capture():
    model = _model(torch.bfloat16, "cuda")
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 8, device="cuda", dtype=torch.bfloat16)
    found_inf = torch.zeros(1, device="cuda")
    opt.found_inf = found_inf
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: state created outside the graph
            opt.zero_grad(set_to_none=False)
            _named_step(model, x, torch.bfloat16)
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        _named_step(model, x, torch.bfloat16)
        opt.step()
    p0 = next(model.parameters())
    step0 = float(opt.state[p0]["step"])
    before = p0.detach().clone()
    g.replay()
    torch.cuda.synchronize()
    assert float(opt.state[p0]["step"]) == step0 + 1
    assert not torch.equal(before, p0.detach())
    found_inf.fill_(1.0)
    before = p0.detach().clone()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(before, p0.detach()) and float(opt.state[p0]["step"]) == step0 + 1


def test_sr_adamw_trains_bf16_like_fp32():
    """The evidence: a noisy linear regression whose weights sit near 4 (bf16 ulp 2**-5 there) with lr 2e-3,
    so every AdamW update is below half a bf16 ulp. Round-to-nearest bf16 weights never move; SR AdamW on
    bf16 weights ends within 5% of torch's fp32 AdamW (both near the noise floor, 0.25)."""
    torch.manual_seed(0)
    n, d = 256, 16
    x = torch.randn(n, d)
    w0 = torch.randn(d, 1) * 0.5 + 4.0
    w_true = w0 + 0.3 * torch.randn(d, 1)
    y = x @ w_true + 0.5 * torch.randn(n, 1)

    def train(dtype, stochastic_rounding, steps=800, lr=2e-3):
        w = torch.nn.Parameter(w0.clone().to(dtype))
        if dtype == torch.float32:
            opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
        else:
            opt = optim.AdamW([w], lr=lr, weight_decay=0.0, stochastic_rounding=stochastic_rounding,
                              generator=torch.Generator().manual_seed(0))
        for _ in range(steps):
            opt.zero_grad()
            (x @ w.float() - y).square().mean().backward()
            opt.step()
        with torch.no_grad():
            return float((x @ w.float() - y).square().mean())

    initial = float((x @ w0 - y).square().mean())
    fp32 = train(torch.float32, False)
    rn = train(torch.bfloat16, False)
    sr = train(torch.bfloat16, True)
    assert fp32 < 0.25 * initial, (initial, fp32)
    assert rn > 3 * fp32, (fp32, rn)  # round to nearest: stuck near the start
    assert abs(sr - fp32) <= 0.05 * fp32, (fp32, sr, rn)


# --------------------------------------------------------------------------- cached step plans
#
# The oracle: the same optimizer with its plans dropped before every step (so
# every step builds and validates from scratch) must give bitwise the same
# params and state as the one that reuses its plans; the random bits come
# from torch.manual_seed before each step.


def _pair(cls, dtype, device, **kw):
    out = []
    for _ in range(2):
        model = _model(dtype, device)
        out.append((model, getattr(optim, cls)(model.parameters(), lr=1e-2, **kw)))
    return out


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)


def _step_both(pair, seed, fresh=True):
    for k, (model, opt) in enumerate(pair):
        if k == 0 and fresh:
            opt._plans = {}
        torch.manual_seed(seed)
        opt.step()


def _assert_same(pair):
    (m0, o0), (m1, o1) = pair
    for p, q in zip(m0.parameters(), m1.parameters()):
        assert_bitwise_equal(p.detach(), q.detach(), "param")
        assert set(o0.state[p]) == set(o1.state[q])
        for key, v in o0.state[p].items():
            if isinstance(v, torch.Tensor):
                assert_bitwise_equal(v, o1.state[q][key], key)


PLAN_CASES = [("AdamW", {}), ("AdamW", dict(moment_dtype=torch.bfloat16)), ("SGD", dict(momentum=0.9)),
              ("SGD", {})]


@pytest.mark.parametrize("cls,kw", PLAN_CASES)
def test_plan_steady_steps_equal_fresh_steps(device, cls, kw):
    pair = _pair(cls, torch.bfloat16, device, **kw)
    for s in range(4):
        for model, _ in pair:
            _grads(model, s)  # new grad tensors, as after zero_grad(set_to_none=True)
        _step_both(pair, s)
        _assert_same(pair)
    assert len(pair[1][1]._plans) == 1


@pytest.mark.parametrize("cls,kw", PLAN_CASES)
def test_plan_rebuilt_when_params_grads_or_state_change(cls, kw):
    pair = _pair(cls, torch.bfloat16, "cpu", **kw)

    def step(s, change=None):
        for model, opt in pair:
            _grads(model, s)
            if change is not None:
                change(model, opt)
        _step_both(pair, s)
        _assert_same(pair)

    step(0)
    step(1, lambda m, o: setattr(m[0].bias, "grad", None))  # a grad set to None: that param is left alone
    step(2)  # and comes back
    step(3, lambda m, o: setattr(m[2].weight, "data", m[2].weight.detach().clone()))  # a param's storage
    if cls == "AdamW" or kw:
        key = "exp_avg" if cls == "AdamW" else "momentum_buffer"
        step(4, lambda m, o: o.state[m[0].weight].__setitem__(key, torch.full_like(o.state[m[0].weight][key], 0.5)))
        step(5, lambda m, o: o.load_state_dict(o.state_dict()))
        step(6, lambda m, o: o.state.__setitem__(m[0].bias, {}))  # state dropped: created anew
    # A param replaced in its group.
    new = [torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(9)).bfloat16()) for _ in pair]
    for i, (model, opt) in enumerate(pair):
        _grads(model, 7)
        opt.param_groups[0]["params"][1] = new[i]
        new[i].grad = torch.ones(3, dtype=torch.bfloat16)
        torch.manual_seed(7)
        if i == 0:
            opt._plans = {}
        opt.step()
    assert_bitwise_equal(new[0].detach(), new[1].detach(), "replaced param")
    # A param group added.
    extra = [torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16)) for _ in pair]
    for e, (_, opt) in zip(extra, pair):
        opt.add_param_group({"params": [e], "lr": 0.5})
        e.grad = torch.full((5,), 0.25, dtype=torch.bfloat16)
    _step_both(pair, 8)
    assert_bitwise_equal(extra[0].detach(), extra[1].detach(), "added group")
    assert not torch.equal(extra[1].detach(), torch.ones(5, dtype=torch.bfloat16))
    assert len(pair[1][1]._plans) == 2


def test_plan_steps_are_views_of_one_counter_and_round_trip():
    model = _model(torch.bfloat16)
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(3):
        _grads(model, s)
        opt.step()
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert all(t.dtype == torch.float32 and t.shape == () and float(t) == 3.0 for t in steps)
    assert all(t._base is steps[0]._base for t in steps)  # one add per step moves them all
    sd = opt.state_dict()
    other = optim.AdamW(_model(torch.bfloat16).parameters(), lr=1e-2)
    other.load_state_dict(sd)
    assert float(other.state[next(iter(other.state))]["step"]) == 3.0


def test_plan_momentum_switched_on_later():
    pair = _pair("SGD", torch.bfloat16, "cpu", momentum=0.0)
    for s in range(3):
        for model, opt in pair:
            _grads(model, s)
            if s == 2:
                opt.param_groups[0]["momentum"] = 0.9
        _step_both(pair, s)
        _assert_same(pair)
    assert "momentum_buffer" in pair[1][1].state[next(pair[1][0].parameters())]


def _bad_grad_cases():
    def other_dtype(p):
        p.grad.data = p.grad.float()

    def other_shape(p):
        p.grad.data = torch.zeros(p.numel() + 1, dtype=p.dtype)

    def sparse(p):
        p.grad = p.grad.to_sparse()

    return [(other_dtype, TypeError, r"grads\[\d\]"), (other_shape, ValueError, r"grads\[\d\]"),
            (sparse, ValueError, "sparse")]


@pytest.mark.parametrize("mutate,err,match", _bad_grad_cases())
@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_plan_bad_grad_errors_and_changes_nothing(cls, mutate, err, match):
    model = _model(torch.bfloat16)
    opt = getattr(optim, cls)(model.parameters(), lr=1e-2, **({"momentum": 0.9} if cls == "SGD" else {}))
    for s in range(2):
        _grads(model, s)
        opt.step()
    _grads(model, 5)
    params = [p.detach().clone() for p in model.parameters()]
    state = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    mutate(model[2].weight)
    with pytest.raises(err, match=match):
        opt.step()
    for p, before in zip(model.parameters(), params):
        assert_bitwise_equal(p.detach(), before, "param")
    after = {(i, k): v for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    assert set(after) == set(state)
    for k in state:
        assert_bitwise_equal(after[k], state[k], str(k))
    # Fixed, it goes on.
    _grads(model, 6)
    opt.step()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("cls", ["AdamW", "SGD"])
def test_plan_grad_on_another_device_errors(cls):
    model = _model(torch.bfloat16, "cuda")
    opt = getattr(optim, cls)(model.parameters(), lr=1e-2, momentum=0.9) if cls == "SGD" else \
        optim.AdamW(model.parameters(), lr=1e-2)
    _grads(model, 0)
    opt.step()
    _grads(model, 1)
    before = [p.detach().clone() for p in model.parameters()]
    model[2].weight.grad.data = model[2].weight.grad.cpu()
    with pytest.raises(ValueError, match="cpu|cuda"):
        opt.step()
    for p, b in zip(model.parameters(), before):
        assert_bitwise_equal(p.detach(), b, "param")


# --------------------------------------------------------------------------- state of the wrong size
#
# A state buffer the core would read and write as if it had its param's size
# (a checkpoint of a resized layer, a buffer replaced or resized after the
# plan was built) must be refused with torch-like errors that name the param
# and the state key, before anything is written.


def _wrong_size_cases(cls):
    key = "exp_avg" if cls == "AdamW" else "momentum_buffer"
    keys = ["exp_avg", "exp_avg_sq"] if cls == "AdamW" else ["momentum_buffer"]

    def replaced_smaller(opt, p, k):
        opt.state[p][k] = torch.zeros(3, dtype=opt.state[p][k].dtype)

    def replaced_larger(opt, p, k):
        opt.state[p][k] = torch.zeros(p.numel() + 1000, dtype=opt.state[p][k].dtype)

    def resized_in_place(opt, p, k):
        opt.state[p][k].resize_(2)  # same object and (shrunk in place) the same pointer

    def same_numel_other_shape(opt, p, k):
        opt.state[p][k] = torch.zeros(p.numel(), dtype=opt.state[p][k].dtype)

    def strided_in_place(opt, p, k):
        t = opt.state[p][k]
        t.as_strided_((t.numel() // 2,), (2,))  # same object, same pointer

    cases = [replaced_smaller, replaced_larger, resized_in_place, same_numel_other_shape, strided_in_place]
    return [(cls, k, c) for k in keys for c in cases] + [(cls, key, None)]


@pytest.mark.parametrize("cls,key,mutate", _wrong_size_cases("AdamW")[:-1] + _wrong_size_cases("SGD")[:-1])
@pytest.mark.parametrize("when", ["after_plan", "before_first_step"])
def test_state_of_the_wrong_size_refused_before_any_write(cls, key, mutate, when):
    torch.manual_seed(0)
    model = _model(torch.bfloat16)
    kw = {"momentum": 0.9} if cls == "SGD" else {}
    opt = getattr(optim, cls)(model.parameters(), lr=1e-2, **kw)
    target = model[2].weight
    if when == "after_plan":
        for s in range(2):
            _grads(model, s)
            opt.step()
        assert opt._plans
    else:  # state present before the optimizer ever stepped (as a loaded checkpoint gives it)
        donor = getattr(optim, cls)(model.parameters(), lr=1e-2, **kw)
        _grads(model, 0)
        donor.step()
        opt.load_state_dict(donor.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape))
    _grads(model, 5)
    mutate(opt, target, key)
    params = [p.detach().clone() for p in model.parameters()]
    state = {(i, k): v.detach().clone() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    index = next(i for i, p in enumerate(model.parameters()) if p is target)
    with pytest.raises(ValueError, match=rf"state\['{key}'\] of params\[{index}\].*(elements|shape|contiguous)"):
        opt.step()
    for p, before in zip(model.parameters(), params):
        assert_bitwise_equal(p.detach(), before, "param")
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            if (i, k) in state and v.shape == state[(i, k)].shape:
                assert_bitwise_equal(v.detach(), state[(i, k)], f"state {i} {k}")
    # Reset, it goes on.
    del opt.state[target]
    opt._plans = {}
    opt.step()


@pytest.mark.parametrize("which", ["exp_avgs", "exp_avg_sqs"])
@pytest.mark.parametrize("size", [3, 40])
def test_adamw_step_wrong_sized_moment_refused(which, size):
    ps, gs, ms, vs, steps = _lists([(37,), (5, 9)], torch.bfloat16, torch.float32)
    lists = dict(exp_avgs=ms, exp_avg_sqs=vs)
    lists[which][1] = torch.zeros(size)
    before = _clone([ps, ms, vs, steps])
    with pytest.raises(ValueError, match=rf"{which}\[1\] has {size} elements.*params\[1\] has 45"):
        optim.adamw_step_(ps, gs, ms, vs, steps, seed=1, **ADAM_KW)
    _assert_lists([ps, ms, vs, steps], before)


@pytest.mark.parametrize("size", [3, 100])
def test_sgd_step_wrong_sized_momentum_buffer_refused(size):
    ps, gs, ms, _, _ = _lists([(37,), (5, 9)], torch.bfloat16, torch.float32)
    ms[0] = torch.zeros(size)
    before = _clone([ps, ms])
    with pytest.raises(ValueError, match=rf"momentum_buffers\[0\] has {size} elements.*params\[0\] has 37"):
        optim.sgd_step_(ps, gs, ms, [False, False], seed=1, **SGD_KW)
    _assert_lists([ps, ms], before)


def test_native_plan_refuses_moment_sizes_it_was_not_given():
    """The core checks every size: a plan handed a moment's true size that differs from its param's refuses
    to launch, whatever Python checked before."""
    from adaptive_amp import _C
    p = torch.zeros(8, dtype=torch.bfloat16)
    m, v = torch.zeros(3), torch.zeros(8)
    step = torch.zeros(1)
    p.grad = torch.ones(8, dtype=torch.bfloat16)
    st = {"exp_avg": m, "exp_avg_sq": v}

    def plan(m_numel, watched=True):
        keys, values = (["exp_avg", "exp_avg_sq"], [m, v]) if watched else ([], [])
        return _C.OptimPlan(0, [p], [0], [], [p], [p.data_ptr()], [8], [2], [p.shape], [p.dtype], {p: st}, [st],
                            keys, values, [x.data_ptr() for x in values], [m.data_ptr()], [m_numel], [0],
                            [v.data_ptr()], [8], [0], [step.data_ptr()], [], -1)

    # Told the moment's true size, the core compares it with the param's and refuses.
    good = plan(3)
    assert good.collect()
    with pytest.raises(ValueError, match=r"exp_avgs\[0\]: has 3 elements; params\[0\] has 8"):
        good.launch(1e-3, 0.9, 0.999, 1e-8, 0.0, 0.0, False, 0.0, False, False, 0, 0, 0, 0, 0, 0, (None,) * 3)
    # Told a wrong size, or handed a moment it cannot watch, the plan is not built.
    with pytest.raises(ValueError, match=r"exp_avgs\[0\]: has 3 elements, not the 8 given"):
        plan(8)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\]: is not one of the state values"):
        plan(3, watched=False)
    # Resized in place after the plan was built (same object, same pointer): collect() no longer holds.
    v.resize_(4)
    assert not good.collect()
    assert torch.equal(m, torch.zeros(3))


@pytest.mark.parametrize("cls,kw", PLAN_CASES)
def test_lazily_negated_grads_step_with_their_sign(cls, kw):
    """A grad with torch's lazy negation flag (memory holds -grad) steps as the resolved grad, on the first
    step and on a planned one (the sign was lost before)."""
    pair = _pair(cls, torch.bfloat16, "cpu", **kw)
    for s in range(3):
        for k, (model, _) in enumerate(pair):
            _grads(model, s)
            if k == 1:
                for p in model.parameters():
                    p.grad = torch._neg_view(p.grad.neg())  # the same values, negated lazily
                    assert p.grad.is_neg()
        _step_both(pair, s, fresh=False)
        _assert_same(pair)


def test_lazily_negated_grad_scale_is_read_with_its_sign():
    ps, gs, ms, vs, steps = _lists([(37,)], torch.float32, torch.float32)
    a, b = _clone([ps, ms, vs, steps]), _clone([ps, ms, vs, steps])
    optim.adamw_step_(a[0], gs, a[1], a[2], a[3], grad_scale=torch.tensor([4.0]), seed=1, **ADAM_KW)
    optim.adamw_step_(b[0], gs, b[1], b[2], b[3], grad_scale=torch._neg_view(torch.tensor([-4.0])), seed=1,
                      **ADAM_KW)
    _assert_lists(a, b)



@pytest.mark.parametrize("cls,kw", PLAN_CASES)
def test_channels_last_params_and_strided_grads_step_like_contiguous_ones(cls, kw):
    """A channels_last conv net (params, grads and the moments created for them in that layout) steps as the
    same net in the contiguous layout; a transposed grad is read through a copy, as torch's optimizers take it."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 1)).bfloat16() for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    nets[1] = nets[1].to(memory_format=torch.channels_last)
    opts = [getattr(optim, cls)(n.parameters(), lr=1e-2, **kw) for n in nets]
    x = torch.randn(2, 3, 9, 9).bfloat16()
    for s in range(3):
        for k, (net, opt) in enumerate(zip(nets, opts)):
            opt.zero_grad()
            inp = x if k == 0 else x.contiguous(memory_format=torch.channels_last)
            net(inp).float().square().mean().backward()
            torch.manual_seed(s)
            opt.step()
        assert not nets[1][0].weight.is_contiguous()
        for p, q in zip(nets[0].parameters(), nets[1].parameters()):
            torch.testing.assert_close(p.float(), q.float(), atol=0.05, rtol=0.05)
    for p in nets[1].parameters():
        for v in opts[1].state[p].values():
            if v.dim() == 4:
                assert v.stride() == p.stride()
    assert len(opts[1]._plans) == 1


@pytest.mark.parametrize("cls, kw", [("AdamW", {}), ("SGD", {"momentum": 0.9})])
def test_contiguous_grad_of_a_channels_last_param_is_read_in_the_params_layout(cls, kw):
    """A grad assigned by hand in the contiguous layout to a channels_last param: the plan must not pair its
    elements with the param's by memory order (it did: a silently wrong update)."""
    torch.manual_seed(0)
    w = torch.randn(8, 3, 3, 3).bfloat16()
    ps = [w.clone().contiguous(memory_format=torch.channels_last).requires_grad_(),
          w.clone().contiguous(memory_format=torch.channels_last).requires_grad_()]
    opts = [getattr(optim, cls)([p], lr=1e-2, **kw) for p in ps]
    for s in range(3):
        g = torch.randn(8, 3, 3, 3).bfloat16()
        ps[0].grad = g.contiguous(memory_format=torch.channels_last)  # the param's layout
        ps[1].grad = g.contiguous()  # contiguous: another memory order
        for opt in opts:
            torch.manual_seed(s)
            opt.step()
        assert_bitwise_equal(ps[1].detach(), ps[0].detach())


def test_transposed_grad_is_read_like_its_contiguous_copy():
    ps, gs, ms, vs, steps = _lists([(5, 9)], torch.float32, torch.float32)
    a, b = _clone([ps, ms, vs, steps]), _clone([ps, ms, vs, steps])
    optim.adamw_step_(a[0], gs, a[1], a[2], a[3], seed=1, **ADAM_KW)
    optim.adamw_step_(b[0], [gs[0].t().contiguous().t()], b[1], b[2], b[3], seed=1, **ADAM_KW)
    _assert_lists(a, b)


def test_contiguous_checkpoint_loads_into_a_channels_last_net():
    torch.manual_seed(0)
    net = torch.nn.Conv2d(3, 8, 3).bfloat16()
    opt = optim.AdamW(net.parameters(), lr=1e-2)
    net(torch.randn(1, 3, 5, 5).bfloat16()).float().sum().backward()
    opt.step()
    sd = opt.state_dict()
    net.to(memory_format=torch.channels_last)
    other = optim.AdamW(net.parameters(), lr=1e-2)
    other.load_state_dict(sd)
    for key in ("exp_avg", "exp_avg_sq"):
        assert other.state[net.weight][key].stride() == net.weight.stride()
        assert torch.equal(other.state[net.weight][key], opt.state[net.weight][key])
    net(torch.randn(1, 3, 5, 5).bfloat16().contiguous(memory_format=torch.channels_last)).float().sum().backward()
    other.step()


@pytest.mark.parametrize("kw", [dict(cls="AdamW"), dict(cls="AdamW", moment_dtype=torch.bfloat16),
                                dict(cls="SGD", momentum=0.9), dict(cls="SGD")])
@pytest.mark.parametrize("view", ["sliced", "transposed"])
def test_a_param_not_dense_in_memory_is_refused_by_name_before_any_state(kw, view):
    """The refusal names the param, not the state the step would create in its layout, and leaves no state."""
    kw = dict(kw)
    cls = getattr(optim, kw.pop("cls"))
    keep = torch.nn.Parameter(torch.randn(3))
    base = torch.randn(4, 8)
    odd = torch.nn.Parameter(base[:, ::2] if view == "sliced" else base.t())
    opt = cls([keep, odd], lr=1e-2, **kw)
    keep.grad, odd.grad = torch.randn(3), torch.randn(odd.shape)
    before = keep.detach().clone(), odd.detach().clone()
    with pytest.raises(ValueError, match=r"params\[1\] is not dense in memory .*nn.Parameter\(w.contiguous\(\)\)"):
        opt.step()
    assert len(opt.state) == 0
    assert torch.equal(keep, before[0]) and torch.equal(odd, before[1])
