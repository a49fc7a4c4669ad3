"""FP8 per layer: which layers can take it, measured gain and error, execution through torchao, a run-time guard.

A layer (an nn.Linear or transformers Conv1D) runs in fp8 as a *kind* of the
per-layer precision map: ``"fp8-tensorwise"`` or ``"fp8-rowwise"``
(:mod:`.config`), its three matmuls through torchao's float8 training
(:func:`fp8_forward`, the ``fp8`` extra: ``pip install -e ".[fp8]"`` in the clone), its
parameters untouched. :func:`select_fp8_layers` decides per layer from
measurements on the user's device and data; :func:`require_fp8` refuses,
with the reason, a layer or machine fp8 cannot run on; :class:`Fp8Guard`
demotes a layer that stops tolerating fp8 while training, fed at statistics
steps by the controller's :class:`Fp8Watch` (:mod:`.training`, with the
measured policies of ``AdaptiveMixedPrecision(policy="bf16+fp8")``, ``"bf16-weights+fp8"``,
``"bf16-pure+fp8"``, and the map a tuning's ``+fp8`` candidates share). Importing
:mod:`.execution` registers the fp8 kinds with
:mod:`adaptive_amp.layer_precision`.
"""

from .config import KINDS, RECIPES, float8_config
from .eligibility import (Eligibility, device_unsupported, eligible_layers, fp8_unavailable, layer_unsupported,
                          matmul_sizes, require_fp8, torchao_missing)
from .execution import check_layer, fp8_forward, plain_forward, wrap_forward
from .guard import Fp8Guard, cast_statistics, fp8_layer_row
from .measure import Captured, LayerError, LayerGain, capture_inputs, layer_error, layer_gain, layer_times
from .select import MAX_ERROR, MIN_GAIN, LayerChoice, select_fp8_layers
from .training import (MEASURED_PRESET, MEASURED_PRESETS, Fp8Map, Fp8Watch, measure_fp8_map, measured_policy,
                       policy_after, tuning_fp8_map)

__all__ = ["KINDS", "RECIPES", "float8_config", "Eligibility", "device_unsupported", "eligible_layers",
           "fp8_unavailable", "layer_unsupported", "matmul_sizes", "require_fp8", "torchao_missing", "check_layer",
           "fp8_forward", "plain_forward", "wrap_forward", "Fp8Guard", "cast_statistics", "fp8_layer_row", "Captured", "LayerError", "LayerGain",
           "capture_inputs", "layer_error", "layer_gain", "layer_times", "MAX_ERROR", "MIN_GAIN", "LayerChoice",
           "select_fp8_layers", "MEASURED_PRESET", "MEASURED_PRESETS", "Fp8Map", "Fp8Watch", "measure_fp8_map",
           "measured_policy", "policy_after", "tuning_fp8_map"]
