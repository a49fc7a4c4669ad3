"""Tiny real models and data for the integration tests (random weights from a config; nothing downloaded)."""

from __future__ import annotations

import torch

VOCAB, SEQ = 96, 16


def tiny_gpt2(seed: int = 0, n_layer: int = 2, n_embd: int = 32):
    """A transformers GPT-2 LM with random weights; dropout off so that runs compare bitwise."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def token_batches(n: int, batch: int = 4, seed: int = 1):
    """`n` batches of random token ids, the same for every call with the same seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(n)]


def lit_gpt2_class(lightning_module):
    """A LightningModule training tiny_gpt2 (from `lightning_module`: pytorch_lightning's or lightning.pytorch's):
    torch AdamW or adaptive_amp's SR AdamW, a per-step LR schedule, an infinite loss at chosen global steps;
    it keeps each step's loss."""
    import adaptive_amp

    class LitGPT2(lightning_module):
        def __init__(self, optimizer="torch", inject_inf_at=(), lr=1e-3):
            super().__init__()
            self.model = tiny_gpt2()
            self.optimizer_kind = optimizer
            self.inject_inf_at = set(inject_inf_at)
            self.lr = lr
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.detach().float().item())
            if self.global_step in self.inject_inf_at:
                loss = loss * float("inf")  # every gradient becomes inf/NaN: the step must be skipped
            return loss

        def configure_optimizers(self):
            if self.optimizer_kind == "sr":
                opt = adaptive_amp.optim.AdamW(self.parameters(), lr=self.lr, stochastic_rounding=True)
            else:
                opt = torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=False)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return LitGPT2
