"""Pure-bf16 training with adaptive_amp.optim.AdamW: bf16 weights, no fp32 master copy.

Needs torch only, no extra (``pip install torch``, then ``pip install -e .`` in the clone).

With bf16 weights and round-to-nearest, an update smaller than half a bf16 ulp of the weight (1/256 of it)
is lost: with a small learning rate, training stalls. adaptive_amp.optim.AdamW does the step in fp32 and
writes the weights back with stochastic rounding, so the expected weight is the fp32 one and small updates
add up. The same model is trained three ways: fp32 weights with torch's AdamW (the reference), bf16 weights
with torch's AdamW (round to nearest), bf16 weights with adaptive_amp's AdamW (stochastic rounding).

    python examples/bf16_pure_adamw.py
"""

import sys

try:
    import torch
    from torch import nn
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs torch: pip install torch")

import adaptive_amp

device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator(device="cpu").manual_seed(0)
x = torch.randn(1024, 32, generator=gen).to(device)
w_true, b_true = torch.randn(1, 32, generator=gen), torch.tensor([3.0])
y = x @ w_true.to(device).T + b_true.to(device)
# Fine-tuning: the weights start near the solution and the learning rate is small, so every update is far
# below a bf16 ulp of the weight (1e-3 against 2**-7 at 1.0, 2**-6 at 3.0).
w_start = w_true + 0.1 * torch.randn(1, 32, generator=gen)
b_start = b_true - 0.2


def train(dtype, make_optimizer, steps=400, lr=1e-3):
    model = nn.Linear(32, 1).to(device=device, dtype=dtype)
    with torch.no_grad():
        model.weight.copy_(w_start)
        model.bias.copy_(b_start)
    optimizer = make_optimizer(model.parameters(), lr)
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x.to(dtype)).float(), y).item()


fp32 = train(torch.float32, lambda p, lr: torch.optim.AdamW(p, lr=lr))
nearest = train(torch.bfloat16, lambda p, lr: torch.optim.AdamW(p, lr=lr))
sround = train(torch.bfloat16, lambda p, lr: adaptive_amp.optim.AdamW(p, lr=lr))  # fp32 moments, SR weights
start = nn.functional.mse_loss(x @ w_start.to(device).T + b_start.to(device), y).item()
print(f"device {device}, mean squared error after 400 steps (it starts at {start:.4f}):")
print(f"  fp32 weights, torch AdamW                    {fp32:.4f}")
print(f"  bf16 weights, torch AdamW (round to nearest) {nearest:.4f}")
print(f"  bf16 weights, adaptive_amp AdamW (SR)        {sround:.4f}")
print(f"  memory per parameter (param + optimizer state): fp32 AdamW 12 B, bf16 + SR AdamW 10 B "
      f"(6 B with moment_dtype=torch.bfloat16)")
assert sround < 0.5 * nearest and nearest > 0.5 * start, "stochastic rounding should keep the small updates that round-to-nearest loses"
