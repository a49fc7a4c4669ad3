"""A zoo of real models with random weights, for tests and benchmarks (nothing is downloaded).

Families: transformers' GPT-2 (Conv1D layers), Llama (RMSNorm, rotary,
grouped-query attention), BERT (masked LM), T5 (encoder-decoder) and ViT,
and a channels_last ResNet of our own. Each comes in the sizes "tiny" (CPU
tests, a fraction of a second per step), "small" and "medium" (GPU runs:
GPT-2 small/medium as released, Llama 125M/245M; see each family's table);
GPT-2 and Llama also in "large" (GPT-2 large, 774M; TinyLlama's shape, 1.1B).
``sizes(family)`` lists a family's sizes.

Usage::

    from adaptive_amp import zoo

    zm = zoo.build("gpt2", "tiny", seed=0)
    batch = zm.make_batch(4, seed=1, device="cpu")
    loss = zm.loss(zm.model, batch)            # or zm.loss(torch.compile(zm.model), batch)
    amp = AdaptiveMixedPrecision(zm.model, opt, sample_inputs=zm.inputs(batch), loss_fn=zm.output_loss(batch))

The transformers families need the transformers package; the resnet needs only torch.
``adaptive_amp.zoo.train`` trains a zoo model under fp32, torch AMP or AdaptiveMixedPrecision (the loop of
the CPU tests and of ``python -m adaptive_amp bench zoo``).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from . import hf
from .model import SIZES, ZooModel, plant_overflow
from .resnet import RESNET_SIZES, ResNet, resnet

#: family -> factory(size) -> ZooModel
FAMILIES: Dict[str, Callable[[str], ZooModel]] = {"gpt2": hf.gpt2, "llama": hf.llama, "bert": hf.bert,
                                                   "t5": hf.t5, "vit": hf.vit, "resnet": resnet}
_SIZE_TABLES = {"gpt2": hf.GPT2_SIZES, "llama": hf.LLAMA_SIZES, "bert": hf.BERT_SIZES, "t5": hf.T5_SIZES,
                "vit": hf.VIT_SIZES, "resnet": RESNET_SIZES}

__all__ = ["FAMILIES", "SIZES", "ResNet", "ZooModel", "build", "plant_overflow", "sizes"]


def sizes(family: str) -> tuple:
    """The sizes `family` comes in: SIZES (every family), and "large" for gpt2 and llama."""
    if family not in FAMILIES:
        raise ValueError(f"unknown zoo family {family!r}; choose one of {', '.join(FAMILIES)}")
    return tuple(_SIZE_TABLES[family])


def build(family: str, size: str = "tiny", *, seed: int = 0, device=None) -> ZooModel:
    """The zoo's `family` model in `size`, its weights drawn from `seed`, built directly on `device`
    (default: torch's default device)."""
    if size not in sizes(family):
        raise ValueError(f"unknown size {size!r} for {family}; choose one of {', '.join(sizes(family))}")
    factory = FAMILIES[family]
    with torch.random.fork_rng(devices=[]), (torch.device(device) if device is not None else _nothing()):
        torch.manual_seed(seed)
        zm = factory(size)
    zm.model.train()
    return zm


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
