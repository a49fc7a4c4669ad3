"""adaptive_amp: faster and safer mixed-precision training.

Native multi-tensor kernels (C++ and CUDA) for the per-element work of mixed
precision, behind a torch.amp-style API. ``import adaptive_amp`` needs only
numpy; the ops also take torch tensors, numpy arrays and DLPack arrays.
"""

from __future__ import annotations

from ._locate import find_extension

# A source folder without a built extension (a clone's root is first on sys.path under
# `python -m`) hands over to an installed copy of the same code, or says what to do.
find_extension(__path__)
try:
    from . import _C
except ImportError as exc:  # a file that is there but does not load (another Python, a broken build)
    raise ImportError(
        f"adaptive_amp: the native extension in {__path__[0]} failed to load: {exc}. Rebuild it: "
        "`pip install -e .` in a checkout, else `pip install --force-reinstall --no-deps .` from one."
    ) from exc

from . import debug  # torch is imported inside its functions
from .ops import (UNSCALE_CHUNK, UnscalePlan, stochastic_round, stochastic_round_ste, tensor_stats,
                  unscale_and_check_, update_scale_)
from .stats import TensorStats

__version__ = "0.1.0"

__all__ = ["AdaptiveMixedPrecision", "AdaptivePrecisionSelector", "Capabilities", "DynamicPrecisionAdjuster", "GradScaler", "HardwareDetector",
           "LossScale", "PrecisionAnalyzer", "PrecisionPolicy", "StabilityMonitor", "StepResult", "TensorStats", "UNSCALE_CHUNK", "UnscalePlan", "build_info", "cuda_available", "debug",
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
    "StepResult": "step_result",
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
    """How the loaded extension was built: CUDA kernels and their architectures, OpenMP, compiler.

    Read from the extension itself (compiled in), with ``extension``, the path
    of the file that was loaded.
    """
    info = dict(_C.build_info())
    info["version"] = __version__
    info["cuda_devices"] = _C.cuda_device_count()
    info["extension"] = _C.__file__
    return info
