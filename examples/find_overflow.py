"""Find the layer whose values overflow fp16, with tensor_stats and debug.grad_report.

Needs torch only, no extra (``pip install torch``, then ``pip install -e .`` in the clone).

A small network has one layer ("blow_up") whose outputs exceed fp16's largest value (65504). Training it in
fp16 would skip every step; instead of guessing, measure: one tensor_stats launch over every layer's output
counts, per tensor, the values that would overflow (and underflow) fp16, and debug.grad_report does the same
for every gradient under a loss scale. Both sort the riskiest tensors first.

    python examples/find_overflow.py
"""

import sys

try:
    import torch
    from torch import nn
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs torch: pip install torch")

import adaptive_amp

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential()
model.add_module("embed", nn.Linear(16, 64))
model.add_module("act", nn.GELU())
model.add_module("blow_up", nn.Linear(64, 64))
model.add_module("norm", nn.LayerNorm(64))
model.add_module("head", nn.Linear(64, 4))
model = model.to(device)
with torch.no_grad():
    model.blow_up.weight.mul_(1e5)  # its outputs reach ~1e5: beyond fp16

# 1. Every layer's output in fp32 (forward hooks), measured against fp16 in one launch.
names, outputs = [], []


def record(name):
    def hook(module, inputs, output):
        names.append(name)
        outputs.append(output.detach())
    return hook


hooks = [module.register_forward_hook(record(name)) for name, module in model.named_children()]
x = torch.randn(256, 16, device=device)
loss = model(x).square().mean()
for h in hooks:
    h.remove()
stats = adaptive_amp.tensor_stats(outputs, fmt="float16", names=names)
print("layer outputs against float16, riskiest first:")
print(stats.table(sort_by="risk"))
worst = max(range(len(names)), key=lambda i: stats.to_dict()["overflow_count"][i])
print(f"-> the layer that overflows fp16: {names[worst]} "
      f"({stats.to_dict()['overflow_count'][worst]} of {outputs[worst].numel()} values, "
      f"amax {stats.to_dict()['amax'][worst]:.3g})")

# 2. The gradients as a GradScaler at 2**16 would scale them.
loss.backward()
report = adaptive_amp.debug.grad_report(model, fmt="float16", scale=2.0 ** 16)
print("\ngradients x 65536 against float16, riskiest first:")
print(report.table(limit=4))
grads = report.to_dict()
print(f"-> gradients that would overflow at this scale: {sum(grads['overflow_count'])} "
      "(the forward pass is the problem: keep blow_up in fp32, e.g. as an island of a PrecisionPolicy)")
assert names[worst] == "blow_up"
