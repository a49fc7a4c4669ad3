"""Which layers fp8 can take, and why not the others.

A layer can run in fp8 when it is a matmul whose weight torch's fp8 GEMM
takes: an ``nn.Linear`` or transformers' ``Conv1D`` (a Linear whose weight is
stored transposed), both sizes divisible by 16. The machine can when torchao
imports and the GPU has fp8 tensor cores (compute capability 8.9 or newer).
Every "no" comes with a reason a person can act on. :func:`require_fp8`
turns a "no" into an error before anything is changed, for a user who asked
for fp8 by name.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, Optional, Tuple, Union

import torch
from torch import nn

from ..layers import is_instance_named, unwrap_model
from .config import DIVISOR, MIN_CAPABILITY, TORCHAO_MIN_VERSION, check_kind


def _conv1d_class() -> Optional[type]:
    # Only a model built with transformers holds a Conv1D, and then transformers is imported already.
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    """Whether `module` is (a subclass of) transformers' Conv1D. Told from its class's own names, not from
    transformers' module: every fp8 layer's forward asks this, inside the graph torch.compile traces, where a
    lookup in ``sys.modules`` would be guarded on (an import of transformers would recompile every graph) and
    fails the compile ("dictionary changed size during iteration") when another thread imports a module."""
    return is_instance_named(module, "transformers.pytorch_utils", "Conv1D")


def matmul_sizes(module: nn.Module) -> Optional[Tuple[int, int]]:
    """(in_features, out_features) of an nn.Linear or a transformers Conv1D; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        nx, nf = module.weight.shape  # stored (in, out): the layer computes x @ weight
        return int(nx), int(nf)
    return None


def layer_unsupported(module: nn.Module) -> Optional[str]:
    """None if fp8 can take `module`'s matmul, else why not (``"out_features 50257 not divisible by 16"``)."""
    sizes = matmul_sizes(module)
    if sizes is None:
        return f"a {type(module).__name__}, not an nn.Linear or a transformers Conv1D"
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return f"its weight is not a floating-point tensor ({type(weight).__name__})"
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"its weight is {weight.dtype}; fp8 casts from float32, bfloat16 or float16"
    for what, n in zip(("in_features", "out_features"), sizes):
        if n % DIVISOR:
            return f"{what} {n} not divisible by {DIVISOR}"
    return None


def torchao_missing() -> Optional[str]:
    """None if torchao's float8 training imports, else why not."""
    if importlib.util.find_spec("torchao") is None:
        return (f"torchao is not installed (pip install 'torchao>={TORCHAO_MIN_VERSION}', or the fp8 extra): "
                "fp8 layers run through its float8 training")
    try:
        import torchao.float8  # noqa: F401
    except Exception as exc:  # an incompatible torch, a broken install
        return f"torchao is installed but torchao.float8 does not import ({type(exc).__name__}: {exc})"
    return None


def device_unsupported(device: Union[torch.device, str, None] = None) -> Optional[str]:
    """None if `device` (default: the current CUDA device, else the CPU) has fp8 matmuls, else why not."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return (f"fp8 matmuls need a CUDA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer; the layers are on the {device.type.upper()}")
    if not torch.cuda.is_available():
        return "fp8 matmuls need a CUDA GPU, and torch sees none"
    if torch.version.hip:
        return "fp8 layers are supported on NVIDIA GPUs only"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                f"fp8 matmuls need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")
    return None


def fp8_unavailable(device: Union[torch.device, str, None] = None) -> Optional[str]:
    """None if fp8 layers can run on `device` here (torchao, and a GPU with fp8 matmuls), else why not."""
    return torchao_missing() or device_unsupported(device)


@dataclass
class Eligibility:
    """The matmul layers of a model (by name) that fp8 can take, and the others with why not."""

    layers: Dict[str, nn.Module] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)


def _model_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def eligible_layers(model: nn.Module, device: Union[torch.device, str, None] = None,
                    *, check_device: bool = True) -> Eligibility:
    """Every nn.Linear and Conv1D of `model`, split into those fp8 can take and those it cannot (with the
    reason). When fp8 cannot run here at all (`device`: default the model's), every one is skipped with that
    reason. check_device=False judges the layers alone (what a measurement on another machine would take)."""
    root = unwrap_model(model)
    why_not = fp8_unavailable(device if device is not None else _model_device(root)) if check_device else None
    out = Eligibility()
    for name, module in root.named_modules():
        if matmul_sizes(module) is None:
            continue
        reason = why_not or layer_unsupported(module)
        if reason is None:
            out.layers[name] = module
        else:
            out.skipped[name] = reason
    return out


def require_fp8(model: nn.Module, names: Optional[Iterable[str]] = None, kind: str = "fp8-tensorwise",
                device: Union[torch.device, str, None] = None) -> Dict[str, nn.Module]:
    """The layers named in `names` (default: every nn.Linear and Conv1D of `model`; `model` itself when it is
    one such layer, named ``""``), checked for running in `kind` on `device` (default: the model's).

    Raises, before anything is changed, RuntimeError when fp8 cannot run here (torchao missing, no GPU with
    fp8 matmuls) and ValueError naming the first layer that fp8 cannot take and why. Call it before applying
    fp8 to any layer, so that a refusal leaves no layer converted."""
    check_kind(kind)
    root = unwrap_model(model)
    why_not = fp8_unavailable(device if device is not None else _model_device(root))
    if why_not is not None:
        raise RuntimeError(f"{kind} cannot run here: {why_not}")
    modules = dict(root.named_modules())
    if names is None:
        chosen = {n: m for n, m in modules.items() if matmul_sizes(m) is not None}
        if not chosen:
            raise ValueError(f"model: {type(root).__name__} has no nn.Linear or Conv1D layer to run in {kind}")
    else:
        if isinstance(names, str):
            names = [names]
        unknown = [n for n in names if n not in modules]
        if unknown:
            raise ValueError(f"names: the model has no module named {unknown[0]!r}; pass dotted names from "
                             "model.named_modules()")
        chosen = {n: modules[n] for n in names}
    for name, module in chosen.items():
        reason = layer_unsupported(module)
        if reason is not None:
            raise ValueError(f"layer {name or type(module).__name__!r} cannot run in {kind}: {reason}; leave it out "
                             "of the fp8 layers")
    return chosen
