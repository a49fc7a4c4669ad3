"""AdaptiveMixedPrecision driving a torch.compile'd model.

Needs torch only, no extra (``pip install torch``, then ``pip install -e .`` in the clone).

The controller picks the precision policy for the hardware (bf16 where it is native, fp16 with loss
scaling otherwise, fp32 islands for layers that need them), scales the loss when the policy says so, and
watches the run; the model itself is compiled, as one graph (fullgraph=True: a graph break would be an
error). The controller is given the module and compiles nothing itself; the autocast context it opens around
the compiled call is traced into the graph.

    python examples/compiled_adaptive.py          # CPU: a few seconds after compilation; GPU as is
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
model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
x = torch.randn(256, 32, device=device)
labels = (x[:, :8].argmax(dim=1))                          # a rule the network can learn

amp = adaptive_amp.AdaptiveMixedPrecision(model, optimizer, policy="auto", sample_inputs=x,
                                          loss_fn=lambda logits: nn.functional.cross_entropy(logits.float(), labels),
                                          progress=False)
compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break would be an error
for step in range(60):
    with amp.autocast():
        loss = nn.functional.cross_entropy(compiled(x).float(), labels)
    amp.backward(loss)
    amp.step(max_grad_norm=1.0)
    amp.zero_grad()
    if step == 0:
        first = loss.item()

accuracy = (compiled(x).argmax(dim=1) == labels).float().mean().item()
print(f"device {device}: policy {amp.policy}")
print(f"loss {first:.3f} -> {loss.item():.3f} in 60 compiled steps; training accuracy {accuracy:.2f}")
print(f"events: {[e.kind for e in amp.events] or 'none'}")
assert loss.item() < 0.5 * first
