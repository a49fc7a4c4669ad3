"""The fp8 kinds a layer can run in, as named recipes of torchao's float8 training.

A *kind* is the name the per-layer precision map gives a layer
(``"fp8-tensorwise"``, ``"fp8-rowwise"``); each maps to one of torchao's
``Float8LinearRecipeName`` recipes:

* ``fp8-tensorwise``: one dynamic scale per tensor, e4m3 for the input and
  the weight, e5m2 for the output gradient (cuBLAS's tensorwise kernel: the
  fastest);
* ``fp8-rowwise``: one scale per row (per token for the input, per output
  feature for the weight), e4m3 throughout, scales rounded down to powers of
  two (slower, and tolerant of outlier tokens).

torchao is an optional extra (``pip install -e ".[fp8]"`` in the clone): nothing here
imports it until a recipe's configuration is asked for.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

#: kind -> torchao recipe name.
RECIPES = {"fp8-tensorwise": "tensorwise", "fp8-rowwise": "rowwise"}
#: The kinds, fastest first.
KINDS: Tuple[str, ...] = tuple(RECIPES)
#: fp8 matmuls (torch._scaled_mm) need both sizes of the weight divisible by this.
DIVISOR = 16
#: The compute capability from which a GPU has fp8 tensor cores (Ada, Hopper, Blackwell).
MIN_CAPABILITY = (8, 9)
#: The torchao release the fp8 kinds are written for (the optional extra's lower bound).
TORCHAO_MIN_VERSION = "0.18.0"

# One object per kind. torch.compile calls the getters at trace time and keeps the result as a constant
# (assume_constant_result): it cannot trace torchao's frozen dataclasses being built.
_CONFIGS: Dict[str, object] = {}
_MM_CONFIGS: Dict[str, object] = {}


def check_kind(kind: str) -> str:
    """`kind` if it is an fp8 kind, else a ValueError naming the choices."""
    if kind not in RECIPES:
        raise ValueError(f"kind is {kind!r}; the fp8 kinds are {', '.join(KINDS)}")
    return kind


@torch._dynamo.assume_constant_result
def float8_config(kind: str):
    """torchao's ``Float8LinearConfig`` for `kind`: one object per kind, a constant to torch.compile."""
    config = _CONFIGS.get(kind)
    if config is None:
        check_kind(kind)
        from torchao.float8 import Float8LinearConfig

        config = _CONFIGS[kind] = Float8LinearConfig.from_recipe_name(RECIPES[kind])
    return config


@torch._dynamo.assume_constant_result
def linear_mm_config(kind: str):
    """torchao's ``LinearMMConfig`` (per-GEMM fast accumulation, as its Float8Linear sets it) for `kind`."""
    config = _MM_CONFIGS.get(kind)
    if config is None:
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        c = float8_config(kind)
        config = _MM_CONFIGS[kind] = LinearMMConfig(*(
            ScaledMMConfig(c.emulate, gemm.use_fast_accum, False, c.pad_inner_dim)
            for gemm in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))
    return config
