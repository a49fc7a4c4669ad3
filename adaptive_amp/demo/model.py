"""A small transformer language model on a synthetic language, for demos and benchmarks.

The corpus is drawn from a fixed random second-order Markov chain over a small
vocabulary, so it needs no download, is the same on every machine, and has a
known floor for the loss (the chain's entropy rate) that a working model
approaches. Mixed-precision training of it exercises every part of the
library: autocast, loss scaling, gradient clipping.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn


class MarkovCorpus:
    """Sequences from a random second-order Markov chain with few likely successors per context."""

    def __init__(self, vocab: int = 64, branching: int = 4, seed: int = 0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab, vocab), -1e9)
        for a in range(vocab):
            for b in range(vocab):
                nxt = torch.randperm(vocab, generator=gen)[:branching]
                logits[a, b, nxt] = torch.randn(branching, generator=gen) * 2
        self.probs = torch.softmax(logits, dim=-1).to(device)
        self.vocab = vocab
        self.device = device
        p = self.probs.clamp_min(1e-30)
        # Entropy rate under the uniform context distribution: a lower bound the loss approaches.
        self.entropy = float(-(p * p.log()).sum(-1).mean())

    def batch(self, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
        seq = torch.empty(batch, length, dtype=torch.long, device=self.device)
        seq[:, :2] = torch.randint(self.vocab, (batch, 2), generator=gen, device=self.device)
        for t in range(2, length):
            p = self.probs[seq[:, t - 2], seq[:, t - 1]]
            seq[:, t] = torch.multinomial(p, 1, generator=gen).squeeze(1)
        return seq


class TinyLM(nn.Module):
    """A decoder-only transformer (pre-norm blocks, learned positions, tied head).

    ``planted`` (a factor, 0 for none) adds an input projection ``inp`` whose
    weights are multiplied by it, followed by a LayerNorm: its outputs are far
    beyond fp16's range while the LayerNorm makes their size harmless in fp32,
    the situation of a layer with outlier activations that fp16 cannot hold.
    """

    def __init__(self, vocab=64, d_model=128, heads=4, layers=2, context=128, planted: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.inp = self.inp_norm = None
        if planted:
            self.inp = nn.Linear(d_model, d_model)
            with torch.no_grad():
                self.inp.weight.mul_(planted)
                self.inp.bias.mul_(planted)
            self.inp_norm = nn.LayerNorm(d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits at the start (loss near log(vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), diagonal=1)
        x = self.embed(tokens) + self.pos[:n]
        if self.inp is not None:
            x = self.inp_norm(self.inp(x))
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.lm_head(self.ln_f(x))


@dataclass
class TrainResult:
    losses: List[float] = field(default_factory=list)
    scales: List[float] = field(default_factory=list)
    skipped_steps: int = 0
    seconds: float = 0.0
    entropy_floor: float = math.nan

    @property
    def final_loss(self) -> float:
        tail = self.losses[-50:]
        return sum(tail) / len(tail)


def train_lm(scaler_factory, *, steps=2000, dtype=torch.float16, device="cuda", seed=0, batch=32, length=64,
             lr=3e-3, max_grad_norm: Optional[float] = 1.0, progress=None) -> TrainResult:
    """Train TinyLM with autocast in `dtype` and the scaler that `scaler_factory()` makes.

    The scaler is used the torch.amp way (scale, backward, unscale_/clip, step,
    update); losses and scales are read once at the end (no per-step sync).
    """
    torch.manual_seed(seed)
    corpus = MarkovCorpus(device=device)
    model = TinyLM(vocab=corpus.vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    scaler = scaler_factory()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    data = corpus.batch(steps * batch, length + 1, gen)  # all of it up front: no sampling in the loop
    init_scale = scaler.get_scale()
    losses, scales = [], []
    start = time.perf_counter()
    for step in range(steps):
        tokens = data[step * batch:(step + 1) * batch]
        with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, corpus.vocab), tokens[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        if max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        scales.append(scaler._get_scale_async().detach().clone())
        if progress is not None:
            progress(step)
    losses_t = torch.stack(losses).float().cpu()
    scales_t = torch.stack(scales).float().cpu()
    result = TrainResult(losses=losses_t.tolist(), scales=scales_t.tolist(), seconds=time.perf_counter() - start,
                         entropy_floor=corpus.entropy)
    skipped = getattr(scaler, "skipped_steps", None)
    # torch's scaler does not count: a skipped step is one where the scale went down.
    went_down = torch.cat([torch.tensor([init_scale]), scales_t])
    result.skipped_steps = int(skipped) if skipped is not None else int((went_down[1:] < went_down[:-1]).sum())
    return result
