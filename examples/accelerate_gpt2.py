"""Train a tiny GPT-2 in a plain Accelerate loop under adaptive_amp: one call after prepare().

Needs the ``integrations`` extra: ``pip install -e ".[integrations]"`` in the clone.

    python examples/accelerate_gpt2.py [--steps 20] [--policy auto] [--fused]

The loop is Accelerate's ordinary one; the point is the one line:

    amp = adaptive_amp.integrations.accelerate.attach(accelerator, model, optimizer, "auto")

after which ``accelerator.backward``, ``accelerator.clip_grad_norm_``,
``optimizer.step`` and the scheduler go through the controller, and the
scheduler does not advance on a step the scaler skipped (fused optimizers
included). Create the Accelerator with mixed_precision="no".
"""

import argparse
import sys

try:
    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs the integrations extra: "
             'pip install -e ".[integrations]"')

import adaptive_amp
from adaptive_amp.integrations.accelerate import attach


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--fused", action="store_true", help="adaptive_amp.optim.AdamW (unscales inside its step)")
    args = parser.parse_args()
    torch.manual_seed(0)

    accelerator = Accelerator(mixed_precision="no")
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    opt_cls = adaptive_amp.optim.AdamW if args.fused else torch.optim.AdamW
    optimizer = opt_cls(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    data = torch.utils.data.DataLoader(torch.randint(0, 256, (8 * args.steps, 64)), batch_size=8)
    model, optimizer, scheduler, data = accelerator.prepare(model, optimizer, scheduler, data)
    amp = attach(accelerator, model, optimizer, args.policy, read_every=5)

    skipped = 0
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped += bool(optimizer.step_was_skipped)  # reads the device-side flag (one sync)
    accelerator.print(f"policy {amp.policy}; {skipped} skipped steps")
    accelerator.print(amp.report(plots=False))


if __name__ == "__main__":
    main()
