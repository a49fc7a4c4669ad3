"""adaptive_amp: faster and safer mixed-precision training.

Native multi-tensor kernels (C++ and CUDA) for the per-element work of mixed
precision, behind a torch.amp-style API. ``import adaptive_amp`` needs only
numpy; the ops also take torch tensors, numpy arrays and DLPack arrays.
"""

from __future__ import annotations

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "adaptive_amp's native extension (adaptive_amp._C) is missing or broken: "
        f"{exc}. Reinstall with `pip install .` (or `pip install -e .` in a checkout)."
    ) from exc

from . import debug  # torch is imported inside its functions
from .ops import (UNSCALE_CHUNK, UnscalePlan, stochastic_round, stochastic_round_ste, tensor_stats,
                  unscale_and_check_, update_scale_)
from .stats import TensorStats

__version__ = "0.1.0"

__all__ = ["AdaptiveMixedPrecision", "AdaptivePrecisionSelector", "Capabilities", "DynamicPrecisionAdjuster", "GradScaler", "HardwareDetector",
           "LossScale", "PrecisionAnalyzer", "PrecisionPolicy", "StabilityMonitor", "TensorStats", "UNSCALE_CHUNK", "UnscalePlan", "build_info", "cuda_available", "debug",
           "stochastic_round", "stochastic_round_ste", "tensor_stats", "unscale_and_check_", "update_scale_",
           "__version__"]

# Modules that need torch load on first use, so `import adaptive_amp` works with numpy alone.
_LAZY = {
    "GradScaler": "scaler",
    "Capabilities": "hardware",
    "HardwareDetector": "hardware",
    "LossScale": "policy",
    "PrecisionPolicy": "policy",
    "AdaptivePrecisionSelector": "policy",
    "DynamicPrecisionAdjuster": "adjust",
    "PrecisionAnalyzer": "analysis",
    "StabilityMonitor": "monitor",
    "AdaptiveMixedPrecision": "controller",
}


# Submodules that need torch, reachable as attributes (adaptive_amp.optim.AdamW).
_LAZY_MODULES = ("optim",)


def __getattr__(name):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'adaptive_amp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


def cuda_available() -> bool:
    """True when the CUDA kernels were built in and a CUDA GPU can be used."""
    return _C.cuda_built() and _C.cuda_device_count() > 0


def build_info() -> dict:
    """How this copy was built: CUDA kernels and their architectures, OpenMP, compiler."""
    info = dict(_C.build_info())
    info["version"] = __version__
    info["cuda_devices"] = _C.cuda_device_count()
    return info
