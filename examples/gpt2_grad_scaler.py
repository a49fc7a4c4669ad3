"""adaptive_amp.GradScaler as a drop-in for torch.amp.GradScaler, on a transformers GPT-2.

Needs the ``integrations`` extra: ``pip install -e ".[integrations]"`` in the clone.

A tiny GPT-2 (random weights, no download) learns a repeating token pattern in fp16 autocast. The loop is
torch's AMP recipe with one line changed (the scaler), plus what the drop-in adds: the gradient norm from
the unscale pass (no second pass over the gradients) and a count of skipped steps.

    python examples/gpt2_grad_scaler.py            # a GPU when there is one, else the CPU (seconds)
"""

import sys

try:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs the integrations extra: "
             'pip install -e ".[integrations]"')

import adaptive_amp

transformers.logging.set_verbosity_error()  # no notes about the tiny config
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = adaptive_amp.GradScaler(device)  # was: torch.amp.GradScaler(device)

pattern = torch.arange(16, device=device) % 11           # a sequence the model can learn
tokens = pattern.repeat(8, 4)[:, :48]                     # 8 sequences of 48 tokens
losses = []
for step in range(40):
    with torch.autocast(device, dtype=torch.float16):
        loss = model(input_ids=tokens, labels=tokens).loss
    scaler.scale(loss).backward()
    grad_norm = scaler.clip_grad_norm_(optimizer, 1.0)    # from the unscale pass: no second read
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())

print(f"device {device}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps; "
      f"last grad norm {float(grad_norm):.3f}; scale {scaler.get_scale():.0f}; "
      f"skipped steps {int(scaler.skipped_steps)}")
assert losses[-1] < 0.5 * losses[0], "the model should learn the pattern"
