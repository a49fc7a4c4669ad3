"""Train a tiny GPT-2 with PyTorch Lightning under adaptive_amp: one plugin argument.

Needs the ``integrations`` extra: ``pip install -e ".[integrations]"`` in the clone.

    python examples/lightning_gpt2.py [--steps 20] [--policy auto] [--plain]

The model is a transformers GPT-2 built from a config (random weights,
nothing downloaded) on random tokens; the point is the one line:

    Trainer(plugins=[AdaptivePrecision("auto")])

With --plain, Lightning's own fp16 plugin with adaptive_amp's GradScaler
instead (the scaler alone, no controller):

    Trainer(plugins=[MixedPrecision("16-mixed", device, scaler=adaptive_amp.GradScaler(device))])
"""

import argparse
import sys

try:
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.plugins.precision import MixedPrecision
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs the integrations extra: "
             'pip install -e ".[integrations]"')

import adaptive_amp
from adaptive_amp.integrations.lightning import AdaptivePrecision


class LitGPT2(pl.LightningModule):
    def __init__(self):
        super().__init__()
        config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                            eos_token_id=0)
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", default="auto",
                        help='"auto", a policy string such as "params=float32,compute=float16,loss_scale=dynamic", '
                             'or "bf16-pure" (needs adaptive_amp.optim.AdamW)')
    parser.add_argument("--plain", action="store_true", help="Lightning's MixedPrecision with our GradScaler")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader([torch.randint(0, 256, (8, 64)) for _ in range(args.steps)], batch_size=None)

    if args.plain:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        scaler = adaptive_amp.GradScaler(device)
        precision = MixedPrecision("16-mixed", device, scaler=scaler)
    else:
        precision = AdaptivePrecision(args.policy, read_every=5)
    trainer = pl.Trainer(max_steps=args.steps, plugins=[precision], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(LitGPT2(), data)
    if args.plain:
        print(f"scale {scaler.get_scale():g}, {scaler.skipped_steps} skipped steps")
    else:
        print(precision.amp.report(plots=False))


if __name__ == "__main__":
    main()
