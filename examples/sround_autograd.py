"""stochastic_round inside a custom autograd function: an unbiased low-precision activation.

Needs torch only, no extra (``pip install torch``, then ``pip install -e .`` in the clone).

`QuantizeSR` rounds a tensor to a low-precision format on the way forward (here fp8 e4m3 with a per-tensor
scale, as fp8 training recipes do) and passes the gradient straight through on the way back. Because the
rounding is stochastic, the quantized activation is unbiased: averaged over steps it equals the fp32 value,
where round-to-nearest keeps the same error every time. The script checks that property, then trains a small
network through the quantizer. (adaptive_amp.stochastic_round_ste is this function, ready made.)

    python examples/sround_autograd.py
"""

import sys

try:
    import torch
    from torch import nn
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs torch: pip install torch")

import adaptive_amp

E4M3_MAX = 448.0


class QuantizeSR(torch.autograd.Function):
    """Forward: x -> fp8 e4m3 with stochastic rounding -> back to x's dtype. Backward: identity."""

    @staticmethod
    def forward(ctx, x, generator=None):
        scale = E4M3_MAX / x.detach().abs().amax().clamp_min(1e-12)        # per-tensor scale, amax -> 448
        q = adaptive_amp.stochastic_round(x.detach(), torch.float8_e4m3fn, scale=float(scale), generator=generator)
        return q.to(x.dtype) / scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None                                               # straight-through


device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator(device=device).manual_seed(0)

# 1. Unbiased: the mean of many stochastic roundings approaches x; round-to-nearest keeps its error.
x = torch.randn(4096, device=device)
x[0] = 100.0  # one outlier sets the scale, so the other values keep only a few fp8 levels
mean_sr = torch.stack([QuantizeSR.apply(x, gen) for _ in range(256)]).mean(0)
scale = E4M3_MAX / x.abs().amax()
nearest = (x * scale).to(torch.float8_e4m3fn).float() / scale
err_sr, err_rn = (mean_sr - x)[1:].abs().mean().item(), (nearest - x)[1:].abs().mean().item()
print(f"mean |error| over 4095 values: stochastic rounding averaged over 256 draws {err_sr:.5f}, "
      f"round to nearest {err_rn:.5f}")

# 2. Train through it: the hidden activation is quantized to fp8 on every forward pass.
torch.manual_seed(0)
model_in, model_out = nn.Linear(16, 64).to(device), nn.Linear(64, 1).to(device)
optimizer = torch.optim.Adam([*model_in.parameters(), *model_out.parameters()], lr=1e-2)
inputs = torch.randn(512, 16, device=device)
target = inputs[:, :1] * 2 - inputs[:, 1:2]
for step in range(200):
    hidden = QuantizeSR.apply(torch.relu(model_in(inputs)), gen)
    loss = nn.functional.mse_loss(model_out(hidden), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"device {device}: training through the fp8 quantizer, final loss {loss.item():.4f}")
assert err_sr < err_rn / 2 and loss.item() < 0.05
