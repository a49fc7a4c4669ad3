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
