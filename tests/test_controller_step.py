"""AdaptiveMixedPrecision.step fails safe: what it refuses, it refuses before any weight changed; an
optimizer without gradients (a GAN step) takes a no-op step; a non-finite loss never reaches the weights.

Oracles: torch's own loop (torch.autocast and torch.amp.GradScaler on the CPU, stepping only the optimizer
that got gradients), the weights and optimizer state before the step, and the monitor's events.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import adaptive_amp.optim as aopt
from adaptive_amp import zoo
from adaptive_amp.controller import AdaptiveMixedPrecision
from adaptive_amp.hardware import Capabilities
from conftest import assert_bitwise_equal, requires_cuda

FP16 = "params=float32,compute=float16,loss_scale=dynamic:1024"
BF16 = "params=float32,compute=bfloat16"
CPU_BF16 = Capabilities(device_type="cpu", name="test cpu with bf16", bf16=True, fp16=True)

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

OPTIMIZERS = {
    "torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "torch_fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adaptive_amp_adamw": lambda ps: aopt.AdamW(ps, lr=1e-2, stochastic_rounding=False),
}


def _mlp(seed, d=8, out=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 16), nn.ReLU(), nn.Linear(16, out))


def _amp(model, optimizers, policy, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AdaptiveMixedPrecision(model, optimizers, policy=policy, capabilities=CPU_BF16, progress=False,
                                      **kw)


def _snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _batch(i, d=8):
    return torch.randn(4, d, generator=torch.Generator().manual_seed(100 + i))


# ---------------------------------------------------------------- an optimizer without gradients


@pytest.mark.parametrize("policy", [FP16, BF16, "float32"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("idle_first", [True, False])
def test_a_gan_step_leaves_the_idle_optimizer_alone_and_steps_the_other_as_torch_does(policy, kind, idle_first):
    make = OPTIMIZERS[kind]
    gen, disc = _mlp(1, out=8), _mlp(2)
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    opt_g, opt_d = make(gen.parameters()), make(disc.parameters())
    amp = _amp(model, [opt_g, opt_d] if idle_first else [opt_d, opt_g], policy)
    # torch's loop: the same autocast and scaler, stepping only the optimizer that got gradients
    ref = _mlp(2)
    ref_opt = make(ref.parameters())
    compute = {FP16: torch.float16, BF16: torch.bfloat16}.get(policy)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=compute == torch.float16)
    gen_before = _snapshot(gen)
    for i in range(3):
        with amp.autocast():
            loss = disc(_batch(i)).float().square().mean()
        amp.backward(loss)
        assert amp.step()
        amp.zero_grad()
        with torch.autocast("cpu", dtype=compute or torch.float32, enabled=compute is not None):
            ref_loss = ref(_batch(i)).float().square().mean()
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    assert _same(gen_before, gen.parameters()) and not opt_g.state
    for got, want in zip(disc.parameters(), ref.parameters()):
        assert_bitwise_equal(got.detach(), want.detach())
    assert amp.step_count == 3


@pytest.mark.parametrize("policy", [FP16, BF16, "float32"])
def test_a_step_without_any_gradient_is_refused_and_changes_nothing(policy):
    model = _mlp(0)
    amp = _amp(model, torch.optim.AdamW(model.parameters()), policy)
    with pytest.raises(RuntimeError, match="no parameter of any optimizer has a gradient.*backward"):
        amp.step()
    assert amp.step_count == 0 and not amp.optimizers[0].state


# ---------------------------------------------------------------- errors before anything changed


def test_gradients_the_scaler_refuses_are_refused_before_the_first_optimizer_steps():
    first, second = _mlp(0), nn.Linear(8, 1).half()  # fp16 weights under a step that unscales them: torch refuses
    model = nn.ModuleDict({"first": first, "second": second})
    opts = [torch.optim.AdamW(first.parameters()), torch.optim.SGD(second.parameters(), lr=0.1)]
    amp = _amp(model, opts, FP16)
    with amp.autocast():
        loss = first(_batch(0)).float().mean() + second(_batch(1).half()).float().mean()
    amp.backward(loss)
    before, scaler_state = _snapshot(model), amp.scaler.state_dict()
    for _ in range(2):  # and a retry fails the same way, still changing nothing
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            amp.step()
        assert _same(before, model.parameters()) and not opts[0].state and amp.step_count == 0
        assert amp.scaler.state_dict() == scaler_state


@pytest.mark.parametrize("max_grad_norm", [-1.0, float("nan"), True, "1"])
def test_a_bad_clip_norm_is_refused_by_name_before_anything_changed(max_grad_norm):
    model = _mlp(0)
    amp = _amp(model, torch.optim.AdamW(model.parameters()), FP16)
    amp.backward(model(_batch(0)).mean())
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="max_grad_norm must be a number >= 0"):
        amp.step(max_grad_norm=max_grad_norm)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        amp.clip_grad_norm_(max_grad_norm)
    with pytest.raises(ValueError, match="norm_type must be a number"):
        amp.step(max_grad_norm=1.0, norm_type="two")
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))  # not even unscaled
    assert amp.step(max_grad_norm=1.0) and amp.step_count == 1


@pytest.mark.filterwarnings("ignore:AdaptiveMixedPrecision. no layer statistics")
@pytest.mark.parametrize("policy", ["float32", BF16, "auto", FP16])
@pytest.mark.parametrize("kind", ["torch_adamw", "torch_fused_adamw"])
def test_a_float64_model_steps(policy, kind):
    model, ref = _mlp(0).double(), _mlp(0).double()
    amp = _amp(model, OPTIMIZERS[kind](model.parameters()), policy)
    ref_opt = OPTIMIZERS[kind](ref.parameters())
    for i in range(3):
        with amp.autocast():
            loss = model(_batch(i).double()).float().square().mean()
        amp.backward(loss)
        assert amp.step()
        amp.zero_grad()
        ref(_batch(i).double()).float().square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert amp.step_count == 3 and all(p.dtype == torch.float64 for p in model.parameters())
    amp.report()  # (reads the last window)
    norms = amp.monitor.history()["grad_norm"]
    assert len(norms) == 3 and all(n > 0 for n in norms)
    if policy == "float32":  # no autocast, no scaling: torch's plain loop, bit for bit
        for got, want in zip(model.parameters(), ref.parameters()):
            assert_bitwise_equal(got.detach(), want.detach())


class _FailingGuard:
    """A memory guard whose check after the step raises: an error once the optimizers have stepped."""

    def after_step(self, amp):
        raise RuntimeError("guard failed")


@pytest.mark.parametrize("policy", [FP16, BF16])
def test_gradients_of_a_step_that_failed_after_stepping_are_not_applied_again(policy):
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = _amp(model, opt, policy, memory_guard=_FailingGuard())
    amp.backward(model(_batch(0)).square().mean())
    with pytest.raises(RuntimeError, match="guard failed"):
        amp.step()
    after_first = _snapshot(model)
    assert not _same(after_first, _snapshot(_mlp(0)))  # the optimizer had stepped
    with pytest.raises(RuntimeError, match="not applied twice"):
        amp.step()
    assert _same(after_first, model.parameters()) and int(opt.state[model[0].weight]["step"]) == 1
    amp.memory_guard = None
    amp.zero_grad()
    amp.backward(model(_batch(1)).square().mean())
    assert amp.step() and int(opt.state[model[0].weight]["step"]) == 2


# ---------------------------------------------------------------- a non-finite loss


@pytest.mark.parametrize("policy", [FP16, BF16, "float32", "bf16-pure"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("bad,through", [(float("nan"), False), (float("inf"), False), (float("nan"), True)],
                         ids=["nan_detached", "inf_detached", "nan_through_the_graph"])
def test_a_non_finite_loss_never_reaches_the_weights(policy, kind, bad, through):
    if policy == "bf16-pure" and kind != "adaptive_amp_adamw":
        pytest.skip("bf16-pure takes an optimizer that rounds stochastically")
    model = _mlp(0)
    make = (lambda ps: aopt.AdamW(ps, lr=1e-2)) if policy == "bf16-pure" else OPTIMIZERS[kind]
    opt = make(model.parameters())
    amp = _amp(model, opt, policy, read_every=4)
    results = []
    for i in range(8):
        before = _snapshot(model)
        steps_before = [float(st["step"]) for st in opt.state.values()]
        with amp.autocast():
            loss = model(_batch(i)).float().square().mean()
            if i in (2, 5):
                # A detached term keeps the gradients finite (only the loss tells); through the graph, the
                # gradients are NaN too (the scaler's own found_inf and the loss's both say skip).
                loss = loss * bad if through else loss + torch.tensor(bad)
        amp.backward(loss)
        results.append(amp.step())
        amp.zero_grad()
        if i in (2, 5):
            assert _same(before, model.parameters()), f"step {i}: a non-finite loss changed the weights"
            assert [float(st["step"]) for st in opt.state.values()] == steps_before, "the optimizer counted it"
    assert [bool(r) for r in results][2] is False and bool(results[5]) is False
    assert sum(bool(r) for r in results) >= 5
    nan_events = [e for e in amp.report().events if e["kind"] == "nan_loss"]
    assert [e["step"] for e in nan_events] == [2, 5]
    assert all("skipped, weights unchanged" in e["message"] and e["data"]["skipped"] == 1 for e in nan_events)


@pytest.mark.parametrize("backwards", [1, 2])
@pytest.mark.parametrize("last_loss", [1.0, float("nan")], ids=["finite", "nan_in_the_last_backward"])
def test_the_host_read_of_the_loss_flag_is_queued_before_each_backward(monkeypatch, backwards, last_loss):
    """Without loss scaling, an optimizer that cannot skip on the device (torch's AdamW) is skipped from the host:
    the loss's flag must be queued behind the forward only, or step()'s read waits for the whole backward at
    every step (the device then idles while the host launches the optimizer and the next forward)."""
    order = []
    real = AdaptiveMixedPrecision._nonfinite
    monkeypatch.setattr(AdaptiveMixedPrecision, "_nonfinite",
                        staticmethod(lambda loss: order.append("flag") or real(loss)))
    model = _mlp(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = _amp(model, opt, BF16)
    before = _snapshot(model)
    for k in range(backwards):
        with amp.autocast():
            loss = model(_batch(k)).float().square().mean()
            if k == backwards - 1:
                loss = loss * last_loss
        loss.register_hook(lambda g: order.append("backward"))
        amp.backward(loss)
    queued = list(order)
    stepped = amp.step()
    assert queued == ["flag", "backward"] * backwards
    assert bool(stepped) == (last_loss == 1.0)
    assert _same(before, model.parameters()) == (last_loss != 1.0)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_on_zoo_models_the_loss_flag_is_queued_before_backward(monkeypatch, family, mode):
    """The same on the zoo's GPT-2 (Conv1D) and Llama, eager and compiled: each step's flag is queued before its
    backward, and a NaN loss is still skipped with the weights unchanged."""
    order = []
    real = AdaptiveMixedPrecision._nonfinite
    monkeypatch.setattr(AdaptiveMixedPrecision, "_nonfinite",
                        staticmethod(lambda loss: order.append("flag") or real(loss)))
    zm = zoo.build(family, "tiny", seed=0)
    torch._dynamo.reset()
    model = torch.compile(zm.model, backend="aot_eager") if mode == "compiled" else zm.model
    amp = _amp(model, torch.optim.AdamW(zm.model.parameters(), lr=1e-3), BF16)
    try:
        for i, factor in enumerate((1.0, float("nan"), 1.0)):
            order.clear()
            before = _snapshot(zm.model)
            with amp.autocast():
                loss = zm.loss(model, zm.make_batch(2, seed=i)) * factor
            loss.register_hook(lambda g: order.append("backward"))
            amp.backward(loss)
            assert order == ["flag", "backward"], (i, order)
            assert bool(amp.step()) == (factor == 1.0)
            assert _same(before, zm.model.parameters()) == (factor != 1.0)
            amp.zero_grad()
    finally:
        amp.remove()


@pytest.mark.cuda
@requires_cuda
def test_step_does_not_wait_for_the_backward_on_cuda():
    """The same on the device: with about half a second of backward queued (a spin in a gradient hook), step()
    returns long before the device is done: its read of the loss's flag waited for the forward only."""
    import time

    model = _mlp(0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # foreach: it cannot skip a step on the device
    amp = AdaptiveMixedPrecision(model, opt, policy=BF16, progress=False)
    assert amp._decides_skip_on_host()
    took = []
    for spin in (0, int(1e9)):  # a warm-up step, then the timed one
        with amp.autocast():
            out = model(_batch(0).cuda())
        out.register_hook(lambda g, spin=spin: torch.cuda._sleep(spin) if spin else None)
        amp.backward(out.float().square().mean())
        start = time.perf_counter()
        assert amp.step()
        took.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - start)
        amp.zero_grad()
    assert took[2] < took[3] / 3, f"step() took {took[2]:.3f} s of the {took[3]:.3f} s the device took"


def test_an_fp16_run_whose_loss_is_nan_from_the_first_step_never_updates_the_weights():
    model = _mlp(0)
    amp = _amp(model, torch.optim.AdamW(model.parameters(), lr=1e-2), FP16, read_every=5)
    before = _snapshot(model)
    for i in range(12):
        with amp.autocast():
            loss = model(_batch(i)).float().mean() * float("nan")
        amp.backward(loss)
        assert not amp.step()
        amp.zero_grad()
    assert _same(before, model.parameters())
    assert amp.policy.compute_dtype == torch.bfloat16  # the switch came, and still nothing was applied
    events = amp.report().events
    assert sum(e["data"].get("skipped", 0) for e in events if e["kind"] == "nan_loss") == 12


@pytest.mark.parametrize("policy", [FP16, BF16])
def test_a_zoo_model_with_a_nan_loss_keeps_its_weights(policy):
    zm = zoo.build("gpt2", "tiny", seed=0)
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-3)
    amp = _amp(zm.model, opt, policy, read_every=3)
    for i in range(6):
        batch = zm.make_batch(2, seed=i)
        before = _snapshot(zm.model)
        with amp.autocast():
            loss = zm.loss(zm.model, batch)
            loss = loss * float("nan") if i % 2 else loss
        amp.backward(loss)
        stepped = amp.step()
        amp.zero_grad()
        if i % 2:
            assert not stepped and _same(before, zm.model.parameters())
    assert all(torch.isfinite(p).all() for p in zm.model.parameters())
