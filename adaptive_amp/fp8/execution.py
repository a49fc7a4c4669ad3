"""A layer's forward (and so its backward) through torchao's float8 matmul.

:func:`fp8_forward` computes what an ``nn.Linear`` or transformers ``Conv1D``
computes, with its three GEMMs (output, input gradient, weight gradient) in
fp8 through torchao's ``matmul_with_hp_or_float8_args``: the same autograd
function, casts and ``torch._scaled_mm`` calls as torchao's ``Float8Linear``.
The module is not swapped and its parameters are used as they are (the same
Parameter objects, in their own dtype: torchao casts a float32 weight to fp8
directly), so the optimizer, ``state_dict`` and checkpoints see no change.

Under autocast the input goes to the autocast dtype first, as ``F.linear``
would; the fp8 matmul then runs with autocast off (its operands are already
cast) and the output comes out in that dtype. :func:`wrap_forward` makes the
forward a kind of the per-layer precision mechanism registers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .config import check_kind, float8_config, linear_mm_config
from .eligibility import is_conv1d, layer_unsupported


def _weight_t(module: nn.Module) -> torch.Tensor:
    """The weight as the right operand of ``input @ weight_t``: a Linear's transposed (a view), a Conv1D's as
    stored."""
    return module.weight if is_conv1d(module) else module.weight.t()


def fp8_forward(module: nn.Module, input: torch.Tensor, kind: str = "fp8-tensorwise") -> torch.Tensor:
    """``module(input)`` for an nn.Linear or transformers Conv1D, its matmuls in fp8 (`kind`:
    ``"fp8-tensorwise"`` or ``"fp8-rowwise"``). Differentiable; traceable by torch.compile."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):
        input = input.to(torch.get_autocast_dtype(device_type))
    with torch.autocast(device_type, enabled=False):
        output = matmul_with_hp_or_float8_args.apply(input, _weight_t(module), linear_mm_config(kind),
                                                     float8_config(kind))
        bias = module.bias
        if bias is not None:
            output = output + bias.to(output.dtype)
    return output


def plain_forward(module: nn.Module, input: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The layer's computation without fp8 (``F.linear``, autocast applying as usual): what fp8 is measured
    against, also for a layer whose class already runs it in fp8. `dtype`: the input, weight and bias read in
    it (copies: the parameters stay as they are), e.g. a float32 recompute of a layer whose weights train in
    bf16 (bf16-weights, bf16-pure)."""
    weight, bias = module.weight, module.bias
    if dtype is not None:
        input, weight = input.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return torch.nn.functional.linear(input, weight.t() if is_conv1d(module) else weight, bias)


def wrap_forward(forward: Callable, kind: str = "fp8-tensorwise") -> Callable:
    """A kind's wrap for the per-layer precision mechanism (``register_kind(kind, functools.partial(
    wrap_forward, kind=kind))``): the returned ``forward(module, input)`` runs the layer in fp8 instead of
    `forward` (the layer's whole computation is the matmul, so the forward it was handed is not called)."""
    check_kind(kind)

    def fp8_layer_forward(self, input):
        return fp8_forward(self, input, kind)

    fp8_layer_forward.__qualname__ = f"fp8_forward[{kind}]"
    return fp8_layer_forward


def check_layer(module: nn.Module, kind: str = "fp8-tensorwise") -> None:
    """ValueError naming why `module` cannot run in `kind`; nothing when it can."""
    check_kind(kind)
    reason = layer_unsupported(module)
    if reason is not None:
        raise ValueError(f"module: cannot run in {kind}: {reason}")


def _register_kinds() -> None:
    # The per-layer precision map applies fp8 through the one per-layer mechanism; importing this module is what
    # makes its kinds known there (the adjuster imports it only for a policy that has an fp8 layer).
    import functools

    from ..layer_precision import register_kind
    from .config import KINDS

    for kind in KINDS:
        register_kind(kind, functools.partial(wrap_forward, kind=kind))


_register_kinds()
