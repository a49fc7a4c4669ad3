"""ZooModel: a model with the batches and the loss it trains on, behind one small interface.

The data are synthetic but learnable, so that a few hundred steps show a
falling loss (what ordinary training looks like to the monitor's detectors):

* token models read arithmetic progressions ``x_t = (start + stride * t) mod
  V`` with a random start and a stride from a small set per sequence: the
  next token follows from the two before it.
* image models see a fixed random prototype per class plus noise.

Everything is drawn from a CPU ``torch.Generator`` seeded by ``seed``, so a
batch is the same on every device and every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

#: Sizes every family accepts: "tiny" for CPU tests, "small" and "medium" for GPU runs.
SIZES = ("tiny", "small", "medium")
_STRIDES = 8  # strides 1..8: few enough to learn in a few hundred steps
_IGNORE = -100  # cross_entropy's ignore_index, as transformers' labels use it


@dataclass
class ZooModel:
    """A model of the zoo and how to train it.

    Attributes:
        name: the family ("gpt2", "llama", "bert", "t5", "vit", "resnet").
        size: one of SIZES.
        model: the nn.Module (random weights, train mode, on the device it was built on).
        make_batch: ``make_batch(batch_size, seed=0, device="cpu", seq_len=None)`` -> dict of tensors.
        input_keys: the batch entries the model's forward takes as keyword arguments.
        loss_from_output: ``loss_from_output(output, batch)`` -> scalar fp32 loss.
        seq_len: tokens per sequence by default (image models: pixels per side).
        config: the transformers config (None for our own models).
    """

    name: str
    size: str
    model: nn.Module
    make_batch: Callable[..., Dict[str, torch.Tensor]]
    input_keys: Tuple[str, ...]
    loss_from_output: Callable[[Any, Dict[str, torch.Tensor]], torch.Tensor]
    seq_len: int
    config: Any = field(default=None, repr=False)

    def inputs(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The model's keyword arguments from a batch (also the analyzer's ``sample_inputs``)."""
        return {k: batch[k] for k in self.input_keys}

    def loss(self, model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward `model` (this model, or a compiled or wrapped form of it) on `batch`; the fp32 loss."""
        return self.loss_from_output(model(**self.inputs(batch)), batch)

    def output_loss(self, batch: Dict[str, torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        """``output -> loss`` for `batch`: the analyzer's and the controller's ``loss_fn``."""
        return lambda output: self.loss_from_output(output, batch)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def cross_entropy_loss(output, batch) -> torch.Tensor:
    """Classification or token prediction against ``batch["labels"]`` (positions with -100 ignored)."""
    logits = _logits(output).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=_IGNORE)


def next_token_loss(output, batch) -> torch.Tensor:
    """Causal language modelling: position t predicts token t + 1 of ``batch["input_ids"]``."""
    logits = _logits(output)[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["input_ids"][:, 1:].reshape(-1))


def progressions(batch_size: int, length: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """`batch_size` sequences ``(start + stride * t) mod vocab``, int64 of shape (batch_size, length)."""
    start = torch.randint(0, vocab, (batch_size, 1), generator=gen, device="cpu")
    stride = torch.randint(1, _STRIDES + 1, (batch_size, 1), generator=gen, device="cpu")
    return (start + stride * torch.arange(length, device="cpu")) % vocab


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _check_batch(batch_size: int, seq_len: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size is {batch_size}; pass at least 1")
    if seq_len < 2:
        raise ValueError(f"seq_len is {seq_len}; pass at least 2 (a token needs one to predict)")


def causal_lm_batches(vocab: int, default_len: int) -> Callable[..., Dict[str, torch.Tensor]]:
    def make_batch(batch_size: int, seed: int = 0, device="cpu", seq_len: Optional[int] = None):
        n = seq_len or default_len
        _check_batch(batch_size, n)
        return {"input_ids": progressions(batch_size, n, vocab, _generator(seed)).to(device)}
    return make_batch


def masked_lm_batches(vocab: int, mask_id: int, default_len: int, fraction: float = 0.15):
    """BERT's objective: `fraction` of the tokens (at least one per sequence) replaced by `mask_id`;
    the labels are the original tokens there and -100 elsewhere. Tokens are drawn below `mask_id`."""
    def make_batch(batch_size: int, seed: int = 0, device="cpu", seq_len: Optional[int] = None):
        n = seq_len or default_len
        _check_batch(batch_size, n)
        gen = _generator(seed)
        ids = progressions(batch_size, n, mask_id, gen)
        masked = torch.rand(batch_size, n, generator=gen, device="cpu") < fraction
        masked[torch.arange(batch_size, device="cpu"), torch.randint(0, n, (batch_size,), generator=gen,
                                                                     device="cpu")] = True
        labels = torch.where(masked, ids, torch.full_like(ids, _IGNORE))
        ids = torch.where(masked, torch.full_like(ids, mask_id), ids)
        return {"input_ids": ids.to(device), "labels": labels.to(device)}
    return make_batch


def seq2seq_batches(vocab: int, start_id: int, default_len: int):
    """Encoder reads a progression; the decoder continues it (teacher forcing from `start_id`)."""
    def make_batch(batch_size: int, seed: int = 0, device="cpu", seq_len: Optional[int] = None):
        n = seq_len or default_len
        _check_batch(batch_size, n)
        seq = progressions(batch_size, 2 * n, vocab, _generator(seed))
        labels = seq[:, n:]
        decoder_in = torch.cat([torch.full((batch_size, 1), start_id, dtype=labels.dtype), labels[:, :-1]], dim=1)
        return {"input_ids": seq[:, :n].to(device), "decoder_input_ids": decoder_in.to(device),
                "labels": labels.to(device)}
    return make_batch


def image_batches(num_classes: int, channels: int, side: int, channels_last: bool = False, noise: float = 0.5,
                  prototype_seed: int = 1234):
    """Images: a fixed random prototype per class (the same for every batch) plus Gaussian noise."""
    # On the CPU (the generators are CPU ones) whatever default device the model was built under.
    prototypes = torch.randn(num_classes, channels, side, side, generator=_generator(prototype_seed), device="cpu")

    def make_batch(batch_size: int, seed: int = 0, device="cpu", seq_len: Optional[int] = None):
        if seq_len is not None and seq_len != side:
            raise ValueError(f"seq_len is {seq_len}; this image model takes {side}x{side} images (leave it None)")
        _check_batch(batch_size, 2)
        gen = _generator(seed)
        labels = torch.randint(0, num_classes, (batch_size,), generator=gen, device="cpu")
        pixels = prototypes[labels] + noise * torch.randn(batch_size, channels, side, side, generator=gen,
                                                          device="cpu")
        if channels_last:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return {"pixel_values": pixels.to(device), "labels": labels.to(device)}
    return make_batch


def plant_overflow(zm: ZooModel, layer: str, batch: Dict[str, torch.Tensor], amax: float = 1e6) -> float:
    """Scale the weights of `layer` (its own parameters of 2 or more dimensions) so that its fp32 output's
    largest |value| on `batch` is `amax` (fp16's max is 65504): a planted overflow, the same at every model
    size. Returns the factor the weights were multiplied by."""
    module = dict(zm.model.named_modules()).get(layer)
    if module is None:
        raise ValueError(f"layer {layer!r} is not a module of the {zm.name} model")
    weights = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    if not weights:
        raise ValueError(f"layer {layer!r} has no weight matrix of its own to scale")
    seen = []

    def hook(mod, args, out):
        t = out if isinstance(out, torch.Tensor) else out[0]
        seen.append(float(t.detach().float().abs().max()))

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            zm.model(**zm.inputs(batch))
    finally:
        handle.remove()
    if not seen or not seen[0] > 0:
        raise ValueError(f"layer {layer!r} was not called by the forward, or its output is all zeros")
    factor = amax / max(seen)
    with torch.no_grad():
        for w in weights:
            w.mul_(factor)
    return factor
