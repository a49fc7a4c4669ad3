"""fp8 layers stacked on the memory recipes: bf16-weights and bf16-pure (stochastic-rounding optimizer, fp32 or
bf16 moments) and activation checkpointing, as presets ("bf16-pure+fp8"), as tuning candidates and under a
MemoryGuard's moves; the guard's recompute whatever the weights' dtype.

On the CPU torch._scaled_mm runs, so fp8 is exercised for real with the device check patched "as on an H100"
and the gain measurement replaced by a table (select_fp8_layers' gain_fn)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import adaptive_amp
from adaptive_amp import AdaptiveMixedPrecision, zoo
from adaptive_amp.policy import PrecisionPolicy


def _quiet_torchao():
    pytest.importorskip("torchao")
    logging.getLogger("torchao").setLevel(logging.ERROR)


@pytest.fixture
def fp8_here(monkeypatch):
    """fp8 allowed on the CPU, as on a GPU with fp8 matmuls (torch._scaled_mm runs on the CPU)."""
    _quiet_torchao()
    from adaptive_amp.fp8 import eligibility

    monkeypatch.setattr(eligibility, "device_unsupported", lambda device=None: None)


def _sr_adamw(model, moments=torch.float32):
    return adaptive_amp.optim.AdamW(model.parameters(), lr=1e-3, stochastic_rounding=True, moment_dtype=moments)


def _train(amp, zm, steps, model=None):
    losses = []
    for step in range(steps):
        with amp.autocast():
            loss = zm.loss(model or zm.model, zm.make_batch(4, seed=step % 2))
        amp.backward(loss)
        amp.step()
        amp.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------- the guard's recompute


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_guards_recompute_takes_any_weight_dtype_and_leaves_the_weights(fp8_here, dtype):
    from adaptive_amp.fp8 import fp8_layer_row

    torch.manual_seed(0)
    layer = nn.Linear(32, 64).to(dtype)
    weight, bias = layer.weight, layer.bias
    before = weight.detach().clone(), bias.detach().clone()
    row = fp8_layer_row("fc", layer, torch.randn(8, 32).to(dtype))
    assert 0 < row["error"] < 0.15
    assert layer.weight is weight and layer.bias is bias and weight.dtype == bias.dtype == dtype
    assert torch.equal(weight, before[0]) and torch.equal(bias, before[1])


def test_bf16_pure_with_fp8_layers_is_guarded_at_statistics_steps(fp8_here):
    zm = zoo.build("llama", "tiny", seed=0)
    opt = _sr_adamw(zm.model)
    policy = PrecisionPolicy.from_string("bf16-pure").replace(layers=(("*.mlp.*", "fp8-tensorwise"),))
    amp = AdaptiveMixedPrecision(zm.model, opt, policy=policy, stats_every=1, progress=False)
    losses = _train(amp, zm, 3)
    assert all(map(torch.isfinite, torch.tensor(losses)))
    rows = amp._fp8_watch.rows
    assert len(rows) == 6 and all(0 < r["error"] < 0.15 for r in rows), rows
    assert not [e for e in amp.events if e.kind.startswith("fp8")]
    assert all(p.dtype == torch.bfloat16 for p in zm.model.parameters())
